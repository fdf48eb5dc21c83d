"""A model of the FP8 forward's barriers (cuda_src/fwd_fp8_sm90.cu, FwdFp8) run on the CPU under random schedules.

Each role of the CTA is a generator that follows the kernel's order of waits, arrivals, reads and writes: the
producer thread (produce, load_kv), the three transposing warps (transpose) and each consumer warpgroup (consume:
step, consume_pipelined, or pass_blocks for a warpgroup without rows), over the CTA's tile. mbarriers keep the
hardware's phase semantics (a parity wait passes once the phase of that parity has completed, whatever has happened
since), TMA writes land at a later point of the schedule's choosing, and the scheduler interleaves the roles at
random. The model checks that no buffer (Q, the K and V^T ring slots, V's staging slots, and O's staging tile over
them) is written while a role reads it or read when it does not hold what the reader expects, and that the CTA never
deadlocks.

With vt_pass (VT_PASS) the producer loads V^T from the pass's workspace beside K on the slot's `full` barrier, the
transposing warps have no work, and what waits for a block's V^T (vt_ready) waits for `full`.

A role stands for all of its threads: where every thread of a warp or warpgroup arrives in the kernel (the
barriers count 32 or 128 arrivals a role there), the model arrives once. It checks the protocol, not the CUDA
code: a change to the kernel's waits and arrivals is made here too.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

TRANSPOSERS, VS = 3, 2


class Hazard(AssertionError):
    pass


class Barrier:
    """An mbarrier: ``count`` arrivals complete a phase (a consumer warpgroup's 128 arrive as one here)."""

    def __init__(self, name: str, count: int):
        self.name, self.count, self.pending, self.phase = name, count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passed(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity has completed (the current phase has the other parity)."""
        return (self.phase & 1) != parity


@dataclass
class Buffer:
    name: str
    content: object = None
    writing: int = 0  # TMA writes in flight
    readers: list = field(default_factory=list)

    def open(self, who: str, expected):
        if self.writing or self.content != expected:
            raise Hazard(f"{who} reads {self.name} holding {self.content} (writes in flight: {self.writing}), "
                         f"expects {expected}")
        self.readers.append(who)

    def close(self, who: str):
        self.readers.remove(who)

    def write(self, who: str, content):
        if self.readers or self.writing:
            raise Hazard(f"{who} writes {self.name} while {self.readers} read it (writes in flight: {self.writing})")
        self.content = content


@dataclass
class Tile:
    count: int          # key blocks
    working: int        # consumer warpgroups with rows (the others pass the tile's blocks on)
    partial: bool       # a packed sequence's last block comes first: the transposes zero V's rows past it


class Cta:
    """The CTA's barriers and buffers, and a role per generator."""

    def __init__(self, tiles, stages: int, wgs: int, pipe: bool, vt_pass: bool = False):
        self.tiles, self.S, self.wgs, self.pipe, self.vt_pass = tiles, stages, wgs, pipe, vt_pass
        self.q_full = Barrier("q_full", 1)
        # a TMA write lands as one arrival here: with vt_pass K's and V^T's complete `full` together (expect_tx)
        self.full = [Barrier(f"full{i}", 2 if vt_pass else 1) for i in range(stages)]
        self.empty = [Barrier(f"empty{i}", wgs) for i in range(stages)]
        self.vt_full = [Barrier(f"vt_full{i}", TRANSPOSERS) for i in range(stages)]
        self.vs_full = [Barrier(f"vs_full{i}", 1) for i in range(VS)]
        self.vs_empty = [Barrier(f"vs_empty{i}", TRANSPOSERS) for i in range(VS)]
        self.vt_ready = self.full if vt_pass else self.vt_full  # FwdFp8::wait_vt, and pass_blocks' wait
        self.q = Buffer("Q")
        self.k = [Buffer(f"K{i}") for i in range(stages)]
        self.vt = [Buffer(f"VT{i}") for i in range(stages)]
        self.vs = [Buffer(f"VS{i}") for i in range(VS)]
        self.named = [0, 0]  # the transposes' named barrier: (arrivals, generation)
        self.spawned = []    # TMA writes in flight, as roles

    # -- TMA: the write lands later, then completes the barrier's phase
    def tma(self, who, buf: Buffer, content, bar: Barrier):
        if buf.readers or buf.writing:
            raise Hazard(f"{who}'s TMA writes {buf.name} while {buf.readers} read it (writes in flight: "
                         f"{buf.writing})")
        buf.writing += 1

        def land():
            yield None
            buf.writing -= 1
            buf.content = content
            bar.arrive()
        self.spawned.append(land())

    def walk(self):
        """(tile index, tile, T0, tiles with blocks before it) of the CTA's tiles (one)."""
        t0, with_blocks = 0, 0
        for i, tile in enumerate(self.tiles):
            yield i, tile, t0, with_blocks
            t0 += tile.count
            with_blocks += tile.count > 0

    def producer(self):
        for i, tile, t0, _ in self.walk():
            if tile.count == 0:
                continue
            first = min(tile.count, self.S)
            for t in range(first):
                yield from self.load_kv(i, t0, t)
            self.tma("producer", self.q, ("q", i), self.q_full)
            for t in range(first, tile.count):
                yield from self.load_kv(i, t0, t)

    def load_kv(self, i, t0, t):
        at = t0 + t
        slot, s = at % self.S, at % VS
        if at >= self.S:
            yield lambda: self.empty[slot].passed(((at // self.S) & 1) ^ 1)
        self.tma("producer", self.k[slot], ("k", i, t), self.full[slot])
        if self.vt_pass:
            self.tma("producer", self.vt[slot], ("v", i, t), self.full[slot])
            return
        if at >= VS:
            yield lambda: self.vs_empty[s].passed(((at // VS) & 1) ^ 1)
        self.tma("producer", self.vs[s], ("v", i, t), self.vs_full[s])

    def transposer(self, w: int):
        who = f"transposer{w}"
        if self.vt_pass:
            return
        for i, tile, t0, _ in self.walk():
            for t in range(tile.count):
                at = t0 + t
                slot, s = at % self.S, at % VS
                yield lambda: self.vs_full[s].passed((at // VS) & 1)
                if t == 0 and tile.partial:  # rows past the keys to zeros, then the warps meet
                    self.vs[s].write(who, self.vs[s].content)
                    generation = self.named[1]
                    self.named[0] += 1
                    if self.named[0] == TRANSPOSERS:
                        self.named = [0, generation + 1]
                    yield lambda g=generation: self.named[1] > g
                if at >= self.S:
                    yield lambda: self.empty[slot].passed(((at // self.S) & 1) ^ 1)
                self.vs[s].open(who, ("v", i, t))
                self.vt[slot].write(who, ("v", i, t))
                yield None
                self.vs[s].close(who)
                self.vs_empty[s].arrive()
                self.vt_full[slot].arrive()

    def consumer(self, g: int):
        who = f"consumer{g}"
        for i, tile, t0, n in self.walk():
            slot = lambda t: (t0 + t) % self.S  # noqa: E731
            parity = lambda t: ((t0 + t) // self.S) & 1  # noqa: E731
            if g >= tile.working:  # pass_blocks
                for t in range(tile.count):
                    yield lambda t=t: self.vt_ready[slot(t)].passed(parity(t))
                    self.empty[slot(t)].arrive()
                continue
            if tile.count > 0:
                yield lambda n=n: self.q_full.passed(n & 1)
            last = tile.count - 1
            if self.pipe and tile.count > 0:  # consume_pipelined
                yield lambda: self.full[slot(0)].passed(parity(0))
                yield from self.s_product(who, i, 0, slot(0))
                for t in range(1, tile.count):
                    yield lambda t=t: self.full[slot(t)].passed(parity(t)) and self.vt_ready[slot(t - 1)].passed(
                        parity(t - 1))
                    self.q.open(who, ("q", i))
                    self.k[slot(t)].open(who, ("k", i, t))
                    self.vt[slot(t - 1)].open(who, ("v", i, t - 1))
                    yield None                     # S of t and P V of t - 1 in flight
                    self.q.close(who)              # wgmma_wait<1>: S of t
                    self.k[slot(t)].close(who)
                    yield None                     # the softmax
                    self.vt[slot(t - 1)].close(who)  # wgmma_wait<0>: P V of t - 1
                    self.empty[slot(t - 1)].arrive()
                yield lambda: self.vt_ready[slot(last)].passed(parity(last))
                yield from self.pv_product(who, i, last, slot(last))
            else:
                for t in range(tile.count):  # step
                    yield lambda t=t: self.full[slot(t)].passed(parity(t))
                    yield from self.s_product(who, i, t, slot(t))
                    yield lambda t=t: self.vt_ready[slot(t)].passed(parity(t))
                    yield from self.pv_product(who, i, t, slot(t))
            for buf in self.vs:  # store: O's staging tile lies over V's staging slots
                buf.write(who, ("o", i))

    def s_product(self, who, i, t, slot):
        self.q.open(who, ("q", i))
        self.k[slot].open(who, ("k", i, t))
        yield None
        self.q.close(who)
        self.k[slot].close(who)

    def pv_product(self, who, i, t, slot):
        self.vt[slot].open(who, ("v", i, t))
        yield None
        self.vt[slot].close(who)
        self.empty[slot].arrive()

    def run(self, rng: random.Random):
        """Interleave the roles at random until all end; Hazard on a race, a deadlock or a leftover write."""
        roles = ([("producer", self.producer())] + [(f"transposer{w}", self.transposer(w)) for w in range(3)]
                 + [(f"consumer{g}", self.consumer(g)) for g in range(self.wgs)])
        waiting = {name: None for name, _ in roles}
        live = dict(roles)
        while live or self.spawned:
            for gen in self.spawned:
                name = f"tma{id(gen)}"
                live[name], waiting[name] = gen, None
            self.spawned = []
            ready = [name for name in live if waiting[name] is None or waiting[name]()]
            if not ready:
                raise Hazard("deadlock: " + ", ".join(sorted(live)))
            name = rng.choice(ready)
            try:
                waiting[name] = next(live[name])
            except StopIteration:
                del live[name]


def random_tile(rng: random.Random, wgs: int):
    return [Tile(count=rng.randint(1, 7), working=rng.choice([wgs, wgs, 1] + list(range(1, wgs))),
                 partial=rng.random() < 0.3)]


FORMS = [(stages, wgs, pipe) for stages in (2, 3, 4) for wgs, pipe in ((2, True), (2, False), (3, False))]


@pytest.mark.parametrize("vt_pass", [False, True])
@pytest.mark.parametrize("stages, wgs, pipe", FORMS)
def test_fp8_forward_barriers_under_random_schedules(stages, wgs, pipe, vt_pass):
    rng = random.Random(1000 * stages + 10 * wgs + pipe)
    for _ in range(150):
        tiles = random_tile(rng, wgs)
        try:
            Cta(tiles, stages, wgs, pipe, vt_pass).run(rng)
        except Hazard as err:
            raise AssertionError(f"{err} (tiles {tiles})") from None

"""Ring attention's schedule, independent of any framework: who holds which part of the sequence, which blocks of
attention each ring step runs with which mask, and how a rank's program meets its transport.

A sequence of ``world * local`` tokens is split over ``world`` ranks. Each rank keeps its queries; keys and values
travel around the ring, so at step ``t`` rank ``r`` holds the keys of rank ``(r - t) % world``. A step's attention
is one or more calls of cuflash's attention on slices of the local queries and the visiting keys (:func:`blocks`);
their results merge exactly through their log-sum-exps (``cuflash.reference.combine``).

Layouts (``world = 4``, a sequence of 8 chunks ``0..7``)::

    contiguous   rank 0: 0 1    rank 1: 2 3    rank 2: 4 5    rank 3: 6 7
    zigzag       rank 0: 0 7    rank 1: 1 6    rank 2: 2 5    rank 3: 3 4

Causal attention over the contiguous split leaves rank 0 idle at every step but the first (its queries see no
later key) while rank 3 works at each; the zigzag split gives every rank the same work at every step.

Masks. cuflash aligns masks bottom-right: query ``i`` of ``sq`` sees key ``j`` of ``sk`` iff
``i + sk - sq - left <= j <= i + sk - sq + right`` (-1: unbounded). Globally, query position ``P`` sees key
position ``Q`` iff ``P - left <= Q <= P + right`` (causal: ``right = 0``). A pair of chunks at distance
``D = P0 - Q0`` needs the offset ``D`` where cuflash has ``sk - sq``; :func:`blocks` trims rows from the end of the
query chunk, or keys from the end of the key chunk -- only rows or keys that see nothing in the pair -- until a
window ``(L, R) = (left - E, right + E)`` with ``E = D - (sk - sq)`` is valid (both sides >= 0 or unbounded). The
causal diagonal block is then plain causal attention, a block of earlier keys is unmasked, a block of later keys
is skipped; a sliding window gives the band's pieces.

Programs and transports. A rank's ring program is a generator that yields :class:`Send` (pass these arrays to the
next rank; the answer is a ticket) and :class:`Receive` (the previous rank's arrays sent under this ticket) and
returns its result. :func:`run` drives one rank's program with a transport (``torch.distributed`` P2P in
``cuflash.torch_distributed``); :func:`run_local` drives all ranks' programs in one process, passing copies
between them -- the same program, the transport swapped.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, NamedTuple, Sequence

__all__ = ["LAYOUTS", "Block", "check_layout", "chunks", "positions", "blocks", "schedule", "work", "Send", "Receive",
           "run", "run_local"]

LAYOUTS = ("contiguous", "zigzag")


class Block(NamedTuple):
    """One attention call of a ring step: local query rows ``q_start:q_stop`` against the visiting keys
    ``k_start:k_stop`` with cuflash's window ``(left, right)`` (bottom-right aligned over those slices)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    left: int
    right: int

    @property
    def full(self) -> bool:
        """No key of the block is masked."""
        return self.left == -1 and self.right == -1


def check_layout(layout: str, local: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if layout == "zigzag" and local % 2:
        raise ValueError(f"layout 'zigzag': each rank's seqlen (axis 1) must be even (two chunks), got {local}")


def chunks(layout: str, world: int, rank: int, local: int) -> tuple:
    """``((local offset, global position, length), ...)``: the pieces of the sequence rank ``rank`` holds in
    ``local`` tokens, in local order."""
    check_layout(layout, local)
    if layout == "contiguous":
        return ((0, rank * local, local),)
    half = local // 2
    return ((0, rank * half, half), (half, (2 * world - 1 - rank) * half, half))


def positions(layout: str, world: int, rank: int, local: int) -> list:
    """The global positions of rank ``rank``'s ``local`` tokens, in local order (to shard or gather a sequence:
    ``x[:, positions(...)]``)."""
    return [start + i for _, start, n in chunks(layout, world, rank, local) for i in range(n)]


def _pair(n: int, m: int, distance: int, left: int, right: int):
    """The block of ``n`` queries at global position ``P0`` against ``m`` keys at ``Q0 = P0 - distance``:
    ``(rows, keys, L, R)`` to attend with, or None when no query sees a key. See the module docstring."""
    rows, keys = n, m
    e = distance - (m - n)
    if left >= 0 and e > left:          # keys too far behind for the last rows: they see nothing here
        rows -= e - left
        e = left
    if right >= 0 and e < -right:       # the last keys lie beyond every row's window
        keys -= -right - e
        e = -right
    if rows <= 0 or keys <= 0:
        return None                     # (otherwise the last row sees the last key: the block is not empty)
    big_l = -1 if left < 0 or left - e >= keys - 1 else left - e    # -1 also where the side hides nothing
    big_r = -1 if right < 0 or right + e >= rows - 1 else right + e
    return rows, keys, big_l, big_r


def _coalesce(found: list) -> list:
    """Unmasked blocks that share their keys and have adjacent rows (or share rows, with adjacent keys) become one
    call."""
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(found):
            for j, b in enumerate(found):
                if i == j or not (a.full and b.full):
                    continue
                if (a.k_start, a.k_stop) == (b.k_start, b.k_stop) and a.q_stop == b.q_start:
                    joined = a._replace(q_stop=b.q_stop)
                elif (a.q_start, a.q_stop) == (b.q_start, b.q_stop) and a.k_stop == b.k_start:
                    joined = a._replace(k_stop=b.k_stop)
                else:
                    continue
                found = [x for n, x in enumerate(found) if n not in (i, j)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(found)


@functools.lru_cache(maxsize=4096)
def blocks(layout: str, world: int, rank: int, source: int, local: int, left: int, right: int) -> tuple:
    """The attention calls of rank ``rank``'s queries against rank ``source``'s keys and values, each rank holding
    ``local`` tokens in ``layout``; ``(left, right)`` is the global window (causal: ``right = 0``). Empty when no
    query sees any of those keys."""
    if rank == source and left == -1 and right in (-1, 0):
        return (Block(0, local, 0, local, -1, right),)  # local order keeps global order: causal is local causal
    found = []
    for q_off, p0, n in chunks(layout, world, rank, local):
        for k_off, k0, m in chunks(layout, world, source, local):
            pair = _pair(n, m, p0 - k0, left, right)
            if pair is not None:
                rows, keys, big_l, big_r = pair
                found.append(Block(q_off, q_off + rows, k_off, k_off + keys, big_l, big_r))
    return tuple(_coalesce(found))


# --------------------------------------------------------------------------------------------
# Programs and the drivers that run them
# --------------------------------------------------------------------------------------------

class Send(NamedTuple):
    """A program's request: start passing ``arrays`` to the next rank (it gets a ticket back)."""
    arrays: tuple


class Receive(NamedTuple):
    """A program's request: the arrays the previous rank sent under the same ticket."""
    ticket: object


def run(program, transport):
    """Runs one rank's program: ``transport.send(arrays) -> ticket`` starts a transfer to the next rank and the
    matching receive from the previous one; ``transport.receive(ticket) -> arrays`` completes it."""
    answer = None
    while True:
        try:
            request = program.send(answer)
        except StopIteration as done:
            return done.value
        answer = transport.send(request.arrays) if type(request) is Send else transport.receive(request.ticket)


def run_local(programs: Sequence, copy: Callable) -> list:
    """Runs the programs of all ranks of a ring in one process, rank ``r`` sending to rank ``(r + 1) % world``.
    What a rank sends is ``copy``-ed (a message is a copy, as on a wire). Returns every program's result.

    Each program stops at a receive whose message is not there yet; the others run on. Tickets number a rank's
    sends, so a receive takes the previous rank's message with its own ticket's number (every rank runs the same
    sequence of requests)."""
    world = len(programs)
    mail: dict = {}                       # (receiving rank, ticket) -> arrays
    sent = [0] * world                    # tickets issued per rank
    answers: list = [None] * world
    waiting: list = [None] * world        # the Receive a rank is stopped at
    results: list = [None] * world
    running = set(range(world))
    while running:
        progressed = False
        for rank in sorted(running):
            while rank in running:
                if waiting[rank] is not None:
                    key = (rank, waiting[rank].ticket)
                    if key not in mail:
                        break
                    answers[rank], waiting[rank] = mail.pop(key), None
                try:
                    request = programs[rank].send(answers[rank])
                except StopIteration as done:
                    results[rank] = done.value
                    running.discard(rank)
                    break
                progressed = True
                answers[rank] = None
                if type(request) is Send:
                    mail[((rank + 1) % world, sent[rank])] = tuple(copy(a) for a in request.arrays)
                    answers[rank] = sent[rank]
                    sent[rank] += 1
                else:
                    waiting[rank] = request
        if not progressed and running:
            raise RuntimeError(f"ring programs of ranks {sorted(running)} wait for messages never sent")
    return results


def schedule(layout: str, world: int, local: int, left: int, right: int) -> list:
    """``schedule[t][r]``: the blocks of rank ``r`` at ring step ``t`` (keys of rank ``(r - t) % world``)."""
    return [[blocks(layout, world, r, (r - t) % world, local, left, right) for r in range(world)]
            for t in range(world)]


def work(steps: Iterable) -> int:
    """Query-key pairs an iterable of block tuples computes (masked pairs counted), for balance checks."""
    return sum((b.q_stop - b.q_start) * (b.k_stop - b.k_start) for step in steps for b in step)

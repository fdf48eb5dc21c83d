"""Context parallelism for PyTorch: ring attention over a ``torch.distributed`` process group.

    import cuflash.torch_distributed            # also cuflash.torch.distributed, once imported
    out = cuflash.torch.distributed.ring_attention(q, k, v, group, causal=True, layout="zigzag")

Each rank of ``group`` holds one shard of every sequence: q, k, v ``(batch, local, heads, headdim)``. Keys and
values travel around the ring by ``torch.distributed`` P2P (``batch_isend_irecv``; NCCL on GPUs, gloo on CPUs),
started on a side stream before the attention of the block in hand so the two overlap. Each step's partial
result -- ``cuflash.torch.attention(..., return_lse=True)`` on the blocks :func:`cuflash.ring.blocks` names --
merges into a float32 accumulator through the log-sum-exps (the math of ``cuflash.reference.combine``). The
backward runs the ring again: keys and values travel as in the forward, and float32 dK/dV accumulators travel
one step behind them back to their owner; every block's backward (``torch.ops.cuflash.attention_bwd``) uses the
merged output and the global log-sum-exp, so its gradients are that block's exact share.

The ring's code is a program per rank (:mod:`cuflash.ring`); :class:`ProcessGroupTransport` carries its messages
over a process group, and :func:`ring_attention_local` runs the programs of all ranks in one process with the
messages passed as copies -- the same code path, the transport swapped (for tests and for debugging on one GPU).
cuflash builds no communication layer of its own.
"""
from __future__ import annotations

import math
import sys
from typing import NamedTuple

try:
    import torch
    import torch.distributed as dist
except ImportError as err:
    raise ModuleNotFoundError(f"cuflash.torch_distributed needs PyTorch: pip install torch ({err})",
                              name=err.name) from err

from . import checks, ring  # noqa: E402
from . import torch as cf_torch  # noqa: E402

__all__ = ["ring_attention", "ring_attention_local", "ProcessGroupTransport", "shard", "gather"]


def ring_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, layout="contiguous", deterministic=False, return_lse=False):
    """Attention of one sequence sharded over the ranks of ``group``, differentiable in q, k and v.

    Parameters
    ----------
    q : torch.Tensor, (batch, local, nheads, headdim), float16 or bfloat16
        This rank's queries: ``local = seqlen / world`` tokens at the positions ``layout`` gives it (see
        :func:`shard`).
    k, v : torch.Tensor, (batch, local, nheads_k, headdim); ``nheads % nheads_k == 0``
        This rank's keys and values, at the same positions as its queries.
    group : torch.distributed.ProcessGroup, optional
        The ring: rank r sends to rank r + 1 of the group. Default: the world.
    causal, softmax_scale, window_size, softcap
        As in :func:`cuflash.torch.attention`, over the whole sequence's positions (queries and keys of one
        sequence: the causal mask is the usual lower triangle).
    alibi_slopes
        Not supported: the kernels take the ALiBi distance from a block's own lengths, not from its position in the
        sequence. Raises NotImplementedError unless None.
    layout : "contiguous" or "zigzag"
        Rank r of N holds positions ``[r*local, (r+1)*local)``, or, for "zigzag", chunks r and 2N-1-r of 2N
        equal chunks (``local`` even). Zigzag balances causal work: every rank computes the same at every step.
    deterministic : bool
        Bitwise-repeatable gradients (a fixed dQ order in each block; the ring's sums have a fixed order anyway).
    return_lse : bool
        Also return the float32 log-sum-exp ``(batch, nheads, local)`` over the whole sequence's keys.

    Returns
    -------
    out : torch.Tensor, (batch, local, nheads, headdim), dtype of q; with ``return_lse``, ``(out, lse)``.

    Examples
    --------
    >>> # torchrun --nproc-per-node 4 train.py
    >>> dist.init_process_group("nccl"); torch.cuda.set_device(dist.get_rank())
    >>> q, k, v = (cuflash.torch_distributed.shard(x, layout="zigzag") for x in (q_full, k_full, v_full))
    >>> out = cuflash.torch_distributed.ring_attention(q, k, v, causal=True, layout="zigzag")
    """
    transport = _transport(group)
    q, k, v, config, headdim = _prepare(q, k, v, transport.world, causal, softmax_scale, window_size, softcap,
                                        alibi_slopes, layout, deterministic)
    out, lse = _RingAttention.apply(q, k, v, transport, config)
    out = out[..., :headdim]
    return (out, lse) if return_lse else out


def ring_attention_local(qs, ks, vs, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, layout="contiguous", deterministic=False, return_lse=False):
    """:func:`ring_attention` of ``len(qs)`` ranks simulated in one process: the same ring programs, their
    messages passed as copies instead of over a process group. Differentiable in every shard.

    ``qs, ks, vs``: sequences of the ranks' shards (rank r's at index r), shaped as :func:`ring_attention`'s.
    Returns the list of the ranks' outputs (with ``return_lse``, a list of ``(out, lse)``).
    """
    world = len(qs)
    if not (len(ks) == len(vs) == world and world >= 1):
        raise ValueError(f"qs, ks, vs: expected one shard per rank each, got {len(qs)}, {len(ks)}, {len(vs)}")
    prepared = [_prepare(q, k, v, world, causal, softmax_scale, window_size, softcap, alibi_slopes, layout,
                         deterministic) for q, k, v in zip(qs, ks, vs)]
    config, headdim = prepared[0][3], prepared[0][4]
    flat = [t for p in prepared for t in p[:3]]
    results = _LocalRingAttention.apply(config, *flat)
    outs = [out[..., :headdim] for out in results[:world]]
    return [(o, l) for o, l in zip(outs, results[world:])] if return_lse else outs


# --------------------------------------------------------------------------------------------
# Options and checks
# --------------------------------------------------------------------------------------------

class _Config(NamedTuple):
    """What every rank's program needs besides its tensors: hashable, one per call."""
    layout: str
    world: int
    scale: float
    left: int           # the global window: -1 unbounded; causal sets right = 0
    right: int
    softcap: float
    deterministic: bool


def _prepare(q, k, v, world, causal, softmax_scale, window_size, softcap, alibi_slopes, layout, deterministic):
    """(q, k, v, config, headdim): the checks, and q, k, v zero-padded to a head dim the kernels take (once
    for the whole ring, as cuflash.torch.attention would per call)."""
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ring attention does not take ALiBi (the kernels measure the ALiBi "
                                  "distance within a block, not from the block's position in the sequence)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name}: expected a 4-d torch.Tensor (batch, local, heads, headdim), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"k, v: each rank holds the keys of its own queries: seqlen (axis 1) must be q's "
                         f"{q.shape[1]}, got {k.shape[1]} and {v.shape[1]}")
    ring.check_layout(layout, q.shape[1])
    left, right = checks.window(causal, tuple(window_size) if isinstance(window_size, list) else window_size)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")
    headdim = q.shape[-1]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    if headdim % 8:
        padded = checks.padded_headdim(headdim)
        q, k, v = (torch.nn.functional.pad(x, (0, padded - headdim)) for x in (q, k, v))
    return q, k, v, _Config(layout, world, scale, left, right, float(softcap), deterministic), headdim


# --------------------------------------------------------------------------------------------
# The merge: partial results over disjoint keys, through their log-sum-exps
# --------------------------------------------------------------------------------------------

def _merge(out, lse, part_out, part_lse) -> None:
    """Merges a partial result into the float32 accumulator in place (``cuflash.reference.combine`` of the two):
    out ``(b, s, h, d)`` and lse ``(b, h, s)`` float32 (views of the accumulator are fine), part_out in any
    dtype. A row with ``lse = -inf`` on one side takes the other side unchanged; on both, it stays 0 and -inf."""
    total = torch.logaddexp(lse, part_lse)
    shift = torch.where(torch.isneginf(total), 0.0, total)   # exp(-inf - 0) = 0 for an empty row
    old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    new = torch.exp(part_lse - shift).transpose(1, 2).unsqueeze(-1)
    out.mul_(old).add_(part_out.float() * new)
    lse.copy_(total)


# --------------------------------------------------------------------------------------------
# One rank's programs (cuflash.ring): forward and backward
# --------------------------------------------------------------------------------------------

def _forward_program(q, k, v, rank: int, config: _Config):
    """Yields ring.Send / ring.Receive; returns ``(out in q's dtype, lse float32)``."""
    b, local, h, d = q.shape
    out = torch.zeros((b, local, h, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, local), -math.inf, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())  # P2P sends whole storage: views of a packed qkv are copied once
    for step in range(config.world):
        last = step + 1 == config.world
        ticket = None if last else (yield ring.Send(kv))  # the next step's keys travel while this step computes
        source = (rank - step) % config.world
        for blk in ring.blocks(config.layout, config.world, rank, source, local, config.left, config.right):
            rows, keys = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
            part_out, part_lse = cf_torch.attention(
                q[:, rows], kv[0][:, keys], kv[1][:, keys], softmax_scale=config.scale,
                window_size=(blk.left, blk.right), softcap=config.softcap, return_lse=True)
            _merge(out[:, rows], lse[:, :, rows], part_out, part_lse)
        if not last:
            kv = yield ring.Receive(ticket)
    return out.to(q.dtype), lse


def _backward_program(dout, q, k, v, out, lse, rank: int, config: _Config):
    """Yields ring.Send / ring.Receive; returns ``(dq, dk, dv)`` in the inputs' dtypes.

    At step t the rank holds the keys of rank ``(rank - t) % world`` and adds its blocks' dK/dV to that rank's
    float32 accumulator, which arrives from the previous rank (who added its share at step t - 1) and leaves for
    the next one; after the last step the accumulator of this rank's own keys arrives home."""
    b, local = q.shape[:2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, grads_ticket = (k.contiguous(), v.contiguous()), None
    for step in range(config.world):
        last = step + 1 == config.world
        kv_ticket = None if last else (yield ring.Send(kv))
        source = (rank - step) % config.world
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for blk in ring.blocks(config.layout, config.world, rank, source, local, config.left, config.right):
            rows, keys = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
            part_dq, part_dk, part_dv = torch.ops.cuflash.attention_bwd(
                dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows],
                lse[:, :, rows].contiguous(),  # a copy only for a part of the rows: lse rows start aligned
                None, None, config.scale, False, blk.left, blk.right, config.softcap, config.deterministic, 0.0)
            dq[:, rows] += part_dq
            dk[:, keys] += part_dk
            dv[:, keys] += part_dv
        if step > 0:  # the shares of the ranks this block visited before
            before = yield ring.Receive(grads_ticket)
            dk += before[0]
            dv += before[1]
        if config.world > 1:
            grads_ticket = yield ring.Send((dk, dv))
        if not last:
            kv = yield ring.Receive(kv_ticket)
    if config.world > 1:
        dk, dv = yield ring.Receive(grads_ticket)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """One rank's ring attention over a transport: returns ``out, lse`` (lse not differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, transport, config):
        out, lse = ring.run(_forward_program(q, k, v, transport.rank, config), transport)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.transport, ctx.config = transport, config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring.run(_backward_program(dout.contiguous(), q, k, v, out, lse, ctx.transport.rank, ctx.config),
                         ctx.transport)
        return (*grads, None, None)


class _LocalRingAttention(torch.autograd.Function):
    """Every rank's ring attention in one process (cuflash.ring.run_local): inputs ``config, q0, k0, v0, q1, ...``,
    outputs ``out0, out1, ..., lse0, lse1, ...``."""

    @staticmethod
    def forward(ctx, config, *tensors):
        world = config.world
        shards = [tensors[3 * r:3 * r + 3] for r in range(world)]
        results = ring.run_local([_forward_program(*shards[r], r, config) for r in range(world)], torch.clone)
        outs, lses = [o for o, _ in results], [l for _, l in results]
        ctx.save_for_backward(*tensors, *outs, *lses)
        ctx.config = config
        ctx.mark_non_differentiable(*lses)
        return (*outs, *lses)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        world = ctx.config.world
        saved = ctx.saved_tensors
        tensors, outs, lses = saved[:3 * world], saved[3 * world:4 * world], saved[4 * world:]
        programs = []
        for r in range(world):
            q, k, v = tensors[3 * r:3 * r + 3]
            dout = torch.zeros_like(outs[r]) if grads[r] is None else grads[r].contiguous()
            programs.append(_backward_program(dout, q, k, v, outs[r], lses[r], r, ctx.config))
        results = ring.run_local(programs, torch.clone)
        return (None, *(g for rank_grads in results for g in rank_grads))


# --------------------------------------------------------------------------------------------
# The transport: torch.distributed P2P on a side stream
# --------------------------------------------------------------------------------------------

class _InFlight(NamedTuple):
    works: list      # the batch's torch.distributed Work handles
    received: tuple  # the buffers the previous rank's tensors land in
    sent: tuple      # kept alive until the transfer completes


class ProcessGroupTransport:
    """Passes tensors to the next rank of a process group and takes the previous rank's, with
    ``torch.distributed.batch_isend_irecv``: on CUDA tensors from a side stream that first waits for the work
    already queued (what is sent is ready), so the transfer runs beside the attention queued after it;
    :meth:`receive` makes the current stream wait for the transfer."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("group: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None \
            else (self.rank + 1) % self.world
        self._previous = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None \
            else (self.rank - 1) % self.world
        self._streams: dict = {}

    def send(self, tensors) -> _InFlight:
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self._previous, self.group) for t in received]
        device = tensors[0].device
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                works = dist.batch_isend_irecv(ops)
        else:
            works = dist.batch_isend_irecv(ops)
        return _InFlight(works, received, tuple(tensors))

    def receive(self, in_flight: _InFlight) -> tuple:
        for work in in_flight.works:
            work.wait()  # NCCL: the current stream waits for the transfer; gloo: the host waits
        return in_flight.received


_transports: dict = {}  # process group -> its transport (and side streams), made once


def _transport(group) -> ProcessGroupTransport:
    key = group if group is not None or not dist.is_available() else dist.group.WORLD  # a new world: a new key
    transport = _transports.get(key) if key is not None else None
    if transport is None:
        transport = ProcessGroupTransport(group)
        _transports[key] = transport
    return transport


# --------------------------------------------------------------------------------------------
# Sharding a sequence, and gathering it back
# --------------------------------------------------------------------------------------------

def shard(x, group=None, *, layout="contiguous", dim=1, rank=None, world=None):
    """This rank's shard of a whole sequence ``x`` along ``dim`` (a copy), as :func:`ring_attention` expects it.
    ``rank``/``world`` default to the group's."""
    if rank is None or world is None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"x: seqlen (axis {dim}) {x.shape[dim]} is not a multiple of the {world} ranks")
    local = x.shape[dim] // world
    index = torch.tensor(ring.positions(layout, world, rank, local), device=x.device)
    return x.index_select(dim, index)


def gather(shards, *, layout="contiguous", dim=1):
    """The whole sequence from every rank's shard (``shards[r]`` is rank r's), for checks and tests."""
    world, local = len(shards), shards[0].shape[dim]
    order = [p for r in range(world) for p in ring.positions(layout, world, r, local)]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(list(shards), dim=dim).index_select(dim, inverse.to(shards[0].device))


# cuflash.torch is a module, so its `distributed` is this module, attached on import (and importable by that name)
cf_torch.distributed = sys.modules[__name__]
sys.modules.setdefault(f"{__package__}.torch.distributed", sys.modules[__name__])

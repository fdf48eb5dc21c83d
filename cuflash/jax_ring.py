"""Context parallelism for JAX: ring attention inside ``jax.shard_map``, keys and values carried by
``jax.lax.ppermute``, under ``jax.jit`` and ``jax.grad``.

    import cuflash.jax_ring
    mesh = jax.make_mesh((4,), ("sp",))
    spec = jax.sharding.PartitionSpec(None, "sp")            # shard axis 1, the sequence
    ring = jax.shard_map(lambda q, k, v: cuflash.jax_ring.ring_attention(q, k, v, "sp", causal=True),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    out = jax.jit(ring)(q, k, v)                              # q, k, v: the whole sequence, (b, s, h, d)

The schedule is :mod:`cuflash.ring`'s, as in ``cuflash.torch_distributed``: at step t the device holds the keys of
the device t places before it on the mesh axis, attends with cuflash's forward kernel on the blocks
:func:`cuflash.ring.blocks` names, and merges the partial results through their log-sum-exps in float32. A
device's rank is a traced value under ``shard_map``, so a step whose blocks differ between ranks (causal: the
diagonal, earlier and later keys) runs the rank's case through ``jax.lax.switch``. The backward is a ring of its
own (``jax.custom_vjp``): keys and values travel again, and float32 dK/dV accumulators travel one step behind them
back to their owner; each block's backward uses the merged output and the global log-sum-exp. XLA runs each
``ppermute`` asynchronously beside the attention that does not depend on it.

Sharding a sequence in the "zigzag" layout: ``cuflash.ring.positions`` gives each rank's positions; permute the
sequence axis with their concatenation before sharding it contiguously (:func:`zigzag_order`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as err:
    raise ModuleNotFoundError(f"cuflash.jax_ring needs JAX: pip install jax ({err})", name=err.name) from err

from . import checks, ring  # noqa: E402
from . import jax as cf_jax  # noqa: E402

__all__ = ["ring_attention", "zigzag_order"]


def ring_attention(q, k, v, axis_name, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   layout="contiguous", deterministic=False):
    """Attention of one sequence sharded over the mesh axis ``axis_name``; call it inside ``jax.shard_map``.

    Parameters
    ----------
    q : jax.Array, (batch, local, nheads, headdim), float16 or bfloat16 -- this device's shard of the queries
    k, v : jax.Array, (batch, local, nheads_k, headdim); ``nheads % nheads_k == 0`` -- the same positions' keys
    axis_name : the mesh axis the sequence is sharded over; device i of that axis sends to device i + 1
    causal, softmax_scale, window_size, softcap, deterministic
        As in :func:`cuflash.jax.attention`, over the whole sequence's positions (static).
    layout : "contiguous" or "zigzag" (:mod:`cuflash.ring`); zigzag balances causal work over the devices.

    Returns
    -------
    out : jax.Array, (batch, local, nheads, headdim), dtype of q; differentiable in q, k and v.
    """
    world = int(jax.lax.axis_size(axis_name))
    local, headdim = q.shape[1], q.shape[-1]
    if k.shape[1] != local or v.shape[1] != local:
        raise ValueError(f"k, v: each device holds the keys of its own queries: seqlen (axis 1) must be q's "
                         f"{local}, got {k.shape[1]} and {v.shape[1]}")
    ring.check_layout(layout, local)
    left, right = checks.window(causal, tuple(window_size))
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    config = _Config(axis_name, layout, world, scale, left, right, float(softcap), bool(deterministic))
    if headdim % 8:  # a head dim the kernels do not take: zero-padded copies, once for the whole ring
        widths = [(0, 0)] * 3 + [(0, checks.padded_headdim(headdim) - headdim)]
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    return _ring(q, k, v, config)[..., :headdim]


def zigzag_order(seqlen: int, world: int) -> np.ndarray:
    """The permutation of a sequence axis that makes a contiguous shard of it rank r's zigzag shard:
    ``x[:, zigzag_order(s, n)]`` sharded over n devices; ``argsort`` of it undoes it."""
    local = seqlen // world
    return np.array([p for r in range(world) for p in ring.positions("zigzag", world, r, local)])


class _Config(NamedTuple):
    axis_name: object
    layout: str
    world: int
    scale: float
    left: int       # the global window: -1 unbounded; causal sets right = 0
    right: int
    softcap: float
    deterministic: bool


# --------------------------------------------------------------------------------------------
# The ring: forward, backward, and the rank's case of a step
# --------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, config):
    return _forward(q, k, v, config)[0]


def _ring_fwd(q, k, v, config):
    out, lse = _forward(q, k, v, config)
    return out, (q, k, v, out, lse)


def _ring_bwd(config, residuals, dout):
    return _backward(dout, *residuals, config)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _pass(arrays, config):
    """The arrays of the previous device on the axis (each device sends its own to the next)."""
    perm = [(i, (i + 1) % config.world) for i in range(config.world)]
    return tuple(jax.lax.ppermute(x, config.axis_name, perm) for x in arrays)


def _by_rank(step: int, local: int, config: _Config, branch, operands):
    """``branch(blocks)(*operands)`` with this device's blocks at ``step``: one trace per distinct case, chosen
    by the traced rank with jax.lax.switch when the ranks' cases differ."""
    cases = [ring.blocks(config.layout, config.world, r, (r - step) % config.world, local, config.left,
                         config.right) for r in range(config.world)]
    distinct = sorted(set(cases))
    if len(distinct) == 1:
        return branch(distinct[0])(*operands)
    index = jnp.asarray([distinct.index(c) for c in cases], dtype=jnp.int32)[jax.lax.axis_index(config.axis_name)]
    return jax.lax.switch(index, [branch(c) for c in distinct], *operands)


def _options(config: _Config, blk: ring.Block, q, k, v):
    """cuflash.jax's options of one block (checked against its slices' shapes)."""
    return cf_jax._Options.make(q, k, v, None, config.scale, False, (blk.left, blk.right), config.softcap,
                                config.deterministic)


def _merge(out, lse, part_out, part_lse):
    """The float32 accumulator ``out (b, s, h, d), lse (b, h, s)`` merged with a partial result (reference.combine
    of the two; an empty row, lse = -inf, adds nothing)."""
    total = jnp.logaddexp(lse, part_lse)
    shift = jnp.where(jnp.isneginf(total), 0.0, total)
    old = jnp.swapaxes(jnp.exp(lse - shift), 1, 2)[..., None]
    new = jnp.swapaxes(jnp.exp(part_lse - shift), 1, 2)[..., None]
    return out * old + part_out.astype(jnp.float32) * new, total


def _forward(q, k, v, config):
    b, local, h, d = q.shape

    def branch(blocks):
        def run(q, k, v, out, lse):
            for blk in blocks:
                rows, keys = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
                qb, kb, vb = q[:, rows], k[:, keys], v[:, keys]
                part_out, part_lse = cf_jax._forward_call(qb, kb, vb, None, _options(config, blk, qb, kb, vb))
                merged = _merge(out[:, rows], lse[:, :, rows], part_out, part_lse)
                out, lse = out.at[:, rows].set(merged[0]), lse.at[:, :, rows].set(merged[1])
            return out, lse
        return run

    out = jnp.zeros((b, local, h, d), jnp.float32)
    lse = jnp.full((b, h, local), -jnp.inf, jnp.float32)
    kv = (k, v)
    for step in range(config.world):
        last = step + 1 == config.world
        coming = None if last else _pass(kv, config)   # the next step's keys travel while this step computes
        out, lse = _by_rank(step, local, config, branch, (q, *kv, out, lse))
        kv = kv if last else coming
    return out.astype(q.dtype), lse


def _backward(dout, q, k, v, out, lse, config):
    local = q.shape[1]
    dout = dout.astype(q.dtype)

    def branch(blocks):
        def run(q, k, v, dq):
            dk = jnp.zeros(k.shape, jnp.float32)
            dv = jnp.zeros(v.shape, jnp.float32)
            for blk in blocks:
                rows, keys = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
                qb, kb, vb = q[:, rows], k[:, keys], v[:, keys]
                part = cf_jax._backward_call(dout[:, rows], qb, kb, vb, out[:, rows], lse[:, :, rows], None,
                                             _options(config, blk, qb, kb, vb))
                dq = dq.at[:, rows].add(part[0].astype(jnp.float32))
                dk = dk.at[:, keys].add(part[1].astype(jnp.float32))
                dv = dv.at[:, keys].add(part[2].astype(jnp.float32))
            return dq, dk, dv
        return run

    dq = jnp.zeros(q.shape, jnp.float32)
    kv, carried = (k, v), None
    for step in range(config.world):
        last = step + 1 == config.world
        coming = None if last else _pass(kv, config)
        dq, dk, dv = _by_rank(step, local, config, branch, (q, *kv, dq))
        if carried is not None:  # the shares of the devices these keys visited before
            dk, dv = dk + carried[0], dv + carried[1]
        carried = _pass((dk, dv), config) if config.world > 1 else (dk, dv)  # home after the last step
        kv = kv if last else coming
    return dq.astype(q.dtype), carried[0].astype(k.dtype), carried[1].astype(v.dtype)

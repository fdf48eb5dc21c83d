"""The backward (``cuflash.attention_backward``, ``attention_varlen_backward``): its launches -- a preprocess, the
main kernel (the portable one, ``cuda_src/bwd.cu``, or on sm_90a the Hopper one, :mod:`cuflash.ops.backward_sm90`)
and the dQ conversion -- their tile tables and specializations, the workspace, the parameter structs, the
deterministic mode's choice between dQ slices and the fixed point, and the calls: :func:`launch` (any layouts, no
checks) and :func:`attention_backward`, :func:`attention_varlen_backward` (the CuPy API's, checked and planned once
per call signature).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import build, checks, plan, runtime, settings
from ..launcher import KernelCall
from ..options import AttentionOptions, resolve
from . import backward_sm90

# Head dims the portable backward is compiled for. Beyond 128, dK and dV of a warp's keys no longer fit in
# registers with the 8-warp split of 64 keys; the wide configuration (WIDE_CONFIG) covers them on sm_90a where the
# Hopper kernel does not (the bwd_sm90 setting off).
BWD_HEADDIMS = (32, 64, 96, 128)


@dataclass(frozen=True)
class BwdConfig:
    block_m: int        # queries per step
    block_n: int        # keys per CTA
    warps: int
    q_buffers: int = 1  # Q/dO buffers: 2 loads the next query block while the current one computes


# One shape for every head dim: 64 keys per CTA, 64 queries per step, 8 warps (4 key tiles x 2 halves);
# the kernel asserts this split (cuda_src/bwd.cu, BwdTraits). 0 spills on sm_80/sm_90a up to d = 128.
BWD_CONFIG = BwdConfig(64, 64, 8)
# Two Q/dO buffers (the next query block loads while one computes) where they are spill-free: up to d = 96 (at 128
# ptxas spills). Faster at d = 64 (docs/perf-notes.md, "backward Q/dO double buffer"); the bwd_qbuf setting
# switches them off.
DOUBLE_BUFFER_HEADDIMS = (32, 64, 96)
# Head dims above 128 (compiled as 256) with 32 keys per CTA (BwdTraits' 2 x 4 warp split; its products' k-loops
# stay rolled): spill-free on sm_90a only (sm_80 spills in two specializations; there such calls raise
# NotImplementedError). The bwd_wide setting switches it off.
WIDE_HEADDIM = 256
WIDE_ARCHS = ("sm_90a",)
WIDE_CONFIG = BwdConfig(64, 32, 8)
# Dropout's keep bits spill some kernels once they join dK and dV in registers, and those kernels leave dropout
# out (BwdTraits::DROPOUT, DROPOUT_MOD): on sm_90a the double-buffered ones and the 64-key d = 128 ones, on sm_80
# the 64-key d = 128 score-mod ones. Calls with dropout take one Q/dO buffer on sm_90a, and at d = 128 there (and
# with a score mod on sm_80) 32 keys per CTA (dropout_config).
DROPOUT_CONFIG = BwdConfig(64, 32, 8)
DROPOUT_HEADDIM = 128


def dropout_config(headdim: int, arch: str, score_mod: bool) -> BwdConfig:
    """The portable backward's tile configuration for a call with dropout at a compiled head dim."""
    if headdim == DROPOUT_HEADDIM and (arch == "sm_90a" or score_mod):
        return DROPOUT_CONFIG
    return BWD_CONFIG if arch == "sm_90a" else bwd_config(headdim)

# Deterministic mode on the Hopper kernel. Where ordered_applies (short sequences, no score mod, a padded batch) from
# ORDERED_MIN_BLOCKS key blocks on, the atomic mode's grid adds fp32 dQ with each query block's key blocks in turn
# ("ordered", below). Elsewhere either each of slots_sm90 CTAs per head adds into its own fp32 dQ
# slice, summed in order after the kernel ("slices"), or the atomic mode's grid adds dQ as int32 fixed point
# (BwdParams::deterministic 2, cuda_src/fixed_dq.cuh): a per-row scale from a bound on the row's partial sums,
# into one accumulator, whose integer sums do not depend on their order ("fixed"). The fixed point costs a pass
# over K and V for the bound and 3-8% in the main kernel's int32 conversions; the slices cost most where a slot's
# passes each add to the whole dQ of its heads, which misses the L2. "auto" (the bwd_sm90_det setting) takes the
# fixed point where the slot rule gives a head more than one slot, or from FIXED_MIN_BLOCKS[d] key blocks on
# (without, with a causal mask); measured in docs/perf-notes.md, "deterministic backward: slices or fixed point".
# At d = 256 the fixed point is faster from one key block on: a slot there adds a 64 x 256 dQ tile per step. A fixed
# slot count (bwd_sm90_det_slots > 0) keeps the slices. With a score mod at d = 64 under a causal mask the slices are
# as fast or faster up to 16k keys, and keep the auto choice there (docs/perf-notes.md, "Hopper backward 128 rows at
# d 64").
FIXED_MIN_BLOCKS = {64: (16, 32), 128: (8, 8), 256: (0, 0)}
# The slices also lose where the dQ of the slot CTAs that run at once outgrows what the L2 holds of it: a slot CTA
# adds to the whole dQ of its (KV head, sequence) group at every key block, where the atomic grid's CTAs at once
# share a few groups'. "auto" takes the fixed point where those bytes (halved under a causal mask, which adds below
# the diagonal only) exceed the L2 size times the memory's bandwidth over SLICES_L2_BANDWIDTH: about 28 MiB on an
# H100 SXM, 41 on an H200 (docs/perf-notes.md, "deterministic backward: slices or fixed point"; measured with one
# slot: 33 MiB at once made the slices 11-21% slower than the fixed point on an H100 and 3-7% faster on an H200).
SLICES_L2_BANDWIDTH = 6e12
# Ordered mode (BwdParams::deterministic DQ_ORDERED): each query block's dQ added to by its key blocks in a fixed order,
# each CTA waiting on the counter of the block for its turn. A CTA waits only on CTAs of its own (KV head, sequence)
# group. CTAs start in launch order, so the oldest group still running has all its CTAs on the GPU and ends, as long as
# a group fits there: at most half the SMs' CTAs (one an SM), so that two such calls on two streams at once cannot fill
# the GPU with CTAs waiting on their groups' unstarted ones. Within that, at most ORDERED_MAX_BLOCKS key blocks (CTAs)
# per group: at d = 64 and 128 the ordered additions are 3-9% faster than the fixed point with 32 and 64 key blocks (4k
# and 8k keys); at d = 256 (64-key blocks) they are not from 32 on (docs/perf-notes.md, "ordered dQ on longer
# sequences"). The bwd_sm90_ordered_blocks setting replaces a head dim's entry, for measurements.
ORDERED_MAX_BLOCKS = {64: 64, 128: 64, 256: 16}
# "auto" takes the ordered mode where it applies from this many key blocks on (without, with a band: a causal mask or a
# window): at d = 64 with 4 key blocks (512 keys) the slices are faster than the atomic mode itself; at d = 256 (64-key
# blocks) under a causal mask the fixed point is faster, the turns there a chain down the diagonal (docs/perf-notes.md,
# "deterministic backward: ordered dQ" and "... at d 256")
ORDERED_MIN_BLOCKS = {64: (8, 8), 128: (1, 1), 256: (1, math.inf)}


def slices_outgrow_l2(problem, slots: int, groups: int, causal: bool, sm_count: int, memory) -> bool:
    """Whether deterministic mode's dQ slices, `slots` CTAs per group (one CTA per SM at once), outgrow the L2 of a
    device with `memory` (build.MemorySystem, or None: never)."""
    if memory is None:
        return False
    group_bytes = problem.seqlen_q * (problem.nheads // problem.nheads_k) * problem.headdim * 4
    at_once = min(slots * groups, sm_count) * group_bytes / (2 if causal else 1)
    return at_once > memory.l2_bytes * memory.bandwidth / SLICES_L2_BANDWIDTH


def bwd_config(headdim: int) -> BwdConfig:
    """The portable backward's tile configuration for a compiled head dim."""
    if headdim == WIDE_HEADDIM:
        return WIDE_CONFIG
    if settings.current().bwd_qbuf and headdim in DOUBLE_BUFFER_HEADDIMS:
        return dataclasses.replace(BWD_CONFIG, q_buffers=2)
    return BWD_CONFIG


@dataclass(frozen=True)
class BwdSpec:
    """One compiled portable backward main kernel."""

    dtype: str
    headdim: int
    config: BwdConfig
    band: bool
    score_mod: bool

    source = "bwd.cu"

    @property
    def name(self) -> str:
        c = self.config
        return (f"bwd_{self.dtype}_d{self.headdim}_m{c.block_m}_n{c.block_n}_w{c.warps}"
                + (f"_qb{c.q_buffers}" if c.q_buffers > 1 else "")
                + ("_causal" if self.band else "") + ("_mod" if self.score_mod else ""))

    @property
    def template(self) -> str:
        c = self.config
        return plan.template("bwd_kernel", self.dtype, (self.headdim, c.block_m, c.block_n, c.warps, c.q_buffers),
                             (self.band, self.score_mod))

    @property
    def threads(self) -> int:
        return self.config.warps * 32

    @property
    def smem_bytes(self) -> int:
        # BwdTraits::SMEM_BYTES: K, V (block_n rows), per buffer Q, dO (block_m rows), P^T and dS^T
        # (block_n x 64), per buffer lse and D (block_m floats each).
        c = self.config
        return (2 * (c.block_n + c.q_buffers * c.block_m) * plan.smem_row_bytes(self.headdim)
                + 2 * c.block_n * 64 * 2 + c.q_buffers * 2 * c.block_m * 4)


class AuxSpec(plan.HelperSpec):
    """A helper kernel of the backward (cuda_src/bwd_aux.cu): bwd_preprocess, bwd_kv_bound, bwd_fixed_scale or
    bwd_convert_dq."""

    source = "bwd_aux.cu"


def pre_lanes(headdim: int) -> int:
    """Threads per query row in bwd_preprocess: the power of two that covers the row in 16-byte pieces, at most a
    warp (a whole warp per row at d = 64 would leave 24 lanes idle)."""
    pieces = -(-headdim // 8)
    return min(32, 1 << (pieces - 1).bit_length())


def bwd_headdim(headdim: int, arch: str | None = None) -> int:
    """The compiled backward head dim for a call's (padded up inside the kernel); NotImplementedError past them."""
    for d in BWD_HEADDIMS:
        if headdim <= d:
            return d
    if settings.current().bwd_wide and arch in WIDE_ARCHS and headdim <= WIDE_HEADDIM:
        return WIDE_HEADDIM
    raise NotImplementedError(f"attention_backward: head dim {headdim} is not supported yet "
                              f"(the backward kernel is compiled up to {BWD_HEADDIMS[-1]})")


def all_specs(arch: str) -> list:
    """Every portable backward specialization (main and helper kernels) the planner can choose on `arch`; the
    double-buffered and wide ones whatever the settings, so they are compiled and checked for spills."""
    specs = [AuxSpec(kernel, dtype) for dtype in ("fp16", "bf16")
             for kernel in ("bwd_preprocess", "bwd_kv_bound", "bwd_fixed_scale", "bwd_convert_dq")]
    for dtype in ("fp16", "bf16"):
        for d in BWD_HEADDIMS:
            for band in (False, True):
                for mod in (False, True):
                    specs.append(BwdSpec(dtype, d, BWD_CONFIG, band, mod))
                    if d in DOUBLE_BUFFER_HEADDIMS:
                        specs.append(BwdSpec(dtype, d, dataclasses.replace(BWD_CONFIG, q_buffers=2), band, mod))
                if arch in WIDE_ARCHS and d == BWD_HEADDIMS[-1]:
                    for mod in (False, True):
                        specs.append(BwdSpec(dtype, WIDE_HEADDIM, WIDE_CONFIG, band, mod))
                if d == DROPOUT_HEADDIM:
                    for mod in ((False, True) if arch == "sm_90a" else (True,)):
                        specs.append(BwdSpec(dtype, d, DROPOUT_CONFIG, band, mod))
    return specs


@dataclass(frozen=True)
class BwdLaunch:
    spec: BwdSpec    # the portable main kernel
    grid: tuple      # the main kernel's grid (the Hopper kernel's where `sm90` is set)
    slices: int      # fp32 dQ accumulator slices (1 unless deterministic)
    fixed_point: bool = False  # deterministic mode 2: one int32 accumulator on the atomic grid
    sm90: backward_sm90.BwdSm90Spec | None = None  # the Hopper main kernel, which then runs instead of `spec`
    ordered: bool = False      # deterministic mode DQ_ORDERED: one fp32 accumulator on the atomic grid, added in turn


def plan_backward(problem, left: int, right: int, score_mod: bool, deterministic: bool, arch: str,
                  sm_count: int, dropout: bool = False, memory=None, packed: bool = False) -> BwdLaunch:
    """Main backward kernel and its grid. Where the Hopper kernel applies (backward_sm90.applies; with dropout,
    dropout_applies) it runs (`sm90`), on its own grid: 128-key blocks, and in deterministic mode slots_sm90 slots
    or the fixed point (not with dropout; `memory`, the device's build.MemorySystem, for slices_outgrow_l2), or the
    ordered additions (ordered_applies, from ORDERED_MIN_BLOCKS key blocks; `packed`: varlen sequences).
    Elsewhere deterministic mode gives each of `slots` CTAs per (KV head, batch) its own dQ slice; enough slots to
    fill the GPU about twice, at most one per KV block."""
    band = left >= 0 or right >= 0
    dtype = plan.dtype_tag(problem.dtype)
    d = bwd_headdim(problem.headdim, arch)
    hopper = (backward_sm90.dropout_applies if dropout else backward_sm90.applies)(problem, score_mod, arch)
    if dropout and d > BWD_HEADDIMS[-1] and not hopper:
        raise NotImplementedError(f"attention_backward: dropout at head dim {problem.headdim} is not supported here "
                                  f"(the portable backward regenerates the mask up to head dim {BWD_HEADDIMS[-1]}, "
                                  f"the Hopper one (sm_90a) at head dims {backward_sm90.DROPOUT_HEADDIMS})")
    config = dropout_config(d, arch, score_mod) if dropout and not hopper else bwd_config(d)
    spec = BwdSpec(dtype, d, config, band, score_mod)
    groups = problem.batch * problem.nheads_k
    if not hopper:
        n_blocks = math.ceil(problem.seqlen_k / spec.config.block_n)
        slots = max(1, min(n_blocks, math.ceil(2 * sm_count / groups))) if deterministic else n_blocks
        return BwdLaunch(spec, plan.check_grid((slots, problem.nheads_k, problem.batch)),
                         slots if deterministic else 1)
    s = settings.current()
    d = backward_sm90.compiled_headdim(problem.headdim)  # the Hopper kernel's compiled head dim
    block_m = backward_sm90.block_m(d, score_mod, dropout)
    n_blocks = math.ceil(problem.seqlen_k / backward_sm90.block_n(d))
    fixed = ordered = False
    if not deterministic:
        slots = n_blocks
    elif s.bwd_sm90_det_slots > 0:
        slots = min(n_blocks, s.bwd_sm90_det_slots)
    else:
        slots = slots_sm90(n_blocks, groups, sm_count, s.bwd_sm90_det_max_passes)
        causal = left < 0 and right == 0
        auto = (slots > 1 or n_blocks >= FIXED_MIN_BLOCKS[d][causal] or
                slices_outgrow_l2(problem, slots, groups, causal, sm_count, memory)) and not (
                    score_mod and causal and d == 64)
        fixed_ok = backward_sm90.tma_dq(d, block_m)  # the FIXED kernels add dQ by TMA
        ordered = ordered_applies(d, block_m, left, right, score_mod, n_blocks, packed, sm_count) and (
            s.bwd_sm90_det == "ordered" or (s.bwd_sm90_det == "auto" and n_blocks >= ORDERED_MIN_BLOCKS[d][band]))
        fixed = not ordered and not dropout and fixed_ok and (
            s.bwd_sm90_det == "fixed" or (s.bwd_sm90_det in ("auto", "ordered") and auto))
    sm90 = backward_sm90.BwdSm90Spec(dtype, d, band, score_mod, block_m, fixed, dropout)
    if fixed or ordered:
        return BwdLaunch(spec, plan.check_grid((n_blocks, problem.nheads_k, problem.batch)), 1, fixed, sm90,
                         ordered)
    return BwdLaunch(spec, plan.check_grid((slots, problem.nheads_k, problem.batch)), slots if deterministic else 1,
                     False, sm90)


def ordered_applies(d: int, block_m: int, left: int, right: int, score_mod: bool, n_blocks: int,
                    packed: bool, sm_count: int) -> bool:
    """Deterministic mode's ordered dQ additions (BwdSm90::dq_turn) run this call: the Hopper kernel's dQ warp
    (backward_sm90.tma_dq), no score mod, a padded batch (the first stores' counters), no band or one with a right
    edge (under which the key blocks reach a query block in their order), at most ORDERED_MAX_BLOCKS[d] key blocks (or
    the bwd_sm90_ordered_blocks setting's) and half of the `sm_count` SMs."""
    most = settings.current().bwd_sm90_ordered_blocks.get(d, ORDERED_MAX_BLOCKS[d])
    return (backward_sm90.tma_dq(d, block_m) and not score_mod and not packed
            and (right >= 0 or left < 0) and n_blocks <= min(most, sm_count // 2))


def slots_sm90(n_blocks: int, groups: int, sm_count: int, max_passes: int = 0) -> int:
    """Deterministic mode on the Hopper kernel (one CTA per SM): of 1..n_blocks slots, the one whose CTAs
    (slots x groups of them, ceil(n_blocks / slots) key blocks each) finish soonest, and of those the fewest (each
    slot is a dQ slice to zero and sum), or with `max_passes` > 0 the fewest of at most that many key blocks each
    where one is as soon. (About two CTAs per SM, the portable rule, would leave waves part-empty and CTAs uneven:
    5 slots of 6-7 blocks at seqlen 4k, batch 4, 16 heads, d 128, where 2 slots of 16 end as soon.)"""
    span = {slots: math.ceil(slots * groups / sm_count) * math.ceil(n_blocks / slots)
            for slots in range(1, n_blocks + 1)}
    best = min(span.values())
    soonest = [slots for slots, s in span.items() if s == best]
    short = [slots for slots in soonest if max_passes > 0 and math.ceil(n_blocks / slots) <= max_passes]
    return (short or soonest)[0]


WORKSPACE_ALIGN = 256  # bytes; each piece of a workspace starts on this boundary


def _aligned(n: int) -> int:
    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def workspace(rows: int, nheads: int, headdim: int, slices: int, nheads_k: int = 0,
              counters: int = 0) -> tuple[int, int, int]:
    """The backward's workspaces as one aligned block: byte offsets of lse_log2 and of the dQ accumulator, and
    the total. In the order :func:`launch` lays them out: dsum and lse_log2 (fp32, one per query row and head),
    then the fp32 dQ accumulator (slices x rows x heads x headdim) with `counters` int32 right after it (the first
    stores' tickets and ready flags: BwdParams::dq_first_store), each piece rounded up to WORKSPACE_ALIGN
    (cuflash.jax hands them out of one XLA buffer this size). `rows`: batch * seqlen_q, or total_q when packed.
    `nheads_k` > 0: deterministic mode's fixed point, whose two pieces follow (fixed_point_offsets)."""
    per_row = _aligned(rows * nheads * 4)
    total = 2 * per_row + _aligned(slices * rows * nheads * headdim * 4 + counters * 4)
    return per_row, 2 * per_row, total + (per_row + _aligned(nheads_k * 2 * 4) if nheads_k > 0 else 0)


def first_store_counters(batch: int, nheads: int, seqlen_q: int, block_m: int) -> int:
    """The int32 counters of BwdParams::dq_first_store after the dQ accumulator (DqStoreCounters in params.cuh): a
    ticket and a ready flag per query block of `block_m` rows and head; none where block_m is 0 (no first stores)."""
    return 2 * batch * nheads * -(-seqlen_q // block_m) if block_m else 0


def kv_bound_blocks(rows: int, rows_per_block: int, groups: int, sm_count: int) -> int:
    """bwd_kv_bound's blocks per (KV head, sequence): enough for about 8 blocks per SM over all `groups`, each
    striding over its rows, at most one per `rows_per_block` rows."""
    return max(1, min(-(-rows // rows_per_block), -(-8 * sm_count // groups)))


def fixed_point_offsets(rows: int, nheads: int, headdim: int, counters: int = 0) -> tuple[int, int]:
    """Byte offsets of fixed point's pieces in workspace(rows, nheads, headdim, 1, nheads_k, counters): |dO| per row
    (like dsum; then each row's dQ scale, written over it), then the K/V bounds (nheads_k x 2 x 4 bytes)."""
    row_scale = workspace(rows, nheads, headdim, 1, counters=counters)[2]
    return row_scale, row_scale + _aligned(rows * nheads * 4)


# Layouts of the structs in cuda_src/params.cuh: same field order, C alignment (tests/test_plan.py checks).
PARAMS_DTYPE = plan.struct(
    ("q", "k", "v", "dout", "dk", "dv", "dq_accum", "lse_log2", "dsum", "alibi", "cu_seqlens_q", "cu_seqlens_k",
     "dq_scale", "kv_bound", "dropout_seed", "dropout_offset", "dropout_state"),
    plan.stride_fields("q", "k", "v", "do", "dk", "dv")
    + ["lse_batch_stride", "lse_head_stride", "dq_batch_stride", "alibi_batch_stride", "dq_slice_stride"],
    ("batch", "seqlen_q", "seqlen_k", "nheads", "heads_per_kv", "headdim", "window_left", "window_right",
     "deterministic", "dropout_threshold", "dq_first_store"),
    ("dropout_scale", "scale_log2", "mod_scale", "softcap", "softmax_scale"))
PRE_PARAMS_DTYPE = plan.struct(
    ("out", "dout", "lse", "dsum", "lse_log2", "dq_accum", "dq_scale", "kv_bound", "k", "v", "cu_seqlens_q",
     "cu_seqlens_k"),
    plan.stride_fields("o", "do", "k", "v") + ["dq_slice_stride"],
    ("batch", "seqlen_q", "nheads", "headdim", "lanes", "slices", "fixed_point", "kv_batch", "seqlen_k", "nheads_k",
     "sequences", "first_store_rows"),
    ("softmax_scale",))
CONVERT_PARAMS_DTYPE = plan.struct(
    ("dq_accum", "dq", "dq_scale"), ("slice_stride",), ("slices", "fixed_point", "seqlen_q", "nheads", "headdim"), ())
SM90_PARAMS_DTYPE = backward_sm90.params_dtype(PARAMS_DTYPE)  # BwdSm90Params: tensor maps, then BwdParams


class BackwardCall(NamedTuple):
    """The backward's launches for one call signature, and where its workspace pieces lie: dsum at 0, lse_log2 at
    ``lse_log2_offset``, the dQ accumulator (``dq_bytes``, zeroed by the preprocess) at ``dq_offset``, and in
    deterministic mode's fixed point the row scales and the K/V bounds at ``fixed_offsets``
    (:func:`workspace`, :func:`fixed_point_offsets`)."""
    # D = rowsum(dO * O), lse in log2, dQ accumulator zeroed (fixed point: |dO| per row, the K/V bounds, then each
    # row's dQ scale over its |dO|):
    # out, dout, lse, dsum, lse_log2, dq_accum, dq_scale, kv_bound, k, v, cu_seqlens_q, cu_seqlens_k (packed: rows
    # past the last sequence read as zeros)
    preprocess: KernelCall
    # main: dK, dV, dQ accumulation: q, k, v, dout, dk, dv, dq_accum, lse_log2, dsum, alibi, cu_q, cu_k, dq_scale,
    # kv_bound (not read by the kernel), dropout_seed, dropout_offset, dropout_state
    main: KernelCall
    convert: KernelCall      # dQ = sum of the slices (fixed point: over the row scales), cast: dq_accum, dq, dq_scale
    lse_log2_offset: int
    dq_offset: int
    dq_bytes: int
    workspace_bytes: int
    fixed_offsets: tuple | None = None  # (dq_scale, kv_bound) byte offsets; None: not fixed point

    def __call__(self, stream, dout, q, k, v, out, lse, dq, dk, dv, alibi, cu_seqlens_q, cu_seqlens_k, workspace,
                 dropout_seed=0, dropout_offset=0, dropout_state=0):
        """Launch on ``stream`` with these data pointers (0 where absent), and the forward's dropout generator: its
        seed and offset, or a pointer to them in device memory (dropout_state)."""
        dsum, lse_log2, dq_accum = workspace, workspace + self.lse_log2_offset, workspace + self.dq_offset
        row_scale, kv_bound = (workspace + o for o in self.fixed_offsets) if self.fixed_offsets else (0, 0)
        self.preprocess(stream, out, dout, lse, dsum, lse_log2, dq_accum, row_scale, kv_bound, k, v, cu_seqlens_q,
                        cu_seqlens_k)
        self.main(stream, q, k, v, dout, dk, dv, dq_accum, lse_log2, dsum, alibi, cu_seqlens_q, cu_seqlens_k,
                  row_scale, kv_bound, dropout_seed, dropout_offset, dropout_state)
        self.convert(stream, dq_accum, dq, row_scale)


def backward_call(problem, dout, q, k, v, out, lse, dq, dk, dv, options: AttentionOptions, *, device_id: int,
                  alibi_slopes=None, deterministic: bool, packed: bool) -> BackwardCall:
    """The backward's launches for these layouts (arrays or TensorSpecs; dq, dk, dv contiguous) and options on
    device `device_id` (current); ``packed``: varlen layouts, as in :func:`launch`."""
    scale, left, right, score_mod = options.softmax_scale, options.left, options.right, options.score_mod
    launch = plan_backward(problem, left, right, score_mod, bool(deterministic), build.device_arch(device_id),
                           build.sm_count(device_id), dropout=options.dropout, memory=build.memory_system(device_id),
                           packed=packed)
    dtype = launch.spec.dtype
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.headdim
    # Per-row workspaces: (b, h, sq) and (slices, b, sq, h, d); packed, one row per query token, (h, total_q) and
    # (slices, total_q, h, d). The elementwise launches see a packed batch as one sequence of total_q rows.
    pre_b, pre_sq = (1, q.shape[0]) if packed else (b, sq)
    rows = pre_b * pre_sq  # query rows of all sequences
    fixed = launch.fixed_point
    # whole query blocks' first dQ additions stored (BwdParams::dq_first_store): a ticket and a flag per block (the
    # flag counts the turns in ordered mode)
    first_store = launch.sm90 is not None and (
        launch.ordered or backward_sm90.dq_first_store(launch.sm90, launch.slices, packed))
    store_rows = launch.sm90.block_m if first_store else 0
    store_blocks = -(-sq // store_rows) if first_store else 0
    counters = first_store_counters(b, h, sq, store_rows)
    lse_log2_offset, dq_offset, workspace_bytes = workspace(rows, h, d, launch.slices,
                                                            problem.nheads_k if fixed else 0, counters)

    # D = rowsum(dO * O) and lse in the log2 domain: pre_lanes(d) threads per row; grid (row blocks, heads,
    # sequences)
    pre = AuxSpec("bwd_preprocess", dtype)
    pp = np.zeros((), dtype=PRE_PARAMS_DTYPE)
    plan.set_strides(pp, o=out, do=dout)
    pp["batch"], pp["seqlen_q"], pp["nheads"], pp["headdim"] = pre_b, pre_sq, h, d
    pp["lanes"] = pre_lanes(d)
    pp["dq_slice_stride"], pp["slices"] = rows * h * d, launch.slices
    pp["sequences"] = b  # (packed: cu_seqlens_q[b] ends the rows that belong to a sequence)
    pp["first_store_rows"] = store_rows
    pre_rows = pre.threads // int(pp["lanes"])
    pre_launches = [(build.get_kernel(pre, device_id), plan.check_grid((-(-pre_sq // pre_rows), h, pre_b)),
                     (pre.threads,), 0)]
    if fixed:  # then max |K| and max |V_j| per KV head, over every row of K and V (packed: one sequence)
        plan.set_strides(pp, k=k, v=v)
        pp["fixed_point"], pp["nheads_k"] = 1, problem.nheads_k
        pp["kv_batch"], pp["seqlen_k"] = (1, k.shape[0]) if packed else (b, problem.seqlen_k)
        kv_grid = plan.check_grid((kv_bound_blocks(int(pp["seqlen_k"]), pre_rows, problem.nheads_k * int(
            pp["kv_batch"]), build.sm_count(device_id)), problem.nheads_k, int(pp["kv_batch"])))
        pre_launches.append((build.get_kernel(AuxSpec("bwd_kv_bound", dtype), device_id), kv_grid,
                             (pre.threads,), 0))
        # then each row's dQ scale over its |dO|: one row per thread, grid (row blocks, heads, sequences)
        scale_spec = AuxSpec("bwd_fixed_scale", dtype)
        pp["softmax_scale"] = scale
        pre_launches.append((build.get_kernel(scale_spec, device_id),
                             plan.check_grid((-(-pre_sq // scale_spec.threads), h, pre_b)), (scale_spec.threads,), 0))
    preprocess = KernelCall(pre_launches, pp, PRE_PARAMS_DTYPE.names[:12])

    # the main kernel; dsum and lse_log2 are (pre_b, h, pre_sq) contiguous, seen per sequence
    bp = np.zeros((), dtype=PARAMS_DTYPE)
    plan.set_strides(bp, q=q, k=k, v=v, do=dout, dk=dk, dv=dv)
    bp["lse_batch_stride"], bp["lse_head_stride"] = (1, pre_sq) if packed else (h * sq, sq)
    bp["dq_batch_stride"] = h * d if packed else sq * h * d  # packed: sequence b starts at row cu_seqlens_q[b]
    bp["alibi_batch_stride"] = checks.alibi_batch_stride(alibi_slopes)
    bp["dq_slice_stride"] = rows * h * d
    bp["batch"], bp["seqlen_q"], bp["seqlen_k"] = b, sq, problem.seqlen_k
    bp["nheads"], bp["heads_per_kv"], bp["headdim"] = h, h // problem.nheads_k, d
    bp["window_left"], bp["window_right"] = left, right
    bp["deterministic"] = backward_sm90.DQ_ORDERED if launch.ordered else 2 if fixed else int(bool(deterministic))
    bp["dq_first_store"] = store_blocks
    for name, value in {**options.scales, **options.dropout_fields}.items():
        bp[name] = value
    bp["softmax_scale"] = scale
    if launch.sm90 is not None:  # same interface, same workspace
        main = backward_sm90.backward_main(launch.sm90, bp, q, k, v, dout, launch.grid, device_id)
    else:
        main = KernelCall([(build.get_kernel(launch.spec, device_id), launch.grid, (launch.spec.threads,),
                            launch.spec.smem_bytes)], bp, PARAMS_DTYPE.names[:17])

    # dQ: sum the slices (fixed order), cast; fixed point: the int32 accumulator times each row's unit, grid (chunks
    # of eight elements of a token, tokens)
    conv = AuxSpec("bwd_convert_dq", dtype)
    cp = np.zeros((), dtype=CONVERT_PARAMS_DTYPE)
    cp["slice_stride"], cp["slices"] = rows * h * d, launch.slices
    conv_grid = (min(-(-(rows * h * d // 4) // conv.threads), 65535 * 16),)
    if fixed:
        cp["fixed_point"], cp["seqlen_q"], cp["nheads"], cp["headdim"] = 1, pre_sq, h, d
        conv_grid = (-(-(h * d // 8) // conv.threads), min(rows, 65535))
    convert = KernelCall([(build.get_kernel(conv, device_id), conv_grid, (conv.threads,), 0)], cp,
                         CONVERT_PARAMS_DTYPE.names[:3])
    return BackwardCall(preprocess, main, convert, lse_log2_offset, dq_offset, launch.slices * rows * h * d * 4,
                        workspace_bytes, fixed_point_offsets(rows, h, d, counters) if fixed else None)


_launches: dict = {}  # call signature -> BackwardCall
_attention_calls: dict = {}  # key of an attention_backward() call -> (BackwardCall, device id)
_varlen_calls: dict = {}  # key of an attention_varlen_backward() call -> (BackwardCall, device id)


@settings.on_change
def _forget() -> None:
    _launches.clear()
    _attention_calls.clear()
    _varlen_calls.clear()


def launch(problem, dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale, causal, window_size, softcap,
           alibi_slopes, deterministic, cu_seqlens_q=None, cu_seqlens_k=None, workspace=None, dropout_p=0.0,
           dropout_seed=0, dropout_offset=0, dropout_state=None):
    """Launch the backward into given dq/dk/dv (contiguous), on the current device and stream; no checks.

    The fp32 workspaces (rowsum(dO*O), lse in log2, the dQ accumulator) are one block of
    ``backward_call(...).workspace_bytes`` bytes: ``workspace`` (a uint8 array at least that long, e.g. a buffer
    XLA owns) or, without it, one allocation from CuPy's current allocator (a wrapper that sets one with
    ``cupy.cuda.using_allocator`` decides where it lives). With ``cu_seqlens_q`` and ``cu_seqlens_k`` the arrays
    are packed as in :func:`cuflash.ops.forward.launch`, and the workspaces too: one row per query token. The
    forward's dropout (``dropout_p``, ``dropout_seed``, ``dropout_offset`` or ``dropout_state``) regenerates the same
    mask.
    """
    key = checks.call_signature((problem, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_size,
                                 softcap, alibi_slopes, deterministic, cu_seqlens_q, cu_seqlens_k, dropout_p))
    call = _launches.get(key) if key is not None else None
    if call is None:
        options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        call = runtime.keep(_launches, key, backward_call(
            problem, dout, q, k, v, out, lse, dq, dk, dv, options, device_id=q.device.id, alibi_slopes=alibi_slopes,
            deterministic=deterministic, packed=cu_seqlens_q is not None))
    import cupy
    if workspace is None:
        workspace = cupy.empty(call.workspace_bytes, dtype=np.uint8)
    elif workspace.nbytes < call.workspace_bytes:
        raise ValueError(f"workspace: {workspace.nbytes} bytes, the backward needs {call.workspace_bytes}")
    call(cupy.cuda.get_current_stream().ptr, dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
         lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, runtime.ptr(alibi_slopes), runtime.ptr(cu_seqlens_q),
         runtime.ptr(cu_seqlens_k), workspace.data.ptr, int(dropout_seed), int(dropout_offset),
         runtime.ptr(dropout_state))


def attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, stream, dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    """:func:`cuflash.attention_backward`: check, resolve the options, plan, allocate, launch. A call with the layouts
    and options of an earlier one skips the checks and the planning (:func:`_launch_kept`)."""
    # one key for the checks and the launches: layouts of the arrays, values of the options
    key, hit = runtime.kept(_attention_calls, (dout, q, k, v, out, lse, alibi_slopes),
                            (softmax_scale, causal, window_size, softcap, bool(deterministic), dropout_p))
    if hit is None:
        problem = checks.check_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                        dropout_p=dropout_p)
        runtime.require_device_arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes)
        options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        hit = runtime.keep(_attention_calls, key, _planned(problem, dout, q, k, v, out, lse, options, alibi_slopes,
                                                           deterministic, packed=False))
    return _launch_kept(hit, stream, dout, q, k, v, out, lse, alibi_slopes, 0, 0, dropout_seed, dropout_offset)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, stream,
                              dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    """:func:`cuflash.attention_varlen_backward`, as :func:`attention_backward`: checked and planned (packed: one
    workspace row per query token) once per key, which holds the layouts of every array (cu_seqlens_q/k too; not
    their contents, which only the kernels read), max_seqlen_q/k and the options."""
    key, hit = runtime.kept(_varlen_calls, (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes),
                            (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                             bool(deterministic), dropout_p))
    if hit is None:
        problem = checks.check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                               window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                               dropout_p=dropout_p)
        runtime.require_device_arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                                      cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
        options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        hit = runtime.keep(_varlen_calls, key, _planned(problem, dout, q, k, v, out, lse, options, alibi_slopes,
                                                        deterministic, packed=True))
    return _launch_kept(hit, stream, dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q.data.ptr,
                        cu_seqlens_k.data.ptr, dropout_seed, dropout_offset)


def _planned(problem, dout, q, k, v, out, lse, options: AttentionOptions, alibi_slopes, deterministic,
             packed: bool) -> tuple:
    """What a cache of the CuPy API keeps for a checked call: ``(call, device id)``, the call planned on dq, dk, dv's
    contiguous layouts; lse must be contiguous (packed: ``(nheads, total_q)``)."""
    if not lse.flags.c_contiguous:
        raise ValueError(f"lse: must be contiguous ({'nheads, total_q' if packed else 'batch, nheads, seqlen_q'}); "
                         f"got strides {checks.elem_strides(lse)} elements")
    runtime.require_gpu()  # after the checks, which need no GPU; once per process
    device_id = q.device.id
    grads = (checks.contiguous(name, x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v)))
    with runtime.device(device_id):
        call = backward_call(problem, dout, q, k, v, out, lse, *grads, options, device_id=device_id,
                             alibi_slopes=alibi_slopes, deterministic=deterministic, packed=packed)
    return call, device_id


def _launch_kept(hit, stream, dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q: int, cu_seqlens_k: int,
                 dropout_seed, dropout_offset):
    """A kept call (:func:`_planned`) on these arrays and cu_seqlens pointers (0: dense): the alignment of dout, q, k,
    v and out and the dropout generator checked (every other check is the key's), dq, dk, dv and the workspace
    allocated from CuPy's pool, the kept launches."""
    if (dout.data.ptr | q.data.ptr | k.data.ptr | v.data.ptr | out.data.ptr) % 16:
        runtime.require_device_arrays(dout=dout, q=q, k=k, v=v, out=out)  # says which pointer
    dropout_seed, dropout_offset = checks.dropout_generator(dropout_seed, dropout_offset)
    call, device_id = hit
    import cupy  # (a first call imported it through the checks, or said how to install it)
    with runtime.device(device_id), runtime.on(stream):
        dq, dk, dv = (cupy.ndarray(x.shape, x.dtype) for x in (q, k, v))
        workspace = cupy.ndarray((call.workspace_bytes,), np.uint8)
        call(cupy.cuda.get_current_stream().ptr, dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
             lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, runtime.ptr(alibi_slopes), cu_seqlens_q, cu_seqlens_k,
             workspace.data.ptr, dropout_seed, dropout_offset)
    return dq, dk, dv

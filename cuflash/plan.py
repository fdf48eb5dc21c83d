"""Planning: which kernel specialization runs a call, on what grid, with how much shared memory.

Everything about tile shapes lives here, as data. The kernels take the chosen sizes as template
arguments (``cuda_src/fwd.cu``) and derive the rest themselves; nothing here is restated in C++
except the shared-memory formula, which mirrors ``FwdTraits::SMEM_BYTES``.

Pure Python: runs on a machine without a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import numpy as np

LOG2E = math.log2(math.e)

# Head dims the kernels are compiled for; a call's head dim is padded up to the next one inside the
# kernel (zero-filled loads, masked stores), never by copying inputs.
COMPILED_HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)

# numpy dtype name -> (short name used in kernel names, C++ element tag)
DTYPES = {"float16": ("fp16", "cuflash::half_t"), "bfloat16": ("bf16", "cuflash::bf16_t")}


@dataclass(frozen=True)
class FwdConfig:
    """Tile shape of the forward kernel."""

    block_m: int           # query rows per CTA
    block_n: int           # keys per KV block
    warps: int             # split-Q: each warp owns block_m / warps rows
    q_in_regs: bool        # keep Q's mma fragments in registers across the KV loop


# (arch, compiled head dim, band) -> ((max_seqlen_k, FwdConfig), ...): the first entry whose bound covers
# seqlen_k wins (None covers any length). "band" is causal or a sliding window.
# Every entry compiles for sm_80 and sm_90a with 0 bytes of spills, for fp16/bf16 and with/without score
# mods (checked by tests/test_compile.py). Two rows per thread per mma tile (block_m / warps = 32) only
# fits in 255 registers up to d = 64; beyond that a warp owns 16 rows and keeps Q in registers, so each
# K fragment read from shared memory feeds one mma without re-reading Q.
_ANY = None
FWD_TABLE = {
    ("sm80", 32, False): ((_ANY, FwdConfig(128, 128, 4, False)),),
    ("sm80", 32, True): ((_ANY, FwdConfig(128, 128, 4, False)),),
    ("sm80", 64, False): ((_ANY, FwdConfig(128, 64, 4, False)),),
    ("sm80", 64, True): ((_ANY, FwdConfig(128, 64, 4, False)),),
    ("sm80", 96, False): ((_ANY, FwdConfig(128, 64, 8, True)),),
    ("sm80", 96, True): ((_ANY, FwdConfig(128, 64, 8, True)),),
    ("sm80", 128, False): ((_ANY, FwdConfig(128, 128, 8, True)),),
    ("sm80", 128, True): ((_ANY, FwdConfig(128, 128, 8, True)),),
    ("sm80", 160, False): ((_ANY, FwdConfig(128, 64, 8, True)),),
    ("sm80", 160, True): ((_ANY, FwdConfig(128, 64, 8, True)),),
    ("sm80", 192, False): ((_ANY, FwdConfig(64, 64, 4, False)),),
    ("sm80", 192, True): ((_ANY, FwdConfig(64, 64, 4, False)),),
    ("sm80", 224, False): ((_ANY, FwdConfig(64, 64, 4, False)),),
    ("sm80", 224, True): ((_ANY, FwdConfig(64, 64, 4, False)),),
    ("sm80", 256, False): ((_ANY, FwdConfig(64, 64, 4, False)),),
    ("sm80", 256, True): ((_ANY, FwdConfig(64, 64, 4, False)),),
}
# sm90 entries override sm80 ones where a measurement on the H200 chose differently.
# H200, bf16, 16k tokens, hidden 2048, triton do_bench median with L2 flushed, like the benchmark
# (benchmarks/tune_forward.py, 2026-11-29). TFLOP/s at seqlen 512 / 1k / 2k / 4k / 8k / 16k:
#   d64  causal  128x64w4    187 238 273 295 308 316   64x64w4q   197 232 255 268 274 279
#   d128 full    128x128w8q  283 315 335 345 351 351   64x128w4q  296 315 329 328 336 339
#   d128 causal  128x128w8q  190 245 286 313 328 354   64x128w4q  210 254 289 309 327 340
# 128x128w8q holds one CTA per SM, so each CTA's prologue (Q, K, V loads) and epilogue are exposed;
# short rows favour the 4-warp tiles that fit two CTAs per SM.
FWD_TABLE_SM90: dict = {
    ("sm90", 64, True): ((512, FwdConfig(64, 64, 4, True)), (_ANY, FwdConfig(128, 64, 4, False))),
    ("sm90", 128, False): ((512, FwdConfig(64, 128, 4, True)), (_ANY, FwdConfig(128, 128, 8, True))),
    ("sm90", 128, True): ((2048, FwdConfig(64, 128, 4, True)), (_ANY, FwdConfig(128, 128, 8, True))),
}

ARCHS = ("sm_80", "sm_90a")


MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z (heads and batch here)


def check_grid(grid: tuple) -> tuple:
    """A launch shape CUDA accepts, or a ValueError naming the axis, before anything is launched."""
    for axis, name, n in ((1, "heads", grid[1]), (2, "batch", grid[2])):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{name}: {n} exceeds the {MAX_GRID_YZ} CUDA allows on grid axis {'xyz'[axis]}")
    return grid


def arch_of(compute_capability: str | int) -> str:
    """NVRTC target for a device: sm_90a on Hopper (wgmma, setmaxnreg), sm_XY elsewhere."""
    cc = int(compute_capability)
    return "sm_90a" if cc == 90 else f"sm_{cc}"


def _family(arch: str) -> str:
    return "sm90" if arch.startswith("sm_90") else "sm80"


def fwd_configs(arch: str, headdim: int, band: bool) -> tuple:
    """The (max_seqlen_k, FwdConfig) entries for a compiled head dim on `arch`."""
    key = (compiled_headdim(headdim), band)
    if _family(arch) == "sm90" and ("sm90",) + key in FWD_TABLE_SM90:
        return FWD_TABLE_SM90[("sm90",) + key]
    return FWD_TABLE[("sm80",) + key]


def fwd_config(arch: str, headdim: int, band: bool, seqlen_k: int) -> FwdConfig:
    for bound, config in fwd_configs(arch, headdim, band):
        if bound is None or seqlen_k <= bound:
            return config
    raise LookupError(f"no forward config for d={headdim} band={band} seqlen_k={seqlen_k} on {arch}")


def compiled_headdim(headdim: int) -> int:
    for d in COMPILED_HEADDIMS:
        if headdim <= d:
            return d
    raise ValueError(f"head dim {headdim} exceeds the largest compiled head dim {COMPILED_HEADDIMS[-1]}")


def _template(kernel: str, dtype: str, ints: tuple, flags: tuple) -> str:
    """C++ name expression of a kernel instantiation: kernel<dtype tag, ints..., flags...>."""
    args = [dict(DTYPES.values())[dtype]] + [str(i) for i in ints] + ["true" if f else "false" for f in flags]
    return f"cuflash::{kernel}<{', '.join(args)}>"


def _smem_row_bytes(headdim: int) -> int:
    """Bytes of one shared-memory tile row: whole 64-column panels of 16-bit elements (tile.cuh)."""
    return math.ceil(headdim / 64) * 64 * 2


@dataclass(frozen=True)
class FwdSpec:
    """One compiled forward kernel."""

    dtype: str        # "fp16" | "bf16"
    headdim: int      # compiled head dim
    config: FwdConfig
    band: bool        # causal / local masking compiled in
    score_mod: bool   # softcap / ALiBi compiled in

    source = "fwd.cu"

    @property
    def name(self) -> str:
        c = self.config
        return (f"fwd_{self.dtype}_d{self.headdim}_m{c.block_m}_n{c.block_n}_w{c.warps}"
                + ("_qreg" if c.q_in_regs else "") + ("_causal" if self.band else "")
                + ("_mod" if self.score_mod else ""))

    @property
    def template(self) -> str:
        c = self.config
        return _template("fwd_kernel", self.dtype, (self.headdim, c.block_m, c.block_n, c.warps),
                         (c.q_in_regs, self.band, self.score_mod))

    @property
    def threads(self) -> int:
        return self.config.warps * 32

    @property
    def smem_bytes(self) -> int:
        # FwdTraits::SMEM_BYTES: Q (block_m rows) + K + V (block_n rows each)
        return (self.config.block_m + 2 * self.config.block_n) * _smem_row_bytes(self.headdim)


def all_forward_specs(arch: str) -> list:
    """Every forward specialization the planner can choose on `arch`."""
    specs = []
    for dtype in ("fp16", "bf16"):
        for d in COMPILED_HEADDIMS:
            for band in (False, True):
                for _, config in fwd_configs(arch, d, band):
                    for mod in (False, True):
                        specs.append(FwdSpec(dtype, d, config, band, mod))
    return specs


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

# Head dims the backward is compiled for. Beyond 128, dK and dV of a warp's keys no longer fit in
# registers with this kernel's 8-warp split (ptxas spills); those head dims are not supported yet.
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
# Two Q/dO buffers (the next query block loads while one computes): spill-free up to d = 96 (at 128 ptxas spills
# 8-52 bytes). Measured (H200, bf16, 2026-11-29, bench_attention.py --op bwd --quick, same run): d = 64 atomic
# 94.5-103.9 -> 105.8-120.1 TFLOP/s (+12-16 %), deterministic 76-83 -> 90-115. On by default; CUFLASH_BWD_QBUF=0
# switches it off.
BWD_DOUBLE_BUFFER = {"enabled": os.environ.get("CUFLASH_BWD_QBUF", "1") == "1", "headdims": (32, 64, 96)}


# Head dims above 128 (compiled as 256) with 32 keys per CTA (BwdTraits' 2 x 4 warp split; its products' k-loops
# stay rolled): spill-free on sm_90a only (sm_80 spills 8 bytes in two specializations; there such calls raise
# NotImplementedError). GPU-verified on the H200 (tests/gpu/test_backward.py, sanitizers); its speed is not yet
# measured. On by default; CUFLASH_BWD_WIDE=0 switches it off.
BWD_WIDE = {"enabled": os.environ.get("CUFLASH_BWD_WIDE", "1") == "1", "headdim": 256, "archs": ("sm_90a",),
            "config": BwdConfig(64, 32, 8)}


# The Hopper backward's main kernel (cuda_src/bwd_sm90.cu, cuflash/hopper.py): TMA and wgmma, 128 keys per CTA.
# On by default on sm_90a for head dims exactly 64 and 128 (CUFLASH_BWD_SM90=0 keeps the portable kernel);
# softcap/ALiBi at d = 64 only (at 128 the score-mod kernel spills: 255 registers are already taken without it).
# Measured (H200, bf16, 2026-11-29, benchmarks/bench_attention.py --op bwd --quick, same run as SDPA; TFLOP/s,
# atomic dQ; docs/bench/drafts_session5_bwd_ab2.txt):
#   d =  64: 211-262 non-causal, 114-154 causal   (portable kernel 105-121 / 85-117; SDPA flash 244-280 / 187-248)
#   d = 128: 314-394 non-causal, 178-252 causal   (portable kernel 112-118 / 101-122; SDPA flash 265-306 / 208-277)
# Since (session 8, ANCHORS grid 512-16k, docs/bench/release_session8.txt): d = 64 250-404 / 160-390 (SDPA flash
# 209-287 / 138-278), d = 128 270-432 / 169-411 (SDPA flash 224-310 / 157-315). Session 10, dQ added by TMA bulk
# reductions (docs/bench/bwd_tma_dq_session10.txt): d = 64 252-440 / 162-433, d = 128 272-452 / 174-445.
BWD_SM90 = {"enabled": os.environ.get("CUFLASH_BWD_SM90", "1") == "1", "headdims": (64, 128), "score_mod": (64,),
            "block_n": 128}  # keys per CTA (BwdSm90::BN)

# Deterministic mode of the Hopper kernel: each of bwd_sm90_slots CTAs per head adds into its own fp32 dQ slice,
# summed in order after the kernel. (Session 9's "ordered" mode, one buffer and key blocks adding in turn, was
# 1.11-1.84x the atomic time against the slices' 0.98-1.28x; it went with session 10's TMA dQ reductions, whose
# registers it did not leave room for. Session 11's, turns in the order of the slots' passes, was 1.25-1.50x:
# drafts/README.md.) "slots" > 0 fixes the slot count (CUFLASH_BWD_SM90_DET_SLOTS; for tests and measurements).
# "max_passes" > 0 (CUFLASH_BWD_SM90_DET_MAX_PASSES) breaks bwd_sm90_slots' ties toward the fewest slots of at most
# that many key blocks each: more slots of a head walk its Q/dO side by side and share them in L2. Measured in
# session 11 with the count fixed (docs/bench/bwd_det_session11.txt, call 3): 2 slots where the rule picks 1 took
# det/atomic 1.201 -> 1.158 at d 64 non-causal 4k (32 -> 16 key blocks each) but 1.062 -> 1.092 at 1k (8 -> 4).
# Off (0) until a run of the whole grid picks a bound.
#
# Fixed point (session 16; BwdParams::deterministic 2, cuda_src/fixed_dq.cuh): the atomic mode's grid, every CTA
# adding its dQ tile as int32 fixed point (a per-row scale from a bound on the row's partial sums) into one
# accumulator; integer sums do not depend on their order. It costs a pass over K and V for the bound (bwd_kv_bound),
# reads |dO| per row, and the main kernel's int32 conversions (cvt, a quarter-rate pipe) cost it 3-8% against the
# atomic mode. "mode": "auto" takes it where the slot rule gives a head more than one slot or from "fixed_min_blocks"
# key blocks on (where the slices cost most: a slot's passes each add to the whole dQ of its heads, which misses the
# L2), "slices" never, "fixed" wherever the kernel adds dQ by TMA (all but the d = 64 score-mod kernel);
# CUFLASH_BWD_SM90_DET. A fixed slot count ("slots" > 0) keeps the slices. Measured (session 16, call 5, with "auto"
# as slots > 1 alone, A/B in one call, det TFLOP/s slices -> fixed): d 128 non-causal 4k / 8k / 16k 367.8 / 379.7 /
# 386.4 -> 379.8 / 408.5 / 424.2, causal 8k / 16k 351.2 / 362.3 -> 367.5 / 413.4; slower at d 128 causal 4k (330.6
# -> 320.2) and d 64 causal 8k (348.4 -> 334.0) with bwd_kv_bound's 210 us, since cut by a block reduction.
# "fixed_min_blocks" per head dim, counting a causal mask's key blocks as half (each sees half the query blocks on
# average), from session 23 (docs/bench/bwd_session23.txt): the slices forced against the fixed point forced, at
# d 128 the fixed point ahead from 1k keys non-causal and 2k causal (causal 1k: 232.5 against 224.5; call 1); at d 64,
# once the row scale came from bwd_fixed_scale (call 6), from 2k non-causal (349.7 against the slices' 338.8) and 4k
# causal (336.6 against 324.9; 2k causal 280.1 against 292.4, 1k non-causal 295.2 against 312.4).
BWD_SM90_DET = {"slots": int(os.environ.get("CUFLASH_BWD_SM90_DET_SLOTS", "0")),
                "max_passes": int(os.environ.get("CUFLASH_BWD_SM90_DET_MAX_PASSES", "0")),
                "mode": os.environ.get("CUFLASH_BWD_SM90_DET", "auto"), "fixed_min_blocks": {64: 16, 128: 8}}
if BWD_SM90_DET["mode"] not in ("auto", "slices", "fixed"):
    raise ValueError(f"CUFLASH_BWD_SM90_DET must be auto, slices or fixed, not {BWD_SM90_DET['mode']!r}")


# Query rows per step of the Hopper backward, per head dim: 64, or 128 at d = 64 without a score mod (twice the work
# per step for the same barriers and waits). 128 at d = 64 measured faster in every cell (H200, bf16, 2026-11-29,
# bench_attention.py --op bwd --quick, A/B in one run, TFLOP/s, 64 -> 128 rows; docs/bench/drafts_session6.txt):
#   non-causal 1k 213.4 -> 221.8, 4k 265.4 -> 280.3; causal 1k 153.1 -> 164.3, 4k 230.0 -> 257.9.
# CUFLASH_BWD_SM90_BLOCK_M="64:64" restores 64.
BWD_SM90_BLOCK_M_CHOICES = (64, 128)
BWD_SM90_BLOCK_M = {64: 128, 128: 64}
for _item in filter(None, os.environ.get("CUFLASH_BWD_SM90_BLOCK_M", "").split(",")):
    BWD_SM90_BLOCK_M[int(_item.partition(":")[0])] = int(_item.partition(":")[2])


def bwd_sm90_block_m_allowed(headdim: int, score_mod: bool, block_m: int) -> bool:
    return block_m == 64 or (block_m == 128 and headdim == 64 and not score_mod)


def bwd_sm90_tma_dq(headdim: int, block_m: int) -> bool:
    """BwdSm90::TMA_DQ: dQ added by TMA bulk reductions from staging tiles (all but d = 64 with 64 query rows, the
    score-mod kernel, whose warpgroups both add to every element with vector reductions)."""
    return not (headdim == 64 and block_m == 64)


def bwd_sm90_block_m(headdim: int, score_mod: bool) -> int:
    """The Hopper backward's query rows per step for this head dim (the table's entry where the kernel allows it)."""
    block_m = BWD_SM90_BLOCK_M.get(headdim, 64)
    return block_m if bwd_sm90_block_m_allowed(headdim, score_mod, block_m) else 64


def bwd_sm90_applies(problem, score_mod: bool, arch: str) -> bool:
    return (BWD_SM90["enabled"] and arch == "sm_90a" and problem.headdim in BWD_SM90["headdims"]
            and (not score_mod or problem.headdim in BWD_SM90["score_mod"]))


def bwd_config(headdim: int) -> BwdConfig:
    """The backward's tile configuration for a compiled head dim."""
    if headdim == BWD_WIDE["headdim"]:
        return BWD_WIDE["config"]
    if BWD_DOUBLE_BUFFER["enabled"] and headdim in BWD_DOUBLE_BUFFER["headdims"]:
        return dataclasses.replace(BWD_CONFIG, q_buffers=2)
    return BWD_CONFIG


@dataclass(frozen=True)
class BwdSpec:
    """One compiled backward main kernel."""

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
        return _template("bwd_kernel", self.dtype, (self.headdim, c.block_m, c.block_n, c.warps, c.q_buffers),
                         (self.band, self.score_mod))

    @property
    def threads(self) -> int:
        return self.config.warps * 32

    @property
    def smem_bytes(self) -> int:
        # BwdTraits::SMEM_BYTES: K, V (block_n rows), per buffer Q, dO (block_m rows), P^T and dS^T
        # (block_n x 64), per buffer lse and D (block_m floats each).
        c = self.config
        return (2 * (c.block_n + c.q_buffers * c.block_m) * _smem_row_bytes(self.headdim)
                + 2 * c.block_n * 64 * 2 + c.q_buffers * 2 * c.block_m * 4)


@dataclass(frozen=True)
class AuxSpec:
    """A small helper kernel of the backward (cuda_src/bwd_aux.cu), templated on the dtype only."""

    kernel: str   # "bwd_preprocess" | "bwd_kv_bound" | "bwd_fixed_scale" | "bwd_convert_dq"
    dtype: str

    source = "bwd_aux.cu"
    threads = 256
    smem_bytes = 0

    @property
    def name(self) -> str:
        return f"{self.kernel}_{self.dtype}"

    @property
    def template(self) -> str:
        return _template(self.kernel, self.dtype, (), ())


def bwd_pre_lanes(headdim: int) -> int:
    """Threads per query row in bwd_preprocess: the power of two that covers the row in 16-byte pieces, at most a
    warp. A warp of one row per warp at d = 64 left 24 lanes idle and took 178 us at batch 32 x 512 x 32 heads."""
    pieces = -(-headdim // 8)
    return min(32, 1 << (pieces - 1).bit_length())


def bwd_headdim(headdim: int, arch: str | None = None) -> int:
    """The compiled backward head dim for a call's (padded up inside the kernel); NotImplementedError past them."""
    for d in BWD_HEADDIMS:
        if headdim <= d:
            return d
    if BWD_WIDE["enabled"] and arch in BWD_WIDE["archs"] and headdim <= BWD_WIDE["headdim"]:
        return BWD_WIDE["headdim"]
    raise NotImplementedError(f"attention_backward: head dim {headdim} is not supported yet "
                              f"(the backward kernel is compiled up to {BWD_HEADDIMS[-1]})")


def all_backward_specs(arch: str) -> list:
    specs = [AuxSpec(kernel, dtype) for dtype in ("fp16", "bf16")
             for kernel in ("bwd_preprocess", "bwd_kv_bound", "bwd_fixed_scale", "bwd_convert_dq")]
    for dtype in ("fp16", "bf16"):
        for d in BWD_HEADDIMS:
            for band in (False, True):
                for mod in (False, True):
                    specs.append(BwdSpec(dtype, d, BWD_CONFIG, band, mod))
                    if d in BWD_DOUBLE_BUFFER["headdims"]:  # compiled (and checked for spills) even when off
                        specs.append(BwdSpec(dtype, d, dataclasses.replace(BWD_CONFIG, q_buffers=2), band, mod))
                if arch in BWD_WIDE["archs"] and d == BWD_HEADDIMS[-1]:  # the wide kernels, likewise
                    for mod in (False, True):
                        specs.append(BwdSpec(dtype, BWD_WIDE["headdim"], BWD_WIDE["config"], band, mod))
    return specs


def all_specs(arch: str) -> list:
    """Every kernel the planner can choose on `arch` (compile test, precompile)."""
    return all_forward_specs(arch) + all_backward_specs(arch) + all_decode_specs(arch)


@dataclass(frozen=True)
class BwdLaunch:
    spec: BwdSpec
    grid: tuple
    slices: int    # fp32 dQ accumulator slices (1 unless deterministic)
    fixed_point: bool = False  # deterministic mode 2 (BWD_SM90_DET): one int32 accumulator on the atomic grid


def plan_backward(problem, left: int, right: int, score_mod: bool, deterministic: bool, arch: str,
                  sm_count: int) -> BwdLaunch:
    """Main backward kernel and its grid. Deterministic mode gives each of `slots` CTAs per (KV head,
    batch) its own dQ slice; enough slots to fill the GPU about twice, at most one per KV block. Where the Hopper
    kernel applies (bwd_sm90_applies; `spec` is then the portable fallback's) the grid is its own: 128-key blocks,
    and in deterministic mode bwd_sm90_slots."""
    band = left >= 0 or right >= 0
    dtype = DTYPES[np.dtype(problem.dtype).name][0]
    d = bwd_headdim(problem.headdim, arch)
    spec = BwdSpec(dtype, d, bwd_config(d), band, score_mod)
    groups = problem.batch * problem.nheads_k
    if bwd_sm90_applies(problem, score_mod, arch):
        n_blocks = math.ceil(problem.seqlen_k / BWD_SM90["block_n"])
        if not deterministic:
            slots = n_blocks
        elif BWD_SM90_DET["slots"] > 0:
            slots = min(n_blocks, BWD_SM90_DET["slots"])
        else:
            slots = bwd_sm90_slots(n_blocks, groups, sm_count, BWD_SM90_DET["max_passes"])
            tma_dq = bwd_sm90_tma_dq(problem.headdim, bwd_sm90_block_m(problem.headdim, score_mod))
            causal = left < 0 and right == 0  # each key block's steps: half the query blocks, on average
            auto = slots > 1 or n_blocks // (2 if causal else 1) >= BWD_SM90_DET["fixed_min_blocks"][d]
            mode = BWD_SM90_DET["mode"]
            if tma_dq and (mode == "fixed" or (mode == "auto" and auto)):
                return BwdLaunch(spec, check_grid((n_blocks, problem.nheads_k, problem.batch)), 1, True)
    else:
        n_blocks = math.ceil(problem.seqlen_k / spec.config.block_n)
        slots = max(1, min(n_blocks, math.ceil(2 * sm_count / groups))) if deterministic else n_blocks
    return BwdLaunch(spec, check_grid((slots, problem.nheads_k, problem.batch)), slots if deterministic else 1)


def bwd_sm90_slots(n_blocks: int, groups: int, sm_count: int, max_passes: int = 0) -> int:
    """Deterministic mode on the Hopper kernel (one CTA per SM): of 1..n_blocks slots, the one whose CTAs
    (slots x groups of them, ceil(n_blocks / slots) key blocks each) finish soonest, and of those the fewest (each
    slot is a dQ slice to zero and sum), or with `max_passes` > 0 the fewest of at most that many key blocks each
    where one is as soon. The portable rule (about two CTAs per SM) left waves part-empty and CTAs uneven: 5 slots
    of 6-7 blocks at seqlen 4k, batch 4, 16 heads, d 128, where 2 slots of 16 end as soon."""
    span = {slots: math.ceil(slots * groups / sm_count) * math.ceil(n_blocks / slots)
            for slots in range(1, n_blocks + 1)}
    best = min(span.values())
    soonest = [slots for slots, s in span.items() if s == best]
    short = [slots for slots in soonest if max_passes > 0 and math.ceil(n_blocks / slots) <= max_passes]
    return (short or soonest)[0]


WORKSPACE_ALIGN = 256  # bytes; each piece of a workspace starts on this boundary


def _aligned(n: int) -> int:
    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def backward_workspace(rows: int, nheads: int, headdim: int, slices: int, nheads_k: int = 0) -> tuple[int, int, int]:
    """The backward's workspaces as one aligned block: byte offsets of lse_log2 and of the dQ accumulator, and
    the total. In the order cuflash.api.launch_backward allocates them: dsum and lse_log2 (fp32, one per query
    row and head), then the fp32 dQ accumulator (slices x rows x heads x headdim), each piece rounded up to
    WORKSPACE_ALIGN (cuflash.jax hands them out of one XLA buffer this size). `rows`: batch * seqlen_q, or
    total_q when packed. `nheads_k` > 0: deterministic mode's fixed point, whose two pieces follow
    (fixed_point_offsets)."""
    per_row = _aligned(rows * nheads * 4)
    total = 2 * per_row + _aligned(slices * rows * nheads * headdim * 4)
    return per_row, 2 * per_row, total + (per_row + _aligned(nheads_k * 2 * 4) if nheads_k > 0 else 0)


def kv_bound_blocks(rows: int, rows_per_block: int, groups: int, sm_count: int) -> int:
    """bwd_kv_bound's blocks per (KV head, sequence): enough for about 8 blocks per SM over all `groups`, each
    striding over its rows, at most one per `rows_per_block` rows."""
    return max(1, min(-(-rows // rows_per_block), -(-8 * sm_count // groups)))


def fixed_point_offsets(rows: int, nheads: int, headdim: int) -> tuple[int, int]:
    """Byte offsets of fixed point's pieces in backward_workspace(rows, nheads, headdim, 1, nheads_k): |dO| per row
    (like dsum; then each row's dQ scale, written over it), then the K/V bounds (nheads_k x 2 x 4 bytes)."""
    row_scale = backward_workspace(rows, nheads, headdim, 1)[2]
    return row_scale, row_scale + _aligned(rows * nheads * 4)


def normalize_window(left: int, right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Drops window sides that cannot hide any key (-1 = unbounded), so full attention runs unmasked."""
    if left >= seqlen_k - 1:   # j >= i + sk - sq - left holds for every row once left >= sk - 1
        left = -1
    if right >= seqlen_q - 1:  # j <= i + sk - sq + right holds for every key once right >= sq - 1
        right = -1
    return left, right


@dataclass(frozen=True)
class Launch:
    spec: FwdSpec
    grid: tuple
    block: tuple
    smem: int


@functools.lru_cache(maxsize=4096)
def plan_forward(problem, left: int, right: int, score_mod: bool, arch: str) -> Launch:
    """Kernel and launch shape for a forward call (window already normalized)."""
    band = left >= 0 or right >= 0
    dtype = DTYPES[np.dtype(problem.dtype).name][0]
    d = compiled_headdim(problem.headdim)
    spec = FwdSpec(dtype, d, fwd_config(arch, d, band, problem.seqlen_k), band, score_mod)
    m_blocks = math.ceil(problem.seqlen_q / spec.config.block_m)
    return Launch(spec, check_grid((m_blocks, problem.nheads, problem.batch)), (spec.threads, 1, 1), spec.smem_bytes)


# ---------------------------------------------------------------------------------------------------------------
# Hopper forward (cuda_src/fwd_sm90.cu, cuflash/hopper.py): which variant per head dim, and whether the planner
# may choose it at all (CUFLASH_SM90=0 keeps every call on the portable kernel).
#
# Measured (H200, bf16, 2026-11-29, scripts/sm90_sweep.sh: benchmarks/bench_sm90.py per variant, same run,
# cells seqlen 1k/4k/16k x causal or not; geometric mean TFLOP/s, scripts/pick_sm90_variants.py):
#   d =  64: ws3_n128 396.8, lockstep 386.8, ws_n128 379.7, pingpong_n128 378.5, ws_n128_p 356.1, ws 351.7,
#            pingpong 337.5, lockstep_n128 328.8
#   d = 128: pingpong_n128 542.3, ws_n128 486.1 (527.1 as ws3_n128, the same kernel at d = 128: run-to-run noise
#            is ~8 %; an earlier call had ws_n128 536.6, pingpong_n128 503.9), ws_n128_p 471.0, lockstep_n128 459.7,
#            pingpong 458.0, ws 454.6, lockstep 401.4   (docs/bench/drafts_session5_bwd_ab2.txt)
#   d = 256 (an earlier call, release_session4.txt): lockstep 444.7, pingpong 398.3, pingpong_n128 398.1,
#            ws_n128 380.2, ws 378.8
# CUFLASH_SM90_VARIANTS ("64:ws_n128", say) overrides it, for measuring.
SM90_DEFAULT_VARIANTS = {64: "ws3_n128", 128: "pingpong_n128", 256: "lockstep"}  # head dim -> cuflash.hopper.VARIANTS


def _env_pairs(text: str | None) -> list:
    """"64:ws,128c:ws_n128" -> [("64", "ws"), ("128c", "ws_n128")] (the variant switches' format)."""
    return [tuple(item.partition(":")[::2]) for item in (text or "").replace(" ", "").split(",") if item]


def _variants_from_env(text: str | None, default: dict) -> dict:
    """"64:ws,128:ws_n128" -> {64: "ws", 128: "ws_n128"} over `default`; head dims not named keep theirs."""
    return {**default, **{int(d): variant for d, variant in _env_pairs(text)}}


# How the warp-specialized Hopper forward kernels write O, per head dim (fwd_sm90.cu epilogue): through shared
# memory and TMA stores (1), or 4-byte stores from registers (0; the lockstep kernel always). Session 12, A/B in one
# device call (bench_attention.py --op fwd, 512-4k, two rounds, TFLOP/s): d = 128 TMA stores, 512 / 1k / 2k keys:
# non-causal 407 / 474 / 517 -> 427 / 493 / 560, causal 226 / 344 / 454 -> 261 / 381 / 478; d = 64 mixed: non-causal
# 373 / 407 at 1k / 2k -> 359 / 397, causal 191 / 262 at 512 / 1k -> 195 / 269. CUFLASH_SM90_O_TMA=0 or 1 sets
# every head dim. Session 25 (call 8, docs/bench/fwd_session25.txt; today's kernels, two rounds): d = 64 TMA stores,
# non-causal 512 / 2k / 4k / 8k 378.6 / 473.0 / 491.0 / 512.0 -> 392.4 / 497.6 / 508.1 / 519.8, causal 8k 461.5 ->
# 475.5, the other cells within 1%, but non-causal 1k 439.2 -> 417.1: there the split tiles run (ws3_n128_p_split),
# which O by TMA stores turns off. So d = 64 takes TMA stores, except in the split variant, which writes O from
# registers whatever the table says (hopper.forward_call; fwd_sm90.cu split_tile).
SM90_O_TMA_DEFAULT = {64: 1, 128: 1, 256: 1}


def _o_tma_from_env(text: str | None) -> dict:
    """CUFLASH_SM90_O_TMA ("0" or "1") as the per-head-dim table of SM90_EPILOGUE; None: SM90_O_TMA_DEFAULT."""
    if text is None:
        return dict(SM90_O_TMA_DEFAULT)
    if text.strip() not in ("0", "1"):
        raise ValueError(f"CUFLASH_SM90_O_TMA must be 0 or 1, not {text!r}")
    return dict.fromkeys(SM90_O_TMA_DEFAULT, int(text))


SM90_EPILOGUE = {"tma_store": _o_tma_from_env(os.environ.get("CUFLASH_SM90_O_TMA"))}


# Short sequences (seqlen_k <= SM90_SHORT_SEQLEN), per (head dim, masked by a band, most keys), where another variant
# beat the head dim's own on the ANCHORS grid (bench_attention.py --op fwd, H200, bf16, TFLOP/s, one run each,
# 2026-11-29; docs/bench/release_session5.txt against docs/bench/release_session6.txt): d = 64 causal ws_n128_p
# (persistent: prologue and epilogue of consecutive tiles overlap) 198.9 / 265.0 / 315.9 at 512 / 1k / 2k against
# ws3_n128's 151.7 / 223.6 / 327.8. The 512-2k sweep (scripts/sm90_sweep.sh, docs/bench/drafts_session6.txt) had also
# picked ws_n128 and ws_n128_p at d = 128, but on the grid they lost to pingpong_n128 in five of six cells (non-causal
# 359.7 / 468.8 / 535.2 against 394.8 / 492.1 / 549.9; causal 2k 373.6 against 439.2): the sweep's short cells swing by
# up to 2x between variants of equal speed (its first cells run cold), so they pick nothing alone.
# Session 7 (scripts/gpu_short_variants.sh, docs/bench/short_variants_session7.txt; geometric mean over 512 / 1k / 2k
# on the grid, best of two runs): pingpong_n128_p (persistent) 413.4 against pingpong_n128's 492.0 at d = 128
# non-causal, 325.4 against 335.5 causal; ws_n128_p 338.5 against ws3_n128's 355.2 at d = 64 non-causal; at d = 64
# causal ws_n128_p stays (259.0 against 222.0). The table did not change.
# Session 9 (scripts/gpu_fwd_tile_order.sh, docs/bench/fwd_tile_order_session9.txt): the persistent kernels without
# a band now walk query blocks fastest, as the grid does (fwd_sm90.cu tile_of), and won the non-causal short cells:
# d = 64 ws_n128_p 345.0 / 407.6 / 432.9 at 512 / 1k / 2k against ws3_n128's 284.1 / 359.7 / 436.5, d = 128
# pingpong_n128_p 425.2 / 510.0 / 568.2 against pingpong_n128's 397.6 / 500.0 / 553.5-603.5 (two rounds).
# Session 13 (docs/bench/fwd_short_session13.txt; two device calls, two rounds each): K and V handed back separately
# (fwd_sm90.cu) made two-slot rings enough, and the persistent kernels walk the grid's order with a snake under a
# band. d = 128 non-causal 512: pingpong_n128_p_s2 (its own O staging tile) 455.5 against pingpong_n128_p's 420.0;
# 1k / 2k: pingpong_n128_s2 519.9-524.7 / 568.0-595.1 against 478.9-484.0 / 513.0-517.6; causal 512 / 1k:
# pingpong_n128_p_s2 295.6-297.5 / 396.8-397.5 against pingpong_n128's 263.5-265.6 / 381.4-382.6 (2k: within noise,
# 467.6-478.4 every way). d = 64: ws_n128_p_s2 1-3% above ws_n128_p in all six cells (e.g. causal 2k 346.8 / 337.4).
# Session 14 (docs/bench/fwd_session14.txt, calls 3-4): at d = 64 the persistent kernels with two Q tiles start
# each tile under the last one's P V (fwd_sm90.cu OVERLAP), which needs the next tile's Q and first K a block sooner:
# with ws_n128_p's four slots 369.2 / 411.8 / 434.2 at 512 / 1k / 2k non-causal, 230.9 / 307.6 / 369.2 causal,
# against 346.6 / 400.7 / 430.1 and 216.4 / 296.6 / 362.2 for ws_n128_p_s2 without the overlap (two slots with it:
# 311.2 / 367.6 / 406.4, 198.3 / 270.9 / 342.3). Call 5: ws_n128_p at d = 64 causal 4k 407.8 against ws3_n128's 397.5
# (non-causal 4k 449.9 against 465.2), so the table reaches 4096 keys, and d = 64 causal takes ws_n128_p up to there.
# Session 18 (docs/bench/fwd_session18.txt, call 2; three rounds, TFLOP/s): ws3_n128_p (three consumer warpgroups,
# persistent, three Q tiles, no overlapped tile start) against the table's d = 64 choices: non-causal 512 / 1k / 2k /
# 4k 369.6 / 409.2 / 462.5 / 472.3 against 367.1 / 402.9 / 430.1 / 471.3 (8k / 16k: within 0.5%), causal 4k 415.4
# against 399.5; causal up to 2k it lost (198.7 / 258.5 / 357.7 against 234.1 / 310.8 / 364.3), and past 4k keys
# (causal 8k / 16k: 418.0 / 414.6 against ws3_n128's 443.3 / 469.7). So d = 64 takes it from 1k to 4k keys without a
# band, and at 4k with one.
# Session 19 (docs/bench/fwd_session19.txt, call 5, after the persistent kernels' tile index lost its divisions;
# three rounds): d = 128 non-causal 1k pingpong_n128_p_s2 587.2 against pingpong_n128_s2's 546.7, so the persistent
# kernel reaches 1k keys there. pingpong_n128_p for d = 64 causal up to 1k tied ws_n128_p (243.3 / 322.7 against
# 244.1 / 322.6). Calls 8-9 (two rounds each, table -> pingpong_n128_p_s2): d = 128 2k non-causal 638.3 / 635.2 ->
# 661.9 / 664.6 (the grid kernel pingpong_n128_s2), causal 483.3 / 494.4 -> 542.9 / 524.5 (the grid pingpong_n128),
# so the persistent kernel takes d = 128 up to 2k keys both ways; at 4k within noise (non-causal 643.5 against
# 632.5, spreads 57 and 24; causal 552.3 against 565.0), not taken.
# Session 20 (docs/bench/fwd_session20.txt, call 1, three rounds): d = 128 causal 4k pingpong_n128_p_s2 586.5
# (567.1-620.3) against the grid pingpong_n128's 537.7 (531.1-548.3), taken; non-causal 4k 658.0 against 662.5
# (spreads 41 and 47), not taken.
# Session 24 (docs/bench/fwd_session24.txt, calls 1-4, three rounds each against the parent): ws3_n128_p with split
# tiles (the last query block's 64 rows worked by all three warpgroups) at d = 64 non-causal 1k 411.5-414.7 ->
# 430.1-430.6; the same code in ws3_n128_p itself cost 2-4% at 2k / 4k (473.1 / 487.5 -> 455.8 / 479.3), where no
# tile splits, so the split is a variant of its own, up to 1k keys.
# Session 24 (calls 7-8, docs/bench/fwd_session24.txt): d = 128 causal 8k pingpong_n128_p_s2 585.1-647.2 / 603.5
# against the grid pingpong_n128's 564.7-570.8 / 593.7 (three rounds, then two, in two calls); at 16k it lost (465.5
# / 476.0 against 607.9 / 621.1), so the table reaches 8192 keys for that entry only. Session 25 (call 1,
# docs/bench/fwd_session25.txt; three rounds, the entry against the grid kernel at every length): causal 4k / 8k /
# 16k 634.0 / 596.2 / 613.8 against 590.5 / 582.5 / 620.5.
# A head dim named in CUFLASH_SM90_VARIANTS takes that variant at every length; CUFLASH_SM90_SHORT_VARIANTS (e.g.
# "64c:ws_n128_p,128@512:pingpong_n128_p_s2", c: causal or local, @N: up to N keys) replaces this table, for
# measuring.
SM90_SHORT_SEQLEN = 8192
SM90_SHORT_VARIANTS = {(64, False, 512): "ws_n128_p", (64, False, 1024): "ws3_n128_p_split",
                       (64, False, 4096): "ws3_n128_p", (64, True, 2048): "ws_n128_p", (64, True, 4096): "ws3_n128_p",
                       (128, False, 2048): "pingpong_n128_p_s2", (128, True, 8192): "pingpong_n128_p_s2"}


def _short_table_from_env(text: str | None) -> dict:
    """CUFLASH_SM90_SHORT_VARIANTS, e.g. "128@512:pingpong_n128_p_s2,128:pingpong_n128_s2,128c:pingpong_n128_p"
    (c: causal or local; @N: up to N keys, else up to SM90_SHORT_SEQLEN), as a table that replaces
    SM90_SHORT_VARIANTS (for measuring; "" empties it); None: the variable is unset."""
    if text is None:
        return SM90_SHORT_VARIANTS
    table = {}
    for key, variant in _env_pairs(text):
        d, _, bound = key.partition("@")
        bound = int(bound) if bound else SM90_SHORT_SEQLEN
        if not 0 < bound <= SM90_SHORT_SEQLEN:
            raise ValueError(f"CUFLASH_SM90_SHORT_VARIANTS: {key!r} bounds the keys beyond 1..{SM90_SHORT_SEQLEN}")
        table[int(d.rstrip("c")), d.endswith("c"), bound] = variant
    return table


def short_variant(table: dict, headdim: int, band: bool, seqlen_k: int) -> str | None:
    """The variant a short-sequence table gives a call: the entry of (head dim, band) with the fewest keys that
    still covers seqlen_k; None where none does."""
    bounds = [bound for d, b, bound in table if d == headdim and b == band and seqlen_k <= bound]
    return table[headdim, band, min(bounds)] if bounds else None


def _short_variants(text: str | None, short_text: str | None = None) -> dict:
    """The short-sequence table (SM90_SHORT_VARIANTS or CUFLASH_SM90_SHORT_VARIANTS's) without the head dims a
    CUFLASH_SM90_VARIANTS text names."""
    named = _variants_from_env(text, {})
    return {key: variant for key, variant in _short_table_from_env(short_text).items() if key[0] not in named}


# The persistent Hopper forward's walk under a band (fwd_sm90.cu tile_of). The tiles of a causal head differ in length;
# walked pair by pair (each (sequence, head) pair's query blocks, longest first) the static rounds left the busiest CTA
# 3.1% above the mean at 512-4k keys on 132 SMs (a model of the walk in docs/perf-notes.md, session 19). Chunks of
# `chunk` pairs walked level by level instead (every pair's longest tile, then every pair's next one ...), with chunk
# a divisor of the CTA count, give each round tiles of one length: the model's busiest CTA is then 1.003-1.015x the
# mean. A chunk's K and V are read once per level, so they should stay in L2 (50 MB on the H200) meanwhile: the
# largest divisor whose K/V fits l2_bytes. Session 19 (docs/bench/fwd_session19.txt, call 5; three rounds, TFLOP/s):
# d 64 causal 512 / 1k / 2k / 4k 241.8 / 318.8 / 375.0 / 418.6 -> 244.1 / 322.6 / 379.4 / 431.1; d 128 causal 512 /
# 1k (pingpong_n128_p_s2, two slots) 345.8 / 451.7 -> 338.6 / 447.8, so head dims other than those listed keep the
# pair-by-pair walk. CUFLASH_SM90_WALK_CHUNK=N forces N at every head dim (1: the pair-by-pair walk).
SM90_WALK = {"l2_bytes": 24 << 20, "head_dims": (64,), "chunk": int(os.environ.get("CUFLASH_SM90_WALK_CHUNK", "0"))}


def sm90_walk_chunk(ctas: int, seqlen_k: int, headdim: int, heads_per_kv: int) -> int:
    """(sequence, head) pairs per chunk of the persistent walk under a band (SM90_WALK): the largest divisor of the
    CTA count whose pairs' K and V (2-byte elements, shared by heads_per_kv heads) fit SM90_WALK["l2_bytes"]; 1 for
    head dims not in SM90_WALK["head_dims"]."""
    if SM90_WALK["chunk"] > 0:
        return SM90_WALK["chunk"]
    if headdim not in SM90_WALK["head_dims"]:
        return 1
    pair_bytes = 2 * seqlen_k * headdim * 2 / heads_per_kv
    return next((c for c in range(ctas, 0, -1) if ctas % c == 0 and c * pair_bytes <= SM90_WALK["l2_bytes"]), 1)


SM90_FORWARD = {
    "enabled": os.environ.get("CUFLASH_SM90", "1") == "1",
    "variants": _variants_from_env(os.environ.get("CUFLASH_SM90_VARIANTS"), SM90_DEFAULT_VARIANTS),
    "short": _short_variants(os.environ.get("CUFLASH_SM90_VARIANTS"), os.environ.get("CUFLASH_SM90_SHORT_VARIANTS")),
}


def sm90_forward_variant(problem, arch: str, band: bool = False) -> str | None:
    """The Hopper forward variant for a call, or None for the portable kernel: sm_90a, an exact head dim of the
    table, and the path enabled; `band`: causal or local (the short-sequence table tells them apart)."""
    if not SM90_FORWARD["enabled"] or arch != "sm_90a" or problem.headdim not in SM90_FORWARD["variants"]:
        return None
    short = short_variant(SM90_FORWARD["short"], problem.headdim, band, problem.seqlen_k)
    return short or SM90_FORWARD["variants"][problem.headdim]


def _struct(pointers, int64s, int32s, float32s) -> np.dtype:
    """A NumPy structured dtype laid out like a C struct of these fields, in this order."""
    return np.dtype([(n, np.uint64) for n in pointers] + [(n, np.int64) for n in int64s]
                    + [(n, np.int32) for n in int32s] + [(n, np.float32) for n in float32s], align=True)


def _strides(*tensors) -> list:
    return [f"{t}_{s}_stride" for t in tensors for s in ("batch", "row", "head")]


# Layouts of the structs in cuda_src/params.cuh: same field order, C alignment (tests/test_plan.py checks).
FWD_PARAMS_DTYPE = _struct(
    ("q", "k", "v", "o", "lse", "alibi", "cu_seqlens_q", "cu_seqlens_k"),
    _strides("q", "k", "v", "o") + ["lse_batch_stride", "lse_head_stride", "alibi_batch_stride"],
    ("seqlen_q", "seqlen_k", "nheads", "heads_per_kv", "headdim", "window_left", "window_right"),
    ("scale_log2", "mod_scale", "softcap"))
BWD_PARAMS_DTYPE = _struct(
    ("q", "k", "v", "dout", "dk", "dv", "dq_accum", "lse_log2", "dsum", "alibi", "cu_seqlens_q", "cu_seqlens_k",
     "dq_scale", "kv_bound"),
    _strides("q", "k", "v", "do", "dk", "dv")
    + ["lse_batch_stride", "lse_head_stride", "dq_batch_stride", "alibi_batch_stride", "dq_slice_stride"],
    ("batch", "seqlen_q", "seqlen_k", "nheads", "heads_per_kv", "headdim", "window_left", "window_right",
     "deterministic"),
    ("scale_log2", "mod_scale", "softcap", "softmax_scale"))
BWD_PRE_PARAMS_DTYPE = _struct(
    ("out", "dout", "lse", "dsum", "lse_log2", "dq_accum", "dq_scale", "kv_bound", "k", "v"),
    _strides("o", "do", "k", "v") + ["dq_slice_stride"],
    ("batch", "seqlen_q", "nheads", "headdim", "lanes", "slices", "fixed_point", "kv_batch", "seqlen_k", "nheads_k"),
    ("softmax_scale",))
BWD_CONVERT_PARAMS_DTYPE = _struct(
    ("dq_accum", "dq", "dq_scale"), ("slice_stride",), ("slices", "fixed_point", "seqlen_q", "nheads", "headdim"), ())


def forward_scales(softmax_scale: float, softcap: float, score_mod: bool) -> dict:
    """The three scalars the kernel uses to turn q.k into exp2 arguments (see params.cuh)."""
    return {
        "scale_log2": LOG2E if score_mod else softmax_scale * LOG2E,
        "mod_scale": softmax_scale / softcap if softcap > 0 else softmax_scale,
        "softcap": softcap,
    }


# --------------------------------------------------------------------------------------------
# Decode (attention_with_kvcache): cuda_src/decode.cu, decode_aux.cu
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape of the decode kernel (4 warps)."""

    row_warps: int     # 1: 16 packed rows shared by all warps, keys split 4 ways; 4: 64 rows, 16 per warp
    block_n: int       # keys per KV block
    stages: int        # depth of the cp.async ring of K/V blocks
    tma: bool = False     # K/V blocks by TMA (decode_tma_kernel, sm_90a; row_warps 1)


# compiled head dim -> (config for up to 16 packed rows, config for more). Decode reads K/V at memory speed, so
# the ring must keep enough bytes in flight per SM. H200, bf16, d 128, 32/8 heads, one new row, TB/s of K/V
# (benchmarks/tune_decode.py, docs/bench/tune_decode.txt; block_n x stages):
#   batch x keys   64x2  64x3  64x4  64x6  128x2 128x3
#   1 x 256k       4.13  4.16  3.87  3.85  3.36  4.16
#   8 x 64k        4.43  4.36  4.06  3.99  3.45  4.41
#   32 x 64k       4.53  4.55  4.18  4.14  3.53  4.62
#   64 x 256k      3.88  4.57  4.23  4.10  3.53  4.60
# That tune used caches laid out (batch, len, nheads_k, d). In benchmarks/bench_decode.py, whose cache is
# SDPA's (batch, nheads_k, len, d) viewed through strides, and with 64-row pages, 128 x 3 lost: 4.36 against
# 4.51 TB/s at 64 x 256k, and paged calls ran 2x slower (same run, 2026-11-29). 64 x 3 (about 100 KB, two CTAs
# per SM) is within 1.5% of the best everywhere, so it stays; other head dims keep 64-key blocks, rings of
# about 100 KB up to d = 128 and two stages beyond. With more than 16 rows each warp holds a whole block of
# scores beside its O accumulator, so blocks stay at 64 keys (32 past d = 128).
_R1, _R4 = 1, 4
DECODE_TABLE = {
    32: (DecodeConfig(_R1, 64, 4), DecodeConfig(_R4, 64, 4)),
    64: (DecodeConfig(_R1, 64, 4), DecodeConfig(_R4, 64, 4)),
    96: (DecodeConfig(_R1, 64, 3), DecodeConfig(_R4, 64, 3)),
    128: (DecodeConfig(_R1, 64, 3), DecodeConfig(_R4, 64, 3)),
    160: (DecodeConfig(_R1, 64, 2), DecodeConfig(_R4, 32, 2)),
    192: (DecodeConfig(_R1, 64, 2), DecodeConfig(_R4, 32, 2)),
    224: (DecodeConfig(_R1, 64, 2), DecodeConfig(_R4, 32, 2)),
    256: (DecodeConfig(_R1, 64, 2), DecodeConfig(_R4, 32, 2)),
}
DECODE_MAX_SPLITS = 128    # decode_combine's shared buffer (MAX_SPLITS in decode_aux.cu)
# decode_combine launched as a programmatic dependent of the decode kernel (sm_90: it starts while the decode
# kernel's last CTAs finish, cuflash.launcher's `overlap`). CUFLASH_PDL=0 launches it plainly.
PDL = {"enabled": os.environ.get("CUFLASH_PDL", "1") == "1"}
# The splits merged by the TMA decode kernel itself (the last CTA of a row tile to finish, counted on a zeroed
# counter per tile that cuflash.api keeps per stream) instead of decode_combine: no second launch. (The cp.async
# kernel keeps decode_combine: beside its loop the merge spilled on sm_80.) Session 10 (bench_decode.py,
# two rounds, docs/bench/decode_session10.txt): batch 8 x 1k (4 splits) 21.5 -> 19.5 us, 8 x 8k 80.6 -> 78.6,
# 1 x 1k (16 splits) 12.3 -> 11.1-11.7, 1 x 8k (32) 20.9-21.0 -> 20.6-20.7, the long cells unchanged. (A first
# version that read every split's lse twice was 0.5-1.5 us slower than decode_combine at 32 splits and more.)
# CUFLASH_DECODE_FUSED_MAX_SPLITS bounds the split counts merged so (0: decode_combine always).
DECODE_COMBINE = {"fused_max_splits": int(os.environ.get("CUFLASH_DECODE_FUSED_MAX_SPLITS", str(DECODE_MAX_SPLITS)))}


def decode_fused_combine(splits: int) -> bool:
    return 1 < splits <= DECODE_COMBINE["fused_max_splits"]


def pdl_applies(arch: str) -> bool:
    return PDL["enabled"] and arch.startswith("sm_9")


# The TMA decode kernel (decode_tma_kernel in cuda_src/decode.cu, sm_90a): up to 16 packed rows at head dims
# exactly 64 and 128, contiguous caches or pages of a multiple of 64 rows, strides TMA accepts; the cp.async kernel
# everywhere else. Measured (session 7, bench_decode A/B in one device call, docs/bench/decode_tma_session7.txt):
# with a 3-slot ring (two CTAs per SM at d = 128) it reads 4.54-4.57 TB/s at 8-32 GB of K/V against the cp.async
# kernel's 4.47-4.50, and paged caches 1.2x faster (8 x 256k keys: 1943.6 against 2379.6 us); a 6-slot ring (one
# CTA per SM) lost at 64 x 8k-256k. CUFLASH_DECODE_TMA=0 turns it off; CUFLASH_DECODE_TMA_STAGES picks the ring.
DECODE_TMA = {"enabled": os.environ.get("CUFLASH_DECODE_TMA", "1") == "1", "headdims": (64, 128), "block_n": 64,
              "stages": int(os.environ.get("CUFLASH_DECODE_TMA_STAGES", "3")), "stage_choices": (3,),
              "evict_first_mb": int(os.environ.get("CUFLASH_DECODE_EVICT_FIRST_MB", "128"))}


# K/V copies marked evict_first in L2 (decode_tma_kernel's kv_evict_first) when a call reads at most
# DECODE_TMA["evict_first_mb"] MiB of K/V: they then replace each other rather than what earlier kernels left in L2
# (dirty lines cost a write-back to evict). Session 10 (bench_decode.py, two rounds each, L2 flushed by a 256 MB
# write before every call, docs/bench/decode_session10.txt): 32 MB (1 x 8k, 8 x 1k) 22.4-23.0 -> 20.8-21.4 us,
# 128 MB (32 x 1k) 45.9 -> 44.0-44.6; but at 256 MB and more 2-6% slower (1 x 256k 256.4 -> 272.4 us, 32 x 8k
# 252.3 -> 265.5). CUFLASH_DECODE_EVICT_FIRST_MB sets the bound (0: never).
def decode_evict_first(kv_bytes: int) -> bool:
    return kv_bytes <= DECODE_TMA["evict_first_mb"] * 2**20


def decode_tma_applies(arch: str, headdim: int, packed_rows: int, page_size: int) -> bool:
    """page_size 0: a contiguous cache."""
    return (DECODE_TMA["enabled"] and arch == "sm_90a" and headdim in DECODE_TMA["headdims"] and packed_rows <= 16
            and page_size % DECODE_TMA["block_n"] == 0)


def decode_tma_config(stages: int | None = None) -> DecodeConfig:
    return DecodeConfig(1, DECODE_TMA["block_n"], stages or DECODE_TMA["stages"], tma=True)


SMEM_PER_SM = 227 * 1024   # usable shared memory per SM on sm_80 / sm_90 (1 KB per CTA reserved)


def decode_config(headdim: int, packed_rows: int) -> DecodeConfig:
    """packed_rows = seqlen_q * (nheads // nheads_k): the rows of one KV head's GQA group."""
    return DECODE_TABLE[compiled_headdim(headdim)][0 if packed_rows <= 16 else 1]


@dataclass(frozen=True)
class DecodeSpec:
    """One compiled decode kernel."""

    dtype: str
    headdim: int
    config: DecodeConfig
    score_mod: bool

    source = "decode.cu"
    threads = 128

    @property
    def name(self) -> str:
        c = self.config
        return (f"decode_{self.dtype}_d{self.headdim}_r{c.row_warps}n{c.block_n}s{c.stages}"
                f"{'_tma' if c.tma else ''}"
                f"{'_mod' if self.score_mod else ''}")

    @property
    def template(self) -> str:
        c = self.config
        if c.tma:
            return _template("decode_tma_kernel", self.dtype, (self.headdim, c.block_n, c.stages), (self.score_mod,))
        return _template("decode_kernel", self.dtype, (self.headdim, c.row_warps, c.block_n, c.stages),
                         (self.score_mod,))

    @property
    def smem_bytes(self) -> int:
        # DecodeTraits::SMEM_BYTES: Q tile and the K/V ring, or the merge buffer if larger.
        c = self.config
        row = _smem_row_bytes(self.headdim)
        tiles = 16 * c.row_warps * row + c.stages * 2 * c.block_n * row
        merge = 64 * (self.headdim + 4 + 2) * 4
        if c.tma:  # the ring's mbarriers after it, and 1 KB of slack to align the tiles to 1024 bytes
            return max(tiles + 8 * c.stages, merge) + 1024
        return max(tiles, merge)


@dataclass(frozen=True)
class DecodeAuxSpec(AuxSpec):
    """decode_append or decode_combine (cuda_src/decode_aux.cu), templated on the dtype only."""

    source = "decode_aux.cu"


def all_decode_specs(arch: str) -> list:
    specs = [DecodeAuxSpec(k, dtype) for k in ("decode_append", "decode_combine") for dtype in ("fp16", "bf16")]
    for dtype in ("fp16", "bf16"):
        for d in COMPILED_HEADDIMS:
            for rows in (1, 64):
                for mod in (False, True):
                    specs.append(DecodeSpec(dtype, d, decode_config(d, rows), mod))
        if arch == "sm_90a":
            specs += [DecodeSpec(dtype, d, decode_tma_config(stages), mod) for d in DECODE_TMA["headdims"]
                      for stages in DECODE_TMA["stage_choices"] for mod in (False, True)]
    return specs


def num_splits_heuristic(work: int, slots: int, n_blocks: int, max_splits: int = DECODE_MAX_SPLITS) -> int:
    """Split count for `work` CTAs (batch x KV heads x row tiles) over `n_blocks` KV blocks, `slots` CTAs
    resident at once. Like FlashAttention-2: no split once the work fills 80% of the slots, and a count that
    gives some split as many blocks as one fewer split would is never taken. Unlike FA2 (the smallest count
    within 85% of the best wave efficiency), the largest count that still fits one wave: decode is bound by
    memory and by the bytes each CTA keeps in flight, so every idle slot costs bandwidth. (FA2's rule gave 29
    splits = 232 of 264 slots for batch 1 x 8 KV heads: 8% slower at 64k-256k keys on the H200,
    benchmarks/bench_decode.py.)"""
    if work >= 0.8 * slots:
        return 1
    best = 1
    for s in range(2, max(1, min(max_splits, n_blocks, slots // work)) + 1):
        if math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1)):
            best = s
    return best


@dataclass(frozen=True)
class DecodeLaunch:
    spec: DecodeSpec
    grid: tuple
    splits: int


@functools.lru_cache(maxsize=4096)
def plan_decode(problem, left: int, right: int, score_mod: bool, num_splits: int, sm_count: int,
                tma: bool = False) -> DecodeLaunch:
    """Decode kernel, its grid (row tiles x splits, KV heads, batch) and split count. `problem.seqlen_k` is
    the most keys a row can see (the cache capacity, or the known length); `num_splits` 0 picks by heuristic.
    `tma`: the TMA kernel (the caller checked decode_tma_applies)."""
    dtype = DTYPES[np.dtype(problem.dtype).name][0]
    d = compiled_headdim(problem.headdim)
    group = problem.nheads // problem.nheads_k
    config = decode_tma_config() if tma else decode_config(d, problem.seqlen_q * group)
    spec = DecodeSpec(dtype, d, config, score_mod)
    m_tiles = math.ceil(problem.seqlen_q * group / (16 * spec.config.row_warps))
    n_blocks = max(1, math.ceil(problem.seqlen_k / spec.config.block_n))
    if num_splits == 0:
        ctas_per_sm = max(1, SMEM_PER_SM // (spec.smem_bytes + 1024))
        num_splits = num_splits_heuristic(problem.batch * problem.nheads_k * m_tiles, sm_count * ctas_per_sm,
                                          n_blocks)
    splits = max(1, min(num_splits, n_blocks, DECODE_MAX_SPLITS))
    return DecodeLaunch(spec, check_grid((m_tiles * splits, problem.nheads_k, problem.batch)), splits)


DECODE_PARAMS_DTYPE = _struct(
    ("q", "k_cache", "v_cache", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "cache_seqlens",
     "cache_batch_idx", "block_table", "alibi", "split_counters"),
    _strides("q", "k", "v", "kn", "vn", "o") + ["alibi_batch_stride", "block_table_stride"],
    ("batch", "seqlen_q", "seqlen_new_k", "cache_len", "nheads", "heads_per_kv", "headdim", "page_size",
     "window_left", "window_right", "num_splits", "kv_evict_first"),
    ("scale_log2", "mod_scale", "softcap"))

# DecodeTmaParams (decode.cu): DecodeParams, then the K and V caches' tensor maps on 64-byte boundaries.
DECODE_TMA_MAPS_OFFSET = -(-DECODE_PARAMS_DTYPE.itemsize // 64) * 64
DECODE_TMA_PARAMS_DTYPE = np.dtype({
    "names": list(DECODE_PARAMS_DTYPE.names) + ["k_map", "v_map"],
    "formats": [DECODE_PARAMS_DTYPE.fields[n][0] for n in DECODE_PARAMS_DTYPE.names] + ["V128", "V128"],
    "offsets": [DECODE_PARAMS_DTYPE.fields[n][1] for n in DECODE_PARAMS_DTYPE.names]
    + [DECODE_TMA_MAPS_OFFSET, DECODE_TMA_MAPS_OFFSET + 128],
    "itemsize": DECODE_TMA_MAPS_OFFSET + 256})

"""The forward (``cuflash.attention``, ``attention_varlen``): which kernel runs a call -- the portable one
(``cuda_src/fwd.cu``) or on sm_90a the Hopper one (:mod:`cuflash.ops.forward_sm90`) -- its tile tables and
specializations, its parameter struct, and its launch.

Tile shapes are data here; the kernels take them as template arguments and derive the rest themselves. Only the
shared-memory formula mirrors ``FwdTraits::SMEM_BYTES``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .. import build, checks, plan, runtime, settings
from ..launcher import KernelCall
from ..options import AttentionOptions, resolve
from . import forward_sm90


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
# sm90 entries override sm80 ones where a measurement on the H200 chose differently (benchmarks/tune_forward.py,
# bf16, 2026-11-29; docs/perf-notes.md, "portable forward tiles on the H200"). 128x128w8q holds one CTA per SM, so
# each CTA's prologue and epilogue are exposed; short rows favour the 4-warp tiles that fit two CTAs per SM.
FWD_TABLE_SM90: dict = {
    ("sm90", 64, True): ((512, FwdConfig(64, 64, 4, True)), (_ANY, FwdConfig(128, 64, 4, False))),
    ("sm90", 128, False): ((512, FwdConfig(64, 128, 4, True)), (_ANY, FwdConfig(128, 128, 8, True))),
    ("sm90", 128, True): ((2048, FwdConfig(64, 128, 4, True)), (_ANY, FwdConfig(128, 128, 8, True))),
}


def fwd_configs(arch: str, headdim: int, band: bool) -> tuple:
    """The (max_seqlen_k, FwdConfig) entries for a compiled head dim on `arch`."""
    key = (plan.compiled_headdim(headdim), band)
    if plan.is_hopper(arch) and ("sm90",) + key in FWD_TABLE_SM90:
        return FWD_TABLE_SM90[("sm90",) + key]
    return FWD_TABLE[("sm80",) + key]


def fwd_config(arch: str, headdim: int, band: bool, seqlen_k: int, dropout: bool = False) -> FwdConfig:
    """The configuration of a call: the table's entry for its keys; with dropout, :func:`dropout_config`."""
    if dropout:
        return dropout_config(arch, headdim, band)
    for bound, config in fwd_configs(arch, headdim, band):
        if bound is None or seqlen_k <= bound:
            return config
    raise LookupError(f"no forward config for d={headdim} band={band} seqlen_k={seqlen_k} on {arch}")


def dropout_config(arch: str, headdim: int, band: bool) -> FwdConfig:
    """The one configuration of the dropout kernels (FwdSpec.dropout) of a head dim: the table's for the longest
    sequences where the keep bits fit beside the scores, else DROPOUT_CONFIG."""
    config = fwd_configs(arch, headdim, band)[-1][1]
    return config if dropout_fits(config) else DROPOUT_CONFIG


# Dropout's keep bits fit beside a warp's scores where it holds at most 16 score tiles (FwdTraits::DROPOUT_FITS);
# the tables' 128 x 128 4-warp configuration (d = 32) holds 32, and dropout calls there run this one.
DROPOUT_CONFIG = FwdConfig(128, 64, 4, False)


def dropout_fits(config: FwdConfig) -> bool:
    return (config.block_m // config.warps // 16) * (config.block_n // 8) <= 16


@dataclass(frozen=True)
class FwdSpec:
    """One compiled portable forward kernel."""

    dtype: str        # "fp16" | "bf16"
    headdim: int      # compiled head dim
    config: FwdConfig
    band: bool        # causal / local masking compiled in
    score_mod: bool   # softcap / ALiBi compiled in
    dropout: bool = False  # dropout compiled in (dropout_config's configuration only)

    source = "fwd.cu"

    @property
    def name(self) -> str:
        c = self.config
        return (f"fwd_{self.dtype}_d{self.headdim}_m{c.block_m}_n{c.block_n}_w{c.warps}"
                + ("_qreg" if c.q_in_regs else "") + ("_causal" if self.band else "")
                + ("_mod" if self.score_mod else "") + ("_drop" if self.dropout else ""))

    @property
    def template(self) -> str:
        c = self.config
        return plan.template("fwd_kernel", self.dtype, (self.headdim, c.block_m, c.block_n, c.warps),
                             (c.q_in_regs, self.band, self.score_mod, self.dropout))

    @property
    def threads(self) -> int:
        return self.config.warps * 32

    @property
    def smem_bytes(self) -> int:
        # FwdTraits::SMEM_BYTES: Q (block_m rows) + K + V (block_n rows each)
        return (self.config.block_m + 2 * self.config.block_n) * plan.smem_row_bytes(self.headdim)


def all_specs(arch: str) -> list:
    """Every portable forward specialization the planner can choose on `arch`."""
    specs = []
    for dtype in ("fp16", "bf16"):
        for d in plan.COMPILED_HEADDIMS:
            for band in (False, True):
                for mod in (False, True):
                    specs += [FwdSpec(dtype, d, config, band, mod) for _, config in fwd_configs(arch, d, band)]
                    specs.append(FwdSpec(dtype, d, dropout_config(arch, d, band), band, mod, True))
    return specs


@dataclass(frozen=True)
class Launch:
    spec: FwdSpec
    grid: tuple
    block: tuple
    smem: int


@functools.lru_cache(maxsize=4096)
def plan_forward(problem, left: int, right: int, score_mod: bool, arch: str, dropout: bool = False) -> Launch:
    """The portable kernel and its launch shape for a forward call (window already normalized)."""
    band = left >= 0 or right >= 0
    d = plan.compiled_headdim(problem.headdim)
    spec = FwdSpec(plan.dtype_tag(problem.dtype), d, fwd_config(arch, d, band, problem.seqlen_k, dropout), band,
                   score_mod, dropout)
    m_blocks = math.ceil(problem.seqlen_q / spec.config.block_m)
    return Launch(spec, plan.check_grid((m_blocks, problem.nheads, problem.batch)), (spec.threads, 1, 1),
                  spec.smem_bytes)


# ---------------------------------------------------------------------------------------------------------------
# The Hopper forward: which variant (forward_sm90.VARIANTS) runs a call on sm_90a.
# ---------------------------------------------------------------------------------------------------------------

# Head dim -> the variant for any length (scripts/sm90_sweep.sh and scripts/pick_sm90_variants.py rank them by the
# geometric mean TFLOP/s over seqlen 1k/4k/16k, causal or not; docs/perf-notes.md, "Hopper forward variants").
# The sm90_variants setting overrides a head dim's.
SM90_DEFAULT_VARIANTS = {64: "ws3_n128", 128: "pingpong_n128", 256: "pingpong_n80"}

# Short sequences: (head dim, masked by a band, most keys) -> the variant that beat the head dim's own up to that
# many keys (bench_attention.py --op fwd on the ANCHORS grid, three rounds per cell; docs/perf-notes.md, "short
# sequence variants"). The persistent kernels overlap one tile's prologue and epilogue with the next tile's work,
# which matters most when the rows are short. A call takes the entry of its (head dim, band) with the fewest keys
# that still covers seqlen_k. The sm90_short_variants setting replaces the table.
SM90_SHORT_SEQLEN = 8192
SM90_SHORT_VARIANTS = {(64, False, 512): "ws_n128_p", (64, False, 1024): "ws3_n128_p_split",
                       (64, False, 4096): "ws3_n128_p", (64, True, 2048): "ws_n128_p", (64, True, 4096): "ws3_n128_p",
                       (128, False, 2048): "pingpong_n128_p_s2", (128, True, 8192): "pingpong_n128_p_s2"}


def short_variant(table: dict, headdim: int, band: bool, seqlen_k: int) -> str | None:
    """The variant a short-sequence table gives a call: the entry of (head dim, band) with the fewest keys that
    still covers seqlen_k; None where none does."""
    bounds = [bound for d, b, bound in table if d == headdim and b == band and seqlen_k <= bound]
    return table[headdim, band, min(bounds)] if bounds else None


def sm90_variants() -> dict:
    """Head dim -> variant: SM90_DEFAULT_VARIANTS with the sm90_variants setting over it."""
    return {**SM90_DEFAULT_VARIANTS, **settings.current().sm90_variants}


def short_table(entries: dict) -> dict:
    """A short-sequence table from the sm90_short_variants setting's entries {(head dim, band, bound or None):
    variant}: a missing bound is SM90_SHORT_SEQLEN; bounds past it are refused."""
    table = {}
    for (d, band, bound), variant in entries.items():
        bound = SM90_SHORT_SEQLEN if bound is None else bound
        if not 0 < bound <= SM90_SHORT_SEQLEN:
            raise ValueError(f"CUFLASH_SM90_SHORT_VARIANTS: head dim {d} bounds the keys at {bound}, beyond "
                             f"1..{SM90_SHORT_SEQLEN}")
        table[d, band, bound] = variant
    return table


def sm90_short_variants() -> dict:
    """The short-sequence table in force: SM90_SHORT_VARIANTS or the sm90_short_variants setting's, without the
    head dims the sm90_variants setting names."""
    s = settings.current()
    table = SM90_SHORT_VARIANTS if s.sm90_short_variants is None else short_table(s.sm90_short_variants)
    return {key: variant for key, variant in table.items() if key[0] not in s.sm90_variants}


def sm90_variant(problem, arch: str, band: bool = False) -> str | None:
    """The Hopper forward variant for a call, or None for the portable kernel: sm_90a, a head dim that runs on one
    of the table's (plan.hopper_headdim), and the sm90 setting on; `band`: causal or local (the short-sequence table
    tells them apart)."""
    variants = sm90_variants()
    d = plan.hopper_headdim(problem.headdim)
    if not settings.current().sm90 or arch != "sm_90a" or d not in variants:
        return None
    short = short_variant(sm90_short_variants(), d, band, problem.seqlen_k)
    return short or variants[d]


# ---------------------------------------------------------------------------------------------------------------
# Parameters and launch
# ---------------------------------------------------------------------------------------------------------------

# FwdParams (cuda_src/params.cuh): same field order, C alignment (tests/test_plan.py checks).
PARAMS_DTYPE = plan.struct(
    ("q", "k", "v", "o", "lse", "alibi", "cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k", "dropout_seed",
     "dropout_offset", "dropout_state"),
    plan.stride_fields("q", "k", "v", "o") + ["lse_batch_stride", "lse_head_stride", "alibi_batch_stride",
                                              "block_table_stride"],
    ("seqlen_q", "seqlen_k", "page_size", "num_pages", "max_pages", "nheads", "heads_per_kv", "headdim",
     "window_left", "window_right", "dropout_threshold"),
    ("dropout_scale", "scale_log2", "mod_scale", "softcap"))
# The fields a call sets: the data pointers q .. seqused_k, then the dropout generator's seed and offset, or the
# pointer to them in device memory (dropout_state)
POINTERS = PARAMS_DTYPE.names[:13]


def params(problem, q, k, v, out, lse, alibi, options: AttentionOptions, block_table=None):
    """FwdParams but its pointers (each call gives them): strides of the layouts (arrays or TensorSpecs), sizes,
    window, scales; with ``block_table`` (k, v page pools) the pages' geometry."""
    p = np.zeros((), dtype=PARAMS_DTYPE)
    if block_table is not None:
        plan.set_pages(p, k, block_table)
    plan.set_strides(p, q=q, k=k, v=v, o=out)
    p["lse_batch_stride"], p["lse_head_stride"] = checks.lse_strides(lse)
    p["alibi_batch_stride"] = checks.alibi_batch_stride(alibi)
    p["seqlen_q"], p["seqlen_k"] = problem.seqlen_q, problem.seqlen_k
    p["nheads"], p["heads_per_kv"] = problem.nheads, problem.nheads // problem.nheads_k
    p["headdim"] = problem.headdim
    p["window_left"], p["window_right"] = options.left, options.right
    for name, value in {**options.scales, **options.dropout_fields}.items():
        p[name] = value
    return p[()]


def forward_call(problem, q, k, v, out, lse, options: AttentionOptions, *, device_id: int, alibi_slopes=None,
                 block_table=None, seqused_k=None):
    """The forward's :class:`~cuflash.launcher.KernelCall` for these layouts and options on device `device_id`
    (current), or where sm90_variant chooses the Hopper kernel, :class:`~cuflash.ops.forward_sm90.ForwardCall`
    (same call). q .. lse, alibi_slopes and block_table are arrays or TensorSpecs: only shapes and strides are read,
    packed ones ((total, heads, d); lse (nheads, total_q)) as in :func:`launch`. A call then takes the stream and the
    pointers ``q, k, v, o, lse, alibi, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k`` (0 where absent).
    Paged keys (block_table, with or without seqused_k) run on the Hopper kernel's PAGED variant where it has the
    head dim (without dropout); key counts without pages (seqused_k, an array or TensorSpec; only its presence is
    read) on the portable kernel."""
    arch = build.device_arch(device_id)
    variant = sm90_variant(problem, arch, options.band) if block_table is not None or seqused_k is None else None
    if variant is not None and block_table is not None:  # paged: the lockstep kernel, without dropout
        variant = forward_sm90.PAGED_VARIANT if not options.dropout else None
    elif variant is not None and options.dropout:  # dropout: one Hopper variant per head dim and mask kind
        variant = forward_sm90.DROPOUT_VARIANTS.get((plan.hopper_headdim(problem.headdim), options.band))
    if variant is not None:
        return forward_sm90.forward_call(problem, q, k, v, out, lse, options, device_id=device_id,
                                         alibi_slopes=alibi_slopes, variant=variant, block_table=block_table)
    launch = plan_forward(problem, options.left, options.right, options.score_mod, arch, options.dropout)
    p = params(problem, q, k, v, out, lse, alibi_slopes, options, block_table)
    return KernelCall([(build.get_kernel(launch.spec, device_id), launch.grid, launch.block, launch.smem)],
                      p, POINTERS)


_launches: dict = {}  # call signature -> KernelCall (launch)
_attention_calls: dict = {}  # key of an attention() call -> (KernelCall, device id, lse shape or None)
_varlen_calls: dict = {}  # key of an attention_varlen() call -> (KernelCall, device id, lse shape or None)


@settings.on_change
def _forget() -> None:
    _launches.clear()
    _attention_calls.clear()
    _varlen_calls.clear()


def launch(problem, q, k, v, out, lse, *, softmax_scale, causal, window_size, softcap, alibi_slopes,
           cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, seqused_k=None, dropout_p=0.0, dropout_seed=0,
           dropout_offset=0, dropout_state=None):
    """Launch the forward into given arrays, on the current device and stream; no checks, no allocation.

    :func:`cuflash.attention` checks and allocates, then calls this; framework wrappers (JAX's FFI handler) call
    it with buffers they own. ``out`` is contiguous like q, ``lse`` is contiguous ``(batch, nheads, seqlen_q)``
    float32 or None.

    Packed variable-length sequences (:func:`cuflash.attention_varlen`): give ``cu_seqlens_q`` and
    ``cu_seqlens_k`` (int32 ``(batch + 1,)`` on the device); q/out are then ``(total_q, nheads, d)``, k/v
    ``(total_k, nheads_k, d)``, lse ``(nheads, total_q)``, and ``problem`` carries the maximum lengths. With
    ``block_table`` k/v are page pools ``(num_pages, page_size, nheads_k, d)``; ``seqused_k`` (int32 ``(batch,)``)
    gives each sequence's key count. ``dropout_p`` > 0 drops probabilities by the mask of ``dropout_seed`` and
    ``dropout_offset`` (cuda_src/dropout.cuh), or of the two int64 words of ``dropout_state`` (a device array; the
    kernels read them) where given.
    """
    key = checks.call_signature((problem, q, k, v, out, lse, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, dropout_p))
    call = _launches.get(key) if key is not None else None
    if call is None:
        options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        call = runtime.keep(_launches, key, forward_call(problem, q, k, v, out, lse, options, device_id=q.device.id,
                                                         alibi_slopes=alibi_slopes, block_table=block_table,
                                                         seqused_k=seqused_k))
    import cupy
    call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, runtime.ptr(lse),
         runtime.ptr(alibi_slopes), runtime.ptr(cu_seqlens_q), runtime.ptr(cu_seqlens_k), runtime.ptr(block_table),
         runtime.ptr(seqused_k), int(dropout_seed), int(dropout_offset), runtime.ptr(dropout_state))


def attention(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, stream, dropout_p=0.0,
              dropout_seed=0, dropout_offset=0):
    """:func:`cuflash.attention`: check, resolve the options, plan, allocate, launch. A call with the layouts and
    options of an earlier one skips the checks and the planning (:func:`_launch_kept`)."""
    # one key for the checks and the launch: layouts of the arrays, values of the options
    key, hit = runtime.kept(_attention_calls, (q, k, v, alibi_slopes),
                            (softmax_scale, causal, window_size, softcap, bool(return_lse), dropout_p))
    if hit is None:
        problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                         dropout_p=dropout_p)
        runtime.require_device_arrays(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
        options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        lse_shape = (problem.batch, problem.nheads, problem.seqlen_q) if return_lse else None
        hit = runtime.keep(_attention_calls, key, _planned(problem, q, k, v, lse_shape, options, alibi_slopes))
    return _launch_kept(hit, stream, q, k, v, alibi_slopes, _NO_INDICES, dropout_seed, dropout_offset)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, return_lse, block_table, seqused_k, stream, dropout_p=0.0,
                     dropout_seed=0, dropout_offset=0):
    """:func:`cuflash.attention_varlen`, as :func:`attention`: checked and planned once per key, which holds the
    layouts of every array (cu_seqlens_q/k, block_table and seqused_k too; not their contents, which only the
    kernels read), max_seqlen_q/k and the options."""
    key, hit = runtime.kept(_varlen_calls, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table, seqused_k),
                            (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, bool(return_lse),
                             dropout_p))
    if hit is None:
        problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
                                      seqused_k=seqused_k, dropout_p=dropout_p)
        runtime.require_device_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                      alibi_slopes=alibi_slopes)
        runtime.require_device_index_arrays(block_table=block_table, seqused_k=seqused_k)
        options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        lse_shape = (problem.nheads, q.shape[0]) if return_lse else None  # packed: (nheads, total_q)
        hit = runtime.keep(_varlen_calls, key, _planned(problem, q, k, v, lse_shape, options, alibi_slopes,
                                                        block_table, seqused_k))
    indices = (cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr, runtime.ptr(block_table), runtime.ptr(seqused_k))
    return _launch_kept(hit, stream, q, k, v, alibi_slopes, indices, dropout_seed, dropout_offset)


def _planned(problem, q, k, v, lse_shape, options: AttentionOptions, alibi_slopes, block_table=None,
             seqused_k=None) -> tuple:
    """What a cache of the CuPy API keeps for a checked call: ``(call, device id, lse_shape)``, the call planned on
    a contiguous out like q and (lse_shape not None) a contiguous float32 lse of that shape."""
    runtime.require_gpu()  # after the checks, which need no GPU; once per process
    device_id = q.device.id
    lse = None if lse_shape is None else checks.contiguous("lse", lse_shape, np.float32)
    with runtime.device(device_id):
        call = forward_call(problem, q, k, v, checks.contiguous("out", q.shape, q.dtype), lse, options,
                            device_id=device_id, alibi_slopes=alibi_slopes, block_table=block_table,
                            seqused_k=seqused_k)
    return call, device_id, lse_shape


_NO_INDICES = (0, 0, 0, 0)


def _launch_kept(hit, stream, q, k, v, alibi_slopes, indices: tuple, dropout_seed, dropout_offset):
    """A kept call (:func:`_planned`) on these arrays and `indices`, the pointers of cu_seqlens_q, cu_seqlens_k,
    block_table and seqused_k (0 where absent): the alignment of q, k and v and the dropout generator checked (every
    other check is the key's), out and lse allocated from CuPy's pool, the kept launch."""
    if (q.data.ptr | k.data.ptr | v.data.ptr) % 16:
        runtime.require_device_arrays(q=q, k=k, v=v)  # says which pointer
    call, device_id, lse_shape = hit
    import cupy  # (a first call imported it through the checks, or said how to install it)
    with runtime.device(device_id), runtime.on(stream):
        out = cupy.ndarray(q.shape, q.dtype)
        lse = None if lse_shape is None else cupy.ndarray(lse_shape, np.float32)
        call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, runtime.ptr(lse),
             runtime.ptr(alibi_slopes), *indices, *checks.dropout_generator(dropout_seed, dropout_offset), 0)
    return out if lse is None else (out, lse)

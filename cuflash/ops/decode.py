"""Decode (``cuflash.attention_with_kvcache``): the append of new keys, the decode kernel -- the cp.async one
(``cuda_src/decode.cu`` decode_kernel) or on sm_90a the TMA one (decode_tma_kernel) -- split over the keys, and
the combine of the splits; their tables, specializations, parameter struct and launch.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from .. import build, checks, plan, runtime, settings, tma
from . import forward_fp8
from ..launcher import KernelCall
from ..options import resolve


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape of the decode kernel (4 warps)."""

    row_warps: int     # 1: 16 packed rows shared by all warps, keys split 4 ways; 4: 64 rows, 16 per warp
    block_n: int       # keys per KV block
    stages: int        # depth of the cp.async ring of K/V blocks
    tma: bool = False     # K/V blocks by TMA (decode_tma_kernel, sm_90a; row_warps 1)
    page_boxes: int = 1   # TMA: boxes per panel of a block, one per page in pages of fewer rows than the block


# compiled head dim -> (config for up to 16 packed rows, config for more). Decode reads K/V at memory speed, so
# the ring must keep enough bytes in flight per SM: 64-key blocks and rings of about 100 KB up to d = 128 (two CTAs
# per SM), two stages beyond (benchmarks/tune_decode.py and bench_decode.py on the H200; docs/perf-notes.md,
# "decode ring"). With more than 16 rows each warp holds a whole block of scores beside its O accumulator, so blocks
# stay at 64 keys (32 past d = 128).
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

# The TMA decode kernel (sm_90a): up to 16 packed rows at head dims exactly 64 and 128, contiguous caches or pages whose
# rows are a multiple of its block's keys or a divisor of them of at least 16 (one box per page; page_boxes), strides
# TMA accepts; the cp.async kernel everywhere else. A 3-slot ring (two CTAs per SM at d = 128; the decode_tma_stages
# setting) reads faster than the cp.async kernel, and paged caches 1.2x faster (docs/perf-notes.md, "TMA decode"). It
# merges its own splits (the last CTA of a row tile to finish, counted on a zeroed counter per tile) up to
# decode_fused_max_splits splits, so no combine launch follows; and marks its K/V copies evict_first in L2 when a call
# reads at most decode_evict_first_mb MiB of K/V, so they replace each other rather than what earlier kernels left in L2
# (larger reads ran slower so).
TMA_HEADDIMS = (64, 128)
TMA_BLOCK_N = 64
TMA_STAGE_CHOICES = (3,)
# The TMA kernel over an e4m3 cache, per head dim, in order of preference: 32 KB blocks (128 keys at d 128, 256 at
# d 64) in rings of 64-96 KB (two or three CTAs per SM), or, for pages that such a block would straddle, 64-key
# blocks in the same ring bytes (a box per page in pages of 16 or 32 rows). TMA takes the cache's address arithmetic
# off the warps, which is what held the cp.async kernel's e4m3 blocks below memory speed (docs/perf-notes.md, "e4m3
# decode on the TMA kernel").
TMA_FP8_CONFIGS = {64: (DecodeConfig(1, 256, 2, tma=True), DecodeConfig(1, 64, 8, tma=True)),
                   128: (DecodeConfig(1, 128, 3, tma=True), DecodeConfig(1, 64, 6, tma=True))}


def fused_combine(splits: int) -> bool:
    """The TMA kernel merges `splits` splits itself."""
    return 1 < splits <= settings.current().decode_fused_max_splits


def pdl_applies(arch: str) -> bool:
    """decode_combine launched as a programmatic dependent of the decode kernel (sm_90: it starts while the decode
    kernel's last CTAs finish, cuflash.launcher's `overlap`); the pdl setting."""
    return settings.current().pdl and arch.startswith("sm_9")


def evict_first(kv_bytes: int) -> bool:
    return kv_bytes <= settings.current().decode_evict_first_mb * 2**20


# A 64-key block of the TMA kernel may span 2 or 4 pages (pages of 32 or 16 rows), one box per page and panel, where
# each box holds at least 2 KB (not e4m3 at d = 64 in pages of 16: 1 KB boxes ran 1.4x slower than the cp.async
# kernel there); larger blocks lie inside one page. docs/perf-notes.md, "decode in pages of 16 and 32 rows".
PAGE_BOX_BLOCK_N = 64
PAGE_BOX_CHOICES = (2, 4)
MIN_BOX_BYTES = 2048


def page_boxes(page_size: int, block_n: int, row_bytes: int) -> int:
    """Boxes per panel of a TMA block of `block_n` keys over a cache in pages of `page_size` rows (0: contiguous)
    whose panels' rows are `row_bytes` long: 1 where each block lies inside one page, 2 or 4 where it is made of whole
    pages (PAGE_BOX_CHOICES), 0 where the TMA kernel does not read such pages."""
    if page_size % block_n == 0:
        return 1
    boxes = block_n // page_size if 0 < page_size and block_n % page_size == 0 else 0
    ok = block_n == PAGE_BOX_BLOCK_N and boxes in PAGE_BOX_CHOICES and page_size * row_bytes >= MIN_BOX_BYTES
    return boxes if ok else 0


def tma_fp8_config(headdim: int, page_size: int) -> DecodeConfig | None:
    """The TMA kernel's config over an e4m3 cache: the first of TMA_FP8_CONFIGS[headdim] whose blocks lie inside one
    page (page_size 0: a contiguous cache), else one whose blocks are made of whole pages (page_boxes), or None."""
    configs, row = TMA_FP8_CONFIGS.get(headdim, ()), min(headdim, 128)  # a box's row: a panel, or a d-byte row
    inside = next((c for c in configs if page_size % c.block_n == 0), None)
    return inside or next((dataclasses.replace(c, page_boxes=n) for c in configs
                           if (n := page_boxes(page_size, c.block_n, row))), None)


def tma_applies(arch: str, headdim: int, packed_rows: int, page_size: int, fp8: bool = False) -> bool:
    """page_size 0: a contiguous cache; fp8: an e4m3 cache."""
    return (settings.current().decode_tma and arch == "sm_90a" and headdim in TMA_HEADDIMS and packed_rows <= 16
            and (tma_fp8_config(headdim, page_size) is not None if fp8
                 else page_boxes(page_size, TMA_BLOCK_N, 128) > 0))


def tma_config(stages: int | None = None, fp8_headdim: int = 0, page_size: int = 0) -> DecodeConfig:
    """The TMA kernel's config (the caller checked tma_applies): over a 16-bit cache, 64-key blocks in `stages` slots
    (the decode_tma_stages setting), a box per page in pages of 16 or 32 rows; over an e4m3 cache of head dim
    `fp8_headdim` in pages of `page_size` rows, tma_fp8_config's."""
    if fp8_headdim:
        return tma_fp8_config(fp8_headdim, page_size)
    return DecodeConfig(1, TMA_BLOCK_N, stages or settings.current().decode_tma_stages, tma=True,
                        page_boxes=max(1, page_boxes(page_size, TMA_BLOCK_N, 128)))  # 16-bit rows: 128-byte panels


def decode_config(headdim: int, packed_rows: int, fp8: bool = False) -> DecodeConfig:
    """packed_rows = seqlen_q * (nheads // nheads_k): the rows of one KV head's GQA group. An e4m3 cache (`fp8`)
    keeps the 16-bit config's ring bytes (so as many CTAs per SM): up to 16 rows in blocks of twice the keys where
    that leaves at least 3 stages, else in as many more stages. (e4m3 decode is bound by the latency of a block's
    step, not by memory: at d = 128, 128-key blocks in 3 stages ran 5% faster than 64-key blocks in 6, and blocks
    that cost a CTA per SM 35-50% slower; docs/perf-notes.md, "e4m3 decode".)"""
    d = plan.compiled_headdim(headdim)
    config = DECODE_TABLE[d][0 if packed_rows <= 16 else 1]
    if not fp8:
        return config
    ring = config.stages * config.block_n * plan.smem_row_bytes(d)
    row = e4m3_row_bytes(d)
    if config.row_warps == 1 and ring // (2 * config.block_n * row) >= 3:
        return dataclasses.replace(config, block_n=2 * config.block_n, stages=ring // (2 * config.block_n * row))
    return dataclasses.replace(config, stages=min(FP8_MAX_STAGES, ring // (config.block_n * row)))


FP8_MAX_STAGES = 8


def e4m3_row_bytes(headdim: int) -> int:
    """Shared-memory bytes of an e4m3 K/V row: d bytes in whole 128-byte panels, or 64 dense at d = 64
    (DecodeTraits::NARROW)."""
    return 64 if headdim == 64 else plan.smem_row_bytes(headdim // 2)


@dataclass(frozen=True)
class DecodeSpec:
    """One compiled decode kernel."""

    dtype: str
    headdim: int
    config: DecodeConfig
    score_mod: bool
    fp8: bool = False  # e4m3 cache

    source = "decode.cu"
    threads = 128

    @property
    def name(self) -> str:
        c = self.config
        return (f"decode_{self.dtype}_d{self.headdim}_r{c.row_warps}n{c.block_n}s{c.stages}"
                f"{'_tma' if c.tma else ''}{f'_b{c.page_boxes}' if c.page_boxes > 1 else ''}"
                f"{'_mod' if self.score_mod else ''}{'_e4m3' if self.fp8 else ''}")

    @property
    def template(self) -> str:
        c = self.config
        if c.tma:
            return plan.template("decode_tma_kernel", self.dtype, (self.headdim, c.block_n, c.stages, c.page_boxes),
                                 (self.score_mod, True) if self.fp8 else (self.score_mod,))
        return plan.template("decode_kernel", self.dtype, (self.headdim, c.row_warps, c.block_n, c.stages),
                             (self.score_mod, True) if self.fp8 else (self.score_mod,))

    @property
    def smem_bytes(self) -> int:
        # DecodeTraits::SMEM_BYTES: Q tile and the K/V ring, or the merge buffer if larger.
        c = self.config
        row = plan.smem_row_bytes(self.headdim)
        kv_row = e4m3_row_bytes(self.headdim) if self.fp8 else row
        tiles = 16 * c.row_warps * row + c.stages * 2 * c.block_n * kv_row
        merge = 64 * (self.headdim + 4 + 2) * 4
        if c.tma:  # the ring's mbarriers after it, and 1 KB of slack to align the tiles to 1024 bytes
            return max(tiles + 8 * c.stages, merge) + 1024
        return max(tiles, merge)


class DecodeAuxSpec(plan.HelperSpec):
    """A helper kernel of decode (cuda_src/decode_aux.cu): decode_append or decode_combine."""

    source = "decode_aux.cu"


def _fp8_page_box_configs(headdim: int) -> tuple:
    """The TMA kernel's e4m3 configs for pages of 32 and 16 rows (boxes per page), where it reads them."""
    return tuple(c for c in (tma_fp8_config(headdim, ps) for ps in (32, 16)) if c is not None)


def all_specs(arch: str) -> list:
    """Every decode specialization the planner can choose on `arch`."""
    specs = [DecodeAuxSpec(k, dtype) for k in ("decode_append", "decode_combine") for dtype in ("fp16", "bf16")]
    for dtype in ("fp16", "bf16"):
        for d in plan.COMPILED_HEADDIMS:
            for rows in (1, 64):
                for mod in (False, True):
                    specs += [DecodeSpec(dtype, d, decode_config(d, rows, fp8), mod, fp8) for fp8 in (False, True)]
        if arch == "sm_90a":
            specs += [DecodeSpec(dtype, d, tma_config(stages, page_size=ps), mod) for d in TMA_HEADDIMS
                      for stages in TMA_STAGE_CHOICES for ps in (0, 32, 16) for mod in (False, True)]
            specs += [DecodeSpec(dtype, d, config, mod, True) for d in TMA_HEADDIMS
                      for config in dict.fromkeys(TMA_FP8_CONFIGS[d] + _fp8_page_box_configs(d))
                      for mod in (False, True)]
    return specs


def num_splits_heuristic(work: int, slots: int, n_blocks: int, max_splits: int = DECODE_MAX_SPLITS) -> int:
    """Split count for `work` CTAs (batch x KV heads x row tiles) over `n_blocks` KV blocks, `slots` CTAs
    resident at once. Like FlashAttention-2: no split once the work fills 80% of the slots, and a count that
    gives some split as many blocks as one fewer split would is never taken. Unlike FA2 (the smallest count
    within 85% of the best wave efficiency), the largest count that still fits one wave: decode is bound by
    memory and by the bytes each CTA keeps in flight, so every idle slot costs bandwidth (FA2's rule leaves
    32 of 264 slots idle for batch 1 x 8 KV heads)."""
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
def _plan_decode(problem, left: int, right: int, score_mod: bool, num_splits: int, sm_count: int, tma: bool,
                 tma_stages: int, fp8: bool, page_size: int) -> DecodeLaunch:
    dtype = plan.dtype_tag(problem.dtype)
    d = plan.compiled_headdim(problem.headdim)
    group = problem.nheads // problem.nheads_k
    config = (tma_config(tma_stages, d if fp8 else 0, page_size) if tma
              else decode_config(d, problem.seqlen_q * group, fp8))
    spec = DecodeSpec(dtype, d, config, score_mod, fp8)
    m_tiles = math.ceil(problem.seqlen_q * group / (16 * spec.config.row_warps))
    n_blocks = max(1, math.ceil(problem.seqlen_k / spec.config.block_n))
    if num_splits == 0:
        ctas_per_sm = max(1, plan.SMEM_PER_SM // (spec.smem_bytes + 1024))
        num_splits = num_splits_heuristic(problem.batch * problem.nheads_k * m_tiles, sm_count * ctas_per_sm,
                                          n_blocks)
    splits = max(1, min(num_splits, n_blocks, DECODE_MAX_SPLITS))
    return DecodeLaunch(spec, plan.check_grid((m_tiles * splits, problem.nheads_k, problem.batch)), splits)


def plan_decode(problem, left: int, right: int, score_mod: bool, num_splits: int, sm_count: int,
                tma: bool = False, fp8: bool = False, page_size: int = 0) -> DecodeLaunch:
    """Decode kernel, its grid (row tiles x splits, KV heads, batch) and split count. `problem.seqlen_k` is
    the most keys a row can see (the cache capacity, or the known length); `num_splits` 0 picks by heuristic.
    `tma`: the TMA kernel (the caller checked tma_applies); `fp8`: an e4m3 cache; `page_size`: its pages' rows
    (0: contiguous), which pick the TMA kernel's blocks and boxes."""
    return _plan_decode(problem, left, right, score_mod, num_splits, sm_count, tma,
                        settings.current().decode_tma_stages, fp8, page_size if tma else 0)


plan_decode.cache_clear = _plan_decode.cache_clear  # for tables changed in place (benchmarks/tune_decode.py)


PARAMS_DTYPE = plan.struct(
    ("q", "k_cache", "v_cache", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "cache_seqlens",
     "cache_batch_idx", "block_table", "alibi", "split_counters", "rotary_cos", "rotary_sin", "cache_leftpad",
     "q_rot", "k_descale", "v_descale"),
    plan.stride_fields("q", "k", "v", "kn", "vn", "o") + ["alibi_batch_stride", "block_table_stride"],
    ("batch", "seqlen_q", "seqlen_new_k", "cache_len", "nheads", "heads_per_kv", "headdim", "page_size",
     "window_left", "window_right", "num_splits", "kv_evict_first", "cache_capacity", "cache_rows", "rotary_dim",
     "rotary_interleaved", "rotary_q_per_row", "seqlen_ro", "cache_fp8", "descale_batch_stride",
     "descale_head_stride"),
    ("scale_log2", "mod_scale", "softcap"))

# DecodeTmaParams (decode.cu): DecodeParams, then the K and V caches' tensor maps on 64-byte boundaries.
TMA_MAPS_OFFSET = -(-PARAMS_DTYPE.itemsize // 64) * 64
TMA_PARAMS_DTYPE = np.dtype({
    "names": list(PARAMS_DTYPE.names) + ["k_map", "v_map"],
    "formats": [PARAMS_DTYPE.fields[n][0] for n in PARAMS_DTYPE.names] + ["V128", "V128"],
    "offsets": [PARAMS_DTYPE.fields[n][1] for n in PARAMS_DTYPE.names] + [TMA_MAPS_OFFSET, TMA_MAPS_OFFSET + 128],
    "itemsize": TMA_MAPS_OFFSET + 256})

# DecodeParams starts with 20 pointers (q .. v_descale, params.cuh); every kernel of a call (append, decode,
# combine) takes the same struct, so one KernelCall launches them all.
POINTERS = PARAMS_DTYPE.names[:20]
_calls: dict = {}         # call signature -> DecodeCall: checks, plan and constant params, done once
_counters: dict = {}      # (device id, stream pointer) -> int32 zeros: the split counters of calls on that stream
_retired: list = []       # outgrown counter buffers, kept: a kernel still queued may use one


@settings.on_change
def _forget() -> None:
    _calls.clear()


def split_counters(device_id: int, stream_ptr: int, tiles: int) -> int:
    """A zeroed int32 counter per row tile for the fused combine, on this stream. The last CTA of a tile resets its
    counter, so a buffer is zero again for the next call on the same stream; calls on other streams, which may run
    at the same time, get their own. The buffer is zeroed on the stream itself, ahead of the call's launches.
    Not for a stream that is being captured into a graph: such a call takes its counters from its own allocation
    (:func:`run`)."""
    buf = _counters.get((device_id, stream_ptr))
    if buf is None or buf.size < tiles:
        import cupy
        if buf is not None:
            _retired.append(buf)
        # Allocated on the stream that zeroes and uses it: CuPy's pool then hands out a block whose earlier work is
        # ordered before the zeroing (a block from another stream's pool, or an allocator that fills new blocks on
        # its current stream, could write over the zeros after they land).
        with runtime.on(stream_ptr):
            buf = cupy.ndarray((max(tiles, 2 * (buf.size if buf is not None else 512)),), dtype=np.int32)
        cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, stream_ptr)
        _counters[device_id, stream_ptr] = buf
    return buf.data.ptr


class DecodeCall(NamedTuple):
    device_id: int
    launch: KernelCall        # append (when k/v are given), decode, combine (when split), one struct
    lse_shape: tuple
    nbytes: int               # one allocation per call: out | lse | partial O | partial lse | split counters
    lse_offset: int           # byte offsets into it; partial_offset 0: one split, no workspace
    partial_offset: int
    lse_partial_offset: int
    counter_offset: int       # where a call captured into a graph keeps its split counters (run)
    q_rot_offset: int         # rotary embedding: where decode_append writes the rotated queries; 0: none
    seqlens_array: Callable   # cache_seqlens -> the array to point at, or None
    maps: tuple | None = None  # the TMA kernel: (k map, v map) encoders, ptr -> 128 bytes; None: cp.async kernel
    counter_tiles: int = 0    # the fused combine: split counters needed (row tiles x KV heads x batch); 0: none


def prepare(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
            window_size, softcap, alibi_slopes, num_splits, return_lse, rotary_cos=None, rotary_sin=None,
            rotary_interleaved=True, cache_leftpad=None, k_descale=None, v_descale=None) -> DecodeCall:
    """Everything about a decode call that depends only on shapes, strides, dtypes and options."""
    problem = checks.check_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                   cache_batch_idx=cache_batch_idx, block_table=block_table,
                                   num_splits=num_splits, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                   rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                   rotary_interleaved=rotary_interleaved, cache_leftpad=cache_leftpad,
                                   k_descale=k_descale, v_descale=v_descale)
    runtime.require_device_arrays(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, alibi_slopes=alibi_slopes,
                                  rotary_cos=rotary_cos, rotary_sin=rotary_sin, k_descale=k_descale,
                                  v_descale=v_descale)
    fp8 = k_cache.dtype == np.uint8  # an e4m3 cache (the checks allow uint8 only so)
    seqlens_is_array = not (cache_seqlens is None or checks.is_int(cache_seqlens))
    runtime.require_device_index_arrays(cache_seqlens=cache_seqlens if seqlens_is_array else None,
                                        cache_batch_idx=cache_batch_idx, block_table=block_table,
                                        cache_leftpad=cache_leftpad)
    runtime.require_gpu()  # after the checks, which need no GPU; once per process
    options = resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                      alibi_slopes=alibi_slopes)
    seqlen_new_k = 0 if k is None else k.shape[1]
    capacity = problem.seqlen_k
    if cache_seqlens is None:
        cache_len = capacity
    else:
        cache_len = 0 if seqlens_is_array else int(cache_seqlens)
    known_keys = capacity if seqlens_is_array else cache_len + seqlen_new_k  # bounds the split count
    device_id = q.device.id
    # the TMA kernel's blocks start at multiples of its block in the cache: not with cache_leftpad's offsets
    maps = None if cache_leftpad is not None else tma_maps(problem, k_cache, v_cache, block_table,
                                                           build.device_arch(device_id), fp8)
    launch = plan_decode(dataclasses.replace(problem, seqlen_k=max(known_keys, 1)), options.left, options.right,
                         options.score_mod, int(num_splits), build.sm_count(device_id), maps is not None, fp8,
                         k_cache.shape[1] if block_table is not None else 0)
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.headdim

    p = np.zeros((), dtype=PARAMS_DTYPE if maps is None else TMA_PARAMS_DTYPE)
    plan.set_strides(p, q=q, k=k_cache, v=v_cache, o=q)  # out is allocated contiguous like q's shape
    p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"] = sq * h * d, h * d, d
    if k is not None:
        plan.set_strides(p, kn=k, vn=v)
    p["alibi_batch_stride"] = checks.alibi_batch_stride(alibi_slopes)
    p["block_table_stride"] = checks.elem_strides(block_table)[0] if block_table is not None else 0
    p["batch"], p["seqlen_q"], p["seqlen_new_k"], p["cache_len"] = b, sq, seqlen_new_k, cache_len
    p["nheads"], p["heads_per_kv"], p["headdim"] = h, h // problem.nheads_k, d
    p["page_size"] = k_cache.shape[1] if block_table is not None else 0
    p["window_left"], p["window_right"] = options.left, options.right
    p["num_splits"] = launch.splits
    kv_bytes = 2 * b * max(known_keys, 1) * problem.nheads_k * d * k_cache.itemsize  # what the call reads at most
    p["kv_evict_first"] = int(maps is not None and evict_first(kv_bytes))
    p["cache_capacity"], p["cache_rows"] = capacity, k_cache.shape[0]
    if rotary_cos is not None:  # flash-attn's rule: per-query positions where the mask makes the queries ordered
        p["rotary_dim"], p["seqlen_ro"] = 2 * rotary_cos.shape[1], rotary_cos.shape[0]
        p["rotary_interleaved"] = int(bool(rotary_interleaved))
        p["rotary_q_per_row"] = int(bool(causal) or tuple(window_size) != (-1, -1))
    for name, value in options.scales.items():
        p[name] = value
    p["cache_fp8"] = int(fp8)
    stride = forward_fp8.descale_stride(problem, (k_descale, v_descale))
    p["descale_batch_stride"], p["descale_head_stride"] = stride, int(stride > 0)

    dtype = launch.spec.dtype
    launches = []
    if k is not None:
        append = DecodeAuxSpec("decode_append", dtype)
        chunks = (b * seqlen_new_k * problem.nheads_k + (b * sq * h if rotary_cos is not None else 0)) * (d // 8)
        launches.append((build.get_kernel(append, device_id), (min(-(-chunks // append.threads), 65535),),
                         (append.threads,), 0))
    launches.append((build.get_kernel(launch.spec, device_id), launch.grid, (launch.spec.threads,),
                     launch.spec.smem_bytes))
    partial_rows = launch.splits * b * h * sq if launch.splits > 1 else 0
    fused = maps is not None and fused_combine(launch.splits)  # the TMA kernel merges its own splits
    counter_tiles = launch.grid[0] // launch.splits * launch.grid[1] * launch.grid[2] if fused else 0
    if partial_rows and not fused:
        combine = DecodeAuxSpec("decode_combine", dtype)
        launches.append((build.get_kernel(combine, device_id), (b * h * sq,), (combine.threads,), 0,  # a CTA a row
                         pdl_applies(build.device_arch(device_id))))
    align = lambda n: -(-n // 256) * 256  # noqa: E731
    lse_offset = align(q.size * q.itemsize)
    partial_offset = align(lse_offset + (b * h * sq * 4 if return_lse else 0)) if partial_rows else 0
    lse_partial_offset = partial_offset + partial_rows * d * 4
    counter_offset = align(lse_partial_offset + partial_rows * 4 if partial_rows
                           else partial_offset or align(lse_offset + b * h * sq * 4))
    q_rot_offset = align(counter_offset + 4 * counter_tiles) if rotary_cos is not None else 0
    nbytes = q_rot_offset + q.size * q.itemsize if q_rot_offset else counter_offset + 4 * counter_tiles
    with runtime.device(device_id):  # the kernels' functions are taken on the device they run on
        launch = KernelCall(launches, p, POINTERS)
    return DecodeCall(device_id, launch, (b, h, sq), nbytes, lse_offset, partial_offset, lse_partial_offset,
                      counter_offset, q_rot_offset, (lambda x: x) if seqlens_is_array else (lambda x: None), maps,
                      counter_tiles)


def tma_maps(problem, k_cache, v_cache, block_table, arch: str, fp8: bool = False):
    """(k, v) tensor-map encoders for the TMA decode kernel, or None where it does not apply (tma_applies, or cache
    strides TMA refuses). A map covers the whole cache as (head dim, KV heads, rows, cache rows or pages), one box a
    block's rows (a page's, in pages of fewer rows: page_boxes) of a 128-byte panel: 64 columns of a 16-bit cache,
    128 of an e4m3 one; an e4m3 row at d = 64 is one 64-byte box (64-byte swizzle)."""
    page_size = k_cache.shape[1] if block_table is not None else 0
    d = problem.headdim
    if not tma_applies(arch, d, problem.seqlen_q * (problem.nheads // problem.nheads_k), page_size, fp8):
        return None
    config = tma_config(fp8_headdim=d if fp8 else 0, page_size=page_size)
    box_rows = config.block_n // config.page_boxes
    itemsize = np.dtype(k_cache.dtype).itemsize
    swizzle = min(d * itemsize, 128)  # a box's row: a 128-byte panel, or a whole 64-byte e4m3 row
    layouts = []
    for x in (k_cache, v_cache):
        dtype, dims, strides, box = tma.map_layout(x, box_rows)
        layouts.append((dtype, dims, strides, (swizzle // itemsize,) + box[1:]))
    try:
        for layout in layouts:
            tma.check_tiled(0x10000, *layout, swizzle)
    except ValueError:
        return None
    return tuple(tma.encoder(*layout, swizzle=swizzle) for layout in layouts)


def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, num_splits, return_lse, stream,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_leftpad=None,
                           k_descale=None, v_descale=None):
    """:func:`cuflash.attention_with_kvcache`: checks, options and plan once per call signature (prepare), then
    one allocation and the launches."""
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
            window_size, softcap, alibi_slopes, num_splits, return_lse, rotary_cos, rotary_sin, rotary_interleaved,
            cache_leftpad, k_descale, v_descale)
    key = checks.call_signature(args)
    prep = _calls.get(key) if key is not None else None
    if prep is None:
        prep = runtime.keep(_calls, key, prepare(*args))
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if x is not None and x.data.ptr % 16:
            raise ValueError(f"{name}: must be 16-byte aligned; data pointer {x.data.ptr:#x}")

    import cupy
    with runtime.device(prep.device_id), runtime.on(stream):
        # one allocation: out, then lse, then the split workspace (partial O, partial lse), then graph counters,
        # then the rotated queries
        mem = cupy.cuda.alloc(prep.nbytes)
        out = cupy.ndarray(q.shape, q.dtype, memptr=mem)
        lse = cupy.ndarray(prep.lse_shape, np.float32, memptr=mem + prep.lse_offset) if return_lse else None
        current = cupy.cuda.get_current_stream()
        run(prep, current.ptr, mem.ptr, q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, runtime.ptr(k),
            runtime.ptr(v), runtime.ptr(prep.seqlens_array(cache_seqlens)), runtime.ptr(cache_batch_idx),
            runtime.ptr(block_table), runtime.ptr(alibi_slopes), runtime.ptr(lse),
            bool(prep.counter_tiles) and current.is_capturing(), runtime.ptr(rotary_cos), runtime.ptr(rotary_sin),
            runtime.ptr(cache_leftpad), runtime.ptr(k_descale), runtime.ptr(v_descale))
    return (out, lse) if return_lse else out


def run(prep: DecodeCall, stream_ptr: int, mem: int, q: int, k_cache: int, v_cache: int, k: int, v: int,
        cache_seqlens: int, cache_batch_idx: int, block_table: int, alibi_slopes: int, lse: int,
        capturing: bool = False, rotary_cos: int = 0, rotary_sin: int = 0, cache_leftpad: int = 0,
        k_descale: int = 0, v_descale: int = 0) -> None:
    """The launches of a prepared call on stream `stream_ptr`, given data pointers (0 where absent), `mem`, the
    call's allocation of ``prep.nbytes`` (out, then the split workspace and the rotated queries), and `lse` (0: none;
    its place in `mem` or elsewhere). prep's device must be current.

    ``capturing``: the stream is being captured into a CUDA graph. The split counters then live in `mem` (zeroed by
    a memset in the graph, owned by whoever owns `mem`) instead of the stream's persistent buffer, so a graph holds
    no memory that outlives it and two graphs never share counters."""
    o_partial = mem + prep.partial_offset if prep.partial_offset else 0
    lse_partial = mem + prep.lse_partial_offset if prep.partial_offset else 0
    counters = 0
    if prep.counter_tiles:
        if capturing:
            import cupy
            counters = mem + prep.counter_offset
            cupy.cuda.runtime.memsetAsync(counters, 0, 4 * prep.counter_tiles, stream_ptr)
        else:
            counters = split_counters(prep.device_id, stream_ptr, prep.counter_tiles)
    pointers = (q, k_cache, v_cache, k, v, mem, lse, o_partial, lse_partial, cache_seqlens, cache_batch_idx,
                block_table, alibi_slopes, counters, rotary_cos, rotary_sin, cache_leftpad,
                mem + prep.q_rot_offset if prep.q_rot_offset else 0, k_descale, v_descale)
    if prep.maps is None:
        prep.launch(stream_ptr, *pointers)
    else:  # the TMA kernel: the caches' tensor maps (cached per address) after the struct's plain fields
        k_map, v_map = prep.maps
        prep.launch.call_with_tail(stream_ptr, TMA_MAPS_OFFSET, k_map(k_cache) + v_map(v_cache), *pointers)

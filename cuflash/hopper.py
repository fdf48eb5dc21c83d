"""Experimental launcher of the Hopper forward (``cuda_src/fwd_sm90.cu``): TMA tensor maps and the kernel's
parameters, behind the call interface of the portable forward (``ForwardCall``). The planner chooses it for the
calls it covers once ``plan.SM90_FORWARD["enabled"]`` (opt-in: ``CUFLASH_SM90=1``); ``tests/gpu/test_sm90.py``
compares each variant with the reference, directly and through ``cuflash.attention`` (issue 8). Head dims 64
128 and 256, fp16/bf16, causal and local windows, GQA, softcap, ALiBi, lse; padded and packed (varlen) batches.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from . import build, checks, plan, tma
from .launcher import KernelCall

HEADDIMS = (64, 128, 256)
BLOCK_M, BLOCK_N = 128, 64


@dataclass(frozen=True)
class FwdSm90Spec:
    dtype: str     # "fp16" | "bf16"
    headdim: int   # 64 | 128 | 256
    band: bool
    block_n: int = BLOCK_N          # keys per block: 64, 128 or 176 (S by wgmma m64n128, m64n176)
    consumers: int = 2              # consumer warpgroups of 64 query rows (3: warp-specialized, no ping-pong)
    persistent: bool = False        # one CTA per SM walking the tiles (warp-specialized only)
    warp_specialized: bool = False  # a producer warpgroup and "empty" mbarriers (fwd_sm90.cu, WS)
    stages: int = 2                 # K/V ring slots (2 without warp specialization)
    score_mod: bool = False         # softcap / ALiBi
    pingpong: bool = False          # the consumer warpgroups take turns issuing GEMMs (warp-specialized only)
    split: bool = False             # tiles whose rows fit in 64 worked by all three consumer warpgroups (SPLIT)

    source = "fwd_sm90.cu"

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + (1 if self.warp_specialized else 0))

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def name(self) -> str:
        ws = (f"_ws{self.stages}" if self.warp_specialized else "") + ("_pp" if self.pingpong else "")
        ws += f"_n{self.block_n}" if self.block_n != BLOCK_N else ""
        ws += f"_m{self.block_m}" if self.block_m != BLOCK_M else ""
        ws += "_persistent" if self.persistent else ""
        ws += "_split" if self.split else ""
        return (f"fwd_sm90_{self.dtype}_d{self.headdim}{ws}{'_band' if self.band else ''}"
                f"{'_mod' if self.score_mod else ''}")

    @property
    def template(self) -> str:
        return plan._template("fwd_sm90_kernel", self.dtype, (self.headdim, self.block_n, self.stages, self.consumers),
                              (self.band, self.warp_specialized, self.score_mod, self.pingpong, self.persistent,
                               self.split))

    def _smem_bytes(self, o_tile: bool, q_bufs: int = 1) -> int:
        """FwdSm90::SMEM_BYTES: Q tiles, K and V slots[, O], mbarriers (Q full[, empty] per Q tile, K and V full
        and empty per slot), room to align to 1024."""
        return ((self.block_m * (o_tile + q_bufs) + 2 * self.stages * self.block_n) * self.headdim * 2
                + (q_bufs * (1 + self.persistent) + 4 * self.stages) * 8 + 1024)

    @property
    def o_tile(self) -> bool:  # FwdSm90::O_TILE: the persistent kernel's own staging tile for O, where it fits
        return self.persistent and self._smem_bytes(True) <= 227 * 1024

    @property
    def q_bufs(self) -> int:  # FwdSm90::Q_BUFS: more Q tiles for the persistent kernel where they fit (d 64: three)
        if self.o_tile and self.headdim == 64 and self._smem_bytes(True, 3) <= 227 * 1024:
            return 3
        return 2 if self.o_tile and self._smem_bytes(True, 2) <= 227 * 1024 else 1

    @property
    def tile_slots(self) -> int:  # FwdSm90::TILE_SLOTS: the tile ring of the OVERLAP kernels (HANDED_TILES)
        overlap = self.persistent and self.q_bufs >= 2 and self.headdim == 64 and self.consumers == 2
        return 8 if overlap else 0

    @property
    def smem_bytes(self) -> int:  # (+ the split's max and sum per row of warpgroups 1 and 2; + the tile ring: 64
        # bytes and two mbarriers per entry)
        return (self._smem_bytes(self.o_tile, self.q_bufs) + (2 * 64 * 8 if self.split else 0)
                + self.tile_slots * (64 + 2 * 8))


# The variants: the lockstep first version; the warp-specialized one with a deeper ring (4 slots; 2 at d = 256,
# whose Q and two slots already take 192 KB of shared memory); that one with ping-pong turns between its two
# consumer warpgroups; and those two with 128-key blocks (S by wgmma m64n128: half the shared-memory reads of Q per
# flop, half the softmax passes' fixed cost per key), 4 slots at d = 64 and 3 at d = 128 (Q and three slots: 225 KB).
# At d = 256 the _n128 variants keep 64-key blocks: O's 128 registers and S's 64 would not fit beside P's.
# ws3_n128: ws_n128 with three consumer warpgroups (192 query rows per CTA, 160 registers each: FA3's d = 64 tile)
# at d = 64 without a score mod; elsewhere (O, or softcap/ALiBi's registers, would not fit in 160 beside S and P:
# ptxas spills) it is ws_n128.
# ws_n128_p: ws_n128 made persistent: one CTA per SM walks the tiles, so the producer loads the next tile's Q and
# keys while the consumers finish the last one (short sequences: prologue and epilogue overlap). (ws3_n128 made
# persistent with the overlapped tile start spills 200-336 bytes: the next tile's S does not fit in 160 registers
# beside P and O.)
# ws3_n128_p_split: ws3_n128_p where a tile whose rows fit in 64 (1024 = 5 x 192 + 64 queries) is worked by all
# three consumer warpgroups, each on every third key block, and merged in warpgroup 0 (fwd_sm90.cu SPLIT); d 64
# without a score mod only, elsewhere that head dim's ws3_n128_p.
# ws3_n128_p: ws3_n128 made persistent, without the overlapped tile start (fwd_sm90.cu OVERLAP is the two-warpgroup
# kernel's) but with three Q tiles, so the producer loads the next tiles' Q during this one (d 64 only; elsewhere
# ws_n128_p).
# pingpong_n128_p: pingpong_n128 made persistent. The turns stay balanced from tile to tile: each tile's first turn is
# warpgroup 0's, and warpgroup 1 skips its last hand-over, so every arrival on the two named barriers is consumed
# before the next tile's.
# lockstep_n128: the lockstep kernel with 128-key blocks (half the CTA barriers per key), 64 at d = 256.
# _s2: a variant with a two-slot ring (K and V handed back separately make two slots enough to keep loads ahead;
# at d = 128 the slot saved leaves room for the persistent kernel's own O staging tile). Any variant takes the
# suffix; VARIANTS lists those the planner's tables use (plan.SM90_SHORT_VARIANTS).
# pingpong_n176: FA3's d = 128 tile, 176-key blocks and two slots (other head dims and score mods: pingpong_n128).
# Measured against pingpong_n128 at d = 128 from 2k keys and not taken (docs/perf-notes.md, session 14); tests run it
# as every variant.
VARIANTS = ("lockstep", "ws", "pingpong", "ws_n128", "pingpong_n128", "ws3_n128", "ws_n128_p", "lockstep_n128",
            "pingpong_n128_p", "pingpong_n128_s2", "pingpong_n128_p_s2", "ws_n128_p_s2", "pingpong_n176", "ws3_n128_p",
            "ws3_n128_p_split")


def variant_options(variant: str, headdim: int, score_mod: bool = False) -> dict:
    """FwdSm90Spec's warp_specialized, stages, pingpong, block_n and consumers for a variant of VARIANTS at a head
    dim, with or without a score mod."""
    if variant.endswith("_s2") and variant[:-3] in VARIANTS:
        return dict(variant_options(variant[:-3], headdim, score_mod), stages=2)
    if variant == "lockstep":
        return dict(warp_specialized=False, stages=2)
    if variant == "lockstep_n128":
        return dict(warp_specialized=False, stages=2, block_n=128 if headdim <= 128 else 64)
    if variant in ("ws", "pingpong"):
        return dict(warp_specialized=True, stages=4 if headdim <= 128 else 2, pingpong=variant == "pingpong")
    if variant == "ws3_n128_p_split":
        options = variant_options("ws3_n128_p", headdim, score_mod)
        return dict(options, split=True) if options.get("consumers") == 3 else options
    if variant in ("ws_n128_p", "pingpong_n128_p", "ws3_n128_p"):  # the persistent kernel of that variant
        return dict(variant_options(variant[:-len("_p")], headdim, score_mod), persistent=True)
    if variant == "ws3_n128":
        three = headdim == 64 and not score_mod
        return dict(variant_options("ws_n128", headdim), **(dict(consumers=3) if three else {}))
    if variant == "pingpong_n176":  # FA3's d = 128 tile: 176-key blocks, two slots (214,088 bytes at d = 128)
        if headdim != 128 or score_mod:  # (softcap/ALiBi beside S's 88 registers: 4 bytes of spills since session 17)
            return variant_options("pingpong_n128", headdim)
        return dict(warp_specialized=True, stages=2, pingpong=True, block_n=176)
    if variant in ("ws_n128", "pingpong_n128"):
        if headdim > 128:
            return variant_options(variant[:-len("_n128")], headdim)
        return dict(warp_specialized=True, stages=4 if headdim <= 64 else 3, pingpong=variant == "pingpong_n128",
                    block_n=128)
    raise ValueError(f"variant: one of {VARIANTS}, not {variant!r}")


def variant_spec(variant: str, dtype: str, headdim: int, band: bool, score_mod: bool) -> FwdSm90Spec:
    """The specialization a variant of VARIANTS compiles for these options."""
    return FwdSm90Spec(dtype, headdim, band, score_mod=score_mod, **variant_options(variant, headdim, score_mod))


# FwdSm90Params (fwd_sm90.cu): four 64-byte-aligned tensor maps (q, k, v, o), the pointers o, lse, alibi,
# cu_seqlens_q, cu_seqlens_k (with the maps, the struct's head a call writes), strides, ints, scales, batch,
# o_tma, the persistent walk's chunk sizes and divisions (multiplier, shift: fast_div); 704 bytes.
_POINTER_NAMES = ("o", "lse", "alibi", "cu_seqlens_q", "cu_seqlens_k")
_I64S = ("o_batch_stride", "o_row_stride", "o_head_stride", "lse_batch_stride", "lse_head_stride",
         "alibi_batch_stride")
_INTS = ("seqlen_q", "seqlen_k", "nheads", "heads_per_kv", "window_left", "window_right")
_FLOATS = ("scale_log2", "mod_scale", "softcap")
_DIVISIONS = tuple(f"by_{n}_{part}" for n in ("m_blocks", "heads", "chunk_tiles", "chunk", "chunk_last")
                   for part in ("mul", "shift"))
PARAMS_DTYPE = np.dtype({
    "names": ["q", "k", "v", "o_map", *_POINTER_NAMES, *_I64S, *_INTS, *_FLOATS, "batch", "o_tma", "chunk",
              "chunk_last", *_DIVISIONS],
    "formats": (["V128"] * 4 + [np.uint64] * 5 + [np.int64] * 6 + [np.int32] * 6 + [np.float32] * 3 + [np.int32] * 4
                + [np.uint32] * len(_DIVISIONS)),
    "offsets": [0, 128, 256, 384] + [512 + 8 * i for i in range(11)] + [600 + 4 * i for i in range(15 + 10)],
    "itemsize": 704})


def fast_div(d: int) -> tuple:
    """(multiplier, shift) of types.cuh FastDiv for the divisor d (1 <= d < 2^31): x // d = (umulhi(x, m) + x) >> p."""
    shift = (d - 1).bit_length()
    return ((((1 << shift) - d) << 32) // d + 1) & 0xFFFFFFFF, shift


def _set_walk(p, spec, m_blocks: int, ctas: int) -> None:
    """The persistent walk's fields of FwdSm90Params (its ints already set; the grid kernels never read them):
    chunks of plan.sm90_walk_chunk pairs under a band (unused without one), and the multiplier and shift of each
    division a tile index takes."""
    heads, pairs = int(p["nheads"]), int(p["nheads"]) * int(p["batch"])
    chunk = 1
    if spec.persistent and spec.band:
        chunk = plan.sm90_walk_chunk(ctas, int(p["seqlen_k"]), spec.headdim, int(p["heads_per_kv"]))
    last = pairs - (math.ceil(pairs / chunk) - 1) * chunk
    p["chunk"], p["chunk_last"] = chunk, last
    for name, d in (("m_blocks", m_blocks), ("heads", heads), ("chunk_tiles", chunk * m_blocks), ("chunk", chunk),
                    ("chunk_last", last)):
        p[f"by_{name}_mul"], p[f"by_{name}_shift"] = fast_div(d)


def all_specs() -> list:
    """Every Hopper forward specialization (each variant, head dim, dtype, band, score mod): what the compile test
    checks and scripts/precompile.py --hopper compiles ahead of the GPU tests."""
    return list(dict.fromkeys(  # in order, without repeats (the _n128 variants at d = 256 are the 64-key ones)
        variant_spec(variant, dtype, d, band, mod)
        for variant in VARIANTS for d in HEADDIMS for dtype in ("fp16", "bf16")
        for band in (False, True) for mod in (False, True)))


_POINTERS = struct.Struct(f"{len(_POINTER_NAMES)}Q")  # right after the four maps (offset 512)


class ForwardCall:
    """The Hopper forward behind the call interface of the forward's KernelCall (``cuflash.api.forward_call``):
    ``call(stream, q, k, v, o, lse, alibi, cu_seqlens_q, cu_seqlens_k)`` with data pointers (0 where absent). The
    tensor maps embed q, k, v and o's addresses, so a call encodes them (cached per pointer by cuflash.tma) into the
    head of the struct."""

    __slots__ = ("kernel_call", "maps", "spec")

    def __init__(self, kernel_call: KernelCall, maps: tuple, spec: FwdSm90Spec):
        self.kernel_call, self.maps, self.spec = kernel_call, maps, spec

    def __call__(self, stream: int, q: int, k: int, v: int, o: int, lse: int, alibi: int = 0, cu_seqlens_q: int = 0,
                 cu_seqlens_k: int = 0) -> None:
        q_map, k_map, v_map, o_map = self.maps
        self.kernel_call.launch_head(
            stream,
            q_map(q) + k_map(k) + v_map(v) + o_map(o) + _POINTERS.pack(o, lse, alibi, cu_seqlens_q, cu_seqlens_k))


def _map_layout(x, rows_box: int) -> tuple:
    """(dtype, dims, byte strides, box) of the tensor map of a layout (array or TensorSpec) with any 16-byte-aligned
    strides: padded (batch, seqlen, heads, d) as 4-D (d, heads, seqlen, batch), box (64, 1, rows_box, 1); packed
    (total, heads, d) as 3-D (d, heads, total), box (64, 1, rows_box). One 64-column panel of rows_box rows. An
    axis of extent 1 is only ever read at index 0; its stride is replaced by the contiguous one, which TMA's rules
    always accept."""
    dtype = np.dtype(x.dtype)
    shape, strides = tuple(x.shape), [n * dtype.itemsize for n in checks.elem_strides(x)]
    contiguous = [int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape))]
    strides = [s if n > 1 else c for n, s, c in zip(shape, strides, contiguous)]
    dims = tuple(reversed(shape))                     # innermost first: d, heads, rows[, batch]
    box = (64, 1, rows_box) + (1,) * (len(shape) - 3)
    return dtype, dims, tuple(reversed(strides[:-1])), box


def _encoder(x, rows_box: int):
    """ptr -> the tensor map (128-byte swizzle) of _map_layout(x, rows_box) at that address."""
    return tma.encoder(*_map_layout(x, rows_box), swizzle=128)


def forward_call(problem, q, k, v, out, lse, *, device_id: int, scale: float, left: int, right: int,
                 softcap: float = 0.0, alibi_slopes=None, variant: str) -> ForwardCall:
    """The Hopper forward for these layouts (arrays or TensorSpecs; out and lse contiguous; padded or packed as
    cuflash.api.launch_forward describes) on device `device_id` (current); the window already normalized."""
    score_mod = softcap > 0 or alibi_slopes is not None
    spec = variant_spec(variant, plan.DTYPES[np.dtype(problem.dtype).name][0], problem.headdim,
                        left >= 0 or right >= 0, score_mod)
    b, sq, h = problem.batch, problem.seqlen_q, problem.nheads  # packed: sq is the longest sequence
    p = np.zeros((), dtype=PARAMS_DTYPE)
    p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"] = checks.seq_strides(out)
    p["lse_batch_stride"], p["lse_head_stride"] = checks.lse_strides(lse)
    p["seqlen_q"], p["seqlen_k"], p["nheads"] = sq, problem.seqlen_k, h
    p["heads_per_kv"], p["window_left"], p["window_right"] = h // problem.nheads_k, left, right
    p["alibi_batch_stride"] = checks.alibi_batch_stride(alibi_slopes)
    for name, value in plan.forward_scales(scale, softcap, score_mod).items():
        p[name] = value
    p["batch"] = b
    p["o_tma"] = plan.SM90_EPILOGUE["tma_store"][problem.headdim]  # (the SPLIT kernel ignores it: epilogue)
    tiles = (math.ceil(sq / spec.block_m), h, b)
    grid = plan.check_grid((min(math.prod(tiles), build.sm_count(device_id)), 1, 1) if spec.persistent else tiles)
    _set_walk(p, spec, tiles[0], grid[0])
    call = KernelCall([(build.get_kernel(spec, device_id), grid, (spec.threads,), spec.smem_bytes)], p, ())
    maps = (_encoder(q, spec.block_m), _encoder(k, spec.block_n), _encoder(v, spec.block_n), _encoder(out, 16))
    return ForwardCall(call, maps, spec)


def attention_sm90(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, return_lse=False, variant="lockstep"):
    """Like :func:`cuflash.attention`, on the Hopper kernel (head dims 64, 128, 256); `variant` one of VARIANTS."""
    import cupy
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes)
    if problem.headdim not in HEADDIMS:
        raise NotImplementedError(f"the Hopper forward covers head dims {HEADDIMS}, not {problem.headdim}")
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    b, sq, h, _ = q.shape
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((b, h, sq), dtype=np.float32) if return_lse else None
        call = forward_call(problem, q, k, v, out, lse, device_id=q.device.id, scale=scale, left=left, right=right,
                            softcap=float(softcap), alibi_slopes=alibi_slopes, variant=variant)
        call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
             0 if lse is None else lse.data.ptr, 0 if alibi_slopes is None else alibi_slopes.data.ptr)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------------------------
# The backward's main kernel on Hopper (cuda_src/bwd_sm90.cu), the planner's choice on sm_90a for head dims 64 and
# 128 (plan.BWD_SM90); softcap / ALiBi at 64.

BWD_HEADDIMS = (64, 128)
BWD_BLOCK_N, BWD_BLOCK_M = plan.BWD_SM90["block_n"], 64  # keys per CTA, query rows per step


@dataclass(frozen=True)
class BwdSm90Spec:
    dtype: str
    headdim: int
    band: bool
    score_mod: bool = False
    block_m: int = BWD_BLOCK_M  # query rows per step: 64, or 128 at d = 64 without a score mod
    fixed: bool = False  # deterministic mode 2 (int32 fixed-point dQ), which runs only on these kernels

    source = "bwd_sm90.cu"
    threads = 256

    @property
    def name(self) -> str:
        return (f"bwd_sm90_{self.dtype}_d{self.headdim}{'_band' if self.band else ''}"
                f"{'_mod' if self.score_mod else ''}{f'_m{self.block_m}' if self.block_m != BWD_BLOCK_M else ''}"
                f"{'_fixed' if self.fixed else ''}")

    @property
    def template(self) -> str:
        return plan._template("bwd_sm90_kernel", self.dtype, (self.headdim, self.block_m),
                              (self.band, self.score_mod, self.fixed))

    @property
    def tma_dq(self) -> bool:  # BwdSm90::TMA_DQ: dQ added by TMA from staging buffers
        return plan.bwd_sm90_tma_dq(self.headdim, self.block_m)

    @property
    def smem_bytes(self) -> int:  # BwdSm90::SMEM_BYTES: K, V, Q[2], dO[2], dS^T, rows (lse, D, dQ scale), dQ staging,
        d, n, m = self.headdim, BWD_BLOCK_N, self.block_m  # barriers
        rows_end = 2 * n * d * 2 + 4 * m * d * 2 + n * m * 2 + 2 * 3 * m * 4
        staging = 2 * 2 * 64 * 64 * 4 if self.tma_dq else 0  # two buffers of a 64 x 64 fp32 tile per warpgroup
        return -(-rows_end // 1024) * 1024 + staging + 3 * 8 + 1024


def all_backward_specs() -> list:
    """Every specialization: the fixed-point ones where dQ is added by TMA (mode 2 needs it)."""
    return [BwdSm90Spec(dtype, d, band, mod, block_m, fixed) for d in BWD_HEADDIMS for dtype in ("fp16", "bf16")
            for band in (False, True) for mod in ((False, True) if d in plan.BWD_SM90["score_mod"] else (False,))
            for block_m in plan.BWD_SM90_BLOCK_M_CHOICES if plan.bwd_sm90_block_m_allowed(d, mod, block_m)
            for fixed in ((False, True) if plan.bwd_sm90_tma_dq(d, block_m) else (False,))]


def _bwd_params_dtype() -> np.dtype:
    """BwdSm90Params: the five tensor maps, then BwdParams (plan.BWD_PARAMS_DTYPE) at byte 640; 64-byte aligned."""
    inner = plan.BWD_PARAMS_DTYPE
    names = ["q_map", "k_map", "v_map", "dout_map", "dq_map"] + list(inner.names)
    formats = ["V128"] * 5 + [inner.fields[n][0] for n in inner.names]
    offsets = [0, 128, 256, 384, 512] + [640 + inner.fields[n][1] for n in inner.names]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": 640 + -(-inner.itemsize // 64) * 64})


BWD_PARAMS_DTYPE = _bwd_params_dtype()
_BWD_POINTERS = struct.Struct("14Q")  # BwdParams' leading pointers, right after the maps


class BackwardMain:
    """The Hopper backward's main launch behind the call interface of the portable one (``BackwardCall.main``):
    ``call(stream, q, k, v, dout, dk, dv, dq_accum, lse_log2, dsum, alibi, cu_seqlens_q, cu_seqlens_k, dq_scale,
    kv_bound)``."""

    __slots__ = ("kernel_call", "maps", "spec")

    def __init__(self, kernel_call: KernelCall, maps: tuple, spec: BwdSm90Spec):
        self.kernel_call, self.maps, self.spec = kernel_call, maps, spec

    def __call__(self, stream: int, q: int, k: int, v: int, dout: int, dk: int, dv: int, dq_accum: int,
                 *rest: int) -> None:
        q_map, k_map, v_map, do_map, dq_map = self.maps
        self.kernel_call.launch_head(
            stream, q_map(q) + k_map(k) + v_map(v) + do_map(dout) + dq_map(dq_accum)
            + _BWD_POINTERS.pack(q, k, v, dout, dk, dv, dq_accum, *rest))


def backward_main(spec: BwdSm90Spec, inner_params, q, k, v, dout, grid, device_id: int) -> BackwardMain:
    """The main launch for these layouts (arrays or TensorSpecs, padded or packed) with BwdParams already filled
    (`inner_params`, a plan.BWD_PARAMS_DTYPE scalar). Mode 2 (the fixed point) runs on the `fixed` kernels only, and
    they on nothing else."""
    if spec.fixed != (int(inner_params["deterministic"]) == 2):
        raise ValueError(f"{spec.name}: deterministic mode {int(inner_params['deterministic'])} on the wrong kernel")
    p = np.zeros((), dtype=BWD_PARAMS_DTYPE)
    for name in plan.BWD_PARAMS_DTYPE.names:
        p[name] = inner_params[name]
    call = KernelCall([(build.get_kernel(spec, device_id), grid, (spec.threads,), spec.smem_bytes)], p, ())
    m = spec.block_m
    maps = (_encoder(q, m), _encoder(k, BWD_BLOCK_N), _encoder(v, BWD_BLOCK_N), _encoder(dout, m),
            _dq_accum_encoder(inner_params, grid))
    return BackwardMain(call, maps, spec)


def _dq_accum_layout(inner_params, grid) -> tuple:
    """(dtype, dims, byte strides, box) of dq_accum's tensor map: fp32 (slices, rows of all sequences, heads, d) as
    4-D (d, heads, rows, slices), box (32, 1, 64, 1): 32 columns (128 bytes, the swizzle span) of 64 rows; int32 and
    one slice in deterministic mode's fixed point (BwdParams::deterministic 2)."""
    h, d = int(inner_params["nheads"]), int(inner_params["headdim"])
    rows = int(inner_params["dq_slice_stride"]) // (h * d)
    mode = int(inner_params["deterministic"])
    slices = grid[0] if mode == 1 else 1
    dtype = np.dtype(np.int32 if mode == 2 else np.float32)
    return dtype, (d, h, rows, slices), (d * 4, h * d * 4, rows * h * d * 4), (32, 1, 64, 1)


def _dq_accum_encoder(inner_params, grid):
    return tma.encoder(*_dq_accum_layout(inner_params, grid), swizzle=128)

"""The Hopper forward (``cuda_src/fwd_sm90.cu``): its specializations and variants, its parameter struct with the
TMA tensor maps, and its launch behind the portable forward's call interface. It is compiled for head dims 64, 128
and 256, and :mod:`cuflash.ops.forward` chooses it on sm_90a for the multiples of 8 from 40 to 256, each on the next
compiled one (plan.hopper_headdim) (fp16/bf16, causal and local windows, GQA, softcap, ALiBi, lse, dropout; padded
and packed batches; a packed batch's keys from page pools).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from .. import build, plan, settings, tma
from ..checks import alibi_batch_stride, lse_strides, seq_strides
from ..launcher import KernelCall
from ..options import AttentionOptions

HEADDIMS = (64, 128, 256)
BLOCK_M, BLOCK_N = 128, 64


@dataclass(frozen=True)
class FwdSm90Spec:
    dtype: str     # "fp16" | "bf16"
    headdim: int   # 64 | 128 | 256
    band: bool
    block_n: int = BLOCK_N          # keys per block: 64, 80, 128 or 176 (S by wgmma m64n64, n80, n128, n176)
    consumers: int = 2              # consumer warpgroups of 64 query rows (3: warp-specialized, no ping-pong)
    persistent: bool = False        # one CTA per SM walking the tiles (warp-specialized only)
    warp_specialized: bool = False  # a producer warpgroup and "empty" mbarriers (fwd_sm90.cu, WS)
    stages: int = 2                 # K/V ring slots (2 without warp specialization)
    score_mod: bool = False         # softcap / ALiBi
    pingpong: bool = False          # the consumer warpgroups take turns issuing GEMMs (warp-specialized only)
    split: bool = False             # tiles whose rows fit in 64 worked by all three consumer warpgroups (SPLIT)
    dropout: bool = False           # dropout on the probabilities (DROPOUT), where a call asks for it
    paged: bool = False             # a packed batch's keys from page pools (PAGED; lockstep only)

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
                f"{'_mod' if self.score_mod else ''}{'_drop' if self.dropout else ''}{'_paged' if self.paged else ''}")

    @property
    def template(self) -> str:
        return plan.template("fwd_sm90_kernel", self.dtype, (self.headdim, self.block_n, self.stages, self.consumers),
                             (self.band, self.warp_specialized, self.score_mod, self.pingpong, self.persistent,
                              self.split, self.dropout, self.paged))

    @property
    def smem_symbol(self) -> str:
        """The name expression of the shared-memory size fwd_sm90.cu states for this kernel (FwdSm90Traits: the
        layout, the O staging tile, the Q buffers and the tile ring are chosen there); build.smem_bytes reads it."""
        return "&" + self.template.replace("fwd_sm90_kernel<", "fwd_sm90_smem_bytes<", 1)


# The variants (fwd_sm90.cu):
# lockstep: two consumer warpgroups, no producer warpgroup, a two-slot ring.
# ws / pingpong: a producer warpgroup and a deeper ring (4 slots; 2 at d = 256, whose Q and two slots already take
#   192 KB of shared memory); pingpong has its two consumer warpgroups take turns issuing GEMMs.
# ws_n128 / pingpong_n128: those with 128-key blocks (S by wgmma m64n128: half the shared-memory reads of Q per flop,
#   half the softmax passes' fixed cost per key), 4 slots at d = 64 and 3 at d = 128 (Q and three slots: 225 KB).
#   At d = 256 they keep 64-key blocks: O's 128 registers and S's 64 would not fit beside P's.
# ws3_n128: ws_n128 with three consumer warpgroups (192 query rows per CTA, 160 registers each) at d = 64 without a
#   score mod; elsewhere (O, or softcap/ALiBi's registers, would not fit in 160 beside S and P) it is ws_n128.
# ws_n128_p, pingpong_n128_p, ws3_n128_p: persistent (one CTA per SM walks the tiles, so the producer loads the next
#   tile's Q and keys while the consumers finish the last one). At d = 64 with two Q tiles, the two-warpgroup
#   persistent kernel starts each tile under the last one's P V (fwd_sm90.cu OVERLAP_TILES); ws3_n128_p keeps three Q
#   tiles instead (d 64; elsewhere ws_n128_p). pingpong_n128_p keeps the turns balanced from tile to tile: each
#   tile's first turn is warpgroup 0's, and warpgroup 1 skips its last hand-over.
# ws3_n128_p_split: ws3_n128_p where a tile whose rows fit in 64 is worked by all three consumer warpgroups, each on
#   every third key block, and merged in warpgroup 0 (fwd_sm90.cu SPLIT); d 64 without a score mod only.
# lockstep_n128: the lockstep kernel with 128-key blocks (half the CTA barriers per key), 64 at d = 256.
# _s2: any variant with a two-slot ring (K and V are handed back separately, so two slots keep loads ahead; at
#   d = 128 the slot saved leaves room for the persistent kernel's own O staging tile).
# pingpong_n176: 176-key blocks and two slots at d = 128 without a score mod (elsewhere pingpong_n128).
# pingpong_n80 (the default at d = 256): 80-key blocks and two slots at d = 256 (S by wgmma m64n80: 40 registers
#   beside O's 128); elsewhere pingpong.
# VARIANTS lists those the forward's tables use and the tests run.
VARIANTS = ("lockstep", "ws", "pingpong", "ws_n128", "pingpong_n128", "ws3_n128", "ws_n128_p", "lockstep_n128",
            "pingpong_n128_p", "pingpong_n128_s2", "pingpong_n128_p_s2", "ws_n128_p_s2", "pingpong_n176", "ws3_n128_p",
            "ws3_n128_p_split", "pingpong_n80")


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
        if headdim != 128 or score_mod:  # (softcap/ALiBi beside S's 88 registers spill)
            return variant_options("pingpong_n128", headdim)
        return dict(warp_specialized=True, stages=2, pingpong=True, block_n=176)
    if variant == "pingpong_n80":  # FA3's d = 256 tile: 80-key blocks, two slots (224 KiB of Q, K and V at d = 256)
        if headdim != 256:
            return variant_options("pingpong", headdim)
        return dict(warp_specialized=True, stages=2, pingpong=True, block_n=80)
    if variant in ("ws_n128", "pingpong_n128"):
        if headdim > 128:
            return variant_options(variant[:-len("_n128")], headdim)
        return dict(warp_specialized=True, stages=4 if headdim <= 64 else 3, pingpong=variant == "pingpong_n128",
                    block_n=128)
    raise ValueError(f"variant: one of {VARIANTS}, not {variant!r}")


def variant_spec(variant: str, dtype: str, headdim: int, band: bool, score_mod: bool,
                 dropout: bool = False, paged: bool = False) -> FwdSm90Spec:
    """The specialization a variant of VARIANTS compiles for these options."""
    return FwdSm90Spec(dtype, headdim, band, score_mod=score_mod, dropout=dropout, paged=paged,
                       **variant_options(variant, headdim, score_mod))


# FwdSm90Params (fwd_sm90_traits.cuh): four 64-byte-aligned tensor maps (q, k, v, o), the pointers o, lse, alibi,
# cu_seqlens_q, cu_seqlens_k, dropout_state, the dropout generator's seed and offset, block_table and seqused_k (with
# the maps, the struct's head a call writes), strides, ints, scales, dropout's threshold and scale, batch, o_tma, the
# persistent walk's chunk sizes and divisions (multiplier, shift: fast_div), the page pools' geometry, the call's head
# dim; 768 bytes.
_POINTER_NAMES = ("o", "lse", "alibi", "cu_seqlens_q", "cu_seqlens_k", "dropout_state", "dropout_seed",
                  "dropout_offset", "block_table", "seqused_k")
_I64S = ("o_batch_stride", "o_row_stride", "o_head_stride", "lse_batch_stride", "lse_head_stride",
         "alibi_batch_stride")
_INTS = ("seqlen_q", "seqlen_k", "nheads", "heads_per_kv", "window_left", "window_right")
_FLOATS = ("scale_log2", "mod_scale", "softcap")
_DROPOUT = ("dropout_threshold", "dropout_scale")
_DIVISIONS = tuple(f"by_{n}_{part}" for n in ("m_blocks", "heads", "chunk_tiles", "chunk", "chunk_last")
                   for part in ("mul", "shift"))
_PAGES = ("block_table_stride", "page_size", "num_pages", "max_pages", "page_box", "headdim")
PARAMS_DTYPE = np.dtype({
    "names": ["q", "k", "v", "o_map", *_POINTER_NAMES, *_I64S, *_INTS, *_FLOATS, *_DROPOUT, "batch", "o_tma", "chunk",
              "chunk_last", *_DIVISIONS, *_PAGES],
    "formats": (["V128"] * 4 + [np.uint64] * 10 + [np.int64] * 6 + [np.int32] * 6 + [np.float32] * 3
                + [np.int32, np.float32] + [np.int32] * 4 + [np.uint32] * len(_DIVISIONS) + [np.int32] * 6),
    "offsets": [0, 128, 256, 384] + [512 + 8 * i for i in range(16)] + [640 + 4 * i for i in range(15 + 10 + 6)],
    "itemsize": 768})


def fast_div(d: int) -> tuple:
    """(multiplier, shift) of types.cuh FastDiv for the divisor d (1 <= d < 2^31): x // d = (umulhi(x, m) + x) >> p."""
    shift = (d - 1).bit_length()
    return ((((1 << shift) - d) << 32) // d + 1) & 0xFFFFFFFF, shift


# The persistent kernel's walk under a band (fwd_sm90.cu tile_of): chunks of `chunk` (sequence, head) pairs walked
# level by level (every pair's longest tile, then every pair's next one ...), chunk a divisor of the CTA count, so
# each round's tiles have one length; a chunk's K and V are read once per level, so they should stay in L2 meanwhile:
# the largest divisor whose K/V fits WALK_L2_BYTES. Head dims not in WALK_HEAD_DIMS walk pair by pair (chunk 1).
# Measured: docs/perf-notes.md, "persistent walk in chunks".
WALK_L2_BYTES = 24 << 20
WALK_HEAD_DIMS = (64,)


def walk_chunk(ctas: int, seqlen_k: int, headdim: int, heads_per_kv: int) -> int:
    """(sequence, head) pairs per chunk of the persistent walk under a band: the largest divisor of the CTA count
    whose pairs' K and V (2-byte elements, shared by heads_per_kv heads) fit WALK_L2_BYTES; 1 for head dims not in
    WALK_HEAD_DIMS; the sm90_walk_chunk setting where it is > 0."""
    forced = settings.current().sm90_walk_chunk
    if forced > 0:
        return forced
    if headdim not in WALK_HEAD_DIMS:
        return 1
    pair_bytes = 2 * seqlen_k * headdim * 2 / heads_per_kv
    return next((c for c in range(ctas, 0, -1) if ctas % c == 0 and c * pair_bytes <= WALK_L2_BYTES), 1)


def set_walk(p, spec, m_blocks: int, ctas: int) -> None:
    """The persistent walk's fields of FwdSm90Params (its ints already set; the grid kernels never read them):
    chunks of walk_chunk pairs under a band (unused without one), and the multiplier and shift of each division a
    tile index takes."""
    heads, pairs = int(p["nheads"]), int(p["nheads"]) * int(p["batch"])
    chunk = 1
    if spec.persistent and spec.band:
        chunk = walk_chunk(ctas, int(p["seqlen_k"]), spec.headdim, int(p["heads_per_kv"]))
    last = pairs - (math.ceil(pairs / chunk) - 1) * chunk
    p["chunk"], p["chunk_last"] = chunk, last
    for name, d in (("m_blocks", m_blocks), ("heads", heads), ("chunk_tiles", chunk * m_blocks), ("chunk", chunk),
                    ("chunk_last", last)):
        p[f"by_{name}_mul"], p[f"by_{name}_shift"] = fast_div(d)


# How the warp-specialized kernels write O, per head dim (fwd_sm90.cu epilogue): through shared memory and TMA
# stores (1), or 4-byte stores from registers (0; the lockstep and split kernels always). The sm90_o_tma setting
# sets every head dim. Measured: docs/perf-notes.md, "O by TMA stores".
O_TMA_DEFAULT = {64: 1, 128: 1, 256: 1}


def o_tma(headdim: int) -> int:
    """FwdSm90Params::o_tma for a head dim: the table's, or the sm90_o_tma setting."""
    forced = settings.current().sm90_o_tma
    return O_TMA_DEFAULT[headdim] if forced is None else int(forced)


# Dropout runs on one variant per head dim and mask kind (band: causal or local), with or without a score mod: the
# head dim's default (cuflash.ops.forward.SM90_DEFAULT_VARIANTS), but under a band at d = 64 the two-warpgroup ws_n128
# (three warpgroups are 14% slower with dropout at 1k causal keys; docs/perf-notes.md, "dropout variants").
DROPOUT_VARIANTS = {(64, False): "ws3_n128", (64, True): "ws_n128", (128, False): "pingpong_n128",
                    (128, True): "pingpong_n128", (256, False): "pingpong_n80", (256, True): "pingpong_n80"}

# Paged keys (block_table) run on the lockstep kernel (PAGED: its CTA barriers let every thread zero the tail of a
# sequence's last V block), with 128-key blocks where the head dim has them (64 at d = 256), without dropout.
PAGED_VARIANT = "lockstep_n128"


def page_box(page_size: int, block_n: int) -> int:
    """Rows per TMA box of a paged K or V block: the largest common divisor of the page size and the block's keys
    (both multiples of 16), so that no box straddles two pages."""
    return math.gcd(page_size, block_n)


def all_specs() -> list:
    """Every Hopper forward specialization (each variant, head dim, dtype, band, score mod; the dropout ones):
    what the compile test checks and scripts/precompile.py --hopper compiles ahead of the GPU tests."""
    return list(dict.fromkeys(  # in order, without repeats (the _n128 variants at d = 256 are the 64-key ones)
        [variant_spec(variant, dtype, d, band, mod)
         for variant in VARIANTS for d in HEADDIMS for dtype in ("fp16", "bf16")
         for band in (False, True) for mod in (False, True)]
        + [variant_spec(variant, dtype, d, band, mod, dropout=True)
           for (d, band), variant in DROPOUT_VARIANTS.items() for dtype in ("fp16", "bf16") for mod in (False, True)]
        + [variant_spec(PAGED_VARIANT, dtype, d, band, mod, paged=True)
           for d in HEADDIMS for dtype in ("fp16", "bf16") for band in (False, True) for mod in (False, True)]))


_POINTERS = struct.Struct(f"{len(_POINTER_NAMES)}Q")  # right after the four maps (offset 512)


class ForwardCall:
    """The Hopper forward behind the call interface of the portable forward's KernelCall
    (:func:`cuflash.ops.forward.forward_call`): ``call(stream, q, k, v, o, lse, alibi, cu_seqlens_q,
    cu_seqlens_k, 0, 0)`` with data pointers (0 where absent). The tensor maps embed q, k, v and o's addresses, so a
    call writes them into the head of the struct, kept joined per pointer tuple (tma.joined_encoder)."""

    __slots__ = ("kernel_call", "_maps", "spec")

    def __init__(self, kernel_call: KernelCall, maps: tuple, spec: FwdSm90Spec):
        """``maps``: the encoders of q, k, v and o's tensor maps (tma.layout_encoder)."""
        self.kernel_call, self.spec = kernel_call, spec
        self._maps = tma.joined_encoder(maps)

    def __call__(self, stream: int, q: int, k: int, v: int, o: int, lse: int, alibi: int = 0, cu_seqlens_q: int = 0,
                 cu_seqlens_k: int = 0, block_table: int = 0, seqused_k: int = 0, dropout_seed: int = 0,
                 dropout_offset: int = 0, dropout_state: int = 0) -> None:
        self.kernel_call.launch_head(
            stream, self._maps((q, k, v, o))
            + _POINTERS.pack(o, lse, alibi, cu_seqlens_q, cu_seqlens_k, dropout_state, dropout_seed, dropout_offset,
                             block_table, seqused_k))


def forward_call(problem, q, k, v, out, lse, options: AttentionOptions, *, device_id: int, alibi_slopes=None,
                 variant: str, block_table=None) -> ForwardCall:
    """The Hopper forward for these layouts (arrays or TensorSpecs; out and lse contiguous; padded or packed as
    :func:`cuflash.ops.forward.launch` describes) on device `device_id` (current); with ``block_table`` (an array
    or TensorSpec) k and v are page pools ``(num_pages, page_size, nheads_k, d)`` and the variant PAGED_VARIANT."""
    paged = block_table is not None
    d = plan.hopper_headdim(problem.headdim)  # compiled; the call's head dim may be below it (p["headdim"])
    spec = variant_spec(variant, plan.dtype_tag(problem.dtype), d, options.band, options.score_mod, options.dropout,
                        paged)
    b, sq, h = problem.batch, problem.seqlen_q, problem.nheads  # packed: sq is the longest sequence
    p = np.zeros((), dtype=PARAMS_DTYPE)
    p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"] = seq_strides(out)
    p["lse_batch_stride"], p["lse_head_stride"] = lse_strides(lse)
    p["seqlen_q"], p["seqlen_k"], p["nheads"] = sq, problem.seqlen_k, h
    p["heads_per_kv"], p["window_left"], p["window_right"] = h // problem.nheads_k, options.left, options.right
    p["alibi_batch_stride"] = alibi_batch_stride(alibi_slopes)
    for name, value in {**options.scales, **options.dropout_fields}.items():
        p[name] = value
    p["batch"] = b
    p["o_tma"] = o_tma(d)  # (the SPLIT kernel ignores it: epilogue)
    p["headdim"] = problem.headdim
    kv_rows_box = spec.block_n
    if paged:
        plan.set_pages(p, k, block_table)
        p["page_box"] = kv_rows_box = page_box(k.shape[1], spec.block_n)
    tiles = (math.ceil(sq / spec.block_m), h, b)
    grid = plan.check_grid((min(math.prod(tiles), build.sm_count(device_id)), 1, 1) if spec.persistent else tiles)
    set_walk(p, spec, tiles[0], grid[0])
    kernel = (build.get_kernel(spec, device_id), grid, (spec.threads,), build.smem_bytes(spec, device_id))
    call = KernelCall([kernel], p, ())
    # (a page pool (num_pages, page_size, heads_k, d) maps as a padded batch of pages: (d, heads_k, page rows, pages))
    maps = (tma.layout_encoder(q, spec.block_m), tma.layout_encoder(k, kv_rows_box),
            tma.layout_encoder(v, kv_rows_box), tma.layout_encoder(out, 16))
    return ForwardCall(call, maps, spec)


def attention_sm90(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, return_lse=False, variant="lockstep"):
    """Like :func:`cuflash.attention`, on the Hopper kernel (head dims 64, 128, 256); `variant` one of VARIANTS
    (for tests and measurements of each variant)."""
    from .. import checks, options as options_module, runtime
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes)
    runtime.require_gpu()
    import cupy
    if problem.headdim not in HEADDIMS:
        raise NotImplementedError(f"the Hopper forward covers head dims {HEADDIMS}, not {problem.headdim}")
    options = options_module.resolve(problem, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes)
    b, sq, h, _ = q.shape
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((b, h, sq), dtype=np.float32) if return_lse else None
        call = forward_call(problem, q, k, v, out, lse, options, device_id=q.device.id, alibi_slopes=alibi_slopes,
                            variant=variant)
        call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
             runtime.ptr(lse), runtime.ptr(alibi_slopes))
    return (out, lse) if return_lse else out

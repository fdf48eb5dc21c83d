"""The Hopper backward's main kernel (``cuda_src/bwd_sm90.cu``): TMA and wgmma, 128 keys per CTA (64 at d = 256,
where the two warpgroups split the head dim), compiled for head dims 64, 128 and 256 and run for the multiples of 8
from 40 up (compiled_headdim: the next compiled one), with softcap / ALiBi, dropout or both at each.
:mod:`cuflash.ops.backward` chooses it on sm_90a where :func:`applies` (with dropout, :func:`dropout_applies`) and
launches it behind the portable main kernel's call interface, with the same preprocess, workspace and dQ
conversion.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .. import build, plan, settings, tma
from ..launcher import KernelCall

HEADDIMS = (64, 128, 256)
# Softcap and ALiBi (BwdSm90's SCORE_MOD kernels, with the head dim's query rows) at every head dim, with dropout too
SCORE_MOD_HEADDIMS = (64, 128, 256)
# Dropout (BwdSm90::DROPOUT) at every head dim, with the head dim's query rows (128 at d = 64 without a score mod:
# the warp-specialized kernel, two keep words a thread) and no fixed-point variant (deterministic mode keeps the fp32
# slices)
DROPOUT_HEADDIMS = (64, 128, 256)
BLOCK_N = 128               # keys per CTA (BwdSm90::BN), 64 at d = 256 (block_n)
BLOCK_M = 64                # query rows per step by default
DQ_ORDERED = 3              # BwdParams::deterministic: dQ added in a fixed order per query block (params.cuh)

# Query rows per step, per head dim: 64, or 128 at d = 64 (twice the work per step for the same barriers and waits;
# faster in every cell measured, docs/perf-notes.md, "Hopper backward 128 rows at d 64"), but with a score mod and
# dropout together (block_m_allowed). The bwd_sm90_block_m setting overrides a head dim's.
BLOCK_M_CHOICES = (64, 128)
BLOCK_M_TABLE = {64: 128, 128: 64}


def dq_first_store(spec: "BwdSm90Spec", slices: int, packed: bool) -> bool:
    """BwdParams::dq_first_store: the first dQ addition to each whole query block is a store, so that the preprocess
    zeroes no more of the accumulator than partial blocks and rows that see no key (the warp-specialized kernels but
    d = 256's, one accumulator, a padded batch; the bwd_sm90_dq_first_store setting)."""
    return (spec.tma_dq and spec.headdim != 256 and slices == 1 and not packed
            and settings.current().bwd_sm90_dq_first_store)


def block_n(headdim: int) -> int:
    """Keys per CTA (BwdSm90::BN): 128, or 64 at d = 256 (DSPLIT)."""
    return 64 if headdim == 256 else BLOCK_N


def compiled_headdim(headdim: int) -> int | None:
    """The kernel's compiled head dim for a call's: plan.hopper_headdim's (the next of HEADDIMS, for multiples of 8
    from 40); None where none runs it."""
    return plan.hopper_headdim(headdim)


def applies(problem, score_mod: bool, arch: str) -> bool:
    """The Hopper kernel runs this backward: sm_90a, a head dim that runs on one of HEADDIMS (compiled_headdim;
    with a score mod, on one of SCORE_MOD_HEADDIMS), setting on."""
    d = compiled_headdim(problem.headdim)
    return (settings.current().bwd_sm90 and arch == "sm_90a" and d in HEADDIMS
            and (not score_mod or d in SCORE_MOD_HEADDIMS))


def block_m_allowed(headdim: int, score_mod: bool, block_m: int, dropout: bool = False) -> bool:
    """A kernel with `block_m` query rows exists: 64, or 128 at d = 64 but with a score mod and dropout together
    (its registers: ptxas spills)."""
    return block_m == 64 or (block_m == 128 and headdim == 64 and not (score_mod and dropout))


def tma_dq(headdim: int, block_m: int) -> bool:
    """BwdSm90::TMA_DQ: dQ added by TMA bulk reductions from staging tiles (all but d = 64 with 64 query rows, whose
    warpgroups both add to every element with vector reductions). Deterministic mode's fixed point (the FIXED
    kernels) exists where this holds; the others keep the fp32 slices."""
    return not (headdim == 64 and block_m == 64)


def block_m(headdim: int, score_mod: bool, dropout: bool = False) -> int:
    """Query rows per step for this head dim (the table's entry, or the setting's, where the kernel allows it)."""
    rows = {**BLOCK_M_TABLE, **settings.current().bwd_sm90_block_m}.get(headdim, 64)
    return rows if block_m_allowed(headdim, score_mod, rows, dropout) else 64




@dataclass(frozen=True)
class BwdSm90Spec:
    dtype: str
    headdim: int
    band: bool
    score_mod: bool = False
    block_m: int = BLOCK_M  # query rows per step: 64, or 128 at d = 64 (block_m_allowed)
    fixed: bool = False  # deterministic mode 2 (int32 fixed-point dQ), which runs only on these kernels
    dropout: bool = False  # BwdSm90::DROPOUT: regenerates the forward's dropout mask (dropout_spec)

    source = "bwd_sm90.cu"

    @property
    def threads(self) -> int:
        """BwdSm90::THREADS: two consumer warpgroups, and a producer warpgroup before them where the kernel is
        warp-specialized (BwdSm90::WS, the kernels that add dQ by TMA: its dQ warp issues the reductions)."""
        return 384 if self.tma_dq else 256

    @property
    def name(self) -> str:
        return (f"bwd_sm90_{self.dtype}_d{self.headdim}{'_band' if self.band else ''}"
                f"{'_mod' if self.score_mod else ''}{f'_m{self.block_m}' if self.block_m != BLOCK_M else ''}"
                f"{'_fixed' if self.fixed else ''}{'_drop' if self.dropout else ''}")

    @property
    def template(self) -> str:
        return plan.template("bwd_sm90_kernel", self.dtype, (self.headdim, self.block_m),
                             (self.band, self.score_mod, self.fixed, self.dropout))

    @property
    def tma_dq(self) -> bool:  # BwdSm90::TMA_DQ: dQ added by TMA from staging buffers
        return tma_dq(self.headdim, self.block_m)

    @property
    def smem_symbol(self) -> str:
        """The name expression of the shared-memory size bwd_sm90.cu states for this kernel (BwdSm90Smem, the layout
        stated once in bwd_sm90_layout.cuh); build.smem_bytes reads it."""
        return "&" + self.template.replace("bwd_sm90_kernel<", "bwd_sm90_smem_bytes<", 1)


def dropout_applies(problem, score_mod: bool, arch: str) -> bool:
    """The Hopper kernel runs this backward with dropout: as :func:`applies`, at the DROPOUT_HEADDIMS (with a score
    mod too)."""
    return applies(problem, score_mod, arch) and compiled_headdim(problem.headdim) in DROPOUT_HEADDIMS


def all_specs() -> list:
    """Every specialization: the fixed-point ones where dQ is added by TMA (mode 2 needs it), and dropout's."""
    return [BwdSm90Spec(dtype, d, band, mod, rows, fixed) for d in HEADDIMS for dtype in ("fp16", "bf16")
            for band in (False, True) for mod in ((False, True) if d in SCORE_MOD_HEADDIMS else (False,))
            for rows in BLOCK_M_CHOICES if block_m_allowed(d, mod, rows)
            for fixed in ((False, True) if tma_dq(d, rows) else (False,))] + [
        BwdSm90Spec(dtype, d, band, mod, block_m(d, mod, True), dropout=True)
        for d in DROPOUT_HEADDIMS for dtype in ("fp16", "bf16")
        for band in (False, True) for mod in ((False, True) if d in SCORE_MOD_HEADDIMS else (False,))]


def params_dtype(inner: np.dtype) -> np.dtype:
    """BwdSm90Params: the five tensor maps, then BwdParams (`inner`, the portable kernel's struct) at byte 640;
    64-byte aligned."""
    names = ["q_map", "k_map", "v_map", "dout_map", "dq_map"] + list(inner.names)
    formats = ["V128"] * 5 + [inner.fields[n][0] for n in inner.names]
    offsets = [0, 128, 256, 384, 512] + [640 + inner.fields[n][1] for n in inner.names]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": 640 + -(-inner.itemsize // 64) * 64})


_POINTERS = struct.Struct("17Q")  # BwdParams' leading per-call fields, right after the maps


class BackwardMain:
    """The Hopper backward's main launch behind the call interface of the portable one (``BackwardCall.main``):
    ``call(stream, q, k, v, dout, dk, dv, dq_accum, lse_log2, dsum, alibi, cu_seqlens_q, cu_seqlens_k, dq_scale,
    kv_bound, dropout_seed, dropout_offset, dropout_state)``."""

    __slots__ = ("kernel_call", "spec", "_maps", "_launch_head")

    def __init__(self, kernel_call: KernelCall, maps: tuple, spec: BwdSm90Spec):
        """``maps``: the encoders of q, k, v, dout and dq_accum's tensor maps (tma.encoder), kept joined."""
        self.kernel_call, self.spec = kernel_call, spec
        self._maps = tma.joined_encoder(maps)
        self._launch_head = kernel_call.launch_head

    def __call__(self, stream: int, q: int, k: int, v: int, dout: int, dk: int, dv: int, dq_accum: int,
                 *rest: int) -> None:
        self._launch_head(stream, self._maps((q, k, v, dout, dq_accum))
                          + _POINTERS.pack(q, k, v, dout, dk, dv, dq_accum, *rest))


def backward_main(spec: BwdSm90Spec, inner_params, q, k, v, dout, grid, device_id: int) -> BackwardMain:
    """The main launch for these layouts (arrays or TensorSpecs, padded or packed) with BwdParams already filled
    (`inner_params`, a cuflash.ops.backward.PARAMS_DTYPE scalar). Mode 2 (the fixed point) runs on the `fixed`
    kernels only, and they on nothing else."""
    if spec.fixed != (int(inner_params["deterministic"]) == 2):
        raise ValueError(f"{spec.name}: deterministic mode {int(inner_params['deterministic'])} on the wrong kernel")
    p = np.zeros((), dtype=params_dtype(inner_params.dtype))
    for name in inner_params.dtype.names:
        p[name] = inner_params[name]
    kernel = (build.get_kernel(spec, device_id), grid, (spec.threads,), build.smem_bytes(spec, device_id))
    call = KernelCall([kernel], p, ())
    m = spec.block_m
    n = block_n(spec.headdim)
    maps = (tma.layout_encoder(q, m), tma.layout_encoder(k, n), tma.layout_encoder(v, n),
            tma.layout_encoder(dout, m), tma.encoder(*dq_accum_layout(inner_params, grid), swizzle=128))
    return BackwardMain(call, maps, spec)


def dq_accum_layout(inner_params, grid) -> tuple:
    """(dtype, dims, byte strides, box) of dq_accum's tensor map: fp32 (slices, rows of all sequences, heads, d) as
    4-D (d, heads, rows, slices), box (32, 1, 64, 1): 32 columns (128 bytes, the swizzle span) of 64 rows; int32 and
    one slice in deterministic mode's fixed point (BwdParams::deterministic 2). Ordered mode (DQ_ORDERED, a padded
    batch): (d, heads, seqlen_q, batch), so that a partial last block's box stops at its sequence's end and no
    addition reaches the next sequence's rows, whose turns are counted apart."""
    h, d = int(inner_params["nheads"]), int(inner_params["headdim"])
    rows = int(inner_params["dq_slice_stride"]) // (h * d)
    mode = int(inner_params["deterministic"])
    if mode == DQ_ORDERED:
        rows, batch = int(inner_params["seqlen_q"]), int(inner_params["batch"])
        return np.dtype(np.float32), (d, h, rows, batch), (d * 4, h * d * 4, rows * h * d * 4), (32, 1, 64, 1)
    slices = grid[0] if mode == 1 else 1
    dtype = np.dtype(np.int32 if mode == 2 else np.float32)
    return dtype, (d, h, rows, slices), (d * 4, h * d * 4, rows * h * d * 4), (32, 1, 64, 1)

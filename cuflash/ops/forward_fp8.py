"""The FP8 (e4m3) forward on Hopper (``cuda_src/fwd_fp8_sm90.cu``, which transposes V in shared memory, or takes V^T
from ``cuda_src/fwd_fp8_aux.cu``'s pass over long rows: :data:`VT_PASS_FROM`): specializations, the parameter
struct, and :func:`attention_fp8` and :func:`attention_varlen_fp8` on CuPy arrays of e4m3 bits (uint8). Padded
batches and packed sequences, causal and local windows, GQA, descales per tensor or per (sequence, KV head), bf16
output and float32 lse; sm_90a only. docs/fp8.md states the accuracy contract,
:func:`cuflash.reference.attention_fp8` models it.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import build, checks, plan, runtime, settings, tma
from ..launcher import KernelCall

HEADDIMS = (64, 128, 256)
BLOCK_N = 128  # keys per block (fwd_fp8_sm90.cu BN)
BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class FwdFp8Spec:
    headdim: int  # compiled: 64, 128, 256 (a call's head dim is a multiple of 16 up to it)
    band: bool
    pipelined: bool = False  # each block's softmax under the last block's P V (fwd_fp8_sm90.cu PIPE)
    warpgroups: int = 2      # consumer warpgroups of 64 query rows (fwd_fp8_sm90.cu WGS): 2, or 3 in the simple form
    vt_pass: bool = False    # V^T from fp8_transpose_v's workspace (fwd_fp8_sm90.cu VT_PASS), not transposed in-kernel

    source = "fwd_fp8_sm90.cu"

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + 1)

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups

    @property
    def name(self) -> str:
        return (f"fwd_fp8_sm90_d{self.headdim}{'_pp' if self.pipelined else ''}"
                f"{f'_w{self.warpgroups}' if self.warpgroups != 2 else ''}{'_band' if self.band else ''}"
                f"{'_vt' if self.vt_pass else ''}")

    @property
    def template(self) -> str:
        band, pipe, vt, sums = ("true" if f else "false"
                                for f in (self.band, self.pipelined, self.vt_pass, self.quantized_sums))
        return f"cuflash::fwd_fp8_sm90_kernel<{self.headdim}, {band}, {pipe}, {self.warpgroups}, {vt}, {sums}>"

    @property
    def smem_symbol(self) -> str:
        return "&" + self.template.replace("fwd_fp8_sm90_kernel<", "fwd_fp8_sm90_smem_bytes<", 1)

    @property
    def quantized_sums(self) -> bool:
        """The row sums of the e4m3 P, added up on the tensor cores (fwd_fp8_sm90.cu PV_SUMS): at d 64, and at d 128
        in the simple form. Same-run A/Bs (docs/perf-notes.md, "FP8 row sums on the tensor cores"): they pay at d 64
        and in d 128's three-warpgroup form; the pipelined form at d 128 spills with the 8 more columns in both of its
        accumulators."""
        return self.headdim == 64 or (self.headdim == 128 and not self.pipelined)


@dataclass(frozen=True)
class Fp8TransposeSpec:
    """fp8_transpose_v: V to V^T with each 32-key chunk's keys in P's fragment order (static shared memory)."""
    source = "fwd_fp8_aux.cu"
    name = "fp8_transpose_v"
    template = "cuflash::fp8_transpose_v"
    threads = 128
    smem_bytes = 0


# The form each compiled head dim runs, without a mask band and with one: (consumer warpgroups, pipelined). The
# fp8_pipelined setting overrides the second (the GPU tests run both forms); a pipelined form has two warpgroups. From
# same-run A/Bs (H200, benchmarks/bench_fp8.py, docs/perf-notes.md, "FP8 forms"): the pipelined form is 1.5-10%
# faster than the simple one with two warpgroups at d 64 and 128, and 16-27% slower at d 256; without a band the
# simple form with three warpgroups is faster still at d 64 and 128 (+1 to +10%), under a causal mask 3-5% slower
# at d 128 (its 192-row tiles cross the diagonal in more blocks).
FORMS = {64: ((3, False), (2, True)), 128: ((3, False), (2, True)), 256: ((2, False), (2, False))}
# The head dims whose pipelined form compiles without spills: at 256, P V's accumulator of a 128-column chunk, O and
# the scores do not fit beside each other (the setting cannot force it there).
PIPE_HEADDIMS = (64, 128)
# From how many keys (seqlen_k, packed: max_seqlen_k) a compiled head dim takes V^T from the pass (fp8_transpose_v,
# one more launch and a workspace of vt_shape bytes) rather than transposing V in the kernel, without a mask band and
# with one. The pass costs a read and a write of V, which long rows spread thin; the kernel's transposes take issue
# slots and shared-memory bandwidth beside the softmax on every block (docs/perf-notes.md, "FP8 V^T pass").
VT_PASS_FROM = {64: (16384, 8192), 128: (4096, 4096), 256: (2048, 4096)}


def all_specs() -> list:
    specs = []
    for d in HEADDIMS:
        for band in (False, True):
            warpgroups, pipe = FORMS[d][band]
            for vt_pass in (False, True):
                specs.append(FwdFp8Spec(d, band, pipe, warpgroups, vt_pass))
                if d in PIPE_HEADDIMS:  # the other form, which the setting forces (kernel_spec)
                    specs.append(FwdFp8Spec(d, band, not pipe, 2, vt_pass))
    return specs + [Fp8TransposeSpec()]


def kernel_spec(headdim: int, band: bool, seqlen_k: int) -> FwdFp8Spec:
    d = compiled_headdim(headdim)
    warpgroups, pipe = FORMS[d][band]
    forced = settings.current().fp8_pipelined
    if forced is not None and d in PIPE_HEADDIMS and bool(forced) != pipe:
        warpgroups, pipe = 2, bool(forced)
    return FwdFp8Spec(d, band, pipe, warpgroups, vt_pass(d, band, seqlen_k))


def vt_pass(headdim: int, band: bool, seqlen_k: int) -> bool:
    """Whether a call takes V^T from the pass (:data:`VT_PASS_FROM`; the fp8_vt_pass setting forces it either way)."""
    forced = settings.current().fp8_vt_pass
    return bool(forced) if forced is not None else seqlen_k >= VT_PASS_FROM[compiled_headdim(headdim)][band]


def vt_shape(problem, band: bool) -> tuple | None:
    """V^T's workspace, uint8 ``(batch, nheads_k, headdim, keys)``, where the call takes V^T from the pass (else
    None): seqlen_k (packed sequences: max_seqlen_k) rounded up to the transpose's 32-key chunks, each sequence
    zero-padded to it."""
    if not vt_pass(problem.headdim, band, problem.seqlen_k):
        return None
    return problem.batch, problem.nheads_k, problem.headdim, -(-problem.seqlen_k // 32) * 32


def quantized_sums(headdim: int, band: bool = False) -> bool:
    """Whether a call's head dim and mask (``band``: causal or a window) run with the row sums of the e4m3 P, added
    up on the tensor cores (:attr:`FwdFp8Spec.quantized_sums` of :func:`kernel_spec`'s form: compiled d 64, and d 128
    without a band, or where the fp8_pipelined setting forces the simple form), the form of
    :func:`cuflash.reference.attention_fp8` and :func:`cuflash.reference.fp8_error_bound` (``quantized_sums``) that
    models it. Elsewhere the sums are those of the fp32 P (docs/perf-notes.md, "FP8 row sums on the tensor
    cores")."""
    return kernel_spec(headdim, band, 0).quantized_sums


def compiled_headdim(headdim: int) -> int:
    """The compiled head dim a call's runs on: the smallest of HEADDIMS at or above it."""
    return next(d for d in HEADDIMS if d >= headdim)


# FwdFp8Params (fwd_fp8_sm90.cu): four 128-byte tensor maps, then pointers, strides, ints and the scale; 640 bytes.
_INTS = ["descale_batch_stride", "seqlen_q", "seqlen_k", "rows_q", "rows_k", "nheads", "heads_per_kv", "window_left",
         "window_right", "headdim"]
PARAMS_DTYPE = np.dtype({
    "names": ["q", "k", "v", "o", "o_ptr", "lse", "q_descale", "k_descale", "v_descale", "cu_seqlens_q",
              "cu_seqlens_k", "o_batch_stride", "o_row_stride", "o_head_stride"] + _INTS + ["scale_log2"],
    "formats": ["V128"] * 4 + [np.uint64] * 7 + [np.int64] * 3 + [np.int32] * len(_INTS) + [np.float32],
    "offsets": [0, 128, 256, 384] + [512 + 8 * i for i in range(10)] + [592 + 4 * i for i in range(len(_INTS) + 1)],
    "itemsize": 640})

TRANSPOSE_DTYPE = np.dtype({
    "names": ["v", "vt", "cu_seqlens_k", "v_batch_stride", "v_row_stride", "v_head_stride", "seqlen_k", "rows_k",
              "keys", "heads_k", "headdim"],
    "formats": [np.uint64] * 3 + [np.int64] * 3 + [np.int32] * 5,
    "offsets": [0, 8, 16, 24, 32, 40, 48, 52, 56, 60, 64], "itemsize": 72})

# o_ptr, lse, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k: right after the four maps
_HEAD_POINTERS = struct.Struct("7Q")


class Fp8Call:
    """The FP8 forward's launches for one call signature (layouts and options), from data pointers: ``call(stream, q,
    k, v, vt, o, lse, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k)`` (0 where absent), ``vt`` a
    workspace of ``vt_shape`` uint8 (C-contiguous) where that is not None (else 0), ``o`` bf16 ``(batch, seqlen_q,
    nheads, headdim)`` C-contiguous, ``lse`` float32 ``(batch, nheads, seqlen_q)``. With ``packed = (total_q,
    total_k)`` the layouts are packed sequences (q ``(total_q, nheads, headdim)``, k and v ``(total_k, ...)``, o
    like q, lse ``(nheads, total_q)``) and the problem's lengths are the maxima. The tensor maps embed the
    addresses: kept joined per pointer tuple (tma.joined_encoder)."""

    __slots__ = ("transpose", "main", "_maps", "vt_shape", "device_id")

    def __init__(self, problem, q_strides: tuple, k_strides: tuple, v_strides: tuple, left: int, right: int,
                 softmax_scale: float | None, descale_stride: int, device_id: int, packed: tuple | None = None):
        b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.headdim
        sk, hk = problem.seqlen_k, problem.nheads_k
        rows_q, rows_k = packed or (sq, sk)
        band = left >= 0 or right >= 0
        spec = kernel_spec(d, band, sk)
        self.vt_shape, self.device_id, self.transpose = vt_shape(problem, band), device_id, None
        if spec.vt_pass:
            keys = self.vt_shape[3]
            tp = np.zeros((), dtype=TRANSPOSE_DTYPE)
            # packed: the row stride is the batch stride (cuda_src/seqlen.cuh)
            tp["v_batch_stride"], tp["v_row_stride"], tp["v_head_stride"] = (
                (v_strides[0],) + v_strides[:2] if packed else v_strides[:3])
            tp["seqlen_k"], tp["rows_k"], tp["keys"], tp["heads_k"], tp["headdim"] = sk, rows_k, keys, hk, d
            self.transpose = KernelCall([(build.get_kernel(Fp8TransposeSpec(), device_id),
                                          plan.check_grid((keys // 32, hk, b)), (Fp8TransposeSpec.threads,), 0)],
                                        tp, ("v", "vt", "cu_seqlens_k"))
        p = np.zeros((), dtype=PARAMS_DTYPE)
        p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"] = (h * d if packed else sq * h * d), h * d, d
        p["descale_batch_stride"] = descale_stride
        p["seqlen_q"], p["seqlen_k"], p["nheads"], p["heads_per_kv"] = sq, sk, h, h // hk
        p["rows_q"], p["rows_k"] = rows_q, rows_k
        p["window_left"], p["window_right"], p["headdim"] = left, right, d
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
        p["scale_log2"] = scale * math.log2(math.e)
        self.main = KernelCall([(build.get_kernel(spec, device_id), plan.check_grid((-(-sq // spec.block_m), h, b)),
                                 (spec.threads,), build.smem_bytes(spec, device_id))], p, ())
        # (d, heads, rows, batch) maps, packed (d, heads, total), boxes of 128 columns (bytes); V as K (the kernel
        # transposes its blocks), or V^T (keys, d, heads_k, batch) with D rows a box; O (bf16, contiguous) as Q, boxes
        # of one warp's 16 rows of a 64-column panel
        if packed:
            q_map = tma.encoder("uint8", (d, h, rows_q), _map_strides((1, rows_q, h, d), (0,) + q_strides)[:2],
                                (128, 1, spec.block_m))
            k_map, v_map = (tma.encoder("uint8", (d, hk, rows_k), _map_strides((1, rows_k, hk, d), (0,) + x)[:2],
                                        (128, 1, BLOCK_N)) for x in (k_strides, v_strides))
        else:
            q_map = tma.encoder("uint8", (d, h, sq, b), _map_strides((b, sq, h, d), q_strides),
                                (128, 1, spec.block_m, 1))
            k_map, v_map = (tma.encoder("uint8", (d, hk, sk, b), _map_strides((b, sk, hk, d), x), (128, 1, BLOCK_N, 1))
                            for x in (k_strides, v_strides))
        if spec.vt_pass:
            v_map = tma.encoder("uint8", (keys, d, hk, b), (keys, keys * d, keys * d * hk), (128, spec.headdim, 1, 1))
        o_strides = (2 * d, 2 * h * d, 2 * sq * h * d)  # bytes: heads, rows, batch (packed: no batch axis)
        o_map = (tma.encoder("bfloat16", (d, h, rows_q), o_strides[:2], (64, 1, 16)) if packed else
                 tma.encoder("bfloat16", (d, h, sq, b), o_strides, (64, 1, 16, 1)))
        self._maps = tma.joined_encoder((q_map, k_map, v_map, o_map))

    def __call__(self, stream: int, q: int, k: int, v: int, vt: int, o: int, lse: int = 0, q_descale: int = 0,
                 k_descale: int = 0, v_descale: int = 0, cu_seqlens_q: int = 0, cu_seqlens_k: int = 0) -> None:
        head = self._maps((q, k, vt if self.transpose else v, o)) + _HEAD_POINTERS.pack(
            o, lse, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k)
        if self.transpose:  # (after the maps: a map the driver refuses raises first)
            self.transpose(stream, v, vt, cu_seqlens_k)
        self.main.launch_head(stream, head)


def _map_strides(shape: tuple, strides: tuple) -> tuple:
    """A (batch, rows, heads, d) layout's byte strides as a tensor map takes them, (heads, rows, batch): an axis of
    extent 1 is only read at index 0, so its stride becomes the contiguous one (TMA wants positive multiples of 16)."""
    contiguous = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3])
    batch, rows, heads = (s if n > 1 else c for n, s, c in zip(shape[:3], strides[:3], contiguous))
    return heads, rows, batch


_calls: dict = {}  # key of an attention_fp8() call (runtime.call_key) -> its Fp8Call


@settings.on_change
def _forget() -> None:
    _calls.clear()


def descale_stride(problem, descales) -> int:
    """The batch stride of a call's descales (arrays or TensorSpecs, None where absent; the checks refuse a mix of
    forms): 0 for per-tensor ones, nheads_k for per-(sequence, KV head) ones (FwdFp8Params::descale_batch_stride,
    DecodeParams::descale_batch_stride)."""
    return problem.nheads_k if any(x is not None and math.prod(x.shape) > 1 for x in descales) else 0


def attention_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), return_lse=False):
    """FP8 (e4m3) attention on Hopper: out = softmax(scale (q q_descale) (k k_descale)^T) (v v_descale), in bf16.

    Parameters
    ----------
    q : cupy.ndarray, (batch, seqlen_q, nheads, headdim), uint8 holding e4m3 bits (CuPy has no float8 dtype; a
        torch ``float8_e4m3fn`` tensor's ``.view(torch.uint8)`` through DLPack is one)
    k, v : cupy.ndarray, (batch, seqlen_k, nheads_k, headdim), uint8 e4m3 bits; ``nheads % nheads_k == 0``
        headdim a multiple of 16 up to 256; the last axis contiguous, the other strides multiples of 16 bytes.
    q_descale, k_descale, v_descale : cupy.ndarray of float32, optional
        Dequantization factors: one per tensor (shape () or (1,)) or per (sequence, KV head), ``(batch, nheads_k)``
        contiguous (flash-attn 3's convention; the query heads of a KV head share its q_descale). None: 1.
    softmax_scale, causal, window_size, return_lse : as in :func:`cuflash.attention`

    Returns
    -------
    out : cupy.ndarray, (batch, seqlen_q, nheads, headdim), bfloat16
    lse : cupy.ndarray, (batch, nheads, seqlen_q), float32, only with ``return_lse``

    P is quantized to e4m3 as e4m3(256 P) / 256 for P V. Up to head dim 64, and up to 128 without a mask, the row
    sums that normalize the output, and the lse, are those of the e4m3 P, added up on the tensor cores; elsewhere
    those of the fp32 P (:func:`quantized_sums`). The error is that of :func:`cuflash.reference.attention_fp8` with that
    ``quantized_sums`` (docs/fp8.md). The kernel transposes V's blocks in shared memory; from :data:`VT_PASS_FROM`
    keys a pass over V transposes it first, into a workspace of ``batch nheads_k headdim ceil(seqlen_k / 32) 32``
    bytes.
    """
    descales = (q_descale, k_descale, v_descale)
    return _run(q, k, v, descales, None, softmax_scale, causal, window_size, return_lse)


def attention_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, q_descale=None,
                         k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         return_lse=False):
    """:func:`attention_fp8` over variable-length sequences packed along one token axis (flash-attn's layout, as
    :func:`cuflash.attention_varlen`).

    Parameters
    ----------
    q : cupy.ndarray, (total_q, nheads, headdim), uint8 holding e4m3 bits
    k, v : cupy.ndarray, (total_k, nheads_k, headdim), uint8 e4m3 bits; strides as :func:`attention_fp8`'s
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k : as in :func:`cuflash.attention_varlen`
        Starts and lengths read from device memory are bounded in the kernels to q's and k's rows.
    q_descale, k_descale, v_descale : cupy.ndarray of float32, optional
        Per tensor, or ``(batch, nheads_k)`` with row ``b`` for sequence ``b``.
    softmax_scale, causal, window_size, return_lse : as in :func:`attention_fp8`, per sequence

    Returns
    -------
    out : cupy.ndarray, (total_q, nheads, headdim), bfloat16; rows outside every sequence are not written
    lse : cupy.ndarray, (nheads, total_q), float32, only with ``return_lse``

    From :data:`VT_PASS_FROM` keys (``max_seqlen_k``), V's transpose workspace is ``batch nheads_k headdim
    ceil(max_seqlen_k / 32) 32`` bytes.
    """
    descales = (q_descale, k_descale, v_descale)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _run(q, k, v, descales, varlen, softmax_scale, causal, window_size, return_lse)


def _run(q, k, v, descales, varlen, softmax_scale, causal, window_size, return_lse):
    """attention_fp8 (varlen None) and attention_varlen_fp8 (varlen: cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k): checks and plan once per call signature, then the launch."""
    cu = varlen[:2] if varlen else (None, None)
    key, call = runtime.kept(_calls, (q, k, v) + descales + cu,
                             (softmax_scale, causal, window_size) + (varlen[2:] if varlen else ()))
    if call is None:
        q_descale, k_descale, v_descale = descales
        if varlen:
            problem = checks.check_varlen_fp8(q, k, v, *varlen, q_descale=q_descale, k_descale=k_descale,
                                              v_descale=v_descale, softmax_scale=softmax_scale, causal=causal,
                                              window_size=window_size)
        else:
            problem = checks.check_attention_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale,
                                                 v_descale=v_descale, softmax_scale=softmax_scale, causal=causal,
                                                 window_size=window_size)
        runtime.require_gpu()
        require_hopper(q.device.id)
        left, right = checks.window(causal, window_size)
        call = runtime.keep(_calls, key, Fp8Call(problem, q.strides, k.strides, v.strides, left, right, softmax_scale,
                                                 descale_stride(problem, descales), q.device.id,
                                                 (q.shape[0], k.shape[0]) if varlen else None))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.data.ptr % 16:
            raise ValueError(f"{name}: data pointer {x.data.ptr:#x} is not 16-byte aligned")
    import cupy
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, dtype=BF16)
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = cupy.empty(lse_shape, dtype=np.float32) if return_lse else None
        vt = cupy.empty(call.vt_shape, dtype=np.uint8) if call.vt_shape else None
        call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, runtime.ptr(vt), out.data.ptr,
             runtime.ptr(lse), *(runtime.ptr(x) for x in descales + cu))
    return (out, lse) if return_lse else out


def require_hopper(device: int) -> None:
    arch = build.device_arch(device)
    if arch != "sm_90a":
        raise NotImplementedError(f"attention_fp8 runs on Hopper (sm_90a) only; device {device} is {arch}")

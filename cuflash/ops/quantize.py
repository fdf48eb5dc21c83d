"""e4m3 quantization on the GPU (``cuda_src/quantize.cu``): :func:`quantize_e4m3` makes the e4m3 arrays and descales
that :func:`cuflash.attention_fp8` and an e4m3 KV cache take, from fp16 or bf16 arrays, without a trip to the host.
:func:`cuflash.reference.quantize_e4m3` is its float64 model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import build, checks, plan, runtime
from ..launcher import KernelCall

ROWS = 128  # rows of one head a block takes (quantize.cu QUANTIZE_ROWS)


@dataclass(frozen=True)
class QuantizeSpec(plan.HelperSpec):
    """e4m3_amax or e4m3_quantize (cuda_src/quantize.cu), templated on x's dtype."""

    source = "quantize.cu"


def descale_shape(batch: int, nheads_k: int, per: str) -> tuple:
    """The descales' shape: ``()`` per tensor, ``(batch, nheads_k)`` per (sequence, KV head)."""
    return () if per == "tensor" else (batch, nheads_k)


def all_specs(arch: str) -> list:
    return [QuantizeSpec(kernel, dtype) for dtype in ("fp16", "bf16") for kernel in ("e4m3_amax", "e4m3_quantize")]


PARAMS_DTYPE = plan.struct(["x", "x8", "amax", "descale"], ["x_batch_stride", "x_row_stride", "x_head_stride"],
                           ["seqlen", "nheads", "headdim", "heads_per_group", "group_batch_stride", "pow2", "given"],
                           [])


class QuantizeCall:
    """The kernels of one call signature: ``call(stream, x, x8, amax, descale)`` from data pointers, x8 contiguous,
    ``descale`` float32 with one element per group (:attr:`groups`) and ``amax`` a zeroed uint32 workspace of as
    many; with ``given`` the descales are the caller's, read as they are, and ``amax`` is not used (0). The descales
    found come back as :attr:`descale_shape`."""

    __slots__ = ("launch", "groups", "descale_shape", "device_id", "given")

    def __init__(self, sizes: tuple, x_strides: tuple, dtype, pow2: bool, device_id: int, given: bool = False):
        batch, seqlen, nheads, d, nheads_k, per = sizes
        tag = plan.DTYPES[np.dtype(dtype).name][0]
        p = np.zeros((), dtype=PARAMS_DTYPE)
        p["x_batch_stride"], p["x_row_stride"], p["x_head_stride"] = x_strides[:3]
        p["seqlen"], p["nheads"], p["headdim"] = seqlen, nheads, d
        p["heads_per_group"], p["group_batch_stride"] = (nheads // nheads_k, nheads_k) if per == "head" else (nheads, 0)
        p["pow2"], p["given"] = pow2, given
        self.descale_shape = descale_shape(batch, nheads_k, per)
        self.groups, self.device_id, self.given = math.prod(self.descale_shape), device_id, given
        grid = plan.check_grid((-(-seqlen // ROWS), nheads, batch))
        kernels = ("e4m3_quantize",) if given else ("e4m3_amax", "e4m3_quantize")
        self.launch = KernelCall([(build.get_kernel(QuantizeSpec(kernel, tag), device_id), grid,
                                   (QuantizeSpec.threads,), 0) for kernel in kernels], p,
                                 ("x", "x8", "amax", "descale"))

    def __call__(self, stream: int, x: int, x8: int, amax: int, descale: int) -> None:
        self.launch(stream, x, x8, amax, descale)


_calls: dict = {}  # key of a quantize_e4m3() call (runtime.call_key) -> its QuantizeCall


def quantize_e4m3(x, *, per="tensor", nheads_k=None, pow2=False, descale=None):
    """Quantize ``x`` to e4m3 on the GPU with amax scaling: ``(x8, descale)``, ``x ~ x8 * descale``.

    Parameters
    ----------
    x : cupy.ndarray, (batch, seqlen, nheads, headdim), float16 or bfloat16
        headdim a multiple of 16 up to 256; the last axis contiguous, other strides free. Packed sequences
        ``(total, nheads, headdim)`` quantize per tensor as ``x[None]``.
    per : "tensor" or "head"
        One descale for the whole tensor (shape ``()``), or one per (sequence, KV head) (shape ``(batch, nheads_k)``,
        the form :func:`cuflash.attention_fp8` and flash-attn 3 take).
    nheads_k : int, optional
        Groups x's heads as a GQA query's: head h shares the descale of KV head ``h // (nheads // nheads_k)``. None:
        x's heads.
    pow2 : bool
        The descale rounded up to a power of two (amax then maps into [224, 448]).
    descale : cupy.ndarray of float32, optional
        Quantize with these descales instead of finding them: ``()`` or ``(1,)``, or ``(batch, nheads_k)``
        contiguous (which sets ``per`` and ``nheads_k``), e.g. an e4m3 KV cache's ``k_descale`` for the rows appended
        to it. Values past ``448 * descale`` saturate. It is returned as it is; pow2 must be False.

    Returns
    -------
    x8 : cupy.ndarray, (batch, seqlen, nheads, headdim), uint8 holding e4m3 bits, contiguous
    descale : cupy.ndarray of float32, ``()`` or ``(batch, nheads_k)`` (or the one given)

    ``descale = amax / 448`` (1 where amax is 0) and ``x8 = e4m3(x / descale)``, rounded to nearest even and
    saturating, as :func:`cuflash.reference.quantize_e4m3`. A non-finite x gives a non-finite descale; a group whose
    amax is below float32's normal range (2^-126, bf16 only) quantizes as zeros with descale 1. Two kernels on the
    current stream: the group maxima, then the quantization (each reads x once); one with a given descale.
    """
    key, call = runtime.kept(_calls, (x, descale), (per, nheads_k, pow2))
    if call is None:
        sizes = checks.check_quantize_e4m3(x, per=per, nheads_k=nheads_k, pow2=pow2, descale=descale)
        runtime.require_cupy_arrays(x=x, descale=descale)
        runtime.require_gpu()
        call = runtime.keep(_calls, key, QuantizeCall(sizes, checks.elem_strides(x), x.dtype, bool(pow2),
                                                      x.device.id, descale is not None))
    import cupy
    with runtime.device(call.device_id):
        x8 = cupy.empty(x.shape, dtype=np.uint8)
        if call.given:
            call(cupy.cuda.get_current_stream().ptr, x.data.ptr, x8.data.ptr, 0, descale.data.ptr)
            return x8, descale
        amax = cupy.zeros(call.groups, dtype=np.uint32)
        found = cupy.empty(call.groups, dtype=np.float32)
        call(cupy.cuda.get_current_stream().ptr, x.data.ptr, x8.data.ptr, amax.data.ptr, found.data.ptr)
    return x8, found.reshape(call.descale_shape)

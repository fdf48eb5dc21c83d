"""e4m3 quantization on the GPU (``cuda_src/quantize.cu``): :func:`quantize_e4m3` makes the e4m3 arrays and descales
that :func:`cuflash.attention_fp8` and an e4m3 KV cache take, from fp16 or bf16 arrays, without a trip to the host.
:func:`cuflash.reference.quantize_e4m3` is its float64 model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import build, checks, plan, runtime
from ..launcher import KernelCall

ROWS = 64  # rows of one head a block takes (quantize.cu QUANTIZE_ROWS)


@dataclass(frozen=True)
class QuantizeSpec(plan.HelperSpec):
    """e4m3_amax or e4m3_quantize (cuda_src/quantize.cu), templated on x's dtype."""

    source = "quantize.cu"


def all_specs(arch: str) -> list:
    return [QuantizeSpec(kernel, dtype) for dtype in ("fp16", "bf16") for kernel in ("e4m3_amax", "e4m3_quantize")]


PARAMS_DTYPE = plan.struct(["x", "x8", "amax", "descale"], ["x_batch_stride", "x_row_stride", "x_head_stride"],
                           ["seqlen", "nheads", "headdim", "heads_per_group", "group_batch_stride", "pow2"],
                           [])


class QuantizeCall:
    """Both kernels of one call signature: ``call(stream, x, x8, amax, descale)`` from data pointers, ``amax`` a
    zeroed uint32 workspace and ``descale`` float32, one element per group each (:attr:`groups`), x8 contiguous."""

    __slots__ = ("launch", "groups", "device_id")

    def __init__(self, sizes: tuple, x_strides: tuple, dtype, per: str, pow2: bool, device_id: int):
        batch, seqlen, nheads, d, nheads_k = sizes
        tag = plan.DTYPES[np.dtype(dtype).name][0]
        p = np.zeros((), dtype=PARAMS_DTYPE)
        p["x_batch_stride"], p["x_row_stride"], p["x_head_stride"] = x_strides[:3]
        p["seqlen"], p["nheads"], p["headdim"] = seqlen, nheads, d
        p["heads_per_group"], p["group_batch_stride"] = (nheads // nheads_k, nheads_k) if per == "head" else (nheads, 0)
        p["pow2"] = pow2
        self.groups, self.device_id = (batch * nheads_k if per == "head" else 1), device_id
        grid = plan.check_grid((-(-seqlen // ROWS), nheads, batch))
        self.launch = KernelCall([(build.get_kernel(QuantizeSpec(kernel, tag), device_id), grid,
                                   (QuantizeSpec.threads,), 0) for kernel in ("e4m3_amax", "e4m3_quantize")],
                                 p, ("x", "x8", "amax", "descale"))

    def __call__(self, stream: int, x: int, x8: int, amax: int, descale: int) -> None:
        self.launch(stream, x, x8, amax, descale)


_calls: dict = {}  # key of a quantize_e4m3() call (runtime.call_key) -> its QuantizeCall


def quantize_e4m3(x, *, per="tensor", nheads_k=None, pow2=False):
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

    Returns
    -------
    x8 : cupy.ndarray, (batch, seqlen, nheads, headdim), uint8 holding e4m3 bits, contiguous
    descale : cupy.ndarray of float32, ``()`` or ``(batch, nheads_k)``

    ``descale = amax / 448`` (1 where amax is 0) and ``x8 = e4m3(x / descale)``, rounded to nearest even and
    saturating, as :func:`cuflash.reference.quantize_e4m3`. A non-finite x gives a non-finite descale; a group whose
    amax is below float32's normal range (2^-126, bf16 only) quantizes as zeros with descale 1. Two kernels on the
    current stream: the group maxima, then the quantization (each reads x once).
    """
    key, call = runtime.kept(_calls, (x,), (per, nheads_k, pow2))
    if call is None:
        sizes = checks.check_quantize_e4m3(x, per=per, nheads_k=nheads_k, pow2=pow2)
        if not isinstance(x, runtime.import_cupy().ndarray):
            raise TypeError(f"x: expected a cupy.ndarray, got {type(x).__module__}.{type(x).__name__} (torch and JAX "
                            "arrays convert without a copy: cupy.from_dlpack(x))")
        runtime.require_gpu()
        call = runtime.keep(_calls, key, QuantizeCall(sizes, checks.elem_strides(x), x.dtype, per, bool(pow2),
                                                      x.device.id))
    import cupy
    with cupy.cuda.Device(x.device.id):
        x8 = cupy.empty(x.shape, dtype=np.uint8)
        amax = cupy.zeros(call.groups, dtype=np.uint32)
        descale = cupy.empty(call.groups, dtype=np.float32)
        call(cupy.cuda.get_current_stream().ptr, x.data.ptr, x8.data.ptr, amax.data.ptr, descale.data.ptr)
    return x8, descale.reshape(() if per == "tensor" else (x.shape[0], call.groups // x.shape[0]))

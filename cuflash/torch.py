"""PyTorch entry points: torch tensors in and out, differentiable, zero-copy through DLPack.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)      # q (b, s, h, d) torch tensors on a GPU

Kernels run on ``torch.cuda.current_stream()``. Not yet: registration with ``torch.library`` (so
``torch.compile`` traces through without a graph break) and outputs from torch's caching allocator
(outputs come from CuPy's pool and are handed to torch without a copy).
"""
from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np
import torch

from . import api

__all__ = ["attention"]


def _to_cupy(t: torch.Tensor):
    """Zero-copy torch -> CuPy; bf16 travels as an int16 view when DLPack refuses it."""
    t = t.detach()  # DLPack exports no autograd state
    try:
        return cupy.from_dlpack(t)
    except Exception:
        if t.dtype != torch.bfloat16:
            raise
        return cupy.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)


def _to_torch(a) -> torch.Tensor:
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        try:
            return torch.from_dlpack(a)
        except Exception:
            return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _stream(t: torch.Tensor):
    return cupy.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream, t.device.index)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, options, deterministic):
        with cupy.cuda.Device(q.device.index):
            slopes = None if alibi_slopes is None else _to_cupy(alibi_slopes)
            out, lse = api.attention(_to_cupy(q), _to_cupy(k), _to_cupy(v), alibi_slopes=slopes, return_lse=True,
                                     stream=_stream(q), **options)
        out_t, lse_t = _to_torch(out), _to_torch(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t, alibi_slopes)
        ctx.options, ctx.deterministic = options, deterministic
        return out_t

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        with cupy.cuda.Device(q.device.index):
            slopes = None if alibi_slopes is None else _to_cupy(alibi_slopes)
            grads = api.attention_backward(_to_cupy(dout.contiguous()), _to_cupy(q), _to_cupy(k), _to_cupy(v),
                                           _to_cupy(out), _to_cupy(lse), alibi_slopes=slopes,
                                           deterministic=ctx.deterministic, stream=_stream(q), **ctx.options)
        return tuple(_to_torch(g) for g in grads) + (None, None, None)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              deterministic=False):
    """:func:`cuflash.attention` on torch tensors, differentiable (backward: :func:`cuflash.attention_backward`).

    q ``(batch, seqlen_q, nheads, headdim)``, k/v ``(batch, seqlen_k, nheads_k, headdim)``, float16 or
    bfloat16 CUDA tensors; returns ``out`` shaped like q. Masks are bottom-right aligned (unlike SDPA's
    ``is_causal``); see :func:`cuflash.attention` for every option.
    """
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size), softcap=softcap)
    return _Attention.apply(q, k, v, alibi_slopes, options, deterministic)

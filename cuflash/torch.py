"""PyTorch entry point: :func:`attention` on torch tensors, differentiable, a ``torch.library`` op.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)      # q (b, s, h, d) torch tensors on a GPU

Two custom ops, ``torch.ops.cuflash.attention_fwd`` (returns ``out, lse``) and
``torch.ops.cuflash.attention_bwd`` (returns ``dq, dk, dv``), each with a fake (shape-only)
implementation, and autograd wiring the first to the second: ``torch.compile`` traces through them
without a graph break.

Kernels run on ``torch.cuda.current_stream(q.device)``, on the tensors' own GPU. Outputs come from
torch's caching allocator (``torch.empty``), and so do the backward's workspaces (CuPy's allocator is
pointed at torch for the duration of the call). Inputs and outputs reach the launcher as CuPy views of the
same memory -- pointer, shape and strides, as DLPack would carry them, minus the capsule round trip. No
copy is made of anything.
"""
from __future__ import annotations

from typing import Optional

import cupy
import ml_dtypes
import numpy as np
import torch

from . import api, checks

__all__ = ["attention"]


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              return_lse=False, deterministic=False):
    """:func:`cuflash.attention` on torch tensors, differentiable in q, k and v.

    Parameters
    ----------
    q : torch.Tensor, (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device
    k, v : torch.Tensor, (batch, seqlen_k, nheads_k, headdim), dtype and device of q; ``nheads % nheads_k == 0``
        The last dimension must be contiguous; other strides are free (views of a packed qkv tensor work).
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As in :func:`cuflash.attention` (``alibi_slopes``: float32 ``(nheads,)`` or ``(batch, nheads)``,
        not differentiated). ``causal`` is bottom-right aligned when ``seqlen_q != seqlen_k``, unlike
        SDPA's ``is_causal`` (top-left). For seqlen_q = 2, seqlen_k = 5 (x = visible)::

            x x x x .
            x x x x x

    return_lse : bool
        Also return the float32 log-sum-exp ``(batch, nheads, seqlen_q)``; it is not differentiable.
    deterministic : bool
        Backward with a fixed dQ summation order: bitwise-repeatable gradients (a little slower).

    Returns
    -------
    out : torch.Tensor, (batch, seqlen_q, nheads, headdim), contiguous, dtype of q
    lse : torch.Tensor, (batch, nheads, seqlen_q), float32 -- only if ``return_lse``

    Examples
    --------
    >>> q, k, v = (torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ...            for _ in range(3))
    >>> cuflash.torch.attention(q, k, v, causal=True).sum().backward()
    """
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        checks.window(causal, window_size)  # raises the usual TypeError
    left, right = window_size
    out, lse = torch.ops.cuflash.attention_fwd(q, k, v, alibi_slopes, softmax_scale, causal, left, right, softcap,
                                               deterministic)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                   softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    options = _options(softmax_scale, causal, window_left, window_right, softcap)
    problem = _check_forward(q, k, v, alibi_slopes, options)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=torch.float32, device=q.device)
    with _on_torch_stream(q.device):
        api.launch_forward(problem, _view(q), _view(k), _view(v), _view(out), _view(lse),
                           alibi_slopes=_view(alibi_slopes), **options)
    return out, lse


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap,
                        deterministic):
    if _concrete(q, k, v, alibi_slopes):
        _check_forward(q, k, v, alibi_slopes, _options(softmax_scale, causal, window_left, window_right, softcap))
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, alibi_slopes: Optional[torch.Tensor], softmax_scale: Optional[float],
                   causal: bool, window_left: int, window_right: int, softcap: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(softmax_scale, causal, window_left, window_right, softcap)
    problem = _check_backward(dout, q, k, v, out, lse, alibi_slopes, options)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    with _on_torch_stream(q.device), cupy.cuda.using_allocator(_torch_allocator(q.device)):
        api.launch_backward(problem, _view(dout), _view(q), _view(k), _view(v), _view(out), _view(lse),
                            _view(dq), _view(dk), _view(dv), alibi_slopes=_view(alibi_slopes),
                            deterministic=deterministic, **options)
    return dq, dk, dv


@_attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal, window_left, window_right,
                        softcap, deterministic):
    if _concrete(dout, q, k, v, out, lse, alibi_slopes):
        _check_backward(dout, q, k, v, out, lse, alibi_slopes,
                        _options(softmax_scale, causal, window_left, window_right, softcap))
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = torch.ops.cuflash.attention_bwd(dout.contiguous(), q, k, v, out, lse, alibi_slopes, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Checks: cuflash.checks on TensorSpecs of the torch tensors, before anything is allocated
# --------------------------------------------------------------------------------------------

_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                 torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}


def _options(softmax_scale, causal, left, right, softcap) -> dict:
    return dict(softmax_scale=softmax_scale, causal=causal, window_size=(left, right), softcap=softcap)


_checked: dict = {}  # signature of a call -> its Problem: the checks run once per distinct signature


def _check_forward(q, k, v, alibi_slopes, options) -> checks.Problem:
    key = ("fwd", _signature(q), _signature(k), _signature(v), _signature(alibi_slopes), *options.values())
    problem = _checked.get(key)
    if problem is None:
        specs = _specs(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
        problem = checks.check_attention(specs["q"], specs["k"], specs["v"], alibi_slopes=specs["alibi_slopes"],
                                         **options)
        _require_cuda(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
        _remember(key, problem)
    _require_aligned(q=q, k=k, v=v)
    return problem


def _check_backward(dout, q, k, v, out, lse, alibi_slopes, options) -> checks.Problem:
    tensors = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes)
    key = ("bwd", *(_signature(t) for t in tensors.values()), *options.values())
    problem = _checked.get(key)
    if problem is None:
        s = _specs(**tensors)
        problem = checks.check_backward(s["dout"], s["q"], s["k"], s["v"], s["out"], s["lse"],
                                        alibi_slopes=s["alibi_slopes"], **options)
        _require_cuda(**tensors)
        _remember(key, problem)
    _require_aligned(dout=dout, q=q, k=k, v=v, out=out)
    return problem


def _signature(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _remember(key, problem) -> None:
    if len(_checked) > 4096:
        _checked.clear()
    _checked[key] = problem


def _specs(**tensors) -> dict:
    specs = {}
    for name, t in tensors.items():
        if t is None:
            specs[name] = None
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
        dtype = _NUMPY_DTYPES.get(t.dtype)
        if dtype is None:
            expected = "torch.float32" if name in ("alibi_slopes", "lse") else "torch.float16 or torch.bfloat16"
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected {expected}")
        device = t.device.index if t.device.type == "cuda" else None
        specs[name] = checks.TensorSpec(name, tuple(t.shape), dtype, tuple(t.stride()), device)
    return specs


def _require_cuda(**tensors) -> None:
    """CUDA tensors whose strides keep 16-byte chunks along the last axis aligned (the kernels copy 16 bytes
    at a time); the pointers are checked on every call by :func:`_require_aligned`."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
        if t.dtype == torch.float32:  # ALiBi slopes, lse: read one float at a time
            continue
        per16 = 16 // t.element_size()
        bad = [axis for axis, (n, s) in enumerate(zip(t.shape[:-1], t.stride()[:-1])) if n > 1 and s % per16]
        if bad:
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of {per16} "
                             f"elements); stride of axis {bad[0]} is {t.stride(bad[0])} elements")


def _require_aligned(**tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch._subclasses.FakeTensor):
            return
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of "
                             f"{16 // t.element_size()} elements); data pointer {t.data_ptr():#x}")


def _concrete(*tensors) -> bool:
    """All sizes and strides are plain ints (not symbolic): the checks would otherwise specialize them."""
    return all(t is None or all(isinstance(n, int) for n in (*t.shape, *t.stride())) for t in tensors)


# --------------------------------------------------------------------------------------------
# torch memory as CuPy arrays; torch's stream and allocator for CuPy
# --------------------------------------------------------------------------------------------

def _view(t: torch.Tensor | None):
    """A CuPy array over the tensor's memory (no copy; the tensor is kept alive by the view)."""
    if t is None:
        return None
    dtype = _NUMPY_DTYPES[t.dtype]
    itemsize = dtype.itemsize
    shape, strides = tuple(t.shape), t.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if t.numel() else 0
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), extent * itemsize, t, t.device.index)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), tuple(s * itemsize for s in strides))


_streams: dict = {}  # (device index, cudaStream_t) -> cupy.cuda.ExternalStream
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, without a torch.cuda.Stream object


class _on_torch_stream:
    """Context: CuPy's current device is the tensor's, its current stream torch's current stream there."""

    __slots__ = ("device", "stream")

    def __init__(self, device: torch.device):
        index = device.index
        handle = _raw_stream(index) if _raw_stream else torch.cuda.current_stream(index).cuda_stream
        stream = _streams.get((index, handle))
        if stream is None:
            if len(_streams) > 64:
                _streams.clear()
            stream = _streams[(index, handle)] = cupy.cuda.ExternalStream(handle, index)
        self.device, self.stream = cupy.cuda.Device(index), stream

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def _torch_allocator(device: torch.device):
    """A CuPy allocator over torch's caching allocator: each block is a torch uint8 tensor on ``device``,
    allocated on (and so ordered with) torch's current stream, freed when CuPy drops the array."""
    def malloc(nbytes: int):
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, device.index), 0)
    return malloc

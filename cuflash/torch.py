"""PyTorch entry points: cuflash's functions on torch tensors, as ``torch.library`` ops.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)      # q (b, s, h, d) torch tensors on a GPU

* :func:`attention` -- differentiable in q, k, v: ops ``cuflash::attention_fwd`` (``out, lse``) and
  ``cuflash::attention_bwd`` (``dq, dk, dv``);
* :func:`attention_varlen` -- packed variable-length sequences, differentiable in q, k, v:
  ``cuflash::attention_varlen_fwd`` and ``cuflash::attention_varlen_bwd``;
* :func:`attention_with_kvcache` -- decode against a KV cache, appending to it in place, not differentiable:
  ``cuflash::attention_with_kvcache`` (mutates ``k_cache``, ``v_cache``).

Every op has a fake (shape-only) implementation, and the forward ops carry their backward through
``register_autograd``, so ``torch.compile`` traces them without a graph break. A plain eager call skips the
op dispatcher (tens of microseconds of Python per call): it runs the same implementation directly, under a
``torch.autograd.Function`` when a gradient is needed. Anything that traces or intercepts -- torch.compile,
export, a dispatch mode, fake or functional tensors, functorch, the JIT tracer -- goes through the op.

Kernels run on ``torch.cuda.current_stream(q.device)``, on the tensors' own GPU. Outputs come from torch's
caching allocator, and so do the workspaces (CuPy's allocator is pointed at torch for the duration of the
call). Tensors reach the launcher as CuPy views of the same memory -- pointer, shape and strides, as DLPack
would carry them, minus the capsule round trip. No copy is made of anything.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import numpy as np

from .runtime import import_cupy

try:
    import torch
except ImportError as err:
    raise ModuleNotFoundError(f"cuflash.torch needs PyTorch: pip install torch ({err})", name=err.name) from err
cupy = import_cupy()
import ml_dtypes  # noqa: E402  (a dependency of cupy's bfloat16 support and of cuflash)

from . import checks, settings  # noqa: E402
from .ops import backward, decode, forward  # noqa: E402
from .options import resolve  # noqa: E402

__all__ = ["attention", "attention_varlen", "attention_with_kvcache"]


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
    left, right = _window(causal, window_size)
    out, lse = _differentiable(_Attention, (q, k, v),
                               (q, k, v, alibi_slopes, softmax_scale, causal, left, right, softcap, deterministic))
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False,
                     deterministic=False):
    """:func:`cuflash.attention_varlen` on torch tensors (flash-attn's ``flash_attn_varlen_func`` layout),
    differentiable in q, k and v.

    Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
    of k and v, attended on its own exactly as :func:`attention` with batch 1 would: masks are aligned
    bottom-right with the sequence's own lengths (``sq = 2``, ``sk = 5``, causal)::

        x x x x .
        x x x x x

    Parameters
    ----------
    q : torch.Tensor, (total_q, nheads, headdim), float16 or bfloat16, on a CUDA device
    k, v : torch.Tensor, (total_k, nheads_k, headdim), dtype and device of q; ``nheads % nheads_k == 0``
    cu_seqlens_q, cu_seqlens_k : torch.Tensor, int32, (batch + 1,), on q's device
        Cumulative sequence starts (``cu_seqlens[0] = 0``); read by the kernels, never by the host.
    max_seqlen_q, max_seqlen_k : int
        Upper bounds on the sequence lengths (they size the grid).
    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As in :func:`attention`, per sequence; ``alibi_slopes`` row ``b`` is sequence ``b``'s.
    return_lse : bool
        Also return the float32 log-sum-exp ``(nheads, total_q)``; it is not differentiable.

    Returns
    -------
    out : torch.Tensor, (total_q, nheads, headdim), contiguous, dtype of q
    lse : torch.Tensor, (nheads, total_q), float32 -- only if ``return_lse``

    Rows of q outside every sequence get unspecified out/lse and zero dq; keys outside every sequence get
    unspecified dk/dv.

    Examples
    --------
    >>> cu = torch.tensor([0, 100, 612], dtype=torch.int32, device="cuda")     # lengths 100 and 512
    >>> q = torch.randn(612, 16, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    >>> cuflash.torch.attention_varlen(q, q, q, cu, cu, 512, 512, causal=True).sum().backward()
    """
    left, right = _window(causal, window_size)
    out, lse = _differentiable(_AttentionVarlen, (q, k, v), (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                              max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                                              left, right, softcap, deterministic))
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                           block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, num_splits=0, return_lse=False):
    """:func:`cuflash.attention_with_kvcache` on torch tensors: new query rows against a KV cache (decode).

    Not differentiable. When ``k`` and ``v`` are given, they are written into ``k_cache``/``v_cache`` in
    place, at positions ``cache_seqlens[b] ..``, before attending (the op declares both caches mutated).

    Parameters
    ----------
    q : torch.Tensor, (batch, seqlen_new, nheads, headdim), float16 or bfloat16, on a CUDA device
    k_cache, v_cache : torch.Tensor
        ``(batch_cache, max_len, nheads_k, headdim)``, or with ``block_table`` a page pool
        ``(num_pages, page_size, nheads_k, headdim)`` (page_size a multiple of 16).
    k, v : torch.Tensor, (batch, seqlen_new_k, nheads_k, headdim), optional
        Appended to the cache in place before attending.
    cache_seqlens : int or torch.Tensor int32 (batch,), optional
        Keys already in the cache per batch row, before the append; default the whole capacity.
    cache_batch_idx : torch.Tensor int32 (batch,), optional
        Batch row b reads (and appends to) cache row ``cache_batch_idx[b]``. Not with ``block_table``.
    block_table : torch.Tensor int32 (batch, max_pages), optional
        Logical position p of row b lives at page ``block_table[b, p // page_size]``, row ``p % page_size``.
    softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits
        As in :func:`cuflash.attention_with_kvcache`. Row b attends to ``L_b = cache_seqlens[b] +
        seqlen_new_k`` keys; masks are aligned bottom-right over that length.
    return_lse : bool
        Also return the float32 log-sum-exp ``(batch, nheads, seqlen_new)``.

    Returns
    -------
    out : torch.Tensor, (batch, seqlen_new, nheads, headdim), contiguous, dtype of q
    lse : torch.Tensor, (batch, nheads, seqlen_new), float32 -- only if ``return_lse``

    Examples
    --------
    >>> k_cache = torch.zeros(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16); v_cache = torch.zeros_like(k_cache)
    >>> lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    >>> out = cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens)
    """
    left, right = _window(causal, window_size)
    seqlens, cache_len = _cache_seqlens(cache_seqlens)
    args = (q, k_cache, v_cache, k, v, seqlens, cache_len, cache_batch_idx, block_table, alibi_slopes,
            softmax_scale, causal, left, right, softcap, num_splits, return_lse)
    if _eager(q, k_cache, v_cache):
        out, lse = _kvcache(*args)
        if k is not None:  # as the op's in-place bookkeeping does: autograd sees the caches as modified
            torch.autograd.graph.increment_version((k_cache, v_cache))
    else:
        out, lse = torch.ops.cuflash.attention_with_kvcache(*args)
    return (out, lse) if return_lse else out


def _window(causal, window_size) -> tuple:
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        checks.window(causal, window_size)  # raises the usual TypeError
    return tuple(window_size)


def _cache_seqlens(cache_seqlens) -> tuple:
    """The op's two arguments for ``cache_seqlens``: (int32 tensor or None, int or -1 for none)."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens, -1
    if not checks.is_int(cache_seqlens):
        raise TypeError(f"cache_seqlens: expected an int or an int32 tensor, got "
                        f"{type(cache_seqlens).__name__} {cache_seqlens!r}")
    if cache_seqlens < 0:
        raise ValueError(f"cache_seqlens: expected an int >= 0, got {cache_seqlens!r}")
    return None, cache_seqlens


# --------------------------------------------------------------------------------------------
# Eager or traced: the ops when something traces or intercepts, else their implementations directly
# --------------------------------------------------------------------------------------------

def _eager(*tensors) -> bool:
    """A plain eager call on real tensors: nothing that should see the op is tracing or intercepting."""
    return (not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in tensors)
            and not torch._C._len_torch_dispatch_stack() and not torch._C._are_functorch_transforms_active()
            and not torch._C._get_tracing_state())


class _Differentiable(NamedTuple):
    op: object        # the forward op, with its backward registered
    impl: Callable    # the op's implementation
    function: type    # a torch.autograd.Function of the implementations of the op and its backward op


def _differentiable(ops: _Differentiable, tensors, args):
    """``ops.op(*args)``; eagerly the same implementation, under the autograd.Function when a gradient is needed,
    else directly."""
    if not _eager(*tensors):
        return ops.op(*args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return ops.function.apply(*args)
    return ops.impl(*args)


# --------------------------------------------------------------------------------------------
# Dense attention: forward and backward ops
# --------------------------------------------------------------------------------------------

def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                   softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    options = _options(softmax_scale, causal, window_left, window_right, softcap)
    problem, launch = _check_forward(q, k, v, alibi_slopes, options, _forward_launch)
    _require_aligned(q=q, k=k, v=v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=torch.float32)
    launch(q, k, v, out, lse, alibi_slopes)
    return out, lse


def _forward_launch(problem, specs: dict, options: dict):
    """The forward of one call signature (built once): a function ``(q, k, v, out, lse, alibi_slopes)`` that
    launches it on torch's current stream into a contiguous ``out`` and ``lse`` -- raw pointers, no views."""
    q, index = specs["q"], specs["q"].device
    lse_shape = (problem.batch, problem.nheads, problem.seqlen_q)
    with cupy.cuda.Device(index):
        call = forward.forward_call(problem, q, specs["k"], specs["v"], checks.contiguous("out", q.shape, q.dtype),
                                    checks.contiguous("lse", lse_shape, np.float32),
                                    resolve(problem, alibi_slopes=specs["alibi_slopes"], **options), device_id=index,
                                    alibi_slopes=specs["alibi_slopes"])

    def launch(q, k, v, out, lse, alibi_slopes):
        with _on_device(index) as stream:
            call(stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                 0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0, 0)
    return launch


def _attention_fwd_fake(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap,
                        deterministic):
    if _concrete(q, k, v, alibi_slopes):
        _check_forward(q, k, v, alibi_slopes, _options(softmax_scale, causal, window_left, window_right, softcap))
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, alibi_slopes: Optional[torch.Tensor], softmax_scale: Optional[float],
                   causal: bool, window_left: int, window_right: int, softcap: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(softmax_scale, causal, window_left, window_right, softcap)
    _, launch = _check_backward(dout, q, k, v, out, lse, alibi_slopes, options, deterministic, _backward_launch)
    _require_aligned(dout=dout, q=q, k=k, v=v, out=out)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    launch(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes)
    return dq, dk, dv


def _backward_launch(problem, specs: dict, options: dict, deterministic: bool):
    """The backward of one call signature (built once): a function ``(dout, q, k, v, out, lse, dq, dk, dv,
    alibi_slopes)`` launching it on torch's current stream into contiguous dq, dk, dv, with its workspace from
    torch's caching allocator."""
    index = specs["q"].device
    grads = (checks.contiguous(n, specs[x].shape, specs[x].dtype) for n, x in (("dq", "q"), ("dk", "k"), ("dv", "v")))
    with cupy.cuda.Device(index):
        call = backward.backward_call(problem, specs["dout"], specs["q"], specs["k"], specs["v"], specs["out"],
                                      specs["lse"], *grads, resolve(problem, alibi_slopes=specs["alibi_slopes"],
                                                                    **options),
                                      device_id=index, alibi_slopes=specs["alibi_slopes"],
                                      deterministic=deterministic, packed=False)
    device = torch.device("cuda", index)

    def launch(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes):
        workspace = torch.empty(call.workspace_bytes, dtype=torch.uint8, device=device)  # freed in stream order
        with _on_device(index) as stream:
            call(stream, dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                 dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), 0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                 0, 0, workspace.data_ptr())
    return launch


def _attention_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal, window_left, window_right,
                        softcap, deterministic):
    if _concrete(dout, q, k, v, out, lse, alibi_slopes):
        _check_backward(dout, q, k, v, out, lse, alibi_slopes,
                        _options(softmax_scale, causal, window_left, window_right, softcap))
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


# --------------------------------------------------------------------------------------------
# Varlen attention: forward and backward ops
# --------------------------------------------------------------------------------------------

def _attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, alibi_slopes: Optional[torch.Tensor], max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int,
                          window_right: int, softcap: float,
                          deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    options = _options(softmax_scale, causal, window_left, window_right, softcap)
    problem = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, options)
    _require_aligned(q=q, k=k, v=v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((problem.nheads, q.shape[0]), dtype=torch.float32)
    with _on_torch_stream(q.device.index):
        forward.launch(problem, _view(q), _view(k), _view(v), _view(out), _view(lse),
                           alibi_slopes=_view(alibi_slopes), cu_seqlens_q=_view(cu_seqlens_q),
                           cu_seqlens_k=_view(cu_seqlens_k), **options)
    return out, lse


def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap, deterministic):
    if _concrete(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, ints=(max_seqlen_q, max_seqlen_k)):
        _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                      _options(softmax_scale, causal, window_left, window_right, softcap))
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          alibi_slopes: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                          softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                          softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(softmax_scale, causal, window_left, window_right, softcap)
    problem = _check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                     max_seqlen_q, max_seqlen_k, options)
    _require_aligned(dout=dout, q=q, k=k, v=v, out=out)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    index = q.device.index
    with _on_torch_stream(index), cupy.cuda.using_allocator(_torch_allocator(index)):
        backward.launch(problem, _view(dout), _view(q), _view(k), _view(v), _view(out), _view(lse),
                            _view(dq), _view(dk), _view(dv), alibi_slopes=_view(alibi_slopes),
                            deterministic=deterministic, cu_seqlens_q=_view(cu_seqlens_q),
                            cu_seqlens_k=_view(cu_seqlens_k), **options)
    return dq, dk, dv


def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    if _concrete(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, ints=(max_seqlen_q, max_seqlen_k)):
        _check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
                               max_seqlen_k, _options(softmax_scale, causal, window_left, window_right, softcap))
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


# --------------------------------------------------------------------------------------------
# KV-cache attention: one op that mutates the caches
# --------------------------------------------------------------------------------------------

def _kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
             v: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor], cache_len: int,
             cache_batch_idx: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
             alibi_slopes: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
             window_right: int, softcap: float, num_splits: int,
             return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache_seqlens`` is given as a tensor, or as the int ``cache_len`` (-1: neither). Returns ``out, lse``;
    lse is empty, ``(0,)``, unless ``return_lse``."""
    seqlens = cache_seqlens if cache_seqlens is not None else None if cache_len < 0 else cache_len
    out, lse = _kvcache_compute(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, cache_batch_idx=cache_batch_idx,
                                block_table=block_table, alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
                                causal=causal, window_size=(window_left, window_right), softcap=softcap,
                                num_splits=num_splits, return_lse=return_lse)
    return out, lse if return_lse else q.new_empty((0,), dtype=torch.float32)


_kv_plans: dict = {}  # signature of a kvcache call -> its decode.DecodeCall
settings.on_change(_kv_plans.clear)
_KV_TENSORS = ("q", "k_cache", "v_cache", "k", "v", "cache_batch_idx", "block_table", "alibi_slopes")


def _kvcache_compute(q, k_cache, v_cache, *, cache_seqlens, return_lse, **options) -> tuple:
    """cuflash.attention_with_kvcache on torch tensors (``cache_seqlens`` a tensor, an int or None): checks and
    plan once per signature (:func:`_kvcache_plan`), then one torch allocation and the launches on torch's
    stream, from data pointers. Returns ``(out, lse or None)``."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, **{n: options.pop(n) for n in _KV_TENSORS[3:]})
    seqlens_key = _signature(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else ("int", cache_seqlens)
    key = (seqlens_key, return_lse, *options.values(), *map(_signature, tensors.values()))
    prep = _kv_plans.get(key)
    if prep is None:
        prep = _kvcache_plan(key, tensors, cache_seqlens, options, return_lse)
    for name in _KV_TENSORS[:5]:
        t = tensors[name]
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name}: must be 16-byte aligned; data pointer {t.data_ptr():#x}")
    index = q.device.index
    block = torch.empty(prep.nbytes, dtype=torch.uint8, device=q.device)  # out | lse | split workspace
    ptr = [0 if tensors[n] is None else tensors[n].data_ptr() for n in _KV_TENSORS]
    seqlens_ptr = cache_seqlens.data_ptr() if isinstance(cache_seqlens, torch.Tensor) else 0
    # the split counters, allocated once per stream, come from torch's allocator (safe under graph capture)
    with _on_device(index) as stream, cupy.cuda.using_allocator(_torch_allocator(index)):
        decode.run(prep, stream, block.data_ptr(), *ptr[:5], seqlens_ptr, *ptr[5:], return_lse)
    out = block[:q.numel() * q.element_size()].view(q.dtype).view(q.shape)
    if not return_lse:
        return out, None
    # out and lse share the block; an op's outputs must not alias each other, so lse (small) gets its own
    lse = block[prep.lse_offset:prep.lse_offset + 4 * math.prod(prep.lse_shape)]
    return out, lse.view(torch.float32).view(prep.lse_shape).clone()


def _kvcache_plan(key: tuple, tensors: dict, cache_seqlens, options: dict, return_lse: bool):
    """Checks a kvcache call and plans it (decode.prepare on CuPy views of the tensors); remembered under `key`."""
    is_tensor = isinstance(cache_seqlens, torch.Tensor)
    cache_len = -1 if cache_seqlens is None or is_tensor else cache_seqlens
    window = options["window_size"]
    _check_kvcache(dict(tensors, cache_seqlens=cache_seqlens if is_tensor else None), cache_len,
                   dict(_options(options["softmax_scale"], options["causal"], *window, options["softcap"]),
                        num_splits=options["num_splits"]))
    views = {name: _view(t) for name, t in tensors.items()}
    with _on_device(tensors["q"].device.index):
        prep = decode.prepare(views["q"], views["k_cache"], views["v_cache"], views["k"], views["v"],
                              _view(cache_seqlens) if is_tensor else cache_seqlens, views["cache_batch_idx"],
                              views["block_table"], options["softmax_scale"], options["causal"], window,
                              options["softcap"], views["alibi_slopes"], options["num_splits"], return_lse)
    if len(_kv_plans) > 4096:
        _kv_plans.clear()
    _kv_plans[key] = prep
    return prep


def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_len, cache_batch_idx, block_table, alibi_slopes,
                  softmax_scale, causal, window_left, window_right, softcap, num_splits, return_lse):
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                   cache_batch_idx=cache_batch_idx, block_table=block_table, alibi_slopes=alibi_slopes)
    if _concrete(*tensors.values(), ints=(cache_len, num_splits)):
        _check_kvcache(tensors, cache_len,
                       dict(_options(softmax_scale, causal, window_left, window_right, softcap), num_splits=num_splits))
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq) if return_lse else (0,), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Registration: ops, fake implementations, autograd (the ops' and the eager autograd.Functions)
# --------------------------------------------------------------------------------------------

def _register(name, fn, fake, mutates_args=()):
    op = torch.library.custom_op(f"cuflash::{name}", fn, mutates_args=mutates_args)
    op.register_fake(fake)
    return op


_attention_fwd_op = _register("attention_fwd", _attention_fwd, _attention_fwd_fake)
_attention_bwd_op = _register("attention_bwd", _attention_bwd, _attention_bwd_fake)
_attention_varlen_fwd_op = _register("attention_varlen_fwd", _attention_varlen_fwd, _attention_varlen_fwd_fake)
_attention_varlen_bwd_op = _register("attention_varlen_bwd", _attention_varlen_bwd, _attention_varlen_bwd_fake)
_kvcache_op = _register("attention_with_kvcache", _kvcache, _kvcache_fake, mutates_args=("k_cache", "v_cache"))


def _autograd(forward_op, forward, backward, backward_op, tensors: int) -> _Differentiable:
    """Wire ``backward`` to ``forward``: the op ``backward_op`` to ``forward_op`` (register_autograd), and the
    plain functions in an autograd.Function for eager calls.

    The forward's arguments are q, k, v, then ``tensors - 3`` more tensors (not differentiated), then options;
    it returns ``out, lse``. The backward takes ``dout, q, k, v, out, lse``, the other tensors and the options,
    and returns ``dq, dk, dv``.
    """
    def setup_context(ctx, inputs, output):
        out, lse = output
        ctx.save_for_backward(*inputs[:3], out, lse, *inputs[3:tensors])
        ctx.options = inputs[tensors:]
        ctx.mark_non_differentiable(lse)

    def gradients(run):
        def grads(ctx, dout, _dlse):
            dq, dk, dv = run(dout.contiguous(), *ctx.saved_tensors, *ctx.options)
            return (dq, dk, dv) + (None,) * (tensors - 3 + len(ctx.options))
        return grads

    def forward_with_context(ctx, *inputs):  # forward(ctx, ...): apply() then skips binding the arguments
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    forward_op.register_autograd(gradients(backward_op), setup_context=setup_context)
    function = type(f"{forward.__name__}_function", (torch.autograd.Function,), dict(
        forward=staticmethod(forward_with_context),
        backward=staticmethod(torch.autograd.function.once_differentiable(gradients(backward)))))
    return _Differentiable(forward_op, forward, function)


_Attention = _autograd(_attention_fwd_op, _attention_fwd, _attention_bwd, torch.ops.cuflash.attention_bwd, 4)
_AttentionVarlen = _autograd(_attention_varlen_fwd_op, _attention_varlen_fwd, _attention_varlen_bwd,
                             torch.ops.cuflash.attention_varlen_bwd, 6)


# --------------------------------------------------------------------------------------------
# Checks: cuflash.checks on TensorSpecs of the torch tensors, once per call signature
# --------------------------------------------------------------------------------------------

_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                 torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}
_TORCH_DTYPES = {v: k for k, v in _NUMPY_DTYPES.items()}
_EXPECTED_DTYPE = dict(alibi_slopes="torch.float32", lse="torch.float32", cu_seqlens_q="torch.int32",
                       cu_seqlens_k="torch.int32", cache_seqlens="torch.int32", cache_batch_idx="torch.int32",
                       block_table="torch.int32")


def _options(softmax_scale, causal, left, right, softcap) -> dict:
    return dict(softmax_scale=softmax_scale, causal=causal, window_size=(left, right), softcap=softcap)


def _check_forward(q, k, v, alibi_slopes, options, make_launch=None):
    """(Problem, make_launch(problem, specs, options) or None), once per signature."""
    return _checked(("fwd", *options.values()), dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes), lambda s: (
        checks.check_attention(s["q"], s["k"], s["v"], alibi_slopes=s["alibi_slopes"], **options)),
        make_launch and (lambda problem, s: make_launch(problem, s, options)))


def _check_backward(dout, q, k, v, out, lse, alibi_slopes, options, deterministic=False, make_launch=None):
    """(Problem, make_launch(problem, specs, options, deterministic) or None), once per signature."""
    tensors = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes)
    return _checked(("bwd", bool(deterministic), *options.values()), tensors, lambda s: checks.check_backward(
        s["dout"], s["q"], s["k"], s["v"], s["out"], s["lse"], alibi_slopes=s["alibi_slopes"], **options),
        make_launch and (lambda problem, s: make_launch(problem, s, options, bool(deterministic))))


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, options):
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    return _checked_problem(("varlen", max_seqlen_q, max_seqlen_k, *options.values()), tensors,
                            lambda s: checks.check_varlen(
                                s["q"], s["k"], s["v"], s["cu_seqlens_q"], s["cu_seqlens_k"], max_seqlen_q,
                                max_seqlen_k, alibi_slopes=s["alibi_slopes"], **options))


def _check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
                           max_seqlen_k, options):
    tensors = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   alibi_slopes=alibi_slopes)
    return _checked_problem(("varlen_bwd", max_seqlen_q, max_seqlen_k, *options.values()), tensors, lambda s: (
        checks.check_varlen_backward(s["dout"], s["q"], s["k"], s["v"], s["out"], s["lse"], s["cu_seqlens_q"],
                                     s["cu_seqlens_k"], max_seqlen_q, max_seqlen_k, alibi_slopes=s["alibi_slopes"],
                                     **options)))


def _check_kvcache(tensors: dict, cache_len: int, options: dict) -> checks.Problem:
    def check(s):
        seqlens = s["cache_seqlens"] if s["cache_seqlens"] is not None else None if cache_len < 0 else cache_len
        return checks.check_kvcache(s["q"], s["k_cache"], s["v_cache"], k=s["k"], v=s["v"], cache_seqlens=seqlens,
                                    cache_batch_idx=s["cache_batch_idx"], block_table=s["block_table"],
                                    alibi_slopes=s["alibi_slopes"], **options)
    return _checked_problem(("kvcache", cache_len, *options.values()), tensors, check)


_problems: dict = {}  # signature of a call -> (Problem, launch or None): checks and planning once per signature
settings.on_change(_problems.clear)  # launches planned under other settings are dropped


def _checked_problem(values: tuple, tensors: dict, check) -> checks.Problem:
    return _checked(values, tensors, check)[0]


def _checked(values: tuple, tensors: dict, check, make_launch=None) -> tuple:
    """``check(specs)`` (TensorSpecs of ``tensors`` by name), then the CUDA requirements, then
    ``make_launch(problem, specs)`` if given -- once per signature of the tensors (shape, strides, dtype, device)
    and ``values``; later calls get the remembered ``(problem, launch)``."""
    key = (make_launch is not None, *values, *map(_signature, tensors.values()))
    hit = _problems.get(key)
    if hit is None:
        specs = _specs(tensors)
        problem = check(specs)
        _require_cuda(**tensors)
        hit = (problem, make_launch(problem, specs) if make_launch is not None else None)
        if len(_problems) > 4096:
            _problems.clear()
        _problems[key] = hit
    return hit


def _signature(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _specs(tensors: dict) -> dict:
    specs = {}
    for name, t in tensors.items():
        if t is None:
            specs[name] = None
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
        dtype = _NUMPY_DTYPES.get(t.dtype)
        if dtype is None:
            expected = _EXPECTED_DTYPE.get(name, "torch.float16 or torch.bfloat16")
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected {expected}")
        device = t.device.index if t.device.type == "cuda" else None
        specs[name] = checks.TensorSpec(name, tuple(t.shape), dtype, tuple(t.stride()), device)
    return specs


def _require_cuda(**tensors) -> None:
    """CUDA tensors; fp16/bf16 ones with strides that keep 16-byte chunks along the last axis aligned (the
    kernels copy 16 bytes at a time); the pointers are checked on every call by :func:`_require_aligned`."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
        if t.dtype not in (torch.float16, torch.bfloat16):  # slopes, lse, index arrays: one element at a time
            continue
        per16 = 16 // t.element_size()
        bad = [axis for axis, (n, s) in enumerate(zip(t.shape[:-1], t.stride()[:-1])) if n > 1 and s % per16]
        if bad:
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of {per16} "
                             f"elements); stride of axis {bad[0]} is {t.stride(bad[0])} elements")


def _require_aligned(**tensors) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of "
                             f"{16 // t.element_size()} elements); data pointer {t.data_ptr():#x}")


def _concrete(*tensors, ints=()) -> bool:
    """All sizes, strides and ints are plain ints (not symbolic): the checks would otherwise specialize them."""
    return all(isinstance(n, int) for n in ints) and all(
        t is None or all(isinstance(n, int) for n in (*t.shape, *t.stride())) for t in tensors)


# --------------------------------------------------------------------------------------------
# torch memory as CuPy arrays and back; torch's stream and allocator for CuPy
# --------------------------------------------------------------------------------------------

_layouts: dict = {}  # (shape, strides, dtype) of a tensor -> what its CuPy view needs besides the pointer


def _view(t: torch.Tensor | None):
    """A CuPy array over the tensor's memory (no copy; the tensor is kept alive by the view)."""
    if t is None:
        return None
    key = (t.shape, t.stride(), t.dtype)
    layout = _layouts.get(key)
    if layout is None:
        dtype = _NUMPY_DTYPES[t.dtype]
        shape, strides = tuple(t.shape), t.stride()
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if t.numel() else 0
        if len(_layouts) > 4096:
            _layouts.clear()
        layout = _layouts[key] = (shape, dtype, tuple(s * dtype.itemsize for s in strides), extent * dtype.itemsize)
    shape, dtype, strides, nbytes = layout
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.get_device())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


_streams: dict = {}  # (device index, cudaStream_t) -> cupy.cuda.ExternalStream
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, without a torch.cuda.Stream object


class _on_torch_stream:
    """Context: CuPy's current device is ``index`` (switched only if it is not already), its current stream
    torch's current stream there."""

    __slots__ = ("index", "stream", "previous")

    def __init__(self, index: int):
        handle = _raw_stream(index) if _raw_stream else torch.cuda.current_stream(index).cuda_stream
        stream = _streams.get((index, handle))
        if stream is None:
            if len(_streams) > 64:
                _streams.clear()
            stream = _streams[(index, handle)] = cupy.cuda.ExternalStream(handle, index)
        self.index, self.stream = index, stream

    def __enter__(self):
        self.previous = cupy.cuda.runtime.getDevice()
        if self.previous != self.index:
            cupy.cuda.runtime.setDevice(self.index)
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        if self.previous != self.index:
            cupy.cuda.runtime.setDevice(self.previous)


class _on_device:
    """Context: device ``index`` is current (switched only if it is not already); gives torch's current stream
    there, as a ``cudaStream_t`` handle."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> int:
        self.previous = cupy.cuda.runtime.getDevice()
        if self.previous != self.index:
            cupy.cuda.runtime.setDevice(self.index)
        return _raw_stream(self.index) if _raw_stream else torch.cuda.current_stream(self.index).cuda_stream

    def __exit__(self, *exc):
        if self.previous != self.index:
            cupy.cuda.runtime.setDevice(self.previous)


_allocators: dict = {}  # device index -> the allocator below


def _torch_allocator(index: int, blocks: list | None = None):
    """A CuPy allocator over torch's caching allocator: each block is a torch uint8 tensor on device ``index``,
    allocated on (and so ordered with) torch's current stream, freed when CuPy drops the array. Blocks are also
    appended to ``blocks`` when it is given."""
    malloc = _allocators.get(index) if blocks is None else None
    if malloc is None:
        device = torch.device("cuda", index)

        def malloc(nbytes: int):
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if blocks is not None:
                blocks.append(t)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, index), 0)
        if blocks is None:
            _allocators[index] = malloc
    return malloc

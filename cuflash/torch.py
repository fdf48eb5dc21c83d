"""PyTorch entry points: cuflash's functions on torch tensors, as ``torch.library`` ops.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)      # q (b, s, h, d) torch tensors on a GPU

* :func:`attention` -- differentiable in q, k, v: ops ``cuflash::attention_fwd`` (``out, lse``) and
  ``cuflash::attention_bwd`` (``dq, dk, dv``);
* :func:`attention_varlen` -- packed variable-length sequences, differentiable in q, k, v:
  ``cuflash::attention_varlen_fwd`` and ``cuflash::attention_varlen_bwd``;
* :func:`attention_with_kvcache` -- decode against a KV cache, appending to it in place, not differentiable:
  ``cuflash::attention_with_kvcache`` (mutates ``k_cache``, ``v_cache``);
* :func:`attention_fp8`, :func:`attention_varlen_fp8` -- the FP8 forward: ``cuflash::attention_fp8`` and
  ``cuflash::attention_varlen_fp8``;
* :func:`quantize_e4m3` -- fp16 or bf16 to float8_e4m3fn with amax descales: ``cuflash::quantize_e4m3``.

Every op has a fake (shape-only) implementation, and the forward ops carry their backward through
``register_autograd``, so ``torch.compile`` traces them without a graph break. A plain eager call skips the
op dispatcher (tens of microseconds of Python per call): it runs the same implementation directly, under a
``torch.autograd.Function`` when a gradient is needed. Anything that traces or intercepts -- torch.compile,
export, a dispatch mode, fake or functional tensors, functorch, the JIT tracer -- goes through the op. With
``dropout_p > 0`` such a call draws the mask's seed and offset in the graph (:func:`_graph_dropout`), where an
eager call reads them from torch's generator on the host.

The first call with a given signature -- shapes, strides, dtypes, devices of the tensors, and the options --
checks it and plans its launches; later calls with that signature look the plan up, allocate their outputs
(and workspaces) from torch's caching allocator, and launch on ``torch.cuda.current_stream(q.device)`` from
the tensors' data pointers. No copy is made of anything. The one buffer outside torch's allocator is the
KV-cache op's split counters, a few kilobytes kept per stream; a call captured into a CUDA graph keeps its
counters in its own allocation instead, so a graph owns all the memory it uses.

Head dims run from 1 to 256. One that is not a multiple of 8 runs on zero-padded copies made with torch ops, and
``out`` is then a view of the padded result (see ``_padded_attention`` and docs/api.md for the cost); ``window_size``
is a pair given as a tuple, a list or a 2-element integer tensor.
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

from . import checks, runtime, settings  # noqa: E402
from .ops import backward, decode, forward, forward_fp8, quantize  # noqa: E402
from .options import resolve  # noqa: E402

__all__ = ["attention", "attention_fp8", "attention_varlen", "attention_varlen_fp8", "attention_with_kvcache",
           "quantize_e4m3"]


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              return_lse=False, deterministic=False, dropout_p=0.0):
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
    dropout_p : float
        Dropout on the attention probabilities (:func:`cuflash.attention`), its mask drawn from torch's CUDA
        generator of q's device (its seed; its offset, which the call advances by 4, as torch's own random
        operations do), so ``torch.manual_seed`` governs it; the backward regenerates the same mask. Under CUDA-graph
        capture, torch.compile and tracing the graph draws the seed and offset on the device, with a random op of
        torch's: each replay or run draws a new mask.

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
    if q.ndim and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies (_padded_attention)
        return _padded_attention(q, k, v, None, None, None, None, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, return_lse, deterministic, dropout_p=dropout_p)
    left, right = window_size if type(window_size) is tuple and len(window_size) == 2 else _window(causal, window_size)
    if _eager(q, k, v):
        return _eager_attention(q, k, v, (None, None, alibi_slopes, None, None, softmax_scale, causal, left, right,
                                          softcap), deterministic, return_lse, _dropout(q, dropout_p))
    state, dropout_p = _graph_dropout(q, dropout_p)
    out, lse = _attention_fwd_op(q, k, v, alibi_slopes, state, softmax_scale, causal, left, right, softcap,
                                 deterministic, dropout_p)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False,
                     deterministic=False, block_table=None, seqused_k=None, dropout_p=0.0):
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
    block_table : torch.Tensor int32 (batch, max_pages), optional
        Paged keys (chunked prefill): k, v are page pools ``(num_pages, page_size, nheads_k, headdim)`` and key p
        of sequence b is row ``p % page_size`` of page ``block_table[b, p // page_size]``. Forward only.
    seqused_k : torch.Tensor int32 (batch,), optional
        Keys of sequence b instead of cu_seqlens_k's difference. Forward only.

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
    if q.ndim and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies (_padded_attention)
        return _padded_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal, window_size, softcap, alibi_slopes, return_lse, deterministic, block_table,
                                 seqused_k, dropout_p)
    left, right = window_size if type(window_size) is tuple and len(window_size) == 2 else _window(causal, window_size)
    if _eager(q, k, v):
        if block_table is not None or seqused_k is not None:  # forward only
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                _no_paged_backward(block_table)
            out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, left, right, softcap, return_lse, block_table, seqused_k,
                                _dropout(q, dropout_p))
            return (out, lse) if return_lse else out
        return _eager_attention(q, k, v, (cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                                          softmax_scale, causal, left, right, softcap), deterministic, return_lse,
                                _dropout(q, dropout_p))
    state, dropout_p = _graph_dropout(q, dropout_p)
    if block_table is not None or seqused_k is not None:
        out, lse = _attention_varlen_paged_op(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                                              alibi_slopes, state, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                              left, right, softcap, dropout_p)
    else:
        out, lse = _attention_varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, state, max_seqlen_q,
                                            max_seqlen_k, softmax_scale, causal, left, right, softcap, deterministic,
                                            dropout_p)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                           block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, num_splits=0, return_lse=False, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_leftpad=None, k_descale=None, v_descale=None):
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
    rotary_cos, rotary_sin : torch.Tensor, (seqlen_ro, rotary_dim / 2), q's dtype, contiguous, optional
        Rotary embedding of the appended keys (at positions ``cache_seqlens[b] + i``) and of the queries (the
        same positions when causal or local, else ``cache_seqlens[b]``), as flash-attn applies it; with k, v only.
    rotary_interleaved : bool
        Pairs (2j, 2j + 1); False: (j, j + rotary_dim / 2).
    cache_leftpad : torch.Tensor int32 (batch,), optional
        Row b's keys start at cache position ``cache_leftpad[b]`` (masks and ALiBi count from there).
    k_descale, v_descale : torch.Tensor float32, optional
        An e4m3 cache: k_cache, v_cache (and k, v) torch.float8_e4m3fn, read as ``k_cache * k_descale`` and
        ``v_cache * v_descale``; shape () or (1,) (per tensor) or (batch, nheads_k) contiguous. None: 1. q stays
        float16 or bfloat16; the head dim a multiple of 16; no rotary embedding.
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
    if q.ndim and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies (_padded_kvcache)
        return _padded_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, return_lse,
                               rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, k_descale, v_descale)
    if _eager(q, k_cache, v_cache):
        window = window_size if type(window_size) is tuple and len(window_size) == 2 else _window(causal, window_size)
        out, lse = _kvcache_compute(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                    alibi_slopes, softmax_scale, causal, window, softcap, num_splits, return_lse,
                                    rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, k_descale, v_descale)
        if k is not None:  # as the op's in-place bookkeeping does: autograd sees the caches as modified
            torch.autograd.graph.increment_version((k_cache, v_cache))
    else:
        left, right = _window(causal, window_size)
        seqlens, cache_len = _cache_seqlens(cache_seqlens)
        out, lse = torch.ops.cuflash.attention_with_kvcache(
            q, k_cache, v_cache, k, v, seqlens, cache_len, cache_batch_idx, block_table, alibi_slopes,
            softmax_scale, causal, left, right, softcap, num_splits, return_lse, rotary_cos, rotary_sin,
            bool(rotary_interleaved), cache_leftpad, k_descale, v_descale)
    return (out, lse) if return_lse else out


def attention_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), return_lse=False):
    """:func:`cuflash.attention_fp8` on torch tensors: FP8 (e4m3) attention on Hopper, forward only.

    Parameters
    ----------
    q : torch.Tensor, (batch, seqlen_q, nheads, headdim), torch.float8_e4m3fn, on a CUDA device of sm_90a
    k, v : torch.Tensor, (batch, seqlen_k, nheads_k, headdim), torch.float8_e4m3fn; ``nheads % nheads_k == 0``
        headdim a multiple of 16 up to 256; the last axis contiguous, the other strides multiples of 16 elements.
    q_descale, k_descale, v_descale : torch.Tensor of float32, optional
        One value per tensor (shape () or (1,)) or one per (sequence, KV head), ``(batch, nheads_k)`` contiguous
        (flash-attn 3's). None: 1.
    softmax_scale, causal, window_size, return_lse : as in :func:`attention`

    Returns
    -------
    out : torch.Tensor, (batch, seqlen_q, nheads, headdim), bfloat16
    lse : torch.Tensor, (batch, nheads, seqlen_q), float32 -- only if ``return_lse``

    Not differentiable. From ``forward_fp8.VT_PASS_FROM`` keys V is transposed into a workspace first
    (docs/fp8.md). Under torch.compile, export and tracing the call is the op ``cuflash::attention_fp8``.
    """
    descales = (q_descale, k_descale, v_descale)
    if _eager(q, k, v):
        return _fp8(q, k, v, descales, None, softmax_scale, causal, window_size, return_lse)
    out, lse = _attention_fp8_op(q, k, v, *descales, softmax_scale, causal, *_window(causal, window_size), return_lse)
    return (out, lse) if return_lse else out


def attention_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, q_descale=None,
                         k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         return_lse=False):
    """:func:`cuflash.attention_varlen_fp8` on torch tensors: :func:`attention_fp8` over packed sequences.

    Parameters
    ----------
    q : torch.Tensor, (total_q, nheads, headdim), torch.float8_e4m3fn
    k, v : torch.Tensor, (total_k, nheads_k, headdim), torch.float8_e4m3fn
    cu_seqlens_q, cu_seqlens_k : torch.Tensor, int32, (batch + 1,), on q's device
    max_seqlen_q, max_seqlen_k : int
    q_descale, k_descale, v_descale : torch.Tensor of float32, optional: per tensor or ``(batch, nheads_k)``
    softmax_scale, causal, window_size, return_lse : as in :func:`attention_fp8`, per sequence

    Returns
    -------
    out : torch.Tensor, (total_q, nheads, headdim), bfloat16; rows outside every sequence are not written
    lse : torch.Tensor, (nheads, total_q), float32 -- only if ``return_lse``

    Under torch.compile, export and tracing the call is the op ``cuflash::attention_varlen_fp8``.
    """
    descales = (q_descale, k_descale, v_descale)
    if _eager(q, k, v):
        return _fp8(q, k, v, descales, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), softmax_scale, causal,
                    window_size, return_lse)
    out, lse = _attention_varlen_fp8_op(q, k, v, cu_seqlens_q, cu_seqlens_k, *descales, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, causal, *_window(causal, window_size), return_lse)
    return (out, lse) if return_lse else out


def quantize_e4m3(x, *, per="tensor", nheads_k=None, pow2=False, descale=None):
    """:func:`cuflash.quantize_e4m3` on torch tensors: ``(x8, descale)`` with ``x ~ x8.float() * descale``, the
    inputs :func:`attention_fp8` takes.

    Parameters
    ----------
    x : torch.Tensor, (batch, seqlen, nheads, headdim), float16 or bfloat16, on a CUDA device
        headdim a multiple of 16 up to 256; the last axis contiguous, other strides free.
    per, nheads_k, pow2 : as in :func:`cuflash.quantize_e4m3` (per "tensor" or "head")
    descale : torch.Tensor of float32, optional
        Quantize with these descales (``()``, ``(1,)`` or ``(batch, nheads_k)`` contiguous), e.g. an e4m3 KV cache's,
        instead of finding them; returned as given.

    Returns
    -------
    x8 : torch.Tensor, shape of x, torch.float8_e4m3fn, contiguous
    descale : torch.Tensor of float32, ``()`` or ``(batch, nheads_k)``

    Not differentiable. Under torch.compile, export and tracing the call is the op ``cuflash::quantize_e4m3``.
    """
    if _eager(x) and (descale is None or _eager(descale)):
        return _quantize(x, per, nheads_k, pow2, descale)
    return _quantize_op(x, per, nheads_k, pow2, descale)


def _quantize(x, per, nheads_k, pow2, descale):
    """quantize_e4m3: checked and planned once per signature, then its launches on torch's stream."""
    try:
        key = ("quantize", per, nheads_k, pow2, _signature(x), _signature(descale))
        call = _plans.get(key)
    except (AttributeError, TypeError):
        key = call = None
    if call is None:
        call = _plan(key, lambda: _quantize_call(x, per, nheads_k, pow2, descale))
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    amax = None if call.given else torch.zeros(call.groups, dtype=torch.int32, device=x.device)  # float bits
    found = descale if call.given else torch.empty(call.groups, dtype=torch.float32, device=x.device)
    index = call.device_id
    previous = _get_device()
    if previous != index:
        _set_device(index)
    try:
        call(_stream(index), x.data_ptr(), x8.data_ptr(), 0 if amax is None else amax.data_ptr(), found.data_ptr())
    finally:
        if previous != index:
            _set_device(previous)
    return (x8, descale) if call.given else (x8, found.reshape(call.descale_shape))


def _quantize_call(x, per, nheads_k, pow2, descale) -> quantize.QuantizeCall:
    specs = _specs({"x": x, "descale": descale})
    sizes = checks.check_quantize_e4m3(specs["x"], per=per, nheads_k=nheads_k, pow2=pow2, descale=specs["descale"])
    for name, t in (("x", x), ("descale", descale)):
        if t is not None and t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        return quantize.QuantizeCall(sizes, x.stride(), specs["x"].dtype, bool(pow2), index, descale is not None)


def _fp8(q, k, v, descales, varlen, softmax_scale, causal, window_size, return_lse):
    """attention_fp8 (varlen None) and attention_varlen_fp8: plan once per signature, then launch."""
    cu = varlen[:2] if varlen else (None, None)
    try:
        key = ("fp8", softmax_scale, causal, window_size, *(varlen[2:] if varlen else ()),
               *(_signature(t) for t in (q, k, v) + descales + cu))
        call = _plans.get(key)
    except (AttributeError, TypeError):  # something that is not a tensor, or unhashable: the checks say what
        key = call = None
    if call is None:
        call = _plan(key, lambda: _fp8_call(q, k, v, descales, varlen, softmax_scale, causal, window_size))
    _require_aligned(q=q, k=k, v=v)
    index = call.device_id
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = None
    if return_lse:
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    vt = torch.empty(call.vt_shape, dtype=torch.uint8, device=q.device) if call.vt_shape else None
    previous = _get_device()
    if previous != index:
        _set_device(index)
    try:
        call(_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if vt is None else vt.data_ptr(),
             out.data_ptr(),
             0 if lse is None else lse.data_ptr(), *(0 if x is None else x.data_ptr() for x in descales + cu))
    finally:
        if previous != index:
            _set_device(previous)
    return (out, lse) if return_lse else out


def _fp8_problem(q, k, v, descales, varlen, softmax_scale, causal, window_size) -> tuple:
    """attention_fp8's and attention_varlen_fp8's checks: (checks.Problem, the tensors' specs)."""
    cu = varlen[:2] if varlen else (None, None)
    tensors = dict(zip(("q", "k", "v", "q_descale", "k_descale", "v_descale", "cu_seqlens_q", "cu_seqlens_k"),
                       (q, k, v) + descales + cu))
    specs = _specs(tensors, fp8=("q", "k", "v"))
    _require_cuda(**tensors)
    fp8 = dict(q_descale=specs["q_descale"], k_descale=specs["k_descale"], v_descale=specs["v_descale"],
               softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if varlen:
        return checks.check_varlen_fp8(specs["q"], specs["k"], specs["v"], specs["cu_seqlens_q"],
                                       specs["cu_seqlens_k"], *varlen[2:], **fp8), specs
    return checks.check_attention_fp8(specs["q"], specs["k"], specs["v"], **fp8), specs


def _fp8_call(q, k, v, descales, varlen, softmax_scale, causal, window_size):
    """attention_fp8's and attention_varlen_fp8's checks and their launch for this signature (forward_fp8.Fp8Call)."""
    problem, specs = _fp8_problem(q, k, v, descales, varlen, softmax_scale, causal, window_size)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    forward_fp8.require_hopper(index)
    left, right = checks.window(causal, window_size)
    stride = forward_fp8.descale_stride(problem, [specs[n] for n in ("q_descale", "k_descale", "v_descale")])
    with cupy.cuda.Device(index):
        return forward_fp8.Fp8Call(problem, q.stride(), k.stride(), v.stride(), left, right, softmax_scale, stride,
                                   index, (q.shape[0], k.shape[0]) if varlen else None)


def _window(causal, window_size) -> tuple:
    """``window_size`` as a tuple: from a tuple or list of two, or a 2-element integer tensor (read on the host,
    once per call: a device tensor costs a synchronization). Anything else gets checks.window's TypeError."""
    if (isinstance(window_size, torch.Tensor) and window_size.numel() == 2 and window_size.dtype != torch.bool
            and not window_size.is_floating_point() and not window_size.is_complex()):
        return tuple(window_size.reshape(2).tolist())
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
# Head dims that are not multiples of 8: the call on zero-padded copies
# --------------------------------------------------------------------------------------------
# The kernels load 16 bytes at a time, so they take head dims that are multiples of 8. Any other head dim d
# runs on copies of the inputs padded with zero columns up to checks.padded_headdim(d), made with torch ops
# (autograd differentiates through them), at the default scale 1 / sqrt(d); the result is the first d columns
# of the padded output (a view). Zero columns add nothing to q . k, and zero columns of v give zero columns
# of out, so the result is exactly the unpadded attention. A call whose head dim is a multiple of 8 never
# comes here.

def _pad(x, headdim: int):
    return None if x is None else torch.nn.functional.pad(x, (0, headdim - x.shape[-1]))


def _padded_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, return_lse, deterministic, block_table=None,
                      seqused_k=None, dropout_p=0.0):
    """:func:`attention` (``cu_seqlens_q`` None) or :func:`attention_varlen` on padded copies of q, k, v (a
    dropout mask is drawn per score, so the padding leaves it as it is)."""
    d = q.shape[-1]
    if _eager(q, k, v):  # errors name the caller's shapes (a traced call gets the ops' checks on the copies)
        tensors = dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
        options = _options(softmax_scale, causal, *_window(causal, window_size), softcap, dropout_p)
        if cu_seqlens_q is None:
            s = _specs(tensors)
            checks.check_attention(s["q"], s["k"], s["v"], alibi_slopes=s["alibi_slopes"], headdim_multiple=1,
                                   **options)
        else:
            s = _specs(dict(tensors, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                            seqused_k=seqused_k))
            checks.check_varlen(s["q"], s["k"], s["v"], s["cu_seqlens_q"], s["cu_seqlens_k"], max_seqlen_q,
                                max_seqlen_k, alibi_slopes=s["alibi_slopes"], block_table=s["block_table"],
                                seqused_k=s["seqused_k"], headdim_multiple=1, **options)
    padded = checks.padded_headdim(d)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q, k, v = _pad(q, padded), _pad(k, padded), _pad(v, padded)
    options = dict(softmax_scale=scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, return_lse=return_lse, deterministic=deterministic, dropout_p=dropout_p)
    if cu_seqlens_q is None:
        result = attention(q, k, v, **options)
    else:
        result = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options,
                                  block_table=block_table, seqused_k=seqused_k)
    return (result[0][..., :d], result[1]) if return_lse else result[..., :d]


def _padded_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                    window_size, softcap, alibi_slopes, num_splits, return_lse, rotary_cos=None, rotary_sin=None,
                    rotary_interleaved=True, cache_leftpad=None, k_descale=None, v_descale=None):
    """:func:`attention_with_kvcache` on padded copies of q, k, v and of both caches (whole: the rows a call
    reads are known on the device only); the appended rows are then copied back into the caller's caches. An e4m3
    cache stops at the checks here (its head dim must be a multiple of 16): no copy of it is made."""
    d = q.shape[-1]
    if _eager(q, k_cache, v_cache):  # errors name the caller's shapes
        seqlens, cache_len = _cache_seqlens(cache_seqlens)
        s = _specs(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens,
                        cache_batch_idx=cache_batch_idx, block_table=block_table, alibi_slopes=alibi_slopes,
                        rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_leftpad=cache_leftpad,
                        k_descale=k_descale, v_descale=v_descale), e4m3=_E4M3_CACHE)
        checks.check_kvcache(s["q"], s["k_cache"], s["v_cache"], k=s["k"], v=s["v"],
                             cache_seqlens=s["cache_seqlens"] if seqlens is not None else
                             None if cache_len < 0 else cache_len,
                             cache_batch_idx=s["cache_batch_idx"], block_table=s["block_table"],
                             alibi_slopes=s["alibi_slopes"], num_splits=num_splits, rotary_cos=s["rotary_cos"],
                             rotary_sin=s["rotary_sin"], rotary_interleaved=rotary_interleaved,
                             cache_leftpad=s["cache_leftpad"], k_descale=s["k_descale"],
                             v_descale=s["v_descale"], headdim_multiple=1,
                             **_options(softmax_scale, causal, *_window(causal, window_size), softcap))
    padded = checks.padded_headdim(d)
    k_cache_padded, v_cache_padded = _pad(k_cache, padded), _pad(v_cache, padded)
    result = attention_with_kvcache(
        _pad(q, padded), k_cache_padded, v_cache_padded, k=_pad(k, padded), v=_pad(v, padded),
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table,
        softmax_scale=1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
        return_lse=return_lse, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_leftpad=cache_leftpad)
    if k is not None:
        rows = _appended_rows(k_cache, k.shape[0], k.shape[1], cache_seqlens, cache_batch_idx, block_table)
        k_cache[rows] = k_cache_padded[rows][..., :d]
        v_cache[rows] = v_cache_padded[rows][..., :d]
    return (result[0][..., :d], result[1]) if return_lse else result[..., :d]


def _appended_rows(cache, batch: int, seqlen_new: int, cache_seqlens, cache_batch_idx, block_table) -> tuple:
    """Index tensors ``(cache rows or pages, positions or rows within the page)``, each ``(batch, seqlen_new)``, of
    the rows an append writes, computed on the cache's device without a synchronization. Indices are clamped into
    the cache (cache_seqlens, cache_batch_idx and block_table may hold anything): every index names a row whose
    padded copy holds that row after the call, so copying it back is right whether or not the call wrote it."""
    device = cache.device
    positions = torch.arange(seqlen_new, device=device).expand(batch, seqlen_new)
    if isinstance(cache_seqlens, torch.Tensor):
        positions = positions + cache_seqlens.to(device=device, dtype=torch.int64)[:, None]
    elif cache_seqlens is not None:
        positions = positions + cache_seqlens
    if block_table is None:
        rows = (torch.arange(batch, device=device) if cache_batch_idx is None
                else cache_batch_idx.to(device=device, dtype=torch.int64).clamp(0, cache.shape[0] - 1))
        return rows[:, None].expand(batch, seqlen_new), positions.clamp(0, cache.shape[1] - 1)
    page_size = cache.shape[1]
    slots = (positions // page_size).clamp(0, block_table.shape[1] - 1)
    pages = block_table.to(dtype=torch.int64).gather(1, slots).clamp(0, cache.shape[0] - 1)
    return pages, positions.remainder(page_size)


# --------------------------------------------------------------------------------------------
# Eager or traced: the ops when something traces or intercepts, else their implementations directly
# --------------------------------------------------------------------------------------------

def _eager(*tensors) -> bool:
    """A plain eager call on real tensors: nothing that should see the op is tracing or intercepting."""
    return (not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in tensors)
            and not torch._C._len_torch_dispatch_stack() and not torch._C._are_functorch_transforms_active()
            and not torch._C._get_tracing_state())


def _eager_attention(q, k, v, args: tuple, deterministic: bool, return_lse: bool, dropout=None):
    """An eager dense or varlen call; ``args`` are :func:`_forward`'s after q, k, v, ``dropout`` its (p, seed,
    offset, state) or None (:func:`_dropout`). With a gradient to track, under an autograd.Function (lse stays with
    the backward unless asked for); else the forward alone."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return (_EagerAttentionLse if return_lse else _EagerAttention).apply(q, k, v, (*args, deterministic, dropout))
    out, lse = _forward(q, k, v, *args, return_lse, dropout=dropout)
    return (out, lse) if return_lse else out


_DROPOUT_OFFSET_STEP = 4  # what a call takes of its generator's offset (torch's Philox consumers advance by 4s)


def _dropout(q, dropout_p) -> tuple | None:
    """(p, seed, offset, state) of an eager call's dropout from torch's CUDA generator of q's device (torch.manual_seed
    seeds it), or None without dropout. Outside graph capture the generator's seed and its offset (advanced by
    _DROPOUT_OFFSET_STEP), state None. Under capture the host's values would be frozen into the graph, so the
    seed and offset are drawn on the device instead (:func:`_device_dropout_state`): ``state``, read by the kernels,
    is drawn anew at each replay from the generator's state then, as torch's own random ops are."""
    if not dropout_p:
        return None
    checks.check_dropout_p(dropout_p)
    generator = _generator(q)
    if _capturing(q):
        return float(dropout_p), 0, 0, _device_dropout_state(q.device, generator)
    offset = generator.get_offset()
    generator.set_offset(offset + _DROPOUT_OFFSET_STEP)
    return float(dropout_p), generator.initial_seed(), offset, None


def _capturing(q) -> bool:
    """q's device's current stream is being captured into a CUDA graph."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _generator(q):
    """torch's default CUDA generator of q's device."""
    return torch.cuda.default_generators[q.device.index if q.device.index is not None else torch.cuda.current_device()]


def _device_dropout_state(device, generator) -> torch.Tensor:
    """The (seed, offset) words of a captured call's mask: two int64 drawn by torch's generator on the device, a
    graph-safe random op (each replay draws new ones)."""
    return torch.empty(2, dtype=torch.int64, device=device).random_(generator=generator)


def _dropout_words(dropout) -> tuple:
    """(seed, offset, state pointer) of a call's dropout (None: none), as the launches take them."""
    if dropout is None:
        return 0, 0, 0
    return dropout[1], dropout[2], 0 if dropout[3] is None else dropout[3].data_ptr()


def _graph_dropout(q, dropout_p) -> tuple:
    """(state, p) of a call that the ops see (torch.compile, tracing, dispatch modes): ``state`` None without
    dropout, else the mask's (seed, offset) words drawn on q's device by a random op of the graph, so that the
    compiled graph draws a new mask per run from torch's generator (torch.manual_seed repeats it) and its backward
    reads the words its forward read."""
    if not dropout_p:
        return None, 0.0
    checks.check_dropout_p(dropout_p)
    return torch.randint(0, _GRAPH_DROPOUT_WORDS, (2,), dtype=torch.int64, device=q.device), float(dropout_p)


_GRAPH_DROPOUT_WORDS = 1 << 62  # the range of a graph's seed and offset words (int64 in the kernels' parameters)


def _graph_dropout_words(dropout_p: float, state) -> tuple | None:
    """An op's dropout as :func:`_dropout` gives an eager call's: (p, seed, offset, state), or None."""
    return (dropout_p, 0, 0, state) if dropout_p else None


class _EagerAttention(torch.autograd.Function):
    """The forward op's implementation, and its backward's, for eager calls: returns ``out``. The last input,
    ``args``, is :func:`_forward`'s arguments after q, k, v, then ``deterministic``; none is differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        return _saved_forward(ctx, q, k, v, args)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        return (*_saved_backward(ctx, dout), None)


class _EagerAttentionLse(torch.autograd.Function):
    """:class:`_EagerAttention` returning ``out, lse`` (lse not differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        out, lse = _saved_forward(ctx, q, k, v, args)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        return (*_saved_backward(ctx, dout), None)


def _saved_forward(ctx, q, k, v, args) -> tuple:
    """out, lse of an eager forward; what its backward needs saved in ``ctx`` (args: the forward's, deterministic,
    dropout)."""
    dropout = args[-1]
    plan = _forward_plan(q, k, v, *args[:-2], dropout_p=dropout[0] if dropout else 0.0)
    out, lse = _run_forward(plan, q, k, v, args[0], args[1], args[2], True, dropout=dropout)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args, ctx.plan = args, plan
    return out, lse


def _saved_backward(ctx, dout) -> tuple:
    """dq, dk, dv of an eager forward. Its backward's plan depends on the forward's (its layouts and options) and on
    dout's layout and the mode, so it is looked up under those alone."""
    q, k, v, out, lse = ctx.saved_tensors
    cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, scale, causal, left, right, softcap, \
        deterministic, dropout = ctx.args
    dout = dout.contiguous()
    key = (ctx.plan, dout.shape, dout.stride(), dout.dtype, deterministic)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(key, lambda: _plan_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                 max_seqlen_q, max_seqlen_k, bool(deterministic),
                                                 _options(scale, causal, left, right, softcap,
                                                          dropout[0] if dropout else 0.0)))
    return _run_backward(plan, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout)


# --------------------------------------------------------------------------------------------
# Dense and varlen attention: forward and backward ops over one planned launch per call signature
# --------------------------------------------------------------------------------------------

class _Plan:
    """The launch of one call signature on torch's current stream, from data pointers (_forward_launch,
    _backward_launch), and what its allocations need. Hashed by identity: a backward's key holds its forward's."""

    __slots__ = ("launch", "lse_shape", "workspace")

    def __init__(self, launch: Callable, lse_shape: tuple = (), workspace: int = 0):
        self.launch = launch
        self.lse_shape = lse_shape  # the forward's lse: (batch, nheads, seqlen_q), packed (nheads, total_q)
        self.workspace = workspace  # the backward's workspace bytes


def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                   dropout_state: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool,
                   window_left: int, window_right: int, softcap: float, deterministic: bool,
                   dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, None, None, alibi_slopes, None, None, softmax_scale, causal, window_left, window_right,
                    softcap, True, dropout=_graph_dropout_words(dropout_p, dropout_state))


def _attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                          dropout_state: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                          softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                          softcap: float, deterministic: bool, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_left, window_right, softcap, True,
                    dropout=_graph_dropout_words(dropout_p, dropout_state))


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
             left, right, softcap, need_lse: bool, block_table=None, seqused_k=None, dropout=None) -> tuple:
    """Dense (``cu_seqlens_q`` None) or varlen forward into a new ``out`` and ``lse`` (None unless ``need_lse``);
    ``dropout``: (p, seed, offset, state) or None (:func:`_dropout`)."""
    plan = _forward_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, left, right, softcap, block_table, seqused_k,
                         dropout[0] if dropout else 0.0)
    return _run_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, need_lse, block_table, seqused_k,
                        dropout)


def _forward_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale,
                  causal, left, right, softcap, block_table=None, seqused_k=None, dropout_p=0.0) -> _Plan:
    """The forward's plan for the call's signature: looked up, else checked and planned."""
    try:
        key = ("fwd", max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right, softcap, _signature(q),
               _signature(k), _signature(v), _signature(alibi_slopes), _signature(cu_seqlens_q),
               _signature(cu_seqlens_k), _signature(block_table), _signature(seqused_k), dropout_p)
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # something that is not a tensor, or unhashable: the checks say what
        key = plan = None
    if plan is None:
        plan = _plan(key, lambda: _plan_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
                                                max_seqlen_k,
                                                _options(softmax_scale, causal, left, right, softcap, dropout_p),
                                                block_table, seqused_k))
    return plan


def _run_forward(plan: _Plan, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, need_lse: bool, block_table=None,
                 seqused_k=None, dropout=None) -> tuple:
    """The allocations and the launch (which checks the inputs' alignment first)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
    plan.launch(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                *_dropout_words(dropout))
    return out, lse


def _plan_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, options,
                  block_table=None, seqused_k=None) -> _Plan:
    tensors = dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    if cu_seqlens_q is not None:
        tensors.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if block_table is not None or seqused_k is not None:
        tensors.update(block_table=block_table, seqused_k=seqused_k)
    problem, specs = _problem(options, tensors, max_seqlen_q, max_seqlen_k)
    lse_shape = ((problem.batch, problem.nheads, problem.seqlen_q) if cu_seqlens_q is None
                 else (problem.nheads, q.shape[0]))
    return _Plan(_forward_launch(problem, specs, options, lse_shape), lse_shape)


def _forward_launch(problem, specs: dict, options: dict, lse_shape: tuple) -> Callable:
    """``launch(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)``: the
    forward of one call signature on torch's current stream, into a contiguous ``out`` and ``lse`` (or None), from
    data pointers; ValueError before it launches where q, k or v is not 16-byte aligned."""
    q, index = specs["q"], specs["q"].device
    with cupy.cuda.Device(index):
        call = forward.forward_call(problem, q, specs["k"], specs["v"], checks.contiguous("out", q.shape, q.dtype),
                                    checks.contiguous("lse", lse_shape, np.float32),
                                    resolve(problem, alibi_slopes=specs["alibi_slopes"], **options), device_id=index,
                                    alibi_slopes=specs["alibi_slopes"], block_table=specs.get("block_table"),
                                    seqused_k=specs.get("seqused_k"))

    def launch(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, dropout_seed,
               dropout_offset, dropout_state):
        p_q, p_k, p_v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (p_q | p_k | p_v) % 16:
            _require_aligned(q=q, k=k, v=v)
        previous = _get_device()
        if previous != index:
            _set_device(index)
        try:
            call(_stream(index), p_q, p_k, p_v, out.data_ptr(),
                 0 if lse is None else lse.data_ptr(), 0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                 0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
                 0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
                 0 if block_table is None else block_table.data_ptr(), 0 if seqused_k is None else seqused_k.data_ptr(),
                 dropout_seed, dropout_offset, dropout_state)
        finally:
            if previous != index:
                _set_device(previous)
    return launch


def _attention_fwd_fake(q, k, v, alibi_slopes, dropout_state, softmax_scale, causal, window_left, window_right,
                        softcap, deterministic, dropout_p):
    if _concrete(q, k, v, alibi_slopes):
        _problem(_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p),
                 dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes))
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_state, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                               dropout_p):
    if _concrete(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, ints=(max_seqlen_q, max_seqlen_k)):
        _problem(_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p),
                 dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k),
                 max_seqlen_q, max_seqlen_k)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, alibi_slopes: Optional[torch.Tensor], dropout_state: Optional[torch.Tensor],
                   softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                   deterministic: bool, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, None, None, alibi_slopes, None, None, softmax_scale, causal,
                     window_left, window_right, softcap, deterministic, _graph_dropout_words(dropout_p, dropout_state))


def _attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          alibi_slopes: Optional[torch.Tensor], dropout_state: Optional[torch.Tensor],
                          max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                          window_left: int, window_right: int, softcap: float, deterministic: bool,
                          dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, deterministic,
                     _graph_dropout_words(dropout_p, dropout_state))


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, left, right, softcap, deterministic, dropout=None) -> tuple:
    """Dense or varlen backward into new contiguous dq, dk, dv; ``dropout`` as in :func:`_forward`."""
    dropout_p = dropout[0] if dropout else 0.0
    try:
        key = ("bwd", bool(deterministic), max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right, softcap,
               _signature(dout), _signature(q), _signature(k), _signature(v), _signature(out), _signature(lse),
               _signature(alibi_slopes), _signature(cu_seqlens_q), _signature(cu_seqlens_k), dropout_p)
        plan = _plans.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is None:
        plan = _plan(key, lambda: _plan_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                 max_seqlen_q, max_seqlen_k, bool(deterministic),
                                                 _options(softmax_scale, causal, left, right, softcap, dropout_p)))
    return _run_backward(plan, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout)


def _run_backward(plan: _Plan, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                  dropout=None) -> tuple:
    """The allocations (the workspace too, from torch's caching allocator, freed in stream order) and the
    launches (which check the inputs' alignment first)."""
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=q.device)
    plan.launch(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, workspace,
                *_dropout_words(dropout))
    return dq, dk, dv


def _plan_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                   deterministic, options) -> _Plan:
    tensors = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes)
    if cu_seqlens_q is not None:
        tensors.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    problem, specs = _problem(options, tensors, max_seqlen_q, max_seqlen_k)
    launch, workspace = _backward_launch(problem, specs, options, deterministic, cu_seqlens_q is not None)
    return _Plan(launch, (), workspace)


def _backward_launch(problem, specs: dict, options: dict, deterministic: bool, packed: bool) -> tuple:
    """(``launch(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, workspace)``, the
    workspace bytes): the backward of one call signature on torch's current stream, into contiguous dq, dk, dv;
    ValueError before it launches where dout, q, k, v or out is not 16-byte aligned."""
    index = specs["q"].device
    grads = (checks.contiguous(n, specs[x].shape, specs[x].dtype) for n, x in (("dq", "q"), ("dk", "k"), ("dv", "v")))
    with cupy.cuda.Device(index):
        call = backward.backward_call(problem, specs["dout"], specs["q"], specs["k"], specs["v"], specs["out"],
                                      specs["lse"], *grads, resolve(problem, alibi_slopes=specs["alibi_slopes"],
                                                                    **options),
                                      device_id=index, alibi_slopes=specs["alibi_slopes"],
                                      deterministic=deterministic, packed=packed)

    def launch(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, workspace,
               dropout_seed=0, dropout_offset=0, dropout_state=0):
        p_dout, p_q, p_k, p_v, p_out = dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (p_dout | p_q | p_k | p_v | p_out) % 16:
            _require_aligned(dout=dout, q=q, k=k, v=v, out=out)
        previous = _get_device()
        if previous != index:
            _set_device(index)
        try:
            call(_stream(index), p_dout, p_q, p_k, p_v, p_out, lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                 dv.data_ptr(), 0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                 0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
                 0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(), workspace.data_ptr(), dropout_seed,
                 dropout_offset, dropout_state)
        finally:
            if previous != index:
                _set_device(previous)
    return launch, call.workspace_bytes


def _attention_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, dropout_state, softmax_scale, causal, window_left,
                        window_right, softcap, deterministic, dropout_p):
    if _concrete(dout, q, k, v, out, lse, alibi_slopes):
        _problem(_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p),
                 dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes))
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_state,
                               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                               deterministic, dropout_p):
    if _concrete(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, ints=(max_seqlen_q, max_seqlen_k)):
        _problem(_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p),
                 dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k), max_seqlen_q, max_seqlen_k)
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _attention_varlen_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, block_table: Optional[torch.Tensor],
                            seqused_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                            dropout_state: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                            softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                            softcap: float, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen forward with paged keys or seqused_k (forward only: its autograd raises)."""
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_left, window_right, softcap, True, block_table, seqused_k,
                    _graph_dropout_words(dropout_p, dropout_state))


def _attention_varlen_paged_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes,
                                 dropout_state, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                                 window_right, softcap, dropout_p):
    if _concrete(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes,
                 ints=(max_seqlen_q, max_seqlen_k)):
        _problem(_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p),
                 dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      block_table=block_table, seqused_k=seqused_k), max_seqlen_q, max_seqlen_k)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _no_paged_backward(block_table, *_):
    name = "block_table" if block_table is not None else "seqused_k"
    raise NotImplementedError(f"{name}: attention_varlen with paged keys or seqused_k has no backward (it serves "
                              f"inference); call it under torch.no_grad() or on tensors that do not require grad")


# --------------------------------------------------------------------------------------------
# FP8 attention: forward-only ops over the eager path (_fp8)
# --------------------------------------------------------------------------------------------

def _attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: Optional[torch.Tensor],
                   k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
                   softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                   return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_fp8 as an op: ``out, lse``, lse empty (``(0,)``) unless ``return_lse``."""
    return _fp8_op_result(q, _fp8(q, k, v, (q_descale, k_descale, v_descale), None, softmax_scale, causal,
                                  (window_left, window_right), return_lse), return_lse)


def _attention_varlen_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, q_descale: Optional[torch.Tensor],
                          k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int,
                          window_right: int, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_varlen_fp8 as an op, as :func:`_attention_fp8`."""
    return _fp8_op_result(q, _fp8(q, k, v, (q_descale, k_descale, v_descale),
                                  (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), softmax_scale, causal,
                                  (window_left, window_right), return_lse), return_lse)


def _fp8_op_result(q, result, return_lse: bool) -> tuple:
    return result if return_lse else (result, q.new_empty((0,), dtype=torch.float32))


def _quantize_e4m3(x: torch.Tensor, per: str, nheads_k: Optional[int], pow2: bool,
                   descale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_e4m3 as an op; with a given descale its second result is a copy of it (an op's outputs may not alias
    its inputs)."""
    x8, out = _quantize(x, per, nheads_k, pow2, descale)
    return x8, (out.clone() if descale is not None else out)


def _quantize_e4m3_fake(x, per, nheads_k, pow2, descale):
    sizes = None
    if _concrete(x, descale, ints=() if nheads_k is None else (nheads_k,)):
        specs = _specs({"x": x, "descale": descale})
        sizes = checks.check_quantize_e4m3(specs["x"], per=per, nheads_k=nheads_k, pow2=pow2, descale=specs["descale"])
    if descale is not None:
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty_like(descale)
    if sizes is not None:
        per, nheads_k = sizes[5], sizes[4]
    shape = quantize.descale_shape(x.shape[0], x.shape[2] if nheads_k is None else nheads_k, per)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(shape, dtype=torch.float32)


def _attention_fp8_fake(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right,
                        return_lse):
    if _concrete(q, k, v, q_descale, k_descale, v_descale):
        _fp8_problem(q, k, v, (q_descale, k_descale, v_descale), None, softmax_scale, causal,
                     (window_left, window_right))
    b, sq, h, _ = q.shape
    return (q.new_empty(q.shape, dtype=torch.bfloat16),
            q.new_empty((b, h, sq) if return_lse else (0,), dtype=torch.float32))


def _attention_varlen_fp8_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window_left, window_right, return_lse):
    if _concrete(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale,
                 ints=(max_seqlen_q, max_seqlen_k)):
        _fp8_problem(q, k, v, (q_descale, k_descale, v_descale), (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k), softmax_scale, causal,
                     (window_left, window_right))
    return (q.new_empty(q.shape, dtype=torch.bfloat16),
            q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32))


# --------------------------------------------------------------------------------------------
# KV-cache attention: one op that mutates the caches
# --------------------------------------------------------------------------------------------

def _kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
             v: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor], cache_len: int,
             cache_batch_idx: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
             alibi_slopes: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
             window_right: int, softcap: float, num_splits: int, return_lse: bool,
             rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
             rotary_interleaved: bool = False, cache_leftpad: Optional[torch.Tensor] = None,
             k_descale: Optional[torch.Tensor] = None,
             v_descale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op: ``cache_seqlens`` is given as a tensor, or as the int ``cache_len`` (-1: neither). Returns ``out,
    lse``; lse is empty, ``(0,)``, unless ``return_lse``. The rotary and leftpad arguments have defaults, so a call
    written before they existed keeps working."""
    seqlens = cache_seqlens if cache_seqlens is not None else None if cache_len < 0 else cache_len
    out, lse = _kvcache_compute(q, k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table, alibi_slopes,
                                softmax_scale, causal, (window_left, window_right), softcap, num_splits, return_lse,
                                rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, k_descale, v_descale)
    return out, lse if return_lse else q.new_empty((0,), dtype=torch.float32)


class _KvPlan(NamedTuple):
    prep: object        # the decode.DecodeCall
    elements: int       # the call's allocation, in elements of q's dtype (out first)
    out_strides: tuple  # contiguous strides of q's shape


_kv_plans: dict = {}  # signature of a kvcache call -> its _KvPlan
settings.on_change(_kv_plans.clear)


def _kvcache_compute(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                     softmax_scale, causal, window_size, softcap, num_splits, return_lse, rotary_cos=None,
                     rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, k_descale=None,
                     v_descale=None) -> tuple:
    """cuflash.attention_with_kvcache on torch tensors (``cache_seqlens`` a tensor, an int or None): checks and
    plan once per signature (:func:`_kvcache_plan`), then one torch allocation (out, then the split workspace) and
    the launches on torch's stream, from data pointers. Returns ``(out, lse or None)``."""
    try:
        key = (type(cache_seqlens), _signature(cache_seqlens) if type(cache_seqlens) is torch.Tensor
               else cache_seqlens, softmax_scale, causal, window_size, softcap, num_splits, return_lse,
               _signature(q), _signature(k_cache), _signature(v_cache), _signature(k), _signature(v),
               _signature(cache_batch_idx), _signature(block_table), _signature(alibi_slopes),
               _signature(rotary_cos), _signature(rotary_sin), rotary_interleaved, _signature(cache_leftpad),
               _signature(k_descale), _signature(v_descale))
        plan = _kv_plans.get(key)
    except (AttributeError, TypeError):  # something that is not a tensor, or unhashable: the checks say what
        key = plan = None
    if plan is None:
        plan = _kvcache_plan(key, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                             alibi_slopes, softmax_scale, causal, window_size, softcap, num_splits, return_lse,
                             rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, k_descale, v_descale)
    if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | (0 if k is None else k.data_ptr())
            | (0 if v is None else v.data_ptr()) | (0 if rotary_cos is None else rotary_cos.data_ptr())
            | (0 if rotary_sin is None else rotary_sin.data_ptr())) % 16:
        _require_aligned(**{n: t for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k),
                                              ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin))
                            if t is not None})
    prep = plan.prep
    block = torch.empty(plan.elements, dtype=q.dtype, device=q.device)
    lse = torch.empty(prep.lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    index = prep.device_id
    previous = _get_device()
    if previous != index:
        _set_device(index)
    try:
        stream = _stream(index)
        decode.run(prep, stream, block.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   0 if k is None else k.data_ptr(), 0 if v is None else v.data_ptr(),
                   cache_seqlens.data_ptr() if type(cache_seqlens) is torch.Tensor else 0,
                   0 if cache_batch_idx is None else cache_batch_idx.data_ptr(),
                   0 if block_table is None else block_table.data_ptr(),
                   0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0 if lse is None else lse.data_ptr(),
                   bool(prep.counter_tiles) and torch.cuda.is_current_stream_capturing(),
                   0 if rotary_cos is None else rotary_cos.data_ptr(),
                   0 if rotary_sin is None else rotary_sin.data_ptr(),
                   0 if cache_leftpad is None else cache_leftpad.data_ptr(),
                   0 if k_descale is None else k_descale.data_ptr(), 0 if v_descale is None else v_descale.data_ptr())
    finally:
        if previous != index:
            _set_device(previous)
    return block.as_strided(q.shape, plan.out_strides), lse


def _kvcache_plan(key, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                  softmax_scale, causal, window_size, softcap, num_splits, return_lse, rotary_cos=None,
                  rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, k_descale=None,
                  v_descale=None) -> _KvPlan:
    """Checks a kvcache call and plans it (decode.prepare on CuPy views of the tensors); remembered under `key`
    (None: not remembered)."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_batch_idx=cache_batch_idx,
                   block_table=block_table, alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                   cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale)
    seqlens, cache_len = _cache_seqlens(cache_seqlens)
    _check_kvcache(dict(tensors, cache_seqlens=seqlens), cache_len,
                   dict(_options(softmax_scale, causal, *window_size, softcap), num_splits=num_splits,
                        rotary_interleaved=rotary_interleaved))
    is_tensor = seqlens is not None
    views = {name: _view(t) for name, t in tensors.items()}
    with cupy.cuda.Device(q.device.index):
        prep = decode.prepare(views["q"], views["k_cache"], views["v_cache"], views["k"], views["v"],
                              _view(cache_seqlens) if is_tensor else cache_seqlens, views["cache_batch_idx"],
                              views["block_table"], softmax_scale, causal, window_size, softcap,
                              views["alibi_slopes"], num_splits, return_lse, views["rotary_cos"],
                              views["rotary_sin"], rotary_interleaved, views["cache_leftpad"], views["k_descale"],
                              views["v_descale"])
    return runtime.keep(_kv_plans, key, _KvPlan(prep, -(-prep.nbytes // q.element_size()),
                                                checks.contiguous("out", q.shape, np.float16).strides))


def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_len, cache_batch_idx, block_table, alibi_slopes,
                  softmax_scale, causal, window_left, window_right, softcap, num_splits, return_lse, rotary_cos=None,
                  rotary_sin=None, rotary_interleaved=False, cache_leftpad=None, k_descale=None, v_descale=None):
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                   cache_batch_idx=cache_batch_idx, block_table=block_table, alibi_slopes=alibi_slopes,
                   rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_leftpad=cache_leftpad, k_descale=k_descale,
                   v_descale=v_descale)
    if _concrete(*tensors.values(), ints=(cache_len, num_splits)):
        _check_kvcache(tensors, cache_len,
                       dict(_options(softmax_scale, causal, window_left, window_right, softcap), num_splits=num_splits,
                            rotary_interleaved=rotary_interleaved))
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
_attention_varlen_paged_op = _register("attention_varlen_paged", _attention_varlen_paged,
                                       _attention_varlen_paged_fake)
_attention_fp8_op = _register("attention_fp8", _attention_fp8, _attention_fp8_fake)
_attention_varlen_fp8_op = _register("attention_varlen_fp8", _attention_varlen_fp8, _attention_varlen_fp8_fake)
_quantize_op = _register("quantize_e4m3", _quantize_e4m3, _quantize_e4m3_fake)


def _register_autograd(forward_op, backward_op, tensors: int) -> None:
    """Wire ``backward_op`` to ``forward_op`` (register_autograd). The forward's arguments are q, k, v, then
    ``tensors - 3`` more tensors (not differentiated), then options; it returns ``out, lse``. The backward takes
    ``dout, q, k, v, out, lse``, the other tensors and the options, and returns ``dq, dk, dv``."""
    def setup_context(ctx, inputs, output):
        out, lse = output
        ctx.save_for_backward(*inputs[:3], out, lse, *inputs[3:tensors])
        ctx.options = inputs[tensors:]
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        dq, dk, dv = backward_op(dout.contiguous(), *ctx.saved_tensors, *ctx.options)
        return (dq, dk, dv) + (None,) * (tensors - 3 + len(ctx.options))

    forward_op.register_autograd(backward, setup_context=setup_context)


_register_autograd(_attention_fwd_op, torch.ops.cuflash.attention_bwd, 5)
_attention_varlen_paged_op.register_autograd(
    lambda ctx, dout, dlse: _no_paged_backward(ctx.block_table),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "block_table", inputs[5]))
_register_autograd(_attention_varlen_fwd_op, torch.ops.cuflash.attention_varlen_bwd, 7)


# --------------------------------------------------------------------------------------------
# Checks: cuflash.checks on TensorSpecs of the torch tensors, when a call signature is planned
# --------------------------------------------------------------------------------------------

_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                 torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}
_TORCH_DTYPES = {v: k for k, v in _NUMPY_DTYPES.items()}
_EXPECTED_DTYPE = dict(alibi_slopes="torch.float32", lse="torch.float32", cu_seqlens_q="torch.int32",
                       cu_seqlens_k="torch.int32", cache_seqlens="torch.int32", cache_batch_idx="torch.int32",
                       block_table="torch.int32", cache_leftpad="torch.int32", seqused_k="torch.int32")


def _options(softmax_scale, causal, left, right, softcap, dropout_p=0.0) -> dict:
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=(left, right), softcap=softcap)
    if dropout_p:
        options["dropout_p"] = dropout_p
    return options


def _problem(options: dict, tensors: dict, max_seqlen_q=None, max_seqlen_k=None) -> tuple:
    """(Problem, TensorSpecs by name) of a dense or varlen (``cu_seqlens_q`` among the tensors) forward, or backward
    (``dout`` among them): the checks of cuflash.checks, then the CUDA requirements."""
    s = _specs(tensors)
    arrays = [s[n] for n in (("dout", "q", "k", "v", "out", "lse") if "dout" in s else ("q", "k", "v"))]
    if "cu_seqlens_q" in s:
        check = checks.check_varlen_backward if "dout" in s else checks.check_varlen
        paged = {n: s[n] for n in ("block_table", "seqused_k") if n in s}  # the forward's paged keys
        problem = check(*arrays, s["cu_seqlens_q"], s["cu_seqlens_k"], max_seqlen_q, max_seqlen_k,
                        alibi_slopes=s["alibi_slopes"], **options, **paged)
    else:
        check = checks.check_backward if "dout" in s else checks.check_attention
        problem = check(*arrays, alibi_slopes=s["alibi_slopes"], **options)
    _require_cuda(**tensors)
    return problem, s


def _check_kvcache(tensors: dict, cache_len: int, options: dict) -> checks.Problem:
    s = _specs(tensors, e4m3=_E4M3_CACHE)
    seqlens = s["cache_seqlens"] if s["cache_seqlens"] is not None else None if cache_len < 0 else cache_len
    problem = checks.check_kvcache(s["q"], s["k_cache"], s["v_cache"], k=s["k"], v=s["v"], cache_seqlens=seqlens,
                                   cache_batch_idx=s["cache_batch_idx"], block_table=s["block_table"],
                                   alibi_slopes=s["alibi_slopes"], rotary_cos=s.get("rotary_cos"),
                                   rotary_sin=s.get("rotary_sin"), cache_leftpad=s.get("cache_leftpad"),
                                   k_descale=s.get("k_descale"), v_descale=s.get("v_descale"), **options)
    _require_cuda(**tensors)
    return problem


_plans: dict = {}  # signature of a dense or varlen call -> its _Plan: checks and planning once per signature
settings.on_change(_plans.clear)  # launches planned under other settings are dropped


def _plan(key, make) -> _Plan:
    """``make()``, remembered under ``key`` (None: an argument the key cannot hold; not remembered)."""
    return runtime.keep(_plans, key, make())


def _signature(t):
    """What a plan depends on in a tensor argument (AttributeError for anything else)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


_E4M3_CACHE = ("k_cache", "v_cache", "k", "v")  # the kvcache arguments that may be float8_e4m3fn


def _specs(tensors: dict, fp8: tuple = (), e4m3: tuple = ()) -> dict:
    """TensorSpecs of the tensors (None where absent); those named in `fp8` must be float8_e4m3fn, those named in
    `e4m3` may be, and the specs of float8_e4m3fn tensors hold uint8 (the e4m3 bits, as the CuPy API takes them)."""
    specs = {}
    for name, t in tensors.items():
        if t is None:
            specs[name] = None
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
        if name in fp8 and t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected torch.float8_e4m3fn")
        e4m3_bits = name in fp8 or (name in e4m3 and t.dtype == torch.float8_e4m3fn)
        dtype = np.dtype(np.uint8) if e4m3_bits else _NUMPY_DTYPES.get(t.dtype)
        if dtype is None:
            expected = _EXPECTED_DTYPE.get(name, "torch.float16 or torch.bfloat16")
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected {expected}")
        device = t.device.index if t.device.type == "cuda" else None
        specs[name] = checks.TensorSpec(name, tuple(t.shape), dtype, tuple(t.stride()), device)
    return specs


def _require_cuda(**tensors) -> None:
    """CUDA tensors; fp16, bf16 and e4m3 ones with strides that keep 16-byte chunks along the last axis aligned (the
    kernels copy 16 bytes at a time); the pointers are checked on every call by :func:`_require_aligned`."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):  # slopes, lse, index arrays:
            continue                                                                # one element at a time
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
# torch memory as CuPy arrays (for planning); the device and torch's stream for a launch
# --------------------------------------------------------------------------------------------

_layouts: dict = {}  # (shape, strides, dtype) of a tensor -> what its CuPy view needs besides the pointer


def _view(t: torch.Tensor | None):
    """A CuPy array over the tensor's memory (no copy; the tensor is kept alive by the view)."""
    if t is None:
        return None
    key = (t.shape, t.stride(), t.dtype)
    layout = _layouts.get(key)
    if layout is None:
        dtype = np.dtype(np.uint8) if t.dtype == torch.float8_e4m3fn else _NUMPY_DTYPES[t.dtype]  # e4m3 bits
        shape, strides = tuple(t.shape), t.stride()
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if t.numel() else 0
        layout = runtime.keep(_layouts, key, (shape, dtype, tuple(s * dtype.itemsize for s in strides),
                                              extent * dtype.itemsize))
    shape, dtype, strides, nbytes = layout
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.get_device())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


_get_device = cupy.cuda.runtime.getDevice  # the CUDA runtime's current device, which torch's is too
_set_device = cupy.cuda.runtime.setDevice
# torch's current stream on a device as a cudaStream_t handle (an int), without a torch.cuda.Stream object
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda index: torch.cuda.current_stream(
    index).cuda_stream)


def __getattr__(name: str):
    """``cuflash.torch.distributed`` (context-parallel ring attention, :mod:`cuflash.torch_distributed`), imported
    when first used."""
    if name == "distributed":
        from . import torch_distributed
        return torch_distributed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

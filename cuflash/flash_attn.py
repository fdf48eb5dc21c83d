"""flash-attn 2.x's public functions on cuflash's kernels: same names, signatures, defaults and returns.

Switching is one import line::

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from cuflash.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Each function is a few lines over :mod:`cuflash.torch` (:func:`~cuflash.torch.attention`,
:func:`~cuflash.torch.attention_varlen`, :func:`~cuflash.torch.attention_with_kvcache`), so everything said
there holds here: fp16 and bf16 on a CUDA device, every head dim from 1 to 256 (one that is not a multiple of 8
runs on zero-padded copies), GQA/MQA, causal masks aligned bottom-right, ``torch.compile`` without graph
breaks. The packed functions take views of the packed tensor (``qkv.unbind(2)``), never copies; their backward
stacks the three gradients into one tensor shaped like ``qkv``.

Where cuflash and flash-attn differ:

* a query row that sees no key gets ``softmax_lse = -inf`` (the log of an empty sum); flash-attn gives
  ``+inf``. ``out`` is 0 in both;
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` where ``S_dmask`` is an empty tensor
  ``(0,)`` of q's dtype: flash-attn 2.x returns the probabilities (for its tests) when ``dropout_p > 0``,
  cuflash never materializes them. ``softmax_lse`` is not differentiable;
* arguments that cuflash cannot honour yet raise ``NotImplementedError`` naming the argument, never ignored:
  the backward above head dim 128 off sm_90a, and a gradient through :func:`flash_attn_varlen_func` with
  ``block_table`` or ``seqused_k`` (paged keys serve inference, as in flash-attn);
* the dropout mask is cuflash's own Philox stream (a different mask from flash-attn's for the same seed), drawn
  from torch's CUDA generator, so ``torch.manual_seed`` makes it repeatable;
* values in device memory (``cache_seqlens``, ``block_table``, ``cache_batch_idx``, ``cache_leftpad``,
  ``seqused_k``) are bounded in the kernels instead of checked with a host synchronization: a call never reads or
  writes outside the row's own cache rows or pages (docs/api.md, "Bounds"), where flash-attn raises.

``window_size`` is a pair ``(left, right)`` given as a tuple, a list or a 2-element integer tensor.
"""
from __future__ import annotations

import torch

from .torch import attention, attention_varlen, attention_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention of q over k, v (flash-attn's ``flash_attn_func``), differentiable in q, k and v.

    Parameters
    ----------
    q : torch.Tensor, (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device
    k, v : torch.Tensor, (batch, seqlen_k, nheads_k, headdim); ``nheads % nheads_k == 0`` (query head h reads
        KV head ``h // (nheads // nheads_k)``)
    dropout_p : float
        Dropout on the attention probabilities, ``0 <= p < 1``, its mask drawn from torch's CUDA generator
        (:func:`cuflash.torch.attention`); pass 0.0 in evaluation, as with flash-attn. Head dims up to 128 in the
        backward (256 too on sm_90a, without softcap or ALiBi); eager, under CUDA-graph capture and under
        torch.compile.
    softmax_scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(headdim)``.
    causal : bool
        Aligned bottom-right: query i sees key j iff ``j <= i + seqlen_k - seqlen_q``. For seqlen_q = 2,
        seqlen_k = 5 (x = visible)::

            x x x x .
            x x x x x

    window_size : (int, int), list or 2-element integer tensor
        Query i sees keys ``i + sk - sq - left <= j <= i + sk - sq + right``; -1 is unbounded.
    softcap : float
        If > 0, scores ``s`` become ``softcap * tanh(s / softcap)``.
    alibi_slopes : torch.Tensor, float32, (nheads,) or (batch, nheads), optional
        Adds ``-slope * |i + sk - sq - j|`` to the score of query i and key j.
    deterministic : bool
        Backward with a fixed dQ summation order (bitwise-repeatable gradients).
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask`` (see the module docstring).

    Returns
    -------
    out : torch.Tensor, (batch, seqlen_q, nheads, headdim), dtype of q
    softmax_lse : torch.Tensor, float32, (batch, nheads, seqlen_q) -- only if ``return_attn_probs``
    S_dmask : torch.Tensor, (0,), dtype of q -- only if ``return_attn_probs``
    """
    result = attention(_last_contiguous(q), _last_contiguous(k), _last_contiguous(v), softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       return_lse=return_attn_probs, deterministic=deterministic, dropout_p=dropout_p)
    return _with_probs(result, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of ``qkv`` (batch, seqlen, 3, nheads, headdim): q, k, v are views of it, and the
    gradient is one tensor shaped like it. Returns as :func:`flash_attn_func`."""
    q, k, v = _unpack(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, headdim)")
    result = attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_attn_probs,
                       deterministic=deterministic, dropout_p=dropout_p)
    return _with_probs(result, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of q and ``kv`` (batch, seqlen_k, 2, nheads_k, headdim): k, v are views of it, and
    its gradient is one tensor shaped like it. Returns as :func:`flash_attn_func`."""
    k, v = _unpack(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    result = attention(_last_contiguous(q), k, v, softmax_scale=softmax_scale, causal=causal,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       return_lse=return_attn_probs, deterministic=deterministic, dropout_p=dropout_p)
    return _with_probs(result, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_k=None):
    """Attention over variable-length sequences packed along the token axis (flash-attn's
    ``flash_attn_varlen_func``), differentiable in q, k and v.

    Sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of
    k and v, attended on its own; masks are aligned bottom-right with the sequence's own lengths.

    Parameters
    ----------
    q : torch.Tensor, (total_q, nheads, headdim), float16 or bfloat16, on a CUDA device
    k, v : torch.Tensor, (total_k, nheads_k, headdim)
    cu_seqlens_q, cu_seqlens_k : torch.Tensor, int32, (batch + 1,), on q's device
    max_seqlen_q, max_seqlen_k : int
        Upper bounds on the sequence lengths.
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs
        As in :func:`flash_attn_func`.
    alibi_slopes : torch.Tensor, float32, (nheads,) or (batch, nheads), optional
    block_table : torch.Tensor int32 (batch, max_blocks_per_seq), optional
        Paged K/V (chunked prefill): k and v are page pools ``(num_blocks, page_block_size, nheads_k, headdim)``,
        page_block_size a multiple of 16, and key p of sequence b is row ``p % page_block_size`` of block
        ``block_table[b, p // page_block_size]``. Forward only.
    seqused_k : torch.Tensor int32 (batch,), optional
        Keyword only (flash-attn's kernels take it; its 2.x Python function does not): keys of sequence b, instead of
        cu_seqlens_k's difference. Forward only.

    Returns
    -------
    out : torch.Tensor, (total_q, nheads, headdim), dtype of q
    softmax_lse : torch.Tensor, float32, (nheads, total_q) -- only if ``return_attn_probs``
    S_dmask : torch.Tensor, (0,), dtype of q -- only if ``return_attn_probs``
    """
    result = attention_varlen(_last_contiguous(q), _last_contiguous(k), _last_contiguous(v), cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              return_lse=return_attn_probs, deterministic=deterministic, block_table=block_table,
                              seqused_k=seqused_k, dropout_p=dropout_p)
    return _with_probs(result, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of ``qkv`` (total, 3, nheads, headdim) with one ``cu_seqlens`` and
    ``max_seqlen`` for q and k: q, k, v are views of qkv, and the gradient is one tensor shaped like it."""
    q, k, v = _unpack(qkv, "qkv", 3, "(total, 3, nheads, headdim)")
    result = attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=softmax_scale,
                              causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              return_lse=return_attn_probs, deterministic=deterministic, dropout_p=dropout_p)
    return _with_probs(result, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of q and ``kv`` (total_k, 2, nheads_k, headdim): k, v are views of kv, and
    its gradient is one tensor shaped like it."""
    k, v = _unpack(kv, "kv", 2, "(total_k, 2, nheads_k, headdim)")
    result = attention_varlen(_last_contiguous(q), k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, return_lse=return_attn_probs, deterministic=deterministic,
                              dropout_p=dropout_p)
    return _with_probs(result, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            k_descale=None, v_descale=None):
    """New query rows against a KV cache (flash-attn's ``flash_attn_with_kvcache``); not differentiable.

    When ``k`` and ``v`` are given they are written into ``k_cache``/``v_cache`` in place at positions
    ``cache_seqlens[b] ..`` before attending; row b then attends to ``cache_seqlens[b] + seqlen_new`` keys, with
    masks aligned bottom-right over that length.

    Parameters
    ----------
    q : torch.Tensor, (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device
    k_cache, v_cache : torch.Tensor
        ``(batch_cache, seqlen_cache, nheads_k, headdim)``, or with ``block_table`` a page pool
        ``(num_blocks, page_block_size, nheads_k, headdim)``, page_block_size a multiple of 16.
    k, v : torch.Tensor, (batch, seqlen_new, nheads_k, headdim), optional
    rotary_cos, rotary_sin : torch.Tensor, (seqlen_ro, rotary_dim / 2), optional
        Rotary embedding of k (at positions ``cache_seqlens[b] + i``) and q (the same when causal or local, else
        ``cache_seqlens[b]``), interleaved pairs or half split by ``rotary_interleaved``; with k and v only.
    cache_seqlens : int or torch.Tensor int32 (batch,), optional
        Keys in the cache per batch row before the append; default the whole capacity.
    cache_batch_idx : torch.Tensor int32 (batch,), optional
        Batch row b reads and appends to cache row ``cache_batch_idx[b]``.
    cache_leftpad : torch.Tensor int32 (batch,), optional
        Row b's keys start at cache position ``cache_leftpad[b]``.
    block_table : torch.Tensor int32 (batch, max_blocks_per_seq), optional
        Logical position p of row b lives at block ``block_table[b, p // page_block_size]``.
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As in :func:`flash_attn_func`.
    num_splits : int
        Splits of the keys across CTAs; 0 chooses, 1 does not split.
    return_softmax_lse : bool
        Also return the float32 ``softmax_lse`` (batch, nheads, seqlen_q).
    k_descale, v_descale : torch.Tensor float32, keyword only, optional
        An e4m3 cache (``torch.float8_e4m3fn`` k_cache, v_cache, k, v; flash-attn 3's names): per tensor or
        ``(batch, nheads_k)``. q stays float16 or bfloat16 (flash-attn 3 takes an FP8 q here; cuflash does not).

    Returns
    -------
    out : torch.Tensor, (batch, seqlen_q, nheads, headdim), dtype of q
    softmax_lse : torch.Tensor, float32, (batch, nheads, seqlen_q) -- only if ``return_softmax_lse``
    """
    return attention_with_kvcache(_last_contiguous(q), k_cache, v_cache, k=_last_contiguous(k),
                                  v=_last_contiguous(v), cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                  block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  num_splits=num_splits, return_lse=return_softmax_lse, rotary_cos=rotary_cos,
                                  rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                                  cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale)


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------

def _last_contiguous(x):
    """x with a contiguous last dimension, as flash-attn accepts any strides: a copy only if it has none."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _unpack(packed, name: str, count: int, layout: str) -> tuple:
    """Views of a packed tensor along its ``count`` axis (the third from the end): ``unbind``, whose gradient
    is one ``stack`` of the parts' gradients."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(packed).__name__}")
    if packed.dim() != len(layout.split(",")) or packed.shape[-3] != count:
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(packed.shape)}")
    return _last_contiguous(packed).unbind(packed.dim() - 3)


def _with_probs(result, return_attn_probs: bool):
    """flash-attn's return: out, or (out, softmax_lse, S_dmask) with S_dmask empty (never materialized)."""
    if not return_attn_probs:
        return result
    out, lse = result
    return out, lse, out.new_empty((0,))

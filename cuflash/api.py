"""The public functions on CuPy arrays. Each hands the call to its operation (:mod:`cuflash.ops`), which checks it,
resolves the options (:mod:`cuflash.options`), chooses the kernels and plans them once per call signature, and
launches them. Head dims run from 1 to 256; one that is not a multiple of 8 is checked here and runs on zero-padded
copies, and the results are views of the padded ones (``_padded``; the cost is in docs/api.md)."""
from __future__ import annotations

import math

import numpy as np

from . import checks, runtime
from .ops import backward, decode, forward

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache"]


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, return_lse=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0, stream=None):
    """Exact scaled-dot-product attention (FlashAttention-2 algorithm).

    Parameters
    ----------
    q : cupy.ndarray, (batch, seqlen_q, nheads, headdim), float16 or bfloat16
    k, v : cupy.ndarray, (batch, seqlen_k, nheads_k, headdim), same dtype as q
        ``nheads % nheads_k == 0`` (GQA/MQA: query head h reads KV head ``h // (nheads // nheads_k)``).
        The last axis must be contiguous; other strides are free (views of a packed qkv tensor work
        without a copy), but must keep 16-byte alignment (multiples of 8 elements).
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned when ``seqlen_q != seqlen_k``: query i sees key j iff
        ``j <= i + seqlen_k - seqlen_q``. For seqlen_q = 2, seqlen_k = 5 (x = visible)::

            x x x x .
            x x x x x

    window_size : (int, int)
        Sliding window ``(left, right)``: query i sees keys
        ``i + sk - sq - left <= j <= i + sk - sq + right``; -1 is unbounded. ``causal`` sets right to 0.
    softcap : float
        If > 0, scores ``s`` become ``softcap * tanh(s / softcap)`` (after scaling).
    alibi_slopes : cupy.ndarray, float32, (nheads,) or (batch, nheads), optional
        Adds ``-slope * |i + sk - sq - j|`` to each (scaled, capped) score.
    return_lse : bool
        Also return the float32 log-sum-exp ``(batch, nheads, seqlen_q)`` (natural log).
    dropout_p : float
        Dropout on the attention probabilities (0 <= p < 1): element (b, h, i, j) is dropped by the mask of
        ``dropout_seed`` and ``dropout_offset`` (:func:`cuflash.reference.dropout_keep`, regenerated in the kernels,
        never stored), and kept ones are scaled by ``1 / (1 - p)`` (p rounded to a multiple of 1/256). The same seed
        and offset give the same mask, bitwise; the backward takes the forward's three. The lse is that of the
        undropped scores. On sm_90a the Hopper kernels run it at head dims 40 to 256 (docs/api.md).
    dropout_seed, dropout_offset : int
        The mask's generator: ints in [0, 2**64).
    stream : cupy.cuda.Stream, optional
        Defaults to CuPy's current stream.

    Returns
    -------
    out : cupy.ndarray, (batch, seqlen_q, nheads, headdim), contiguous, dtype of q
    lse : cupy.ndarray, (batch, nheads, seqlen_q), float32 -- only if ``return_lse``

    A query row that sees no key gets ``out = 0`` and ``lse = -inf``.

    Examples
    --------
    >>> q = cupy.random.randn(2, 1024, 16, 128).astype(cupy.float16)
    >>> out = cuflash.attention(q, q, q, causal=True)
    """
    if getattr(q, "ndim", 0) and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies
        d = q.shape[-1]
        checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, headdim_multiple=1)
        q, k, v = _padded(d, stream, q=q, k=k, v=v)
        result = forward.attention(q, k, v, _scale(softmax_scale, d), causal, window_size, softcap, alibi_slopes,
                                   return_lse, stream, dropout_p, dropout_seed, dropout_offset)
        return (result[0][..., :d], result[1]) if return_lse else result[..., :d]
    return forward.attention(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, stream,
                             dropout_p, dropout_seed, dropout_offset)


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_seed=0,
                       dropout_offset=0, stream=None):
    """Gradients of :func:`attention` (FlashAttention-2 backward, KV-block parallel).

    Parameters
    ----------
    dout : cupy.ndarray, (batch, seqlen_q, nheads, headdim), dtype of q
        Gradient of the loss with respect to ``out``.
    q, k, v : as in :func:`attention`; head dims up to 256 on sm_90a, up to 128 elsewhere (larger ones raise
        NotImplementedError).
    out : cupy.ndarray, (batch, seqlen_q, nheads, headdim)
        The forward's output.
    lse : cupy.ndarray, float32, (batch, nheads, seqlen_q), contiguous
        The forward's log-sum-exp (``attention(..., return_lse=True)``).
    softmax_scale, causal, window_size, softcap, alibi_slopes
        Exactly as given to the forward.
    deterministic : bool
        If True, dQ is accumulated in a fixed order (per-CTA slices summed in order), so repeated calls
        give bitwise-identical results; otherwise fp32 atomics (faster, last-bit nondeterministic).
    dropout_p, dropout_seed, dropout_offset
        The forward's: the backward regenerates its mask (head dims up to 128; on sm_90a up to 256).
    stream : cupy.cuda.Stream, optional
        Defaults to CuPy's current stream.

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        Shaped and typed like q, k, v (contiguous). With GQA, dk/dv hold the sum over the query heads
        that share each KV head. Rows that saw no key get zero gradients.
    """
    if getattr(q, "ndim", 0) and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies
        d = q.shape[-1]
        checks.check_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              dropout_p=dropout_p, headdim_multiple=1)
        grads = attention_backward(*_padded(d, stream, dout=dout, q=q, k=k, v=v, out=out), lse,
                                   softmax_scale=_scale(softmax_scale, d), causal=causal, window_size=window_size,
                                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                   dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                                   stream=stream)
        return tuple(g[..., :d] for g in grads)
    return backward.attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap,
                                       alibi_slopes, deterministic, stream, dropout_p, dropout_seed, dropout_offset)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False,
                     block_table=None, seqused_k=None, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
                     stream=None):
    """Attention over a batch of variable-length sequences packed along one token axis (flash-attn's layout).

    Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
    of k and v. Each sequence is attended on its own, exactly as :func:`attention` with batch 1 would: masks are
    aligned bottom-right with the sequence's own lengths. For lengths ``sq = 2``, ``sk = 5``, causal::

        x x x x .
        x x x x x

    Parameters
    ----------
    q : cupy.ndarray, (total_q, nheads, headdim), float16 or bfloat16
    k, v : cupy.ndarray, (total_k, nheads_k, headdim), same dtype as q
        ``nheads % nheads_k == 0`` (GQA/MQA). Last axis contiguous, other strides free (16-byte aligned).
    cu_seqlens_q, cu_seqlens_k : cupy.ndarray, int32, (batch + 1,), on the device
        Cumulative sequence starts: non-decreasing, ``cu_seqlens[0] = 0`` and ``cu_seqlens[-1]`` at most the
        token count. Equal neighbours make an empty sequence. They are read by the kernels, never by the host
        (no synchronization); out and lse rows outside every sequence are not written.
    max_seqlen_q, max_seqlen_k : int
        Upper bounds on the sequence lengths (they size the grid and pick the tile config); a sequence longer
        than ``max_seqlen_q`` would be left partly uncomputed.
    softmax_scale, causal, window_size, softcap : as in :func:`attention`, per sequence.
    alibi_slopes : cupy.ndarray, float32, (nheads,) or (batch, nheads), optional
        Row ``b`` for sequence ``b``.
    return_lse : bool
        Also return the float32 log-sum-exp ``(nheads, total_q)`` (natural log).
    block_table : cupy.ndarray, int32, (batch, max_pages), optional
        Paged keys (chunked prefill against a KV cache): k and v are then page pools ``(num_pages, page_size,
        nheads_k, headdim)``, page_size a multiple of 16, and key p of sequence b is row ``p % page_size`` of page
        ``block_table[b, p // page_size]``; sequence b has ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys (or
        ``seqused_k[b]``), at most ``max_pages * page_size``. Forward only (no backward); on sm_90a at head dims
        40 to 256 (without dropout) the Hopper kernel's paged variant runs it.
    seqused_k : cupy.ndarray, int32, (batch,), optional
        Keys of sequence b, instead of cu_seqlens_k's difference (at most that difference when not paged). Forward
        only; on sm_90a it runs on the portable kernel.
    dropout_p, dropout_seed, dropout_offset
        As in :func:`attention`; element (b, h, i, j) is query i, key j of sequence b.
    stream : cupy.cuda.Stream, optional

    Returns
    -------
    out : cupy.ndarray, (total_q, nheads, headdim), contiguous, dtype of q
    lse : cupy.ndarray, (nheads, total_q), float32 -- only if ``return_lse``

    A query row that sees no key (also every row of a sequence with no keys) gets ``out = 0`` and
    ``lse = -inf``. Key counts and pages read from device memory are bounded in the kernel: a sequence never reads
    past its own rows or the pages of its block_table row, and a page index outside the pool reads as zeros.

    Examples
    --------
    >>> cu = cupy.asarray([0, 100, 100, 612], dtype=cupy.int32)   # lengths 100, 0, 512
    >>> q = cupy.random.randn(612, 16, 128).astype(cupy.float16)
    >>> out = cuflash.attention_varlen(q, q, q, cu, cu, 512, 512, causal=True)
    """
    if getattr(q, "ndim", 0) and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies
        d = q.shape[-1]
        checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, block_table=block_table, seqused_k=seqused_k,
                            dropout_p=dropout_p, headdim_multiple=1)
        result = attention_varlen(*_padded(d, stream, q=q, k=k, v=v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=_scale(softmax_scale, d), causal=causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  return_lse=return_lse, block_table=block_table, seqused_k=seqused_k,
                                  dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                                  stream=stream)
        return (result[0][..., :d], result[1]) if return_lse else result[..., :d]
    return forward.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, window_size, softcap, alibi_slopes, return_lse, block_table, seqused_k,
                                    stream, dropout_p, dropout_seed, dropout_offset)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_seed=0,
                              dropout_offset=0, stream=None):
    """Gradients of :func:`attention_varlen`: the kernels of :func:`attention_backward`, per sequence.

    Parameters
    ----------
    dout : cupy.ndarray, (total_q, nheads, headdim), dtype of q
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k : as in :func:`attention_varlen`;
        head dims up to 256 on sm_90a, up to 128 elsewhere (larger ones raise NotImplementedError).
    out : cupy.ndarray, (total_q, nheads, headdim)
        The forward's output.
    lse : cupy.ndarray, float32, (nheads, total_q), contiguous
        The forward's log-sum-exp (``attention_varlen(..., return_lse=True)``).
    softmax_scale, causal, window_size, softcap, alibi_slopes
        Exactly as given to the forward.
    deterministic : bool
        Bitwise-repeatable dQ, as in :func:`attention_backward`.
    dropout_p, dropout_seed, dropout_offset
        The forward's.
    stream : cupy.cuda.Stream, optional

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        Shaped and typed like q, k, v (contiguous). Keys of a sequence without queries get zero gradients.
        Token rows outside every sequence get dq = 0; their dk, dv are not written.
    """
    if getattr(q, "ndim", 0) and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies
        d = q.shape[-1]
        checks.check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                     dropout_p=dropout_p, headdim_multiple=1)
        grads = attention_varlen_backward(*_padded(d, stream, dout=dout, q=q, k=k, v=v, out=out), lse, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=_scale(softmax_scale, d), causal=causal,
                                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                          deterministic=deterministic, dropout_p=dropout_p,
                                          dropout_seed=dropout_seed, dropout_offset=dropout_offset, stream=stream)
        return tuple(g[..., :d] for g in grads)
    return backward.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                              deterministic, stream, dropout_p, dropout_seed, dropout_offset)


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                           block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, num_splits=0, return_lse=False, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_leftpad=None, k_descale=None, v_descale=None, stream=None):
    """Attention of new query rows against a KV cache (decode), with FlashAttention's semantics.

    Parameters
    ----------
    q : cupy.ndarray, (batch, seqlen_new, nheads, headdim)
        Usually seqlen_new = 1; up to a few hundred rows (speculative decoding) work too.
    k_cache, v_cache : cupy.ndarray
        Contiguous cache ``(batch_cache, max_len, nheads_k, headdim)``, or with ``block_table`` a page pool
        ``(num_pages, page_size, nheads_k, headdim)``, page_size any multiple of 16. Updated in place when
        ``k``/``v`` are given.
    k, v : cupy.ndarray, (batch, seqlen_new_k, nheads_k, headdim), optional
        Appended to the cache at positions ``cache_seqlens[b] ..`` (in place) before attending.
    cache_seqlens : int or cupy int32 (batch,), optional
        Keys already in the cache per batch row (before the append); default: the whole capacity.
    cache_batch_idx : cupy int32 (batch,), optional
        Batch row b reads (and appends to) cache row ``cache_batch_idx[b]``. Not with ``block_table``.
    block_table : cupy int32 (batch, max_pages), optional
        Page indices: logical position p of row b lives at page ``block_table[b, p // page_size]``,
        row ``p % page_size``.
    softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, stream
        As in :func:`attention`. Row b attends to ``L_b = cache_seqlens[b] + seqlen_new_k`` keys; causal and
        window masks are aligned bottom-right over that length (new query i sits at position
        ``L_b - seqlen_new + i``).
    num_splits : int
        Splits of the keys across CTAs (merged by a combine kernel). 0 chooses from the SM count, the number
        of (batch, KV head) pairs and the cache length; 1 writes the output directly.
    rotary_cos, rotary_sin : cupy.ndarray, (seqlen_ro, rotary_dim / 2), q's dtype, contiguous, optional
        Rotary embedding of the new keys and the queries (with ``k``/``v`` only), as flash-attn applies it: new key
        i of row b is rotated for position ``cache_seqlens[b] + i`` before it is appended; query i for position
        ``cache_seqlens[b] + i`` when causal or local, else ``cache_seqlens[b]``. rotary_dim (a multiple of 16, at
        most the head dim) leading elements of a row are rotated; positions past ``seqlen_ro`` are not.
    rotary_interleaved : bool
        Rotate element pairs (2j, 2j + 1) (GPT-J style); False: (j, j + rotary_dim / 2) (GPT-NeoX style).
    cache_leftpad : cupy int32 (batch,), optional
        Row b's keys start at cache position ``cache_leftpad[b]``: it attends to positions ``cache_leftpad[b] ..
        L_b - 1`` as if they were its positions ``0 ..`` (masks and ALiBi count from there).
    k_descale, v_descale : cupy.ndarray of float32, optional
        An e4m3 cache: k_cache and v_cache (and k, v) uint8 holding e4m3 bits, read as ``k_cache * k_descale`` and
        ``v_cache * v_descale``; one value per tensor (shape () or (1,)) or per (batch row, KV head),
        ``(batch, nheads_k)`` contiguous. None: 1. q and out stay fp16 or bf16. The head dim is then a multiple of
        16, the strides multiples of 16 bytes, and there is no rotary embedding (rotate k before quantizing it).
        The decode reads half the bytes (docs/fp8.md, "KV cache").

    Returns
    -------
    out : cupy.ndarray, (batch, seqlen_new, nheads, headdim); lse (batch, nheads, seqlen_new) float32 if asked.
    A row with no key (``L_b = 0``) gets ``out = 0`` and ``lse = -inf``. Values read from device memory
    (cache_seqlens, cache_batch_idx, block_table, cache_leftpad) are bounded in the kernels (docs/api.md, "Bounds").

    The query heads that share a KV head are processed together, so every K/V byte is read once.
    """
    if getattr(q, "ndim", 0) and q.shape[-1] % 8:  # a head dim the kernels do not take: padded copies
        return _padded_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, return_lse,
                               stream, rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, k_descale,
                               v_descale)
    return decode.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                         softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
                                         return_lse, stream, rotary_cos, rotary_sin, rotary_interleaved,
                                         cache_leftpad, k_descale, v_descale)


# --------------------------------------------------------------------------------------------
# Head dims that are not multiples of 8: the call on zero-padded copies
# --------------------------------------------------------------------------------------------
# The kernels load 16 bytes at a time, so they take head dims that are multiples of 8. A call with any other
# head dim d is checked as given, then runs on copies of its arrays padded with zero columns up to
# checks.padded_headdim(d), at the default scale 1 / sqrt(d), and returns the first d columns of the padded
# results (views). Zero columns add nothing to q . k, and zero columns of v (and of dout) give zero columns of
# out (and of the gradients), so the result is exactly the unpadded one. A call whose head dim is a multiple
# of 8 never comes here.

def _scale(softmax_scale, headdim: int):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale


def _padded(headdim: int, stream, **arrays) -> list:
    """Zero-padded copies of the (CuPy) arrays, made on the first one's device, on ``stream``."""
    cupy = runtime.import_cupy()
    for name, x in arrays.items():
        if x is not None and not isinstance(x, cupy.ndarray):
            runtime.require_device_arrays(**{name: x})  # the usual TypeError
    runtime.require_gpu()
    padded = checks.padded_headdim(headdim)
    copies = []
    with cupy.cuda.Device(next(iter(arrays.values())).device.id), runtime.on(stream):
        for x in arrays.values():
            if x is None:
                copies.append(None)
                continue
            copy = cupy.zeros(x.shape[:-1] + (padded,), dtype=x.dtype)
            copy[..., :x.shape[-1]] = x
            copies.append(copy)
    return copies


def _padded_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                    window_size, softcap, alibi_slopes, num_splits, return_lse, stream, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, k_descale=None, v_descale=None):
    """:func:`attention_with_kvcache` on padded copies of q, k, v and of both caches (whole: the rows a call reads
    are known on the device only); the appended rows are then copied back into the caller's caches."""
    d = q.shape[-1]
    checks.check_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                         block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                         softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits, rotary_cos=rotary_cos,
                         rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, cache_leftpad=cache_leftpad,
                         k_descale=k_descale, v_descale=v_descale, headdim_multiple=1)
    runtime.require_device_index_arrays(cache_batch_idx=cache_batch_idx, block_table=block_table,
                                        cache_seqlens=None if checks.is_int(cache_seqlens) else cache_seqlens)
    q_padded, k_cache_padded, v_cache_padded, k_padded, v_padded = _padded(d, stream, q=q, k_cache=k_cache,
                                                                           v_cache=v_cache, k=k, v=v)
    result = attention_with_kvcache(q_padded, k_cache_padded, v_cache_padded, k=k_padded, v=v_padded,
                                    cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                    block_table=block_table, softmax_scale=_scale(softmax_scale, d), causal=causal,
                                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                    num_splits=num_splits, return_lse=return_lse, rotary_cos=rotary_cos,
                                    rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                                    cache_leftpad=cache_leftpad, stream=stream)
    if k is not None:
        import cupy
        with cupy.cuda.Device(q.device.id), runtime.on(stream):
            rows = _appended_rows(k_cache, k.shape[0], k.shape[1], cache_seqlens, cache_batch_idx, block_table)
            k_cache[rows] = k_cache_padded[rows][..., :d]
            v_cache[rows] = v_cache_padded[rows][..., :d]
    return (result[0][..., :d], result[1]) if return_lse else result[..., :d]


def _appended_rows(cache, batch: int, seqlen_new: int, cache_seqlens, cache_batch_idx, block_table) -> tuple:
    """Index arrays ``(cache rows or pages, positions or rows within the page)``, each ``(batch, seqlen_new)``, of
    the rows an append writes, computed on the device without a synchronization. Indices are clamped into the
    cache (cache_seqlens, cache_batch_idx and block_table may hold anything): every index names a row whose padded
    copy holds that row after the call, so copying it back is right whether or not the call wrote it."""
    xp = runtime.import_cupy().get_array_module(cache)  # cupy; numpy for host arrays
    positions = xp.broadcast_to(xp.arange(seqlen_new, dtype=np.int64), (batch, seqlen_new))
    if cache_seqlens is not None:
        positions = positions + (cache_seqlens if checks.is_int(cache_seqlens)
                                 else cache_seqlens.astype(np.int64)[:, None])
    if block_table is None:
        rows = (xp.arange(batch, dtype=np.int64) if cache_batch_idx is None
                else xp.clip(cache_batch_idx.astype(np.int64), 0, cache.shape[0] - 1))
        return xp.broadcast_to(rows[:, None], (batch, seqlen_new)), xp.clip(positions, 0, cache.shape[1] - 1)
    page_size = cache.shape[1]
    slots = xp.clip(positions // page_size, 0, block_table.shape[1] - 1)
    pages = xp.clip(xp.take_along_axis(block_table.astype(np.int64), slots, axis=1), 0, cache.shape[0] - 1)
    return pages, positions % page_size

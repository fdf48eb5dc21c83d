"""NumPy float64 reference of every public cuflash function.

This module is the executable definition of cuflash's semantics: every GPU kernel is tested
against it. It favours obviousness over speed — whole score matrices are materialized — so use it
on small problems only.

Every function takes the same arguments as its GPU counterpart in ``cuflash``. Inputs may be NumPy
arrays of any float dtype (float16, float32, float64, ``ml_dtypes.bfloat16``; CuPy arrays are
copied to the host); all arithmetic is float64 and every result is float64. GPU-only options
(``stream``, ``deterministic``, ``num_splits``) are accepted and ignored.

The FP8 functions (:func:`attention_fp8`, :func:`fp8_error_bound`, :func:`dequantize_e4m3`) take
float8_e4m3fn arrays (``ml_dtypes``), or their bits as uint8, with float32 descales, and
:func:`quantize_e4m3` makes them; they model the FP8 forward and state its accuracy contract
(docs/fp8.md).

All masking, soft-capping and ALiBi is defined once, in :func:`_scores`; everything else
(forward, backward, varlen, KV cache, FP8) calls it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "attention",
    "attention_backward",
    "dropout_keep",
    "philox4x32",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "combine",
    "attention_fp8",
    "fp8_error_bound",
    "quantize_e4m3",
    "dequantize_e4m3",
]


# --------------------------------------------------------------------------------------------
# Input conversion and checks
# --------------------------------------------------------------------------------------------


def _host(x):
    """Return ``x`` as a NumPy array, copying device (CuPy) arrays to the host."""
    if not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x)


def _f64(x):
    """Return ``x`` as a float64 NumPy array (bf16 through ml_dtypes converts fine)."""
    return np.asarray(_host(x), dtype=np.float64)


def _i64(x):
    """Return an integer index array (cu_seqlens, cache_seqlens, block_table) as int64."""
    return np.asarray(_host(x)).astype(np.int64)


def _check_qkv(q, k, v, *, batch_axis=True):
    """Check the shape relations between q, k and v; return ``(nheads, nheads_k)``."""
    nd = 4 if batch_axis else 3
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != nd:
            raise ValueError(f"{name} must have {nd} dimensions, got shape {x.shape}")
    if batch_axis and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {k.shape} and v {v.shape} must agree on all but the head dim")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k head dim is {k.shape[-1]}, q's is {q.shape[-1]}")
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    return nheads, nheads_k


def _alibi_per_batch(alibi_slopes, batch, nheads):
    """ALiBi slopes as float64 ``(batch, nheads)``, or None."""
    if alibi_slopes is None:
        return None
    slopes = _f64(alibi_slopes)
    if slopes.shape == (nheads,):
        return np.broadcast_to(slopes, (batch, nheads))
    if slopes.shape == (batch, nheads):
        return slopes
    raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {slopes.shape}")


def _repeat_kv(x, nheads):
    """Expand ``(..., nheads_k, d)`` to ``(..., nheads, d)``: query head h reads kv head h // group."""
    return np.repeat(x, nheads // x.shape[-2], axis=-2)


def _sum_groups(x, nheads_k):
    """Inverse of :func:`_repeat_kv` for gradients: sum each group of query heads."""
    *lead, nheads, d = x.shape
    return x.reshape(*lead, nheads_k, nheads // nheads_k, d).sum(axis=-2)


# --------------------------------------------------------------------------------------------
# The semantics: one definition of the score matrix
# --------------------------------------------------------------------------------------------


def _bhsd(x):
    """``(b, s, h, d)`` <-> ``(b, h, s, d)``: heads next to the batch, so that products over the head dim or the
    keys are batched matrix products (``@``: BLAS, many times faster than ``np.einsum``'s loops)."""
    return x.transpose(0, 2, 1, 3)


def _visible(seqlen_q, seqlen_k, causal, window_size):
    """Bool ``(seqlen_q, seqlen_k)``: may query i see key j? Masks are aligned bottom-right.

    Query i sits at key position ``i + seqlen_k - seqlen_q``. The window keeps
    ``pos - left <= j <= pos + right`` with -1 meaning unbounded on that side; ``causal`` forces
    ``right = 0`` and keeps ``left`` from ``window_size`` (flash-attn behaviour).
    """
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    pos = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    keep = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        keep &= j >= pos - left
    if right >= 0:
        keep &= j <= pos + right
    return keep


class _Scores(NamedTuple):
    scores: np.ndarray     # (batch, nheads, seqlen_q, seqlen_k), -inf where not visible
    visible: np.ndarray    # (seqlen_q, seqlen_k) bool
    dcap: np.ndarray | float  # d(capped score)/d(raw score): 1 - tanh^2, or 1.0 without softcap


def _scores(q, k, *, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """Masked score matrix of q ``(b, sq, h, d)`` against k ``(b, sk, h, d)`` (kv heads expanded).

    ``s = softmax_scale * q.k``; if ``softcap > 0``: ``s = softcap * tanh(s / softcap)``; then
    ALiBi adds ``-slope[b, h] * |i + sk - sq - j|`` (not scaled); then not-visible entries are -inf.
    ``alibi_slopes`` is None or float64 ``(b, h)``.
    """
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    s = softmax_scale * (_bhsd(q) @ _bhsd(k).swapaxes(-1, -2))
    dcap = 1.0
    if softcap > 0:
        t = np.tanh(s / softcap)
        s = softcap * t
        dcap = 1.0 - t * t
    if alibi_slopes is not None:
        dist = np.abs(np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, :])
        s = s - alibi_slopes[:, :, None, None] * dist
    visible = _visible(seqlen_q, seqlen_k, causal, window_size)
    s = np.where(visible, s, -np.inf)
    return _Scores(s, visible, dcap)


def _default_scale(softmax_scale, headdim):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """:func:`_scores`' keywords from a dense call's arguments, q ``(b, sq, h, d)``."""
    return dict(softmax_scale=_default_scale(softmax_scale, q.shape[-1]), causal=causal, window_size=window_size,
                softcap=float(softcap), alibi_slopes=_alibi_per_batch(alibi_slopes, q.shape[0], q.shape[2]))


# --------------------------------------------------------------------------------------------
# Dropout: the mask, from a counter-based generator (Philox 4x32-10)
# --------------------------------------------------------------------------------------------

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(counter, key, rounds: int = 10):
    """Philox 4x32 (Salmon et al., SC 2011): four uint32 words of ``counter`` (a sequence of 4 arrays of one shape)
    under the two uint32 words of ``key`` -> four uint32 arrays. Each round multiplies words 0 and 2 by the round
    constants into 64-bit products and mixes their halves with words 1 and 3 and the key, which is bumped by the Weyl
    constants between rounds."""
    c = [np.asarray(x, dtype=np.uint64) & 0xFFFFFFFF for x in counter]
    k0, k1 = (np.uint64(int(x) & 0xFFFFFFFF) for x in key)
    mask = np.uint64(0xFFFFFFFF)
    for r in range(rounds):
        p0, p1 = c[0] * np.uint64(_PHILOX_M[0]), c[2] * np.uint64(_PHILOX_M[1])
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & mask, p1 >> np.uint64(32), p1 & mask
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        if r + 1 < rounds:
            k0, k1 = (k0 + np.uint64(_PHILOX_W[0])) & mask, (k1 + np.uint64(_PHILOX_W[1])) & mask
    return [x.astype(np.uint32) for x in c]


DROPOUT_LEVELS = 256  # the draws are bytes


def dropout_threshold(dropout_p: float) -> int:
    """A draw u (a byte) keeps its element when u < threshold = round((1 - p) 256), at most 255 where p > 0: the keep
    probability is then exactly threshold / 256 (p rounded to a multiple of 1/256, at least 1/256), and kept
    probabilities are scaled by 256 / threshold. 256: no dropout."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected 0 <= p < 1, got {dropout_p!r}")
    if dropout_p == 0.0:
        return DROPOUT_LEVELS
    return min(DROPOUT_LEVELS - 1, max(1, round((1.0 - dropout_p) * DROPOUT_LEVELS)))


def dropout_keep(seed: int, offset: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float) -> np.ndarray:
    """The dropout mask, bool ``(batch, nheads, seqlen_q, seqlen_k)`` (True: kept), of element (b, h, i, j) — query
    row i, key j of sequence b, head h — as every cuflash kernel regenerates it.

    The 16 x 16 tile of rows 16R.., keys 16C.. splits into 32 sets of 8 elements: rows {2a, 2a + 1, 2a + 8, 2a + 9} x
    keys {k, k + 8} (a in 0..3, k in 0..7), and the sets in pairs k = 2t, 2t + 1. One Philox call gives a pair its
    sixteen draws, bytes, under the key (seed's low word, seed's high word ^ offset's high word), from the counter

        word 0 = C = j / 16            word 1 = R = i / 16
        word 2 = 16 (b nheads + h) + 4 a + t      (a = (i % 8) / 2, t = (j % 8) / 2)
        word 3 = offset's low word

    Set k % 2 of the pair takes output words 2 (k % 2) and 2 (k % 2) + 1; draw v = 4 ((i % 16) / 8) +
    2 ((j % 16) / 8) + i % 2 of the set is byte v % 4 of the first word (v < 4) or the second. A thread of the
    backward's transposed accumulator layout (rows = keys) holds one set per 16 x 16 tile and one of the forward's
    (rows = queries) half of both sets of a pair; either shares a call with the thread four lanes away, each drawing
    the call of every other tile (cuda_src/dropout.cuh).
    """
    threshold = dropout_threshold(dropout_p)
    i = np.arange(seqlen_q, dtype=np.int64)[:, None]
    j = np.arange(seqlen_k, dtype=np.int64)[None, :]
    bh = np.arange(batch * nheads, dtype=np.int64).reshape(batch, nheads, 1, 1)
    word2 = 16 * bh + 4 * ((i % 8) // 2) + (j % 8) // 2
    zeros = np.zeros_like(word2)
    counter = (j // 16 + zeros, i // 16 + zeros, word2, np.full_like(word2, int(offset) & 0xFFFFFFFF))
    key = (int(seed) & 0xFFFFFFFF, ((int(seed) >> 32) ^ (int(offset) >> 32)) & 0xFFFFFFFF)
    words = philox4x32(counter, key)
    v = 4 * ((i % 16) // 8) + 2 * ((j % 16) // 8) + i % 2 + zeros
    word = np.choose(2 * (j % 2) + v // 4, words)
    draw = (word >> (8 * (v % 4)).astype(np.uint32)) & 0xFF
    return draw < threshold


# --------------------------------------------------------------------------------------------
# Dense forward and backward on float64 arrays (the workers behind every public function)
# --------------------------------------------------------------------------------------------


class _Probs(NamedTuple):
    p: np.ndarray          # (batch, nheads, seqlen_q, seqlen_k): exp(S - row max), 0 where not visible
    l: np.ndarray          # (batch, nheads, seqlen_q): row sums of p
    lse: np.ndarray        # (batch, nheads, seqlen_q): natural log, -inf for a row with no visible key
    m: np.ndarray          # (batch, nheads, seqlen_q): the row max that p is shifted by, 0 for a row with no key
    visible: np.ndarray    # (seqlen_q, seqlen_k) bool


def _lse(l, m):
    """``m + log(l)``: the lse of a row whose probabilities, shifted by m, sum to l; -inf where l = 0."""
    with np.errstate(divide="ignore"):
        return np.log(l) + m


def _probs(q, k, **options):
    """The softmax of q ``(b, sq, h, d)`` against k ``(b, sk, h, d)`` (kv heads expanded), unnormalized: P shifted
    by each row's max, its row sums and the lse. ``options``: :func:`_scores`' keywords."""
    sc = _scores(q, k, **options)
    m = np.max(sc.scores, axis=-1, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)        # empty row: any finite shift; exp(-inf) = 0 anyway
    p = np.exp(sc.scores - m[..., None])
    l = p.sum(axis=-1)
    return _Probs(p, l, _lse(l, m), m, sc.visible)


def _weighted_values(p, v, l):
    """``(p @ v) / l``: p ``(b, h, sq, sk)``, v ``(b, sk, h, dv)``, row sums l ``(b, h, sq)`` -> ``(b, sq, h, dv)``;
    0 in rows with ``l = 0``."""
    return _bhsd(p @ _bhsd(v)) / np.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]


def _forward(q, k, v, *, dropout=None, p_round=None, round_sums=False, **options):
    """q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)`` float64 -> out ``(b, sq, h, dv)``, lse ``(b, h, sq)``.
    ``options``: :func:`_scores`' keywords. dropout: (keep ``(b, h, sq, sk)``, keep probability): out from the kept
    probabilities over it; lse is dropout's none. p_round: a function of P (shifted by the row max) that gives the P
    multiplying V (the FP8 kernel's quantization); the row sums that normalize out, and the lse, are those of P, or
    with ``round_sums`` those of the rounded P."""
    nheads = q.shape[2]
    pr = _probs(q, _repeat_kv(k, nheads), **options)
    p, l, lse = pr.p, pr.l, pr.lse
    if dropout is not None:
        p = np.where(dropout[0], p / dropout[1], 0.0)
    if p_round is not None:
        p = p_round(p)
        if round_sums:
            l = p.sum(axis=-1)
            lse = _lse(l, pr.m)
    return _weighted_values(p, _repeat_kv(v, nheads), l), lse


def _backward(dout, q, k, v, out, lse, *, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout=None):
    """Analytic gradients; shapes as in :func:`_forward`, lse ``(b, h, sq)``. Returns dq, dk, dv."""
    nheads, nheads_k = q.shape[2], k.shape[2]
    ke, ve = _repeat_kv(k, nheads), _repeat_kv(v, nheads)
    sc = _scores(q, ke, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                 softcap=softcap, alibi_slopes=alibi_slopes)
    lse = np.where(np.isneginf(lse), np.inf, lse)[..., None]   # empty row: exp(-inf - inf) = 0
    p = np.exp(sc.scores - lse)                 # 0 where masked (score -inf) or the row is empty
    scale = 1.0 if dropout is None else np.where(dropout[0], 1.0 / dropout[1], 0.0)  # out = (P scale) V
    dv = _bhsd((p * scale).swapaxes(-1, -2) @ _bhsd(dout))
    dp = _bhsd(dout) @ _bhsd(ve).swapaxes(-1, -2) * scale
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta) * sc.dcap * softmax_scale
    dq = _bhsd(ds @ _bhsd(ke))
    dk = _bhsd(ds.swapaxes(-1, -2) @ _bhsd(q))
    return dq, _sum_groups(dk, nheads_k), _sum_groups(dv, nheads_k)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _dropout(dropout_p, seed, offset, batch, nheads, seqlen_q, seqlen_k):
    """(keep mask, keep probability) for _forward / _backward, or None without dropout."""
    if not dropout_p:
        return None
    return (dropout_keep(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p),
            dropout_threshold(dropout_p) / DROPOUT_LEVELS)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, return_lse=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0, stream=None):
    """Exact softmax attention, float64 reference of :func:`cuflash.attention`.

    Parameters
    ----------
    q : array, ``(batch, seqlen_q, nheads, headdim)``
    k : array, ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0``. Query head
        ``h`` uses kv head ``h // (nheads // nheads_k)`` (MQA/GQA).
    v : array, ``(batch, seqlen_k, nheads_k, headdim_v)``
    softmax_scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(headdim)``.
    causal : bool
        Query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q`` (aligned bottom-right).
        With ``seqlen_q=3, seqlen_k=5`` (``x`` = visible)::

                      key j  0 1 2 3 4
              query i = 0    x x x . .
                        1    x x x x .
                        2    x x x x x

        With ``seqlen_q > seqlen_k`` the first ``seqlen_q - seqlen_k`` rows see no key.
    window_size : (int, int)
        ``(left, right)``: query ``i`` sees keys ``i + sk - sq - left <= j <= i + sk - sq + right``;
        ``-1`` is unbounded on that side. With ``causal=True``, ``right`` is forced to 0.
    softcap : float
        If ``> 0`` the scaled score ``s`` becomes ``softcap * tanh(s / softcap)``.
    alibi_slopes : array, ``(nheads,)`` or ``(batch, nheads)``, optional
        Adds ``-slope * |i + sk - sq - j|`` to the (capped) score; not multiplied by the scale.
    return_lse : bool
        Also return the log-sum-exp of each row's scores.
    dropout_p, dropout_seed, dropout_offset : float, int, int
        Dropout on the probabilities: element (b, h, i, j) is kept where :func:`dropout_keep` says, and kept ones are
        scaled by 256 / dropout_threshold(p) (1 / (1 - p), p rounded to a multiple of 1/256). The lse is that of the
        scores, without dropout.
    stream : ignored

    Returns
    -------
    out : float64 ``(batch, seqlen_q, nheads, headdim_v)``
        A row with no visible key is 0.
    lse : float64 ``(batch, nheads, seqlen_q)``, only with ``return_lse``
        Natural log; ``-inf`` for a row with no visible key.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    nheads, _ = _check_qkv(q, k, v)
    out, lse = _forward(q, k, v, **_options(q, softmax_scale, causal, window_size, softcap, alibi_slopes),
                        dropout=_dropout(dropout_p, dropout_seed, dropout_offset, q.shape[0], nheads, q.shape[1],
                                         k.shape[1]))
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_seed=0,
                       dropout_offset=0, stream=None):
    """Gradients of :func:`attention`, float64 reference of :func:`cuflash.attention_backward`.

    Analytic, from the saved ``out`` and ``lse``: ``P = exp(S - lse)`` (0 where masked or
    ``lse = -inf``), ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(dO * O)``,
    ``dS = P * (dP - D)`` times ``1 - tanh^2`` when ``softcap > 0``, times ``softmax_scale``;
    ``dQ = dS K``, ``dK = dS^T Q``. For GQA, ``dk``/``dv`` sum over the query heads of a group.

    Parameters
    ----------
    dout : array, ``(batch, seqlen_q, nheads, headdim_v)``
    q, k, v : arrays as in :func:`attention`
    out : array, ``(batch, seqlen_q, nheads, headdim_v)``, the forward output
    lse : array, ``(batch, nheads, seqlen_q)``, the forward log-sum-exp
    softmax_scale, causal, window_size, softcap, alibi_slopes : as in :func:`attention`
    dropout_p, dropout_seed, dropout_offset : the forward's (the same mask: ``dV = (P M / pk)^T dO``,
        ``dS = P * (dP M / pk - D)``)
    deterministic, stream : ignored

    Returns
    -------
    dq : float64, shaped like q
    dk : float64, shaped like k
    dv : float64, shaped like v
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    nheads, _ = _check_qkv(q, k, v)
    return _backward(_f64(dout), q, k, v, _f64(out), _f64(lse),
                     **_options(q, softmax_scale, causal, window_size, softcap, alibi_slopes),
                     dropout=_dropout(dropout_p, dropout_seed, dropout_offset, q.shape[0], nheads, q.shape[1],
                                      k.shape[1]))


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """Yield ``(b, slice_q, slice_k)`` for each sequence of a varlen batch."""
    cq, ck = _i64(cu_seqlens_q), _i64(cu_seqlens_k)
    if cq.ndim != 1 or cq.shape != ck.shape or cq.size < 1:
        raise ValueError(f"cu_seqlens_q {cq.shape} and cu_seqlens_k {ck.shape} must both be (batch + 1,)")
    for b in range(cq.size - 1):
        yield b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])


def _sequence_dropout(dropout_p, seed, offset, b, nheads, seqlen_q, seqlen_k):
    """The dropout of sequence b of a varlen batch (its element (b, h, i, j): query i, key j of the sequence)."""
    if not dropout_p:
        return None
    keep = dropout_keep(seed, offset, b + 1, nheads, seqlen_q, seqlen_k, dropout_p)[b:b + 1]
    return keep, dropout_threshold(dropout_p) / DROPOUT_LEVELS


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False,
                     block_table=None, seqused_k=None, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
                     stream=None):
    """Attention over packed variable-length sequences; reference of :func:`cuflash.attention_varlen`.

    Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v; each is attended on its own, with masks aligned
    bottom-right within the sequence, exactly as :func:`attention` with batch 1.

    Parameters
    ----------
    q : array, ``(total_q, nheads, headdim)``
    k, v : arrays, ``(total_k, nheads_k, headdim)`` / ``(total_k, nheads_k, headdim_v)``
    cu_seqlens_q, cu_seqlens_k : int32 ``(batch + 1,)``, cumulative sequence starts (first is 0)
    max_seqlen_q, max_seqlen_k : int
        Planning hints for the GPU; ignored here.
    alibi_slopes : array, ``(nheads,)`` or ``(batch, nheads)`` (row ``b`` for sequence ``b``), optional
    softmax_scale, causal, window_size, softcap, return_lse, stream : as in :func:`attention`
    block_table : int32 ``(batch, max_pages)``, optional
        k, v are page pools ``(num_pages, page_size, nheads_k, d)``; key p of sequence b is row
        ``p % page_size`` of page ``block_table[b, p // page_size]``.
    seqused_k : int32 ``(batch,)``, optional
        Keys of sequence b, instead of ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``.
    dropout_p, dropout_seed, dropout_offset : as in :func:`attention`, element (b, h, i, j) being query i and key j
        of sequence b

    Returns
    -------
    out : float64 ``(total_q, nheads, headdim_v)``
    lse : float64 ``(nheads, total_q)``, only with ``return_lse``
    """
    q = _f64(q)
    k_all, v_all = _f64(k), _f64(v)
    if block_table is not None:  # the pools as one row per (page, row), and each sequence's rows among them
        page_size = k_all.shape[1]
        k, v = k_all.reshape(-1, *k_all.shape[2:]), v_all.reshape(-1, *v_all.shape[2:])
    else:
        k, v = k_all, v_all
    nheads, _ = _check_qkv(q, k, v, batch_axis=False)
    cu_q = _i64(cu_seqlens_q)
    slopes = _alibi_per_batch(alibi_slopes, max(cu_q.size - 1, 0), nheads)
    scale = _default_scale(softmax_scale, q.shape[-1])
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full((nheads, q.shape[0]), -np.inf)
    for b, sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        n = sk.stop - sk.start if seqused_k is None else int(_i64(seqused_k)[b])
        if block_table is not None:
            pos = np.arange(n)
            sk = _i64(block_table)[b, pos // page_size] * page_size + pos % page_size
        elif seqused_k is not None:
            if n > sk.stop - sk.start:
                raise ValueError(f"seqused_k[{b}] = {n} exceeds the sequence's {sk.stop - sk.start} keys")
            sk = slice(sk.start, sk.start + n)
        o, l = _forward(q[None, sq], k[None, sk], v[None, sk], softmax_scale=scale, causal=causal,
                        window_size=window_size, softcap=float(softcap),
                        alibi_slopes=None if slopes is None else slopes[b:b + 1],
                        dropout=_sequence_dropout(dropout_p, dropout_seed, dropout_offset, b, nheads,
                                                  sq.stop - sq.start, n))
        out[sq], lse[:, sq] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_seed=0,
                              dropout_offset=0, stream=None):
    """Gradients of :func:`attention_varlen`; reference of :func:`cuflash.attention_varlen_backward`.

    Parameters
    ----------
    dout, out : arrays, ``(total_q, nheads, headdim_v)``
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k : as in :func:`attention_varlen`
    lse : array, ``(nheads, total_q)``
    softmax_scale, causal, window_size, softcap, alibi_slopes : as in :func:`attention_varlen`
    deterministic, stream : ignored

    Returns
    -------
    dq, dk, dv : float64, shaped like q, k, v
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    dout, out, lse = _f64(dout), _f64(out), _f64(lse)
    nheads, _ = _check_qkv(q, k, v, batch_axis=False)
    cu_q = _i64(cu_seqlens_q)
    slopes = _alibi_per_batch(alibi_slopes, max(cu_q.size - 1, 0), nheads)
    scale = _default_scale(softmax_scale, q.shape[-1])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b, sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        g = _backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], out[None, sq], lse[None, :, sq],
                      softmax_scale=scale, causal=causal, window_size=window_size, softcap=float(softcap),
                      alibi_slopes=None if slopes is None else slopes[b:b + 1],
                      dropout=_sequence_dropout(dropout_p, dropout_seed, dropout_offset, b, nheads, sq.stop - sq.start,
                                                sk.stop - sk.start))
        dq[sq], dk[sk], dv[sk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def rotary(x, cos, sin, positions, interleaved=True):
    """The rotary embedding of rows ``x`` (``(rows, nheads, d)``) at ``positions`` (``(rows,)``), as the
    kernels apply it: in float32, each product and sum rounded, then rounded to x's dtype. Pairs (2j, 2j + 1)
    (interleaved) or (j, j + R / 2) of the first R = 2 cos.shape[1] elements, angle j from row ``positions[i]`` of
    cos / sin ``(seqlen_ro, R / 2)``; rows whose position is outside the tables are not rotated."""
    x = np.asarray(x)
    dtype, r = x.dtype, 2 * np.asarray(cos).shape[1]
    positions = np.asarray(positions, dtype=np.int64)
    inside = (positions >= 0) & (positions < np.asarray(cos).shape[0])
    c = np.asarray(cos).astype(np.float32)[np.where(inside, positions, 0)][..., None, :]  # (rows, 1, R / 2)
    s_ = np.asarray(sin).astype(np.float32)[np.where(inside, positions, 0)][..., None, :]
    y = x.astype(np.float32)
    if interleaved:
        x1, x2 = y[..., 0:r:2], y[..., 1:r:2]
    else:
        x1, x2 = y[..., :r // 2], y[..., r // 2:r]
    o1 = (x1 * c).astype(np.float32) - (x2 * s_).astype(np.float32)
    o2 = (x1 * s_).astype(np.float32) + (x2 * c).astype(np.float32)
    out = y.copy()
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = o1, o2
    else:
        out[..., :r // 2], out[..., r // 2:r] = o1, o2
    return np.where(inside[:, None, None], out, y).astype(dtype)


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                           block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, num_splits=0, return_lse=False, rotary_cos=None,
                           rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, stream=None):
    """Decode-style attention against a KV cache; reference of :func:`cuflash.attention_with_kvcache`.

    Batch row ``b`` attends to cache positions ``0 .. L_b - 1`` where
    ``L_b = cache_seqlens[b] + seqlen_new_k`` (``seqlen_new_k = 0`` without ``k``/``v``). Masks are
    aligned bottom-right over that length: ``sk = L_b``, ``sq = seqlen_new``.

    Parameters
    ----------
    q : array, ``(batch, seqlen_new, nheads, headdim)``
    k_cache, v_cache : writable NumPy float arrays
        Contiguous: ``(batch_cache, max_len, nheads_k, headdim)``. Paged (with ``block_table``):
        a page pool ``(num_pages, page_size, nheads_k, headdim)``; logical position ``p`` of batch
        row ``b`` lives at page ``block_table[b, p // page_size]``, row ``p % page_size``.
    k, v : arrays ``(batch, seqlen_new_k, nheads_k, headdim)``, optional
        Written into the cache in place (cast to the cache's dtype) at positions
        ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new_k - 1`` before attending.
    cache_seqlens : int or int32 ``(batch,)``, optional
        Valid cache length per batch row before the append; default the whole cache
        (``max_len``, or ``max_pages * page_size`` when paged).
    cache_batch_idx : int32 ``(batch,)``, optional
        Batch row ``b`` uses cache row ``cache_batch_idx[b]``. Not with ``block_table``.
    block_table : int32 ``(batch, max_pages)``, optional
        Page indices into the pool, see above.
    softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, stream :
        as in :func:`attention`.
    num_splits : ignored
    rotary_cos, rotary_sin, rotary_interleaved : optional
        The rotary embedding (:func:`rotary`) of the new keys, at positions ``cache_seqlens[b] + i``, before the
        append, and of the queries, at ``cache_seqlens[b] + i`` (causal or local) or ``cache_seqlens[b]``.
    cache_leftpad : int32 ``(batch,)``, optional
        Row ``b`` attends to positions ``cache_leftpad[b] .. L_b - 1`` only, counted from 0 there (masks, ALiBi).

    Returns
    -------
    out : float64 ``(batch, seqlen_new, nheads, headdim_v)``
    lse : float64 ``(batch, nheads, seqlen_new)``, only with ``return_lse``
    """
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array (it is updated in place), got {type(c).__name__}")
    q_in = _host(q)
    q = _f64(q_in)
    if q.ndim != 4:
        raise ValueError(f"q must be (batch, seqlen_new, nheads, headdim), got shape {q.shape}")
    batch, seqlen_new, nheads, _ = q.shape
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    paged = block_table is not None
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table")

    if paged:
        table = _i64(block_table)
        page_size = k_cache.shape[1]
        capacity = table.shape[1] * page_size

        def locate(b, positions):        # (page indices, rows within the page)
            return table[b, positions // page_size], positions % page_size
    else:
        rows = np.arange(batch) if cache_batch_idx is None else _i64(cache_batch_idx)
        capacity = k_cache.shape[1]

        def locate(b, positions):
            return np.full_like(positions, rows[b]), positions

    if cache_seqlens is None:
        lens = np.full(batch, capacity, dtype=np.int64)
    else:
        lens = np.broadcast_to(_i64(cache_seqlens), (batch,))

    seqlen_new_k = 0
    if k is not None:
        k_new, v_new = _host(k), _host(v)
        if k_new.ndim != 4 or k_new.shape[0] != batch or k_new.shape[:2] != v_new.shape[:2]:
            raise ValueError(f"k {k_new.shape} and v {v_new.shape} must be (batch={batch}, seqlen_new_k, nheads_k, d)")
        seqlen_new_k = k_new.shape[1]
    if np.any(lens < 0) or np.any(lens + seqlen_new_k > capacity):
        raise ValueError(f"cache_seqlens {lens.tolist()} plus {seqlen_new_k} appended keys overflows the cache "
                         f"(capacity {capacity})")
    starts = np.zeros(batch, np.int64) if cache_leftpad is None else np.broadcast_to(_i64(cache_leftpad), (batch,))
    if np.any(starts < 0) or np.any(starts > lens):
        raise ValueError(f"cache_leftpad {starts.tolist()} must lie in [0, cache_seqlens {lens.tolist()}]")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos: the rotary embedding applies with k and v")
        cos, sin = _host(rotary_cos), _host(rotary_sin)
        per_query = bool(causal) or tuple(window_size) != (-1, -1)
        k_new = np.stack([rotary(k_new[b], cos, sin, lens[b] + np.arange(seqlen_new_k), rotary_interleaved)
                          for b in range(batch)])
        q = _f64(np.stack([rotary(q_in[b], cos, sin, lens[b] + (np.arange(seqlen_new) if per_query else
                                                                 np.zeros(seqlen_new, np.int64)), rotary_interleaved)
                           for b in range(batch)]))
    if k is not None:
        for b in range(batch):
            idx = locate(b, np.arange(lens[b], lens[b] + seqlen_new_k))
            k_cache[idx] = np.asarray(k_new[b]).astype(k_cache.dtype)
            v_cache[idx] = np.asarray(v_new[b]).astype(v_cache.dtype)

    slopes = _alibi_per_batch(alibi_slopes, batch, nheads)
    scale = _default_scale(softmax_scale, q.shape[-1])
    out = np.zeros((batch, seqlen_new, nheads, v_cache.shape[-1]))
    lse = np.full((batch, nheads, seqlen_new), -np.inf)
    for b in range(batch):
        idx = locate(b, np.arange(starts[b], lens[b] + seqlen_new_k))
        kb, vb = _f64(k_cache[idx])[None], _f64(v_cache[idx])[None]
        _check_qkv(q[b:b + 1], kb, vb)
        o, l = _forward(q[b:b + 1], kb, vb, softmax_scale=scale, causal=causal, window_size=window_size,
                        softcap=float(softcap), alibi_slopes=None if slopes is None else slopes[b:b + 1])
        out[b], lse[b] = o[0], l[0]
    return (out, lse) if return_lse else out


def combine(outs, lses):
    """Merge partial attention results over disjoint key sets (split-KV) exactly.

    ``lse = log(sum_s exp(lses[s]))`` and ``out = sum_s exp(lses[s] - lse) * outs[s]``, computed
    with a max shift. A split with ``lse = -inf`` (no visible key) contributes nothing, whatever
    its ``out`` holds; if every split is empty the result is ``out = 0``, ``lse = -inf``.

    Parameters
    ----------
    outs : array, ``(splits, ..., headdim)``, each split's normalized output
    lses : array, ``(splits, ...)``, each split's log-sum-exp

    Returns
    -------
    out : float64 ``(..., headdim)``
    lse : float64 ``(...)``
    """
    outs, lses = _f64(outs), _f64(lses)
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs {outs.shape} must be lses {lses.shape} plus a head dim")
    m = np.max(lses, axis=0, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    w = np.exp(lses - m)                             # exactly 0 for an empty split
    total = w.sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + m
    contrib = np.where((w > 0)[..., None], w[..., None] * outs, 0.0)
    out = contrib.sum(axis=0) / np.where(total > 0, total, 1.0)[..., None]
    return out, lse


# --------------------------------------------------------------------------------------------
# FP8 (e4m3) forward: inputs, scales, P's quantization and the accuracy bound (docs/fp8.md)
# --------------------------------------------------------------------------------------------

E4M3_MAX = 448.0          # the largest finite float8_e4m3fn
E4M3_UNIT = 2.0 ** -4     # unit roundoff: 3 fraction bits, |rn(x) - x| <= 2^-4 |x| for normal x
E4M3_HALF_STEP = 2.0 ** -10  # half the subnormal spacing 2^-9: |rn(x) - x| <= 2^-10 below 2^-6
P_SCALE = 256.0           # P in [0, 1] is multiplied by this before its conversion to e4m3
# S = Q K^T on FP8 tensor cores: each k = 32 group's exact products are added to the accumulator with all of them
# aligned to the largest magnitude among them (a product or the accumulator) and kept to about 13 fraction bits, so a
# group loses under 32 2^-13 = 2^-8 of that magnitude (docs/fp8.md, _fp8_score_errors).
FP8_S_UNIT = 2.0 ** -8
FP8_S_GROUP = 32


def _float8_e4m3fn():
    import ml_dtypes  # the float8 dtype; a dependency of the cuda extras, not of the float references

    return ml_dtypes.float8_e4m3fn


def _to_e4m3(x):
    """float64 ``x`` to float8_e4m3fn: round to nearest even, saturating at +-448 (``cvt.rn.satfinite``)."""
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(_float8_e4m3fn())


def _fp8_array(x, name):
    """``x`` as a float8_e4m3fn NumPy array: e4m3 arrays as they are, uint8 arrays (CuPy has no float8 dtype; a
    torch float8_e4m3fn tensor's bytes) as the bits of e4m3 values."""
    x, e4m3 = _host(x), _float8_e4m3fn()
    if x.dtype == e4m3:
        return x
    if x.dtype == np.uint8:
        return x.view(e4m3)
    raise TypeError(f"{name} must be float8_e4m3fn, or its bits as uint8, got dtype {x.dtype}")


def _descales(descale, batch, nheads_k, name):
    """A descale argument as float64 ``(batch, nheads_k)``: None is 1, a scalar is every head's. Values are rounded to
    float32, the kernel's type."""
    d = np.asarray(1.0 if descale is None else _host(descale), dtype=np.float32)
    if d.shape == ():
        d = np.full((batch, nheads_k), d)
    if d.shape != (batch, nheads_k):
        raise ValueError(f"{name} must be a scalar or (batch, nheads_k) = ({batch}, {nheads_k}), got shape {d.shape}")
    return d.astype(np.float64)


def _per_head(d, nheads):
    """Descales ``(batch, nheads_k)`` broadcast against ``(batch, seqlen, nheads, d)``: head h reads kv head
    h // (nheads // nheads_k)."""
    return _repeat_kv(d[..., None], nheads)[:, None]


def _dequantize(x8, descale, nheads_k, name):
    """e4m3 ``x8`` ``(batch, seqlen, nheads, d)`` times its descale argument (``()`` or ``(batch, nheads_k)``)."""
    return x8.astype(np.float64) * _per_head(_descales(descale, x8.shape[0], nheads_k, name), x8.shape[2])


def dequantize_e4m3(x8, descale=None):
    """The values that e4m3 ``x8`` ``(batch, seqlen, nheads, d)`` (float8_e4m3fn, or its bits as uint8) stands for,
    float64: ``x8 * descale``. descale: None (1), a scalar, or ``(batch, nheads_k)`` with nheads_k dividing nheads,
    head h scaled by ``descale[b, h // (nheads // nheads_k)]`` (the q_descale of a GQA group)."""
    x8 = _fp8_array(x8, "x8")
    if x8.ndim != 4:
        raise ValueError(f"x8 must be (batch, seqlen, nheads, d), got shape {x8.shape}")
    descale = None if descale is None else _host(descale)
    nheads_k = descale.shape[1] if np.ndim(descale) == 2 else x8.shape[2]
    if nheads_k == 0 or x8.shape[2] % nheads_k:
        raise ValueError(f"descale's {nheads_k} heads must divide x8's {x8.shape[2]}")
    return _dequantize(x8, descale, nheads_k, "descale")


def quantize_e4m3(x, per="tensor", *, nheads_k=None, pow2=False, descale=None):
    """Quantize ``x`` ``(batch, seqlen, nheads, d)`` to e4m3 with amax scaling: ``(x8, descale)``, x8 float8_e4m3fn
    (``x8.view(np.uint8)`` for CuPy) and descale float32, ``x ~ x8 * descale`` (:func:`dequantize_e4m3`).

    The scale maps the largest magnitude to 448: ``descale = amax / 448`` over the whole tensor (``per="tensor"``,
    descale shape ``()``) or over each ``(batch, kv head)`` (``per="head"``, shape ``(batch, nheads_k)``, the
    per-head form of flash-attn 3). nheads_k (default: x's heads) groups x's heads for q: head h shares the descale of
    kv head ``h // (nheads // nheads_k)``. Where amax is 0 the descale is 1. Rounding is to nearest even, saturating.
    ``pow2``: the descale rounded up to a power of two (amax then maps into [224, 448]); the dequantized values (4
    significant bits times a power of two) are then exact in bf16, so bf16 attention sees exactly the FP8 inputs.
    A given ``descale`` (float32, a scalar, ``(1,)`` or ``(batch, nheads_k)``, which sets nheads_k) is used instead
    of the amax one, and returned as float32 of its shape: ``x8 = e4m3(x / descale)``, saturating.
    :func:`cuflash.quantize_e4m3` is the GPU form.
    """
    x = _f64(x)
    if x.ndim != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, d), got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("x must be finite")
    batch, _, nheads, d = x.shape
    if descale is not None:
        given = np.asarray(_host(descale), dtype=np.float32)
        nheads_k = given.shape[1] if given.ndim == 2 else nheads
        if nheads % nheads_k:
            raise ValueError(f"descale's {nheads_k} heads (axis 1) must divide x's {nheads}")
        per_group = _descales(given.reshape(()) if given.ndim < 2 and given.size == 1 else given, batch, nheads_k,
                              "descale")
        return _to_e4m3(x / _per_head(per_group, nheads)), given
    nheads_k = nheads if nheads_k is None else int(nheads_k)
    if nheads_k <= 0 or nheads % nheads_k:
        raise ValueError(f"nheads_k ({nheads_k}) must divide x's {nheads} heads")
    if per == "tensor":
        amax = np.abs(x).max(initial=0.0)
    elif per == "head":
        amax = np.abs(x).reshape(batch, -1, nheads_k, nheads // nheads_k, d).max(axis=(1, 3, 4), initial=0.0)
    else:
        raise ValueError(f"per must be 'tensor' or 'head', got {per!r}")
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    if pow2:
        descale = np.exp2(np.ceil(np.log2(descale)))
    descale = descale.astype(np.float32)
    x8 = _to_e4m3(x / _per_head(_descales(descale, batch, nheads_k, "descale"), nheads))
    return x8, descale


def _fp8_inputs(q8, k8, v8, q_descale, k_descale, v_descale):
    """Checked e4m3 q, k, v dequantized to float64, every descale ``()`` or ``(batch, nheads_k)``."""
    q8, k8, v8 = _fp8_array(q8, "q8"), _fp8_array(k8, "k8"), _fp8_array(v8, "v8")
    _, nheads_k = _check_qkv(q8, k8, v8)
    return (_dequantize(q8, q_descale, nheads_k, "q_descale"), _dequantize(k8, k_descale, nheads_k, "k_descale"),
            _dequantize(v8, v_descale, nheads_k, "v_descale"))


def _p_rounding(p_scale):
    """P -> e4m3(P p_scale) / p_scale, the kernel's P for P V."""
    p_scale = float(p_scale)
    if not (p_scale > 0 and math.isfinite(p_scale)):
        raise ValueError(f"p_scale must be positive and finite, got {p_scale!r}")
    return lambda p: _to_e4m3(p * p_scale).astype(np.float64) / p_scale


def attention_fp8(q8, k8, v8, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, p_scale=P_SCALE, quantize_p=True,
                  quantized_sums=False, return_lse=False, stream=None):
    """FP8 (e4m3) forward attention, float64 model of the Hopper FP8 kernel (docs/fp8.md).

    The inputs are dequantized exactly (``x8 * descale``, float64); then the forward is :func:`attention`'s, except
    that with ``quantize_p`` the probabilities multiplying V are the kernel's e4m3 ones: P, shifted by the row max
    (so in [0, 1]), becomes ``Pq = e4m3(P p_scale) / p_scale`` (round to nearest even, saturating at 448). The row
    sums that normalize the output, and the lse, are those of the unquantized P (the kernel's fp32 sums: compiled
    head dim 256, and 128 under a mask), or with ``quantized_sums`` those of Pq (the kernel's tensor-core sums,
    compiled head dim 64, and 128 without a mask: ``cuflash.ops.forward_fp8.quantized_sums``): per row i, over the
    visible keys j,

        out_i = sum_j Pq_ij V_j / sum_j Pq_ij,      lse_i = m_i + log(sum_j Pq_ij)      (m_i: the row max)

    ``quantize_p=False`` is :func:`attention` on the dequantized inputs, with or without ``quantized_sums`` (the row
    sums are always those of the P that multiplies V).

    Parameters
    ----------
    q8, k8, v8 : float8_e4m3fn arrays (ml_dtypes), or their bits as uint8, shaped as :func:`attention`'s q, k, v
    q_descale, k_descale, v_descale : float32, optional (None: 1)
        A scalar (per tensor) or ``(batch, nheads_k)`` (per kv head, flash-attn 3's shape); ``q_descale[b, g]``
        scales the query heads of kv head g. Rounded to float32.
    softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse : as in :func:`attention`
    p_scale : float
        P's scale before the e4m3 conversion; 256 keeps probabilities down to 2^-14 normal in e4m3.
    quantize_p : bool
        Model the e4m3 quantization of P (default), or not.
    quantized_sums : bool
        Normalize by the row sums of the quantized P and take the lse from them (the kernel at head dims up to 64),
        rather than from the unquantized P (default).
    stream : ignored

    Returns
    -------
    out : float64 ``(batch, seqlen_q, nheads, headdim_v)`` (the kernel's is bf16)
    lse : float64 ``(batch, nheads, seqlen_q)``, natural log, only with ``return_lse``
    """
    q, k, v = _fp8_inputs(q8, k8, v8, q_descale, k_descale, v_descale)
    out, lse = _forward(q, k, v, **_options(q, softmax_scale, causal, window_size, softcap, alibi_slopes),
                        p_round=_p_rounding(p_scale) if quantize_p else None, round_sums=bool(quantized_sums))
    return (out, lse) if return_lse else out


def _fp8_score_errors(q, k, softmax_scale):
    """The FP8 tensor cores' error in each score, bounded: q ``(b, sq, h, d)``, k ``(b, sk, h, d)`` dequantized ->
    ``(b, h, sq, sk)``,

        e_ij = 2^-8 c sum_g max(max_{d in g} |q_id| max_{d in g} |k_jd|, |sum_{d before g} q_id k_jd|)

    over the k = 32 groups g of the head dim, in the wgmmas' order: each group's products and the accumulator they
    join are aligned to the largest of them (at most the first term, or the accumulator's exact value, the second)."""
    qt, kt = _bhsd(q), _bhsd(k)
    errors = np.zeros(qt.shape[:-1] + kt.shape[-2:-1])
    partial = np.zeros_like(errors)
    for g in range(0, qt.shape[-1], FP8_S_GROUP):
        qg, kg = qt[..., g:g + FP8_S_GROUP], kt[..., g:g + FP8_S_GROUP]
        largest = np.abs(qg).max(axis=-1)[..., :, None] * np.abs(kg).max(axis=-1)[..., None, :]
        errors += np.maximum(largest, np.abs(partial))
        partial += qg @ kg.transpose(0, 1, 3, 2)
    return FP8_S_UNIT * softmax_scale * errors


_DEVIATION_BLOCK = 1 << 24  # elements of the (rows, keys, headdim_v) differences that _weighted_deviations holds


def _weighted_deviations(w, v, o):
    """``sum_j w_ij |v_jc - o_ic|``: w ``(b, h, sq, sk)``, v ``(b, sk, h, dv)``, o ``(b, sq, h, dv)`` ->
    ``(b, sq, h, dv)``, a block of query rows at a time."""
    vt, ot = _bhsd(v)[:, :, None], _bhsd(o)     # (b, h, 1, sk, dv), (b, h, sq, dv)
    b, h, sq, sk = w.shape
    rows = max(1, _DEVIATION_BLOCK // max(1, b * h * sk * vt.shape[-1]))
    out = np.empty(ot.shape)
    for r in range(0, sq, rows):
        block = slice(r, r + rows)
        out[:, :, block] = (w[:, :, block, :, None] * np.abs(vt - ot[:, :, block, None, :])).sum(axis=-2)
    return _bhsd(out)


def fp8_error_bound(q8, k8, v8, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, p_scale=P_SCALE, bf16_error=0.0,
                    quantized_sums=False, bf16_lse_error=0.0, tensor_core_scores=False, return_lse=False):
    """The FP8 forward's accuracy contract, elementwise ``(batch, seqlen_q, nheads, headdim_v)`` float64:

        |out_fp8 - O| <= 2 bf16_error + E_P,        O = attention(dequantized inputs)

    bf16_error is the error of bf16 attention on the same dequantized inputs (the GPU test measures it: the max
    absolute difference of ``cuflash.attention`` on them in bf16 from the reference); 0 leaves the P term alone, which
    bounds ``attention_fp8(quantize_p=True, quantized_sums=quantized_sums)``. E_P bounds the e4m3 quantization of P.
    With P = exp(S - row max), l_i its row sum and, over the visible keys j,

        s_ij = max(2^-4 P_ij, 2^-10 / p_scale),     eta_i = sum_j s_ij / l_i

    (s_ij bounds the rounding error of ``e4m3(P_ij p_scale) / p_scale``: relative 2^-4 when normal, at most half the
    subnormal spacing 2^-9 below 2^-6), the P term is, with the row sums of the unquantized P (``quantized_sums``
    False: the kernel at compiled head dim 256, and 128 under a mask)

        E_P[b, i, h, c] = sum_j s_ij |V_jc| / l_i

    and with the row sums of the quantized P (``quantized_sums``: compiled head dim 64, and 128 without a mask)

        E_P[b, i, h, c] = sum_j s_ij |V_jc - O_ic| / (l_i (1 - eta_i))

    since then ``out - O = sum_j delta_j (V_j - O_i) / lq_i`` (delta_j = Pq_j - P_j, |delta_j| <= s_j) and the
    quantized row sum is ``lq_i >= l_i (1 - eta_i)``. With P relative to a running max instead (the online softmax),
    the rescaling by exp(m_old - m) <= 1 only shrinks each delta_j, so both bounds hold for any tiling. docs/fp8.md
    derives them. eta_i < 2^-4 + n_i 2^-10 / p_scale (l_i >= 1), so eta_i < 1 in rows of fewer than 960 p_scale
    visible keys; the quantized-sums bound raises ValueError where some eta_i >= 1.

    With ``return_lse`` the result is ``(out_bound, lse_bound)``, lse_bound float64 ``(batch, nheads, seqlen_q)``:

        |lse_fp8 - lse| <= 2 bf16_lse_error + (-log(1 - eta_i) with quantized_sums, else 0)
                           + (E_S,i with tensor_core_scores, else 0)

    bf16_lse_error being bf16 attention's lse error, as bf16_error. ``tensor_core_scores`` accounts for the FP8
    tensor cores' sums of S (the kernel's), which bf16's fp32 accumulation does not show and :func:`attention_fp8`
    does not model (its S is exact): with e_ij the bound on score (i, j)'s error (:func:`_fp8_score_errors`) and
    E_S,i = max_j e_ij over the visible keys, by which the lse moves at most, the output bound becomes

        2 bf16_error + exp(2 E_S,i) E_P + min((exp(2 E_S,i) - 1) sigma_ic, max_j |V_jc - O_ic|)

    (each P_ij / l_i moves by a factor within exp(+-2 E_S,i), which moves O_ic by at most that minus 1 times
    sum_j P_ij |V_jc - O_ic| / l_i <= sigma_ic, the standard deviation of column c's values under P_i / l_i; the
    maximum over all of the sequence's keys).
    A row with no visible key has bound 0 (its lse is -inf in both). Other arguments are :func:`attention_fp8`'s;
    ``0 < p_scale <= 448`` (no saturation of P p_scale <= p_scale).
    """
    p_scale = float(p_scale)
    if not 0 < p_scale <= E4M3_MAX:
        raise ValueError(f"the bound needs 0 < p_scale <= {E4M3_MAX:g} (P p_scale must not saturate), got {p_scale}")
    q, k, v = _fp8_inputs(q8, k8, v8, q_descale, k_descale, v_descale)
    nheads = q.shape[2]
    options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
    k = _repeat_kv(k, nheads)
    pr = _probs(q, k, **options)
    v = _repeat_kv(v, nheads)
    o = _weighted_values(pr.p, v, pr.l)  # the exact output
    step = np.where(pr.visible, np.maximum(E4M3_UNIT * pr.p, E4M3_HALF_STEP / p_scale), 0.0)
    eta = step.sum(axis=-1) / np.where(pr.l > 0, pr.l, 1.0)   # 0 in a row with no visible key
    if quantized_sums:
        if np.any(eta >= 1):
            raise ValueError(f"the quantized-sums bound needs eta = sum_j s_j / l < 1 in every row, got "
                             f"{eta.max():.4g} (rows of {np.count_nonzero(pr.visible, axis=-1).max()} keys; "
                             f"eta < 1 holds below 960 p_scale = {960 * p_scale:g} keys)")
        lq_min = pr.l * (1.0 - eta)                         # the least quantized row sum
        deviations = _weighted_deviations(step, v, o)
        p_term = deviations / np.where(lq_min > 0, lq_min, 1.0).transpose(0, 2, 1)[..., None]
        lse_term = -np.log1p(-eta)
    else:
        p_term = _weighted_values(step, np.abs(v), pr.l)
        lse_term = np.zeros_like(eta)
    if tensor_core_scores:  # softcap's tanh and ALiBi's bias move no score by more than its product did
        e_s = np.max(np.where(pr.visible, _fp8_score_errors(q, k, options["softmax_scale"]), 0.0), axis=-1,
                     initial=0.0)                          # (b, h, sq): the most any visible score moves
        lse_term = lse_term + e_s
        # Scores off by at most e_s move each P_j / l by a factor within exp(+-2 e_s): the P term grows by that
        # factor, and the output moves by at most (exp(2 e_s) - 1) sum_j P_j |V_j - O| / l, which the values'
        # standard deviation under P bounds (two products, where the mean deviation would take a pass over rows x
        # keys x columns), and by no more than the farthest value from O (both outputs averaging the values). Past
        # 2 e_s = 40 the bound says nothing anyway.
        grow = np.exp(np.minimum(2.0 * e_s, 40.0)).transpose(0, 2, 1)[..., None]   # (b, sq, h, 1)
        spread = np.sqrt(np.maximum(_weighted_values(pr.p, v * v, pr.l) - o * o, 0.0))
        farthest = np.maximum(v.max(axis=1)[:, None] - o, o - v.min(axis=1)[:, None]) if v.shape[1] else 0.0
        p_term = grow * p_term + np.minimum((grow - 1.0) * spread, farthest)
    bound = 2.0 * np.asarray(bf16_error, dtype=np.float64) + p_term
    if not return_lse:
        return bound
    return bound, np.where(pr.l > 0, 2.0 * np.asarray(bf16_lse_error, dtype=np.float64) + lse_term, 0.0)

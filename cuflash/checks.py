"""Input validation for every public function, in pure Python.

Each public ``check_*`` takes :class:`TensorSpec` descriptions of the arguments (or the arrays
themselves) and either returns the :class:`Problem` they describe or raises before anything is
allocated or launched:

* ``TypeError``  -- an argument of the wrong kind or dtype,
* ``ValueError`` -- a bad value, shape or stride.

Messages name the argument, the axis when there is one, what was expected and what was given::

    k: head dim (axis 3) is 96 but q's is 128
    v: last dimension (axis 3) must be contiguous (stride 1), got stride 2
    nheads (q axis 2) = 6 is not a multiple of nheads_k (k axis 2) = 4

Nothing here touches a GPU, so all of it runs in CPU-only CI. Kernels may assume what is checked
here: every axis is non-empty, strides are non-negative, the last dimension is contiguous, head
dims are multiples of 8 in 8..256, and all arrays of one call live on one device. The public functions take
every head dim in 1..256: they check a call with ``headdim_multiple=1`` first, then run it on copies padded to
:func:`padded_headdim`, which pass the default rule.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

__all__ = [
    "TensorSpec", "Problem", "spec", "window",
    "check_attention", "check_backward",
    "check_varlen", "check_varlen_backward",
    "check_kvcache", "padded_headdim",
]

ATTENTION_DTYPES = ("float16", "bfloat16")
FP8_DTYPES = ("uint8",)  # e4m3 bits (CuPy has no float8 dtype)
MAX_HEADDIM = 256
HEADDIM_MULTIPLE = 8  # what the kernels take; the public functions pad other head dims up to it
PAGE_MULTIPLE = 16

# Axis names, used in messages. The head-count axis is always -2 and the head dim always -1.
Q_AXES = ("batch", "seqlen_q", "nheads", "head dim")
K_AXES = ("batch", "seqlen_k", "nheads_k", "head dim")
VARLEN_Q_AXES = ("total_q", "nheads", "head dim")
VARLEN_K_AXES = ("total_k", "nheads_k", "head dim")
KVCACHE_Q_AXES = ("batch", "seqlen_new", "nheads", "head dim")
CACHE_AXES = ("batch_cache", "max_len", "nheads_k", "head dim")
PAGED_CACHE_AXES = ("num_pages", "page_size", "nheads_k", "head dim")
NEW_K_AXES = ("batch", "seqlen_new_k", "nheads_k", "head dim")
QUANTIZE_AXES = ("batch", "seqlen", "nheads", "head dim")


@dataclass(frozen=True)
class TensorSpec:
    """What the checks need to know about one array argument."""

    name: str          # argument name, used in messages
    shape: tuple
    dtype: np.dtype
    strides: tuple     # in elements, not bytes
    device: int | None  # CUDA device id; None for a host (NumPy) array


@dataclass(frozen=True)
class Problem:
    """Sizes of one attention call, as the planner and the launcher see them."""

    batch: int
    seqlen_q: int      # max_seqlen_q for varlen, seqlen_new for the KV cache
    seqlen_k: int      # max_seqlen_k for varlen, cache capacity for the KV cache
    nheads: int
    nheads_k: int
    headdim: int
    dtype: np.dtype


def elem_strides(x) -> tuple:
    """Strides in elements of an array (whose strides are in bytes), or of a TensorSpec (which holds them so)."""
    if isinstance(x, TensorSpec):
        return x.strides
    return tuple(s // x.itemsize for s in x.strides)


def seq_strides(x) -> tuple:
    """(batch, row, head) strides in elements: the first three axes of a padded (batch, seqlen, heads, d) array.
    A packed (total, heads, d) array gives its row stride as the batch stride: the kernels place sequence b at
    begin * batch_stride, with begin = b padded and cu_seqlens[b] packed (cuda_src/seqlen.cuh)."""
    strides = elem_strides(x)
    return strides[:3] if len(strides) == 4 else (strides[0],) + strides[:2]


def lse_strides(lse) -> tuple:
    """(batch, head) strides in elements of lse (batch, nheads, seqlen_q), or of packed lse (nheads, total_q),
    whose "batch" stride is its row stride, 1 (see seq_strides); rows are contiguous. (0, 0) without lse."""
    if lse is None:
        return 0, 0
    strides = elem_strides(lse)
    return strides[:2] if len(strides) == 3 else (1, strides[0])


def alibi_batch_stride(alibi) -> int:
    """Slopes (nheads,) are shared by the batch (stride 0); (batch, nheads) have a row per batch entry."""
    return elem_strides(alibi)[0] if alibi is not None and len(alibi.shape) == 2 else 0


def contiguous(name: str, shape, dtype, device=None) -> TensorSpec:
    """The layout of an output allocated contiguous (only its strides are read)."""
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    return TensorSpec(name, tuple(shape), np.dtype(dtype), strides, device)


def spec(x, name: str) -> TensorSpec | None:
    """Describe array ``x`` (CuPy or NumPy) as a :class:`TensorSpec`; ``None`` gives ``None``.

    Strides are converted from bytes to elements. The device is ``x.device.id`` when ``x`` has
    one (CuPy), else ``None`` (NumPy, whose ``.device`` is the string ``"cpu"``).
    """
    if x is None:
        return None
    if isinstance(x, TensorSpec):
        return x
    if not all(hasattr(x, attr) for attr in ("shape", "dtype", "strides")):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    try:
        dtype = np.dtype(x.dtype)
    except TypeError:
        raise TypeError(f"{name}: dtype {x.dtype} is not a NumPy dtype") from None
    shape = tuple(int(n) for n in x.shape)
    strides = []
    for axis, stride in enumerate(x.strides):
        elements, remainder = divmod(int(stride), dtype.itemsize)
        if remainder:
            raise ValueError(f"{name}: stride of axis {axis} is {stride} bytes, "
                             f"not a multiple of the item size {dtype.itemsize}")
        strides.append(elements)
    device = getattr(getattr(x, "device", None), "id", None)
    return TensorSpec(name, shape, dtype, tuple(strides), device)


def window(causal, window_size) -> tuple[int, int]:
    """Validate ``causal`` and ``window_size`` and return the window as ``(left, right)``.

    ``-1`` means unbounded on that side; ``causal=True`` sets ``right`` to 0 and keeps ``left``.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {_given(causal)}")
    expected = f"window_size: expected a pair of ints >= -1, got {window_size!r}"
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(expected)
    if not all(is_int(w) for w in window_size):
        raise TypeError(expected)
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(expected)
    return left, (0 if causal else right)


# --------------------------------------------------------------------------------------------
# Public checks
# --------------------------------------------------------------------------------------------

def check_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                    headdim_multiple=HEADDIM_MULTIPLE) -> Problem:
    """Check the arguments of ``attention``.

    q ``(batch, seqlen_q, nheads, d)``, k/v ``(batch, seqlen_k, nheads_k, d)``, fp16 or bf16;
    d in 1..256 and a multiple of ``headdim_multiple`` (the kernels': 8; 1 before padding).
    """
    q, k, v = _spec(q, "q"), _spec(k, "k"), _spec(v, "v")
    alibi_slopes = _spec(alibi_slopes, "alibi_slopes", required=False)
    _check_qkv(q, k, v, Q_AXES, K_AXES)
    _same_axis(k, 0, q, 0, "batch")
    batch, seqlen_q, nheads, headdim = q.shape
    _check_options(softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads)
    check_dropout_p(dropout_p)
    _same_device(q, k, v, alibi_slopes)
    _check_headdim_multiple(q, headdim_multiple)
    return Problem(batch, seqlen_q, k.shape[1], nheads, k.shape[2], headdim, q.dtype)


def check_attention_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                        causal=False, window_size=(-1, -1)) -> Problem:
    """Check the arguments of ``attention_fp8``: q ``(batch, seqlen_q, nheads, d)``, k/v ``(batch, seqlen_k,
    nheads_k, d)``, the e4m3 bits as uint8, d a multiple of 16 up to 256, every stride but the last a multiple of 16
    bytes (TMA's rule); each descale None, one float32 value (shape () or (1,)), or float32 ``(batch, nheads_k)``
    contiguous."""
    q, k, v = _spec(q, "q"), _spec(k, "k"), _spec(v, "v")
    _check_qkv(q, k, v, Q_AXES, K_AXES, FP8_DTYPES)
    _same_axis(k, 0, q, 0, "batch")
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k = k.shape[2]
    _check_options(softmax_scale, causal, window_size, 0.0, None, batch, nheads)
    _check_fp8(q, k, v, (q_descale, k_descale, v_descale), batch, nheads_k)
    return Problem(batch, seqlen_q, k.shape[1], nheads, nheads_k, headdim, q.dtype)


def check_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, q_descale=None,
                     k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                     window_size=(-1, -1)) -> Problem:
    """Check the arguments of ``attention_varlen_fp8``: :func:`check_varlen`'s layouts (q ``(total_q, nheads, d)``,
    k/v ``(total_k, nheads_k, d)``, cu_seqlens, max_seqlen) with the e4m3 bits as uint8, and
    :func:`check_attention_fp8`'s head dim, strides and descales, ``(batch, nheads_k)`` for the batch of
    sequences."""
    problem = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           headdim_multiple=1, dtypes=FP8_DTYPES)
    _check_fp8(_spec(q, "q"), _spec(k, "k"), _spec(v, "v"), (q_descale, k_descale, v_descale), problem.batch,
               problem.nheads_k)
    return problem


def check_quantize_e4m3(x, *, per="tensor", nheads_k=None, pow2=False, descale=None) -> tuple:
    """Check the arguments of ``quantize_e4m3``: x ``(batch, seqlen, nheads, d)``, fp16 or bf16, d a multiple of 16
    up to 256 (what the e4m3 kernels take), the last axis contiguous; ``per`` "tensor" or "head"; nheads_k (None:
    x's heads) a divisor of nheads; pow2 a bool. A given ``descale`` (float32, ``()`` or ``(1,)``, or ``(batch,
    nheads_k)`` contiguous) sets the form instead: ``per`` follows its shape, nheads_k is its second axis, and pow2
    must be False. Returns ``(batch, seqlen, nheads, d, nheads_k, per)``."""
    x = _spec(x, "x")
    _check_tensor(x, QUANTIZE_AXES)
    _check_dtype(x, ATTENTION_DTYPES)
    _check_headdim(x)
    batch, seqlen, nheads, d = x.shape
    if d % 16:
        raise ValueError(f"x: head dim (axis 3) is {d}; e4m3 arrays take multiples of 16")
    if per not in ("tensor", "head"):
        raise ValueError(f"per: expected 'tensor' or 'head', got {per!r}")
    if not isinstance(pow2, (bool, np.bool_)):
        raise TypeError(f"pow2: expected a bool, got {_given(pow2)}")
    descale = _spec(descale, "descale", required=False)
    if descale is not None:
        _check_dtype(descale, ("float32",))
        if pow2:
            raise ValueError("pow2: must be False with a given descale, which is used as it is")
        if descale.shape in ((), (1,)):
            per = "tensor"
        elif len(descale.shape) == 2 and descale.shape[0] == batch:
            if nheads_k is not None and nheads_k != descale.shape[1]:
                raise ValueError(f"nheads_k: {nheads_k} differs from descale's {descale.shape[1]} heads (axis 1)")
            per, nheads_k = "head", descale.shape[1]
            if descale.strides != (nheads_k, 1) and batch * nheads_k > 1:
                raise ValueError(f"descale: must be contiguous, got strides {descale.strides} (elements)")
        else:
            raise ValueError(f"descale: expected shape () or (1,) (per tensor) or (batch, nheads_k) with batch = "
                             f"{batch}, got {descale.shape}")
        _same_device(x, descale)
    if nheads_k is None:
        nheads_k = nheads
    if not is_int(nheads_k) or nheads_k < 1 or nheads % nheads_k:
        raise ValueError(f"nheads_k: expected a positive int dividing x's nheads (axis 2) = {nheads}, got "
                         f"{_given(nheads_k)}")
    return batch, seqlen, nheads, d, int(nheads_k), per


def _check_fp8(q, k, v, descales, batch: int, nheads_k: int) -> None:
    """The FP8 kernel's own rules: descales, head dim a multiple of 16, 16-byte strides (q, k, v TensorSpecs)."""
    descales = [_spec(x, name, required=False) for x, name in zip(descales, ("q_descale", "k_descale", "v_descale"))]
    _check_e4m3_rows((q, k, v), descales, batch, nheads_k, "the FP8 kernel", "the FP8 kernel's TMA loads")


def _check_e4m3_rows(arrays, descales, batch: int, nheads_k: int, taker: str, loads: str) -> None:
    """e4m3 arrays (TensorSpecs, None where absent): head dim a multiple of 16, every stride but the last a multiple
    of 16 bytes; their descales (TensorSpecs, None where absent): float32, all one per tensor or all ``(batch,
    nheads_k)`` contiguous."""
    for x in descales:
        if x is None:
            continue
        _check_dtype(x, ("float32",))
        if x.shape not in ((), (1,), (batch, nheads_k)):
            raise ValueError(f"{x.name}: expected shape () or (1,) (per tensor) or (batch, nheads_k) = "
                             f"({batch}, {nheads_k}), got {x.shape}")
        if x.shape == (batch, nheads_k) and x.strides != (nheads_k, 1) and batch * nheads_k > 1:
            raise ValueError(f"{x.name}: must be contiguous, got strides {x.strides} (elements)")
    given = [x for x in descales if x is not None]
    if len({math.prod(x.shape) == 1 for x in given}) > 1:
        raise ValueError(f"{', '.join(x.name for x in given)}: per-tensor and per-head descales cannot be mixed")
    arrays = [x for x in arrays if x is not None]
    _same_device(*arrays, *descales)
    headdim = arrays[0].shape[-1]
    if headdim % 16:
        raise ValueError(f"{arrays[0].name}: head dim (axis {len(arrays[0].shape) - 1}) is {headdim}; {taker} "
                         "takes multiples of 16")
    for x in arrays:
        for axis in range(len(x.shape) - 1):
            if x.shape[axis] > 1 and x.strides[axis] % 16:
                raise ValueError(f"{x.name}: stride of axis {axis} is {x.strides[axis]} bytes; {loads} need "
                                 "multiples of 16")


def check_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                   headdim_multiple=HEADDIM_MULTIPLE) -> Problem:
    """Check the arguments of ``attention_backward``.

    As :func:`check_attention`, plus dout/out shaped and typed like q and float32 lse
    ``(batch, nheads, seqlen_q)``.
    """
    dout, out, lse = _spec(dout, "dout"), _spec(out, "out"), _spec(lse, "lse")
    problem = check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                              headdim_multiple=headdim_multiple)
    q = _spec(q, "q")
    _check_like_q(q, Q_AXES, dout, out)
    _check_lse(lse, ("batch", "nheads", "seqlen_q"),
               (problem.batch, problem.nheads, problem.seqlen_q))
    _same_device(q, dout, out, lse)
    return problem


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, block_table=None, seqused_k=None, dropout_p=0.0,
                 headdim_multiple=HEADDIM_MULTIPLE, dtypes=ATTENTION_DTYPES) -> Problem:
    """Check the arguments of ``attention_varlen``.

    q ``(total_q, nheads, d)``, k/v ``(total_k, nheads_k, d)`` or with block_table (int32
    ``(batch, max_pages)``) page pools ``(num_pages, page_size, nheads_k, d)``, page_size a
    multiple of 16; cu_seqlens_q/k int32 ``(batch + 1,)``, seqused_k int32 ``(batch,)``,
    max_seqlen_q/k positive ints. The returned Problem has ``seqlen_q = max_seqlen_q`` and
    ``seqlen_k = max_seqlen_k``.
    """
    q, k, v = _spec(q, "q"), _spec(k, "k"), _spec(v, "v")
    cu_q, cu_k = _spec(cu_seqlens_q, "cu_seqlens_q"), _spec(cu_seqlens_k, "cu_seqlens_k")
    alibi_slopes = _spec(alibi_slopes, "alibi_slopes", required=False)
    block_table = _spec(block_table, "block_table", required=False)
    seqused_k = _spec(seqused_k, "seqused_k", required=False)
    if block_table is not None:
        _check_qkv(q, k, v, VARLEN_Q_AXES, PAGED_CACHE_AXES, dtypes)
        if k.shape[1] % PAGE_MULTIPLE:
            raise ValueError(f"{k.name}: page_size (axis 1) is {k.shape[1]}; "
                             f"must be a positive multiple of {PAGE_MULTIPLE}")
        _check_index(block_table, ("batch", "max_pages"))
    else:
        _check_qkv(q, k, v, VARLEN_Q_AXES, VARLEN_K_AXES, dtypes)
    if seqused_k is not None:
        _check_index(seqused_k, ("batch",))
    for cu in (cu_q, cu_k):
        _check_index(cu, ("batch + 1",))
        if cu.shape[0] < 2:
            raise ValueError(f"{cu.name}: expected shape (batch + 1,) with batch >= 1, "
                             f"got {cu.shape}")
    _same_axis(cu_k, 0, cu_q, 0, "length")
    for x in (block_table, seqused_k):
        if x is not None and x.shape[0] != cu_q.shape[0] - 1:
            raise ValueError(f"{x.name}: batch (axis 0) is {x.shape[0]} but {cu_q.name} holds "
                             f"{cu_q.shape[0] - 1} sequences")
    _check_int(max_seqlen_q, "max_seqlen_q", minimum=1)
    _check_int(max_seqlen_k, "max_seqlen_k", minimum=1)
    batch = cu_q.shape[0] - 1
    _, nheads, headdim = q.shape
    _check_options(softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads)
    check_dropout_p(dropout_p)
    _same_device(q, k, v, cu_q, cu_k, alibi_slopes, block_table, seqused_k)
    _check_headdim_multiple(q, headdim_multiple)
    return Problem(batch, int(max_seqlen_q), int(max_seqlen_k), nheads, k.shape[-2], headdim,
                   q.dtype)


def check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, *, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                          headdim_multiple=HEADDIM_MULTIPLE) -> Problem:
    """Check the arguments of ``attention_varlen_backward``.

    As :func:`check_varlen`, plus dout/out shaped and typed like q and float32 lse
    ``(nheads, total_q)``.
    """
    dout, out, lse = _spec(dout, "dout"), _spec(out, "out"), _spec(lse, "lse")
    problem = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                           headdim_multiple=headdim_multiple)
    q = _spec(q, "q")
    _check_like_q(q, VARLEN_Q_AXES, dout, out)
    _check_lse(lse, ("nheads", "total_q"), (problem.nheads, q.shape[0]))
    _same_device(q, dout, out, lse)
    return problem


def check_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                  cache_batch_idx=None, block_table=None, num_splits=0, softmax_scale=None,
                  causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                  cache_leftpad=None, k_descale=None, v_descale=None,
                  headdim_multiple=HEADDIM_MULTIPLE) -> Problem:
    """Check the arguments of ``attention_with_kvcache``.

    q ``(batch, seqlen_new, nheads, d)``. The cache is ``(batch_cache, max_len, nheads_k, d)``,
    or with ``block_table`` (int32 ``(batch, max_pages)``) a page pool
    ``(num_pages, page_size, nheads_k, d)`` with page_size a multiple of 16. New keys/values
    k/v ``(batch, seqlen_new_k, nheads_k, d)`` come both or neither, and need cache_seqlens
    (an int or int32 ``(batch,)``). cache_batch_idx (int32 ``(batch,)``) excludes block_table.
    rotary_cos / rotary_sin ``(seqlen_ro, rotary_dim / 2)``, contiguous, q's dtype, rotary_dim a
    multiple of 16 up to d, come both or neither, and only with k and v. cache_leftpad is int32
    ``(batch,)``. An e4m3 cache holds uint8 (k/v then uint8 too, no rotary embedding, d a multiple
    of 16, strides multiples of 16 bytes), with k_descale / v_descale as ``attention_fp8``'s (one
    float32, or ``(batch, nheads_k)``); q stays fp16 or bf16. The returned Problem has
    ``seqlen_k`` = max_len, or max_pages * page_size when paged.
    """
    q = _spec(q, "q")
    k_cache, v_cache = _spec(k_cache, "k_cache"), _spec(v_cache, "v_cache")
    k, v = _spec(k, "k", required=False), _spec(v, "v", required=False)
    cache_batch_idx = _spec(cache_batch_idx, "cache_batch_idx", required=False)
    block_table = _spec(block_table, "block_table", required=False)
    alibi_slopes = _spec(alibi_slopes, "alibi_slopes", required=False)
    if cache_seqlens is not None and not is_int(cache_seqlens) \
            and not all(hasattr(cache_seqlens, a) for a in ("shape", "dtype", "strides")):
        raise TypeError(f"cache_seqlens: expected an int or an int32 array, "
                        f"got {_given(cache_seqlens)}")
    seqlens_array = None if is_int(cache_seqlens) else _spec(cache_seqlens, "cache_seqlens",
                                                             required=False)

    fp8 = k_cache.dtype.name in FP8_DTYPES
    seqlen_k = _check_cache(q, k_cache, v_cache, cache_batch_idx, block_table)
    seqlen_new_k = _check_new_kv(q, k, v, k_cache, seqlen_k, cache_seqlens)
    if seqlens_array is not None:
        _check_index(seqlens_array, ("batch",))
        _same_axis(seqlens_array, 0, q, 0, "batch")
    elif cache_seqlens is not None:
        _check_int(cache_seqlens, "cache_seqlens", minimum=0)
        if cache_seqlens + seqlen_new_k > seqlen_k:
            raise ValueError(f"cache_seqlens: {cache_seqlens} cached + {seqlen_new_k} new "
                             f"keys exceed the cache capacity {seqlen_k}")
    _check_int(num_splits, "num_splits", minimum=0)
    rotary_cos = _spec(rotary_cos, "rotary_cos", required=False)
    rotary_sin = _spec(rotary_sin, "rotary_sin", required=False)
    _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved)
    if fp8 and rotary_cos is not None:
        raise ValueError("rotary_cos: not supported with an e4m3 (uint8) cache; rotate k before quantizing it")
    k_descale = _spec(k_descale, "k_descale", required=False)
    v_descale = _spec(v_descale, "v_descale", required=False)
    if not fp8:
        for x in (k_descale, v_descale):
            if x is not None:
                raise ValueError(f"{x.name}: only for an e4m3 (uint8) cache; k_cache is {k_cache.dtype.name}")
    cache_leftpad = _spec(cache_leftpad, "cache_leftpad", required=False)
    if cache_leftpad is not None:
        _check_index(cache_leftpad, ("batch",))
        _same_axis(cache_leftpad, 0, q, 0, "batch")

    batch, seqlen_new, nheads, headdim = q.shape
    _check_options(softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads)
    _same_device(q, k_cache, v_cache, k, v, seqlens_array, cache_batch_idx, block_table,
                 alibi_slopes, rotary_cos, rotary_sin, cache_leftpad)
    if fp8:
        _check_e4m3_rows((k_cache, v_cache, k, v), (k_descale, v_descale), batch, k_cache.shape[2],
                         "an e4m3 cache", "the decode kernel's 16-byte loads")
    _check_headdim_multiple(q, headdim_multiple)
    return Problem(batch, seqlen_new, seqlen_k, nheads, k_cache.shape[2], headdim, q.dtype)


def _check_cache(q, k_cache, v_cache, cache_batch_idx, block_table) -> int:
    """The KV cache, contiguous per sequence or paged; returns its capacity in keys."""
    paged = block_table is not None
    _check_qkv(q, k_cache, v_cache, KVCACHE_Q_AXES, PAGED_CACHE_AXES if paged else CACHE_AXES, e4m3_kv=True)
    batch = q.shape[0]
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx and block_table cannot be used together")
        page_size = k_cache.shape[1]
        if page_size % PAGE_MULTIPLE:
            raise ValueError(f"{k_cache.name}: page_size (axis 1) is {page_size}; "
                             f"must be a positive multiple of {PAGE_MULTIPLE}")
        _check_index(block_table, ("batch", "max_pages"))
        _same_axis(block_table, 0, q, 0, "batch")
        return block_table.shape[1] * page_size
    if cache_batch_idx is not None:
        _check_index(cache_batch_idx, ("batch",))
        _same_axis(cache_batch_idx, 0, q, 0, "batch")
    elif k_cache.shape[0] < batch:
        raise ValueError(f"{k_cache.name}: batch_cache (axis 0) is {k_cache.shape[0]} "
                         f"but must be at least q's batch {batch}")
    return k_cache.shape[1]


def _check_rotary(q, k, rotary_cos, rotary_sin, interleaved) -> None:
    """Tables of a rotary embedding, (seqlen_ro, rotary_dim / 2) each, for the appended keys and the queries."""
    if (rotary_cos is None) != (rotary_sin is None):
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise ValueError(f"rotary_cos and rotary_sin must be given together; got {given} but not {missing}")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved: expected a bool, got {_given(interleaved)}")
    if rotary_cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos: the rotary embedding applies to the appended keys (and the queries); "
                         "give k and v")
    for table in (rotary_cos, rotary_sin):
        _check_tensor(table, ("seqlen_ro", "rotary_dim / 2"))
        _check_same_dtype(table, q)
        if table.shape[0] > 1 and table.strides[0] != table.shape[1]:
            raise ValueError(f"{table.name}: must be contiguous; stride of axis 0 is {table.strides[0]} "
                             f"elements, expected {table.shape[1]}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin: shape {rotary_sin.shape} differs from rotary_cos's {rotary_cos.shape}")
    rotary_dim, d = 2 * rotary_cos.shape[1], q.shape[-1]
    if rotary_dim % 16 or rotary_dim > d:
        raise ValueError(f"rotary_cos: rotary_dim = 2 x axis 1 = {rotary_dim}; must be a multiple of 16 and at "
                         f"most q's head dim {d}")


def _check_new_kv(q, k, v, k_cache, seqlen_k, cache_seqlens) -> int:
    """Keys/values to append to the cache (both or neither); returns their count."""
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"k and v must be given together; got {given} but not {missing}")
    if k is None:
        return 0
    _check_qkv(q, k, v, KVCACHE_Q_AXES, NEW_K_AXES, e4m3_kv=True)
    _check_same_dtype(k, k_cache)
    _same_axis(k, 0, q, 0, "batch")
    _same_axis(k, 2, k_cache, 2, "nheads_k")
    if k.shape[1] > seqlen_k:
        raise ValueError(f"{k.name}: seqlen_new_k (axis 1) is {k.shape[1]} but the cache "
                         f"holds at most {seqlen_k}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required when k and v are given "
                         "(it says where to append them)")
    return k.shape[1]


# --------------------------------------------------------------------------------------------
# Shared sub-checks
# --------------------------------------------------------------------------------------------

def _check_qkv(q, k, v, q_axes, k_axes, dtypes=ATTENTION_DTYPES, e4m3_kv=False):
    """q, k, v: rank, dtype (one of `dtypes`), layout, head dim, v shaped like k, and nheads a multiple of
    nheads_k. k and v have q's dtype, or with `e4m3_kv` both the e4m3 bits' (a KV cache's). Batch matching is left
    to the caller (the KV cache's batch differs)."""
    _check_tensor(q, q_axes)
    _check_dtype(q, dtypes)
    _check_headdim(q)
    fp8_kv = e4m3_kv and k.dtype.name in FP8_DTYPES
    for x in (k, v):
        _check_tensor(x, k_axes)
        _check_same_dtype(x, k if fp8_kv else q)
    for axis, label in enumerate(k_axes):
        _same_axis(v, axis, k, axis, label)
    _same_axis(k, -1, q, -1, "head dim")
    heads, heads_k = len(q_axes) - 2, len(k_axes) - 2  # the head-count axes, just before the head dim
    nheads, nheads_k = q.shape[heads], k.shape[heads_k]
    if nheads % nheads_k:
        raise ValueError(f"nheads ({q.name} axis {heads}) = {nheads} is not a multiple of "
                         f"nheads_k ({k.name} axis {heads_k}) = {nheads_k}")


def _check_tensor(x: TensorSpec, axes: tuple) -> None:
    """Rank, non-empty axes, non-negative strides, contiguous last dimension."""
    if len(x.shape) != len(axes):
        raise ValueError(f"{x.name}: expected {len(axes)} dimension(s) ({', '.join(axes)}), "
                         f"got {len(x.shape)} with shape {x.shape}")
    for axis, (size, label) in enumerate(zip(x.shape, axes)):
        if size < 1:
            raise ValueError(f"{x.name}: {label} (axis {axis}) must be at least 1, got {size}")
    for axis, (size, stride) in enumerate(zip(x.shape, x.strides)):
        if stride < 0 and size > 1:
            raise ValueError(f"{x.name}: stride of axis {axis} is {stride}; "
                             f"strides must be non-negative")
    last = len(x.shape) - 1
    if x.shape[last] > 1 and x.strides[last] != 1:
        raise ValueError(f"{x.name}: last dimension (axis {last}) must be contiguous "
                         f"(stride 1), got stride {x.strides[last]}")


def _check_dtype(x: TensorSpec, allowed: tuple) -> None:
    if x.dtype.name not in allowed:
        raise TypeError(f"{x.name}: dtype {x.dtype.name} is not supported; "
                        f"expected {' or '.join(allowed)}")


def _check_same_dtype(x: TensorSpec, ref: TensorSpec) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{x.name}: dtype {x.dtype.name} differs from {ref.name}'s "
                        f"{ref.dtype.name}; expected {ref.dtype.name}")


def _check_headdim(x: TensorSpec) -> None:
    d, axis = x.shape[-1], len(x.shape) - 1
    if not 1 <= d <= MAX_HEADDIM:
        raise ValueError(f"{x.name}: head dim (axis {axis}) is {d}; must be between 1 and {MAX_HEADDIM}")


def _check_headdim_multiple(x: TensorSpec, multiple: int) -> None:
    """The kernels' rule (after every other check, so a mismatch or a bad dtype is reported first)."""
    d, axis = x.shape[-1], len(x.shape) - 1
    if d % multiple:
        raise ValueError(f"{x.name}: head dim (axis {axis}) is {d}; the kernels take multiples of {multiple} "
                         "(cuflash's public functions pad other head dims; this entry point does not)")


def padded_headdim(headdim: int) -> int:
    """The head dim a call runs at: ``headdim`` rounded up to a multiple of :data:`HEADDIM_MULTIPLE`. A call
    whose head dim differs runs on zero-padded copies of its inputs and returns the leading columns."""
    return -(-headdim // HEADDIM_MULTIPLE) * HEADDIM_MULTIPLE


def _same_axis(x: TensorSpec, axis: int, ref: TensorSpec, ref_axis: int, label: str) -> None:
    """Axis ``axis`` of x (called ``label`` in the message) must match ``ref_axis`` of ref."""
    axis, ref_axis = axis % len(x.shape), ref_axis % len(ref.shape)
    if x.shape[axis] != ref.shape[ref_axis]:
        raise ValueError(f"{x.name}: {label} (axis {axis}) is {x.shape[axis]} "
                         f"but {ref.name}'s is {ref.shape[ref_axis]}")


def _check_like_q(q: TensorSpec, q_axes: tuple, *xs: TensorSpec) -> None:
    """dout and out: the shape and dtype of q, and the common layout rules."""
    for x in xs:
        if x.shape != q.shape:
            raise ValueError(f"{x.name}: expected shape {q.shape} like {q.name}'s, "
                             f"got {x.shape}")
        _check_tensor(x, q_axes)
        _check_same_dtype(x, q)


def _check_lse(lse: TensorSpec, axes: tuple, shape: tuple) -> None:
    if lse.shape != shape:
        raise ValueError(f"{lse.name}: expected shape {shape} ({', '.join(axes)}), "
                         f"got {lse.shape}")
    _check_tensor(lse, axes)
    _check_dtype(lse, ("float32",))


def _check_index(x: TensorSpec, axes: tuple) -> None:
    """An int32 index array (cu_seqlens, cache_seqlens, cache_batch_idx, block_table)."""
    _check_tensor(x, axes)
    _check_dtype(x, ("int32",))


def _check_alibi(alibi: TensorSpec, batch: int, nheads: int) -> None:
    if alibi.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"{alibi.name}: expected shape {(nheads,)} or {(batch, nheads)}, "
                         f"got {alibi.shape}")
    _check_tensor(alibi, ("nheads",) if len(alibi.shape) == 1 else ("batch", "nheads"))
    _check_dtype(alibi, ("float32",))


def check_dropout_p(dropout_p) -> None:
    """dropout_p: a real number with 0 <= p < 1 (TypeError or ValueError naming it)."""
    _check_real(dropout_p, "dropout_p", "a float with 0 <= p < 1", lambda p: 0 <= p < 1)


def dropout_generator(seed, offset) -> tuple[int, int]:
    """(seed, offset) of the dropout mask's generator, checked: ints in [0, 2**64)."""
    for name, value in (("dropout_seed", seed), ("dropout_offset", offset)):
        if not is_int(value):
            raise TypeError(f"{name}: expected an int, got {_given(value)}")
        if not 0 <= value < 2 ** 64:
            raise ValueError(f"{name}: expected 0 <= {name} < 2**64, got {value!r}")
    return int(seed), int(offset)


def _check_options(softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads):
    """The options every attention function shares."""
    if softmax_scale is not None:
        _check_real(softmax_scale, "softmax_scale", "None or a finite float > 0",
                    lambda s: s > 0)
    window(causal, window_size)
    _check_real(softcap, "softcap", "a finite float >= 0", lambda s: s >= 0)
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, batch, nheads)


def _check_real(value, name: str, expected: str, ok) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {_given(value)}")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _check_int(value, name: str, minimum: int) -> None:
    expected = f"an int >= {minimum}" if minimum != 1 else "a positive int"
    if not is_int(value):
        raise TypeError(f"{name}: expected {expected}, got {_given(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _same_device(*xs: TensorSpec | None) -> None:
    """All given arrays on the device of the first; None (absent) arguments are skipped."""
    present = [x for x in xs if x is not None]
    first = present[0]
    for x in present[1:]:
        if x.device != first.device:
            raise ValueError(f"{first.name} and {x.name} are on different devices "
                             f"({_device(first)} and {_device(x)})")


# --------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------

def _spec(x, name: str, required: bool = True) -> TensorSpec | None:
    """Accept a TensorSpec or an array; a missing required argument is a TypeError."""
    if x is None:
        if required:
            raise TypeError(f"{name}: expected an array, got None")
        return None
    return spec(x, name)


def is_int(value) -> bool:
    """An integer that is not a bool (Python or NumPy)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _given(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _device(x: TensorSpec) -> str:
    return "host" if x.device is None else str(x.device)


# --------------------------------------------------------------------------------------------
# Memo: a call with the same array layouts and options as an earlier valid one skips the checks
# --------------------------------------------------------------------------------------------

_MEMO_SIZE = 4096


_VALUE_TYPES = (type(None), bool, int, float, str)


def signature(x):
    """What a check can depend on: an array's type, shape, byte strides, dtype and device; a value with its type (a
    tuple's or list's elements with theirs: ``(3, -1)`` and ``(3.0, -1)`` are equal, but only one is a window).
    TypeError for anything else. (Ordered for speed: this runs on every call of a public function.)"""
    t = type(x)
    if t in _VALUE_TYPES or t is TensorSpec or t is Problem or isinstance(x, np.generic):  # NumPy scalars too
        return (t, x)
    if hasattr(x, "shape"):
        return (t, tuple(x.shape), tuple(x.strides), x.dtype, getattr(getattr(x, "device", None), "id", None))
    if isinstance(x, (tuple, list)):
        return (t,) + tuple(signature(v) for v in x)
    if isinstance(x, numbers.Number):
        return (t, x)
    raise TypeError("no signature")


def call_signature(args: tuple):
    """A hashable key of a call's arguments (see signature), or None if some argument has none (a shaped value without
    strides, such as a jax tracer given for an int, has none either: the check itself then says what is wrong)."""
    try:
        key = tuple(signature(a) for a in args)
        hash(key)
        return key
    except (TypeError, AttributeError):
        return None


def _memoized(check):
    """Wraps a check_* function: results of valid calls are kept, keyed by the arguments' signatures, so a
    decode loop pays for validation once (about 30 us of Python per call otherwise). Failing calls raise
    every time; nothing about an array's contents is part of any check."""
    memo: dict = {}

    @functools.wraps(check)
    def checked(*args, **kwargs):
        key = call_signature(args + tuple(kwargs.items()))
        if key is None:
            return check(*args, **kwargs)
        hit = memo.get(key)
        if hit is None:
            hit = check(*args, **kwargs)
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[key] = hit
        return hit

    return checked


check_attention = _memoized(check_attention)
check_backward = _memoized(check_backward)
check_varlen = _memoized(check_varlen)
check_varlen_backward = _memoized(check_varlen_backward)
check_kvcache = _memoized(check_kvcache)

"""The CuPy API at head dims that are not multiples of 8, without a GPU.

A NumPy stand-in takes CuPy's place (``cupy.ndarray``, ``zeros``, ``empty``, ``cuda.Device``) and the launches run
cuflash.reference on host memory, so the padding branches of cuflash.api run as they would on a GPU: the checks on
the caller's arrays, the zero-padded copies, the default scale 1 / sqrt(d), the results sliced back, and the KV
cache's appended rows copied back. tests/gpu/test_headdim_padding.py runs the same on the kernels.
"""
import contextlib
import math
import sys
import types

import numpy as np
import pytest

import cuflash
from cuflash import checks, reference, runtime
from cuflash.ops import backward, decode, forward


class _DeviceArray(np.ndarray):
    """A NumPy array that answers ``.device.id`` as a CuPy array does."""

    device = types.SimpleNamespace(id=0)


def _device(x):
    return None if x is None else np.asarray(x).view(_DeviceArray)


@pytest.fixture
def on_host(monkeypatch):
    """CuPy replaced by NumPy, every launch by the float64 reference; returns the (head dim, scale) launched."""
    fake = types.ModuleType("cupy")
    fake.ndarray = _DeviceArray
    fake.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(_DeviceArray)
    fake.empty = lambda shape, dtype: np.full(shape, np.nan, dtype).view(_DeviceArray)  # unwritten: NaN
    fake.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    fake.get_array_module = lambda x: np
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(runtime, "require_device_arrays", lambda **arrays: None)  # pointers: none on the host
    monkeypatch.setattr(runtime, "require_device_index_arrays", lambda **arrays: None)
    launched = []

    def attention(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, stream,
                  dropout_p=0.0, dropout_seed=0, dropout_offset=0):
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes)
        checks.check_attention(q, k, v, **options)  # the kernels' rule
        launched.append((q.shape[-1], softmax_scale))
        out, lse = reference.attention(q, k, v, return_lse=True, **options)
        return (_device(out.astype(q.dtype)), _device(lse.astype(np.float32))) if return_lse else \
            _device(out.astype(q.dtype))

    def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, return_lse, block_table, seqused_k, stream, dropout_p=0.0,
                       dropout_seed=0, dropout_offset=0):
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes)
        checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)
        launched.append((q.shape[-1], softmax_scale))
        out, lse = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              return_lse=True, **options)
        return (_device(out.astype(q.dtype)), _device(lse.astype(np.float32))) if return_lse else \
            _device(out.astype(q.dtype))

    def backward_attention(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, stream, dropout_p=0.0, dropout_seed=0, dropout_offset=0):
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes)
        checks.check_backward(dout, q, k, v, out, lse, **options)  # the kernels' rule
        launched.append((q.shape[-1], softmax_scale))
        grads = reference.attention_backward(dout, q, k, v, out, lse, **options)
        return tuple(_device(g.astype(x.dtype)) for g, x in zip(grads, (q, k, v)))

    def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, stream, dropout_p=0.0,
                        dropout_seed=0, dropout_offset=0):
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes)
        checks.check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     **options)
        launched.append((q.shape[-1], softmax_scale))
        grads = reference.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                    max_seqlen_k, **options)
        return tuple(_device(g.astype(x.dtype)) for g, x in zip(grads, (q, k, v)))

    def kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                window_size, softcap, alibi_slopes, num_splits, return_lse, stream, rotary_cos=None, rotary_sin=None,
                rotary_interleaved=True, cache_leftpad=None, k_descale=None, v_descale=None):
        launched.append((q.shape[-1], softmax_scale))
        out, lse = reference.attention_with_kvcache(
            q, k_cache.view(np.ndarray), v_cache.view(np.ndarray), k=k, v=v, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True,
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
            cache_leftpad=cache_leftpad)
        out = _device(out.astype(q.dtype))
        return (out, _device(lse.astype(np.float32))) if return_lse else out

    monkeypatch.setattr(forward, "attention", attention)
    monkeypatch.setattr(forward, "attention_varlen", forward_varlen)
    monkeypatch.setattr(backward, "attention_backward", backward_attention)
    monkeypatch.setattr(backward, "attention_varlen_backward", backward_varlen)
    monkeypatch.setattr(decode, "attention_with_kvcache", kvcache)
    return launched


def _rand(rng, *shape):
    return _device(rng.standard_normal(shape).astype(np.float16))


def _assert_close(got, want, tol):
    """Within ``tol`` relative to the largest value (the results are rounded to float16)."""
    assert got.shape == want.shape
    assert np.abs(np.asarray(got, np.float64) - want).max() < tol * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("d", [1, 59, 111, 255])
def test_dense_forward_and_backward(on_host, d):
    rng = np.random.default_rng(d)
    q, k, v = _rand(rng, 2, 9, 4, d), _rand(rng, 2, 13, 2, d), _rand(rng, 2, 13, 2, d)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    _assert_close(out, want, 3e-3)
    _assert_close(lse, want_lse, 1e-4)
    dout = _rand(rng, *q.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for got, ref in zip(grads, reference.attention_backward(dout, q, k, v, out, lse, causal=True)):
        _assert_close(got, ref, 1e-2)
    padded = checks.padded_headdim(d)
    assert on_host == [(padded, 1 / math.sqrt(d))] * 2  # padded launches at the caller's default scale


def test_varlen_forward_and_backward(on_host):
    rng = np.random.default_rng(1)
    q, k, v = _rand(rng, 9, 4, 59), _rand(rng, 13, 2, 59), _rand(rng, 13, 2, 59)
    cu_q, cu_k = _device(np.array([0, 4, 9], np.int32)), _device(np.array([0, 6, 13], np.int32))
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 5, 7, window_size=(3, 1), return_lse=True)
    want, want_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 5, 7, window_size=(3, 1), return_lse=True)
    _assert_close(out, want, 3e-3)
    dout = _rand(rng, *q.shape)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 5, 7, window_size=(3, 1),
                                              softmax_scale=0.3)
    want_grads = reference.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 5, 7, window_size=(3, 1),
                                                     softmax_scale=0.3)
    for got, ref in zip(grads, want_grads):
        _assert_close(got, ref, 1e-2)
    assert on_host == [(64, 1 / math.sqrt(59)), (64, 0.3)]


@pytest.mark.parametrize("layout", ["contiguous", "paged", "batch_idx"])
def test_kvcache_appends_into_the_callers_cache(on_host, layout):
    rng = np.random.default_rng(2)
    d = 59
    k_cache, v_cache = _rand(rng, 3, 32, 2, d), _rand(rng, 3, 32, 2, d)
    extra = {}
    if layout == "paged":
        k_cache, v_cache = _rand(rng, 6, 16, 2, d), _rand(rng, 6, 16, 2, d)
        extra["block_table"] = _device(np.array([[5, 0], [1, 4], [2, 3]], np.int32))
    elif layout == "batch_idx":
        extra["cache_batch_idx"] = _device(np.array([2, 0, 1], np.int32))
    q, k, v = _rand(rng, 3, 2, 4, d), _rand(rng, 3, 2, 2, d), _rand(rng, 3, 2, 2, d)
    lens = _device(np.array([3, 0, 20], np.int32))
    want_k, want_v = np.array(k_cache), np.array(v_cache)
    want = reference.attention_with_kvcache(q, want_k, want_v, k=k, v=v, cache_seqlens=lens, causal=True, **extra)
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, causal=True, **extra)
    assert np.array_equal(np.asarray(k_cache), want_k) and np.array_equal(np.asarray(v_cache), want_v)
    _assert_close(out, want, 3e-3)
    assert on_host == [(64, 1 / math.sqrt(d))]


def test_errors_name_the_callers_arrays(on_host):
    rng = np.random.default_rng(3)
    q = _rand(rng, 2, 9, 4, 59)
    with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 64 but q's is 59"):
        cuflash.attention(q, _rand(rng, 2, 9, 4, 64), _rand(rng, 2, 9, 4, 64))
    with pytest.raises(ValueError, match=r"q: head dim \(axis 3\) is 300; must be between 1 and 256"):
        cuflash.attention(*(_rand(rng, 1, 3, 2, 300) for _ in range(3)))
    assert on_host == []

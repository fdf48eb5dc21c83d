"""Input validation (cuflash.checks): valid inputs pass, each bad input gets its message.

CPU only: arguments are TensorSpecs of small NumPy arrays, or built directly for devices.
"""
import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest

from cuflash.checks import (Problem, TensorSpec, check_attention, check_backward,
                            check_kvcache, check_varlen, check_varlen_backward, spec, window)

F16 = np.float16
BF16 = ml_dtypes.bfloat16
B, S, H, D = 2, 16, 8, 64


def arr(shape, dtype=F16):
    return np.zeros(shape, dtype)


def specs(**arrays):
    """TensorSpecs named after their keywords."""
    return {name: spec(x, name) for name, x in arrays.items()}


def qkv(b=B, sq=S, sk=S, h=H, hk=H, d=D, dtype=F16):
    return specs(q=arr((b, sq, h, d), dtype), k=arr((b, sk, hk, d), dtype),
                 v=arr((b, sk, hk, d), dtype))


def on_device(x: TensorSpec, device) -> TensorSpec:
    return dataclasses.replace(x, device=device)


def raises(exc, message):
    """pytest.raises matching ``message`` literally."""
    return pytest.raises(exc, match=re.escape(message))


# --------------------------------------------------------------------------------------------
# spec() and window()
# --------------------------------------------------------------------------------------------

def test_spec_reads_shape_dtype_strides_in_elements():
    packed = arr((2, 5, 3, 4, 8), BF16)
    s = spec(packed[:, :, 1], "k")
    assert s == TensorSpec("k", (2, 5, 4, 8), np.dtype(BF16), (480, 96, 8, 1), None)
    assert s.dtype.name == "bfloat16"


def test_spec_of_none_is_none_and_spec_passes_through():
    assert spec(None, "alibi_slopes") is None
    s = spec(arr((2, 8)), "x")
    assert spec(s, "y") is s


def test_spec_reads_device_id():
    class Device:
        id = 3

    class FakeCupyArray:
        shape, dtype, strides, device = (4, 8), np.dtype(F16), (16, 2), Device()

    assert spec(FakeCupyArray(), "q").device == 3
    assert spec(FakeCupyArray(), "q").strides == (8, 1)


def test_spec_rejects_non_arrays():
    with raises(TypeError, "q: expected an array, got list"):
        spec([[1.0]], "q")


@pytest.mark.parametrize("causal, window_size, expected", [
    (False, (-1, -1), (-1, -1)),
    (True, (-1, -1), (-1, 0)),
    (True, (5, 7), (5, 0)),
    (False, (3, 0), (3, 0)),
    (False, [np.int32(2), 4], (2, 4)),
])
def test_window_normalizes(causal, window_size, expected):
    assert window(causal, window_size) == expected
    assert all(type(w) is int for w in window(causal, window_size))


def test_window_rejects_values_below_minus_one():
    with raises(ValueError, "window_size: expected a pair of ints >= -1, got (-2, 0)"):
        window(False, (-2, 0))


@pytest.mark.parametrize("bad", [(1, 2, 3), 4, (1.0, 2), (True, 0)])
def test_window_rejects_non_pairs(bad):
    with raises(TypeError, f"window_size: expected a pair of ints >= -1, got {bad!r}"):
        window(False, bad)


def test_causal_must_be_bool():
    with raises(TypeError, "causal: expected a bool, got int 1"):
        check_attention(**qkv(), causal=1)


# --------------------------------------------------------------------------------------------
# Valid inputs
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F16, BF16])
def test_attention_returns_problem(dtype):
    problem = check_attention(**qkv(sq=3, sk=17, d=40, dtype=dtype), causal=True,
                              window_size=(4, -1), softcap=30.0, softmax_scale=0.125)
    assert problem == Problem(B, 3, 17, H, H, 40, np.dtype(dtype))


def test_attention_accepts_arrays_directly():
    problem = check_attention(arr((1, 5, 2, 8)), arr((1, 7, 2, 8)), arr((1, 7, 2, 8)))
    assert problem == Problem(1, 5, 7, 2, 2, 8, np.dtype(F16))


def test_packed_qkv_views_pass():
    packed = arr((B, S, 3, H, D), BF16)
    q, k, v = (spec(packed[:, :, i], name) for i, name in enumerate("qkv"))
    assert q.strides == (S * 3 * H * D, 3 * H * D, D, 1)
    assert check_attention(q, k, v) == Problem(B, S, S, H, H, D, np.dtype(BF16))


def test_strided_heads_and_broadcast_batch_pass():
    every_other_head = arr((1, S, 2 * H, D))[:, :, ::2]          # head stride 2 * D
    q = spec(np.broadcast_to(every_other_head, (B, S, H, D)), "q")  # batch stride 0
    k = spec(np.broadcast_to(arr((1, S, H, D)), (B, S, H, D)), "k")
    v = spec(arr((B, S, H, D)), "v")
    assert q.strides == (0, 2 * H * D, 2 * D, 1) and k.strides[0] == 0
    assert check_attention(q, k, v) == Problem(B, S, S, H, H, D, np.dtype(F16))


@pytest.mark.parametrize("hk", [1, 2, 4, 8], ids=["mqa", "gqa4", "gqa2", "mha"])
def test_gqa_and_mqa_pass(hk):
    assert check_attention(**qkv(hk=hk)).nheads_k == hk


@pytest.mark.parametrize("d", [8, 72, 256])
def test_head_dims_in_range_pass(d):
    tensors = {n: spec(np.broadcast_to(arr(d), (1, 3, 2, d)), n) for n in "qkv"}
    assert check_attention(**tensors).headdim == d


@pytest.mark.parametrize("shape", [(H,), (B, H)])
def test_alibi_shapes_pass(shape):
    alibi = spec(arr(shape, np.float32), "alibi_slopes")
    assert check_attention(**qkv(), alibi_slopes=alibi).nheads == H


def test_backward_returns_problem():
    t = qkv(sq=5, sk=9, hk=2)
    grads = specs(dout=arr((B, 5, H, D)), out=arr((B, 5, H, D)),
                  lse=arr((B, H, 5), np.float32))
    problem = check_backward(grads["dout"], t["q"], t["k"], t["v"], grads["out"],
                             grads["lse"], causal=True)
    assert problem == Problem(B, 5, 9, H, 2, D, np.dtype(F16))


def varlen(total_q=20, total_k=30, h=H, hk=2, d=D, batch=3, dtype=F16):
    return dict(**specs(q=arr((total_q, h, d), dtype), k=arr((total_k, hk, d), dtype),
                        v=arr((total_k, hk, d), dtype),
                        cu_seqlens_q=arr(batch + 1, np.int32),
                        cu_seqlens_k=arr(batch + 1, np.int32)),
                max_seqlen_q=11, max_seqlen_k=13)


def test_varlen_returns_problem():
    alibi = spec(arr((3, H), np.float32), "alibi_slopes")
    problem = check_varlen(**varlen(), alibi_slopes=alibi, window_size=(8, 8))
    assert problem == Problem(3, 11, 13, H, 2, D, np.dtype(F16))


def test_varlen_backward_returns_problem():
    t = varlen()
    g = specs(dout=arr((20, H, D)), out=arr((20, H, D)), lse=arr((H, 20), np.float32))
    problem = check_varlen_backward(g["dout"], t["q"], t["k"], t["v"], g["out"], g["lse"],
                                    t["cu_seqlens_q"], t["cu_seqlens_k"], 11, 13)
    assert problem == Problem(3, 11, 13, H, 2, D, np.dtype(F16))


def cache(b=B, sq=1, max_len=64, h=H, hk=2, d=D, dtype=F16):
    return specs(q=arr((b, sq, h, d), dtype), k_cache=arr((b, max_len, hk, d), dtype),
                 v_cache=arr((b, max_len, hk, d), dtype))


def paged(b=B, pages=6, page_size=16, max_pages=3, h=H, hk=2, d=D):
    return dict(**specs(q=arr((b, 1, h, d)), k_cache=arr((pages, page_size, hk, d)),
                        v_cache=arr((pages, page_size, hk, d))),
                block_table=spec(arr((b, max_pages), np.int32), "block_table"))


def new_kv(b=B, s=3, hk=2, d=D):
    return specs(k=arr((b, s, hk, d)), v=arr((b, s, hk, d)))


def test_kvcache_returns_problem():
    assert check_kvcache(**cache()) == Problem(B, 1, 64, H, 2, D, np.dtype(F16))


def test_kvcache_with_new_kv_and_int_seqlens():
    problem = check_kvcache(**cache(sq=3), **new_kv(), cache_seqlens=61, num_splits=4)
    assert problem == Problem(B, 3, 64, H, 2, D, np.dtype(F16))


def test_kvcache_with_seqlens_array_and_batch_idx():
    t = cache()
    t["k_cache"] = spec(arr((5, 64, 2, D)), "k_cache")      # more cache rows than batch
    t["v_cache"] = spec(arr((5, 64, 2, D)), "v_cache")
    extra = specs(cache_seqlens=arr(B, np.int32), cache_batch_idx=arr(B, np.int32))
    assert check_kvcache(**t, **extra, **new_kv()).seqlen_k == 64


def test_paged_kvcache_capacity_is_pages_times_page_size():
    problem = check_kvcache(**paged(page_size=32, max_pages=5), cache_seqlens=7)
    assert problem == Problem(B, 1, 160, H, 2, D, np.dtype(F16))


# --------------------------------------------------------------------------------------------
# Tensor rules shared by every function
# --------------------------------------------------------------------------------------------

def test_missing_tensor():
    t = qkv()
    with raises(TypeError, "v: expected an array, got None"):
        check_attention(t["q"], t["k"], None)


def test_rank():
    t = qkv()
    t["q"] = spec(arr((B, S, H * D)), "q")
    with raises(ValueError, "q: expected 4 dimension(s) (batch, seqlen_q, nheads, head dim), "
                            "got 3 with shape (2, 16, 512)"):
        check_attention(**t)


def test_unsupported_dtype():
    t = qkv()
    t["q"] = spec(arr((B, S, H, D), np.float32), "q")
    with raises(TypeError, "q: dtype float32 is not supported; expected float16 or bfloat16"):
        check_attention(**t)


def test_mixed_dtypes():
    t = qkv()
    t["k"] = spec(arr((B, S, H, D), BF16), "k")
    with raises(TypeError, "k: dtype bfloat16 differs from q's float16"):
        check_attention(**t)


def test_last_dim_not_contiguous():
    t = qkv()
    t["v"] = spec(arr((B, S, H, 2 * D))[..., ::2], "v")
    with raises(ValueError, "v: last dimension (axis 3) must be contiguous (stride 1), "
                            "got stride 2"):
        check_attention(**t)


def test_negative_stride():
    t = qkv()
    t["q"] = spec(arr((B, S, H, D))[:, ::-1], "q")
    with raises(ValueError, f"q: stride of axis 1 is {-H * D}; strides must be non-negative"):
        check_attention(**t)


def test_empty_axis():
    with raises(ValueError, "k: seqlen_k (axis 1) must be at least 1, got 0"):
        check_attention(**qkv(sk=0))


@pytest.mark.parametrize("d", [257, 264])
def test_head_dim_rule(d):
    tensors = {n: spec(np.broadcast_to(arr(d), (1, 3, 2, d)), n) for n in "qkv"}
    with raises(ValueError, f"q: head dim (axis 3) is {d}; must be between 1 and 256"):
        check_attention(**tensors)


@pytest.mark.parametrize("d", [1, 4, 59, 200, 256])
def test_every_head_dim_up_to_256_passes_before_padding(d):
    tensors = {n: spec(np.broadcast_to(arr(d), (1, 3, 2, d)), n) for n in "qkv"}
    assert check_attention(**tensors, headdim_multiple=1).headdim == d


@pytest.mark.parametrize("d", [4, 59])
def test_the_kernels_take_multiples_of_8(d):
    tensors = {n: spec(np.broadcast_to(arr(d), (1, 3, 2, d)), n) for n in "qkv"}
    with raises(ValueError, f"q: head dim (axis 3) is {d}; the kernels take multiples of 8 (cuflash's public "
                            "functions pad other head dims; this entry point does not)"):
        check_attention(**tensors)


def test_padded_headdim():
    from cuflash.checks import padded_headdim
    assert [padded_headdim(d) for d in (1, 8, 59, 64, 111, 200, 255, 256)] == [8, 8, 64, 64, 112, 200, 256, 256]


def test_head_dim_mismatch():
    t = qkv(d=128)
    t["k"] = spec(arr((B, S, H, 96)), "k")
    t["v"] = spec(arr((B, S, H, 96)), "v")
    with raises(ValueError, "k: head dim (axis 3) is 96 but q's is 128"):
        check_attention(**t)


def test_batch_mismatch():
    t = qkv()
    t["k"], t["v"] = spec(arr((3, S, H, D)), "k"), spec(arr((3, S, H, D)), "v")
    with raises(ValueError, "k: batch (axis 0) is 3 but q's is 2"):
        check_attention(**t)


def test_v_unlike_k():
    t = qkv(sk=6)
    t["v"] = spec(arr((B, 5, H, D)), "v")
    with raises(ValueError, "v: seqlen_k (axis 1) is 5 but k's is 6"):
        check_attention(**t)


def test_nheads_not_multiple_of_nheads_k():
    with raises(ValueError, "nheads (q axis 2) = 6 is not a multiple of nheads_k (k axis 2) = 4"):
        check_attention(**qkv(h=6, hk=4))


def test_different_devices():
    t = {n: on_device(s, 0) for n, s in qkv().items()}
    t["k"] = on_device(t["k"], 1)
    with raises(ValueError, "q and k are on different devices (0 and 1)"):
        check_attention(**t)


def test_host_array_with_device_arrays():
    t = {n: on_device(s, 0) for n, s in qkv().items()}
    alibi = spec(arr(H, np.float32), "alibi_slopes")
    with raises(ValueError, "q and alibi_slopes are on different devices (0 and host)"):
        check_attention(**t, alibi_slopes=alibi)


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_softmax_scale_value(scale):
    with raises(ValueError, f"softmax_scale: expected None or a finite float > 0, got {scale!r}"):
        check_attention(**qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True])
def test_softmax_scale_type(scale):
    with raises(TypeError, "softmax_scale: expected None or a finite float > 0, got"):
        check_attention(**qkv(), softmax_scale=scale)


def test_softcap_value():
    with raises(ValueError, "softcap: expected a finite float >= 0, got -1.0"):
        check_attention(**qkv(), softcap=-1.0)


def test_window_size_checked_by_attention():
    with raises(ValueError, "window_size: expected a pair of ints >= -1, got (-2, 0)"):
        check_attention(**qkv(), window_size=(-2, 0))


def test_alibi_shape():
    alibi = spec(arr(3, np.float32), "alibi_slopes")
    with raises(ValueError, "alibi_slopes: expected shape (8,) or (2, 8), got (3,)"):
        check_attention(**qkv(), alibi_slopes=alibi)


def test_alibi_dtype():
    alibi = spec(arr(H), "alibi_slopes")
    with raises(TypeError, "alibi_slopes: dtype float16 is not supported; expected float32"):
        check_attention(**qkv(), alibi_slopes=alibi)


def test_alibi_last_dim_not_contiguous():
    alibi = spec(arr((B, 2 * H), np.float32)[:, ::2], "alibi_slopes")
    with raises(ValueError, "alibi_slopes: last dimension (axis 1) must be contiguous "
                            "(stride 1), got stride 2"):
        check_attention(**qkv(), alibi_slopes=alibi)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------

def backward_args(**overrides):
    t = qkv()
    g = specs(dout=arr((B, S, H, D)), out=arr((B, S, H, D)), lse=arr((B, H, S), np.float32))
    g.update({n: spec(x, n) for n, x in overrides.items()})
    return g["dout"], t["q"], t["k"], t["v"], g["out"], g["lse"]


def test_backward_dout_shape():
    with raises(ValueError, "dout: expected shape (2, 16, 8, 64) like q's, got (2, 15, 8, 64)"):
        check_backward(*backward_args(dout=arr((B, S - 1, H, D))))


def test_backward_out_dtype():
    with raises(TypeError, "out: dtype bfloat16 differs from q's float16"):
        check_backward(*backward_args(out=arr((B, S, H, D), BF16)))


def test_backward_lse_shape():
    with raises(ValueError, "lse: expected shape (2, 8, 16) (batch, nheads, seqlen_q), "
                            "got (2, 16, 8)"):
        check_backward(*backward_args(lse=arr((B, S, H), np.float32)))


def test_backward_lse_dtype():
    with raises(TypeError, "lse: dtype float16 is not supported; expected float32"):
        check_backward(*backward_args(lse=arr((B, H, S))))


# --------------------------------------------------------------------------------------------
# Varlen
# --------------------------------------------------------------------------------------------

def test_varlen_nheads_axis():
    with raises(ValueError, "nheads (q axis 1) = 8 is not a multiple of nheads_k (k axis 1) = 3"):
        check_varlen(**varlen(hk=3))


def test_varlen_cu_seqlens_dtype():
    t = varlen()
    t["cu_seqlens_k"] = spec(arr(4, np.int64), "cu_seqlens_k")
    with raises(TypeError, "cu_seqlens_k: dtype int64 is not supported; expected int32"):
        check_varlen(**t)


def test_varlen_cu_seqlens_lengths_differ():
    t = varlen()
    t["cu_seqlens_k"] = spec(arr(5, np.int32), "cu_seqlens_k")
    with raises(ValueError, "cu_seqlens_k: length (axis 0) is 5 but cu_seqlens_q's is 4"):
        check_varlen(**t)


def test_varlen_cu_seqlens_too_short():
    with raises(ValueError, "cu_seqlens_q: expected shape (batch + 1,) with batch >= 1, "
                            "got (1,)"):
        check_varlen(**varlen(batch=0))


def test_varlen_cu_seqlens_rank():
    t = varlen()
    t["cu_seqlens_q"] = spec(arr((4, 1), np.int32), "cu_seqlens_q")
    with raises(ValueError, "cu_seqlens_q: expected 1 dimension(s) (batch + 1), got 2"):
        check_varlen(**t)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-3, ValueError), (11.0, TypeError)])
def test_varlen_max_seqlen(value, exc):
    with raises(exc, "max_seqlen_q: expected a positive int, got"):
        check_varlen(**{**varlen(), "max_seqlen_q": value})


def test_varlen_alibi_uses_batch_from_cu_seqlens():
    alibi = spec(arr((2, H), np.float32), "alibi_slopes")
    with raises(ValueError, "alibi_slopes: expected shape (8,) or (3, 8), got (2, 8)"):
        check_varlen(**varlen(), alibi_slopes=alibi)


def test_varlen_backward_lse_shape():
    t = varlen()
    g = specs(dout=arr((20, H, D)), out=arr((20, H, D)), lse=arr((1, H, 20), np.float32))
    with raises(ValueError, "lse: expected shape (8, 20) (nheads, total_q), got (1, 8, 20)"):
        check_varlen_backward(g["dout"], t["q"], t["k"], t["v"], g["out"], g["lse"],
                              t["cu_seqlens_q"], t["cu_seqlens_k"], 11, 13)


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------

def test_kvcache_page_size():
    with raises(ValueError, "k_cache: page_size (axis 1) is 24; must be a positive multiple "
                            "of 16"):
        check_kvcache(**paged(page_size=24))


def test_kvcache_batch_idx_with_block_table():
    with raises(ValueError, "cache_batch_idx and block_table cannot be used together"):
        check_kvcache(**paged(), cache_batch_idx=spec(arr(B, np.int32), "cache_batch_idx"))


def test_kvcache_block_table_batch():
    t = paged()
    t["block_table"] = spec(arr((B + 1, 3), np.int32), "block_table")
    with raises(ValueError, "block_table: batch (axis 0) is 3 but q's is 2"):
        check_kvcache(**t)


def test_kvcache_block_table_dtype():
    t = paged()
    t["block_table"] = spec(arr((B, 3), np.int64), "block_table")
    with raises(TypeError, "block_table: dtype int64 is not supported; expected int32"):
        check_kvcache(**t)


def test_kvcache_cache_smaller_than_batch():
    t = cache(b=1)
    t["q"] = spec(arr((B, 1, H, D)), "q")
    with raises(ValueError, "k_cache: batch_cache (axis 0) is 1 but must be at least "
                            "q's batch 2"):
        check_kvcache(**t)


def test_kvcache_cache_head_dim():
    t = cache()
    t["v_cache"] = spec(arr((B, 64, 2, 32)), "v_cache")
    with raises(ValueError, "v_cache: head dim (axis 3) is 32 but k_cache's is 64"):
        check_kvcache(**t)


def test_kvcache_k_without_v():
    with raises(ValueError, "k and v must be given together; got k but not v"):
        check_kvcache(**cache(), k=new_kv()["k"], cache_seqlens=3)


def test_kvcache_new_kv_needs_cache_seqlens():
    with raises(ValueError, "cache_seqlens: required when k and v are given"):
        check_kvcache(**cache(), **new_kv())


def test_kvcache_new_kv_heads():
    with raises(ValueError, "k: nheads_k (axis 2) is 4 but k_cache's is 2"):
        check_kvcache(**cache(), **new_kv(hk=4), cache_seqlens=0)


def test_kvcache_new_kv_longer_than_cache():
    with raises(ValueError, "k: seqlen_new_k (axis 1) is 65 but the cache holds at most 64"):
        check_kvcache(**cache(), **new_kv(s=65), cache_seqlens=0)


def test_kvcache_int_seqlens_overflow():
    with raises(ValueError, "cache_seqlens: 62 cached + 3 new keys exceed the cache "
                            "capacity 64"):
        check_kvcache(**cache(), **new_kv(), cache_seqlens=62)


@pytest.mark.parametrize("value, exc, message", [
    (-1, ValueError, "cache_seqlens: expected an int >= 0, got -1"),
    (3.0, TypeError, "cache_seqlens: expected an int or an int32 array, got float 3.0"),
])
def test_kvcache_int_seqlens_value(value, exc, message):
    with raises(exc, message):
        check_kvcache(**cache(), cache_seqlens=value)


def test_kvcache_seqlens_array_shape():
    seqlens = spec(arr(B + 1, np.int32), "cache_seqlens")
    with raises(ValueError, "cache_seqlens: batch (axis 0) is 3 but q's is 2"):
        check_kvcache(**cache(), cache_seqlens=seqlens)


def test_kvcache_num_splits():
    with raises(ValueError, "num_splits: expected an int >= 0, got -1"):
        check_kvcache(**cache(), num_splits=-1)


def test_kvcache_devices_include_index_arrays():
    t = {n: on_device(s, 0) for n, s in cache().items()}
    seqlens = on_device(spec(arr(B, np.int32), "cache_seqlens"), 1)
    with raises(ValueError, "q and cache_seqlens are on different devices (0 and 1)"):
        check_kvcache(**t, cache_seqlens=seqlens)


def test_memoized_checks_still_reject_bad_values():
    """The memo keys on values as well as layouts: a bad scalar after a good one with the same arrays fails."""
    q = np.zeros((1, 4, 2, 64), np.float16)
    check_attention(q, q, q, softmax_scale=np.float32(0.5))
    with pytest.raises(ValueError, match="softmax_scale"):
        check_attention(q, q, q, softmax_scale=np.float32(-0.5))
    check_attention(q, q, q, window_size=[4, 0])
    with pytest.raises(ValueError, match="window_size"):
        check_attention(q, q, q, window_size=[-4, 0])
    with pytest.raises(ValueError):
        check_attention(q, q[..., :32], q)

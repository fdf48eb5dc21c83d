"""The public functions reject bad input before anything touches a GPU (runs without one)."""
import numpy as np
import pytest

import cuflash


def _qkv(d=64, dtype=np.float16):
    q = np.zeros((1, 8, 2, d), dtype)
    return q, q.copy(), q.copy()


def test_host_arrays_are_refused_with_a_clear_message():
    with pytest.raises(TypeError, match=r"q: expected a cupy\.ndarray, got numpy\.ndarray.*from_dlpack"):
        cuflash.attention(*_qkv())


def test_shape_errors_come_before_the_array_type_check():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 32 but q's is 64"):
        cuflash.attention(q, k[..., :32], v[..., :32])


def test_backward_rejects_bad_input_before_launch():
    q, k, v = _qkv()
    lse = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash.attention_backward(q, q, k, v, q, lse)
    with pytest.raises(ValueError, match="lse"):
        cuflash.attention_backward(q, q, k, v, q, lse[:, :1])


def test_public_names():
    assert set(cuflash.__all__) >= {"attention", "attention_backward", "precompile", "reference"}

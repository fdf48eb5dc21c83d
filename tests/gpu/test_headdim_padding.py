"""Head dims that are not multiples of 8 through the CuPy API: zero-padded copies inside the call.

The same cases as the forward, backward, varlen and KV-cache suites (their run_case helpers, the float64 reference
and the naive low-precision bound), at head dims 1..255 that the kernels do not take as they are; plus what only
padding can get wrong: the default scale, packed views whose strides are not 16-byte aligned, the caller's stream,
and the KV cache's copy-back (the appended rows reach the caller's cache, nothing else changes).
"""
import math

import numpy as np
import pytest

from tests.gpu import test_backward as backward_suite
from tests.gpu import test_forward as forward_suite
from tests.gpu import test_kvcache as kvcache_suite
from tests.gpu import test_varlen as varlen_suite
from tests.gpu.helpers import DTYPES, randn

pytestmark = pytest.mark.gpu

HEADDIMS = [1, 3, 59, 111, 200, 255]


@pytest.mark.parametrize("d", HEADDIMS)
def test_forward(compiled, d):
    rng = np.random.default_rng(d)
    forward_suite.run_case(rng, b=2, sq=113, sk=97, h=4, hk=2, d=d, dtype="fp16", causal=True)
    forward_suite.run_case(rng, b=1, sq=17, sk=200, h=2, hk=1, d=d, dtype="bf16", window_size=(32, 4), softcap=9.0,
                          alibi="bh", softmax_scale=0.2)


@pytest.mark.parametrize("d", [59, 111])
def test_packed_views_with_unaligned_strides(compiled, d):
    """Slices of one (b, s, 3, h, d) tensor: strides of d elements, not multiples of 8; the padded copies are."""
    forward_suite.run_case(np.random.default_rng(0), b=2, sq=65, sk=65, h=3, hk=3, d=d, dtype="bf16", causal=True,
                          views=True)


@pytest.mark.parametrize("d", HEADDIMS)
def test_backward(compiled, d):
    rng = np.random.default_rng(100 + d)
    backward_suite.run_case(rng, b=2, sq=97, sk=130, h=4, hk=2, d=d, dtype="bf16", causal=True)
    backward_suite.run_case(rng, b=1, sq=64, sk=33, h=2, hk=2, d=d, dtype="fp16", window_size=(8, 8), alibi="h",
                           deterministic=True)


@pytest.mark.parametrize("d", [59, 200])
def test_varlen(compiled, d):
    rng = np.random.default_rng(200 + d)
    varlen_suite.run_forward(rng, lens_q=[1, 17, 113], lens_k=[40, 17, 130], h=4, hk=2, d=d, dtype="fp16",
                            causal=True)
    varlen_suite.run_backward(rng, lens_q=[33, 0, 64], lens_k=[33, 5, 64], h=2, hk=1, d=d, dtype="bf16",
                             window_size=(16, 0))


@pytest.mark.parametrize("d", [59, 111, 255])
@pytest.mark.parametrize("layout", [dict(), dict(page_size=16), dict(batch_idx=True)])
def test_kvcache_append_is_copied_back(compiled, d, layout):
    """run_case compares the whole cache after the call, bit for bit, with the reference's in-place append."""
    rng = np.random.default_rng(300 + d)
    kvcache_suite.run_case(rng, b=3, sq=2, h=8, hk=2, d=d, dtype="bf16", capacity=90, lens=[0, 40, 87], new_k=2,
                          causal=True, **layout)
    kvcache_suite.run_case(rng, b=3, sq=1, h=4, hk=4, d=d, dtype="fp16", capacity=90, lens=[5, 5, 5], new_k=1,
                          seqlens_kind="int", num_splits=3, **layout)


def test_default_scale_is_the_callers():
    """softmax_scale=None at d = 59 is 1 / sqrt(59), not 1 / sqrt(64): the same as passing it."""
    import cupy
    import cuflash
    rng = np.random.default_rng(7)
    q, k, v = (cupy.asarray(randn(rng, (1, 50, 2, 59), DTYPES["fp16"])) for _ in range(3))
    assert cupy.array_equal(cuflash.attention(q, k, v), cuflash.attention(q, k, v, softmax_scale=1 / math.sqrt(59)))


def test_stream_argument():
    """The padded copies, the launch and the slice all run on the given stream."""
    import cupy
    import cuflash
    rng = np.random.default_rng(8)
    q, k, v = (cupy.asarray(randn(rng, (2, 300, 4, 59), DTYPES["bf16"])) for _ in range(3))
    want = cuflash.attention(q, k, v, causal=True)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    got = cuflash.attention(q, k, v, causal=True, stream=stream)
    stream.synchronize()
    assert cupy.array_equal(got, want)

"""Hopper primitives (cuda_src/sm90.cuh) on the GPU: TMA tile loads with the 128-byte swizzle, mbarrier
transaction counting and wgmma from shared-memory descriptors, checked as a small GEMM against NumPy."""
import numpy as np
import pytest

from tests.gpu.helpers import DTYPES, randn
from tests.sm90_selftest import PARAMS_DTYPE, SelftestSpec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k", [64, 256, 1024])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_tma_wgmma_gemm_matches_numpy(dtype, k):
    import cupy
    from cuflash import build, tma
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    rng = np.random.default_rng(k)
    a = cupy.asarray(randn(rng, (64, k), DTYPES[dtype]))
    b = cupy.asarray(randn(rng, (64, k), DTYPES[dtype]))
    c = cupy.full((64, 64), np.nan, dtype=np.float32)
    p = np.zeros((), dtype=PARAMS_DTYPE)
    for name, x in (("a", a), ("b", b)):  # (rows 64, K) K-major: dims innermost first, box 64 x 64
        p[name] = tma.encode_tiled(x.data.ptr, x.dtype, (k, 64), (k * 2,), (64, 64), swizzle=128)
    p["c"], p["k_tiles"] = c.data.ptr, k // 64
    spec = SelftestSpec(dtype)
    build.get_kernel(spec, a.device.id)((1,), (spec.threads,), (p[()],), shared_mem=spec.smem_bytes)
    ref = a.get().astype(np.float32) @ b.get().astype(np.float32).T
    np.testing.assert_allclose(c.get(), ref, rtol=1e-3, atol=1e-3 * np.sqrt(k))


@pytest.mark.parametrize("k", [64, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_register_a_mn_major_b_matches_numpy(dtype, k):
    """O += P V: A from registers, B = V (keys x 64, head dim contiguous) MN-major through TMA."""
    import cupy
    from cuflash import build, tma
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    rng = np.random.default_rng(k + 1)
    a = cupy.asarray(randn(rng, (64, k), DTYPES[dtype]))
    b = cupy.asarray(randn(rng, (k, 64), DTYPES[dtype]))
    c = cupy.full((64, 64), np.nan, dtype=np.float32)
    p = np.zeros((), dtype=PARAMS_DTYPE)
    p["b"] = tma.encode_tiled(b.data.ptr, b.dtype, (64, k), (64 * 2,), (64, 64), swizzle=128)
    p["a_rows"], p["c"], p["k_tiles"] = a.data.ptr, c.data.ptr, k // 64
    spec = SelftestSpec(dtype, "sm90_pv_selftest")
    build.get_kernel(spec, a.device.id)((1,), (spec.threads,), (p[()],), shared_mem=spec.smem_bytes)
    ref = a.get().astype(np.float32) @ b.get().astype(np.float32)
    np.testing.assert_allclose(c.get(), ref, rtol=1e-3, atol=1e-3 * np.sqrt(k))


@pytest.mark.parametrize("variant", ["lockstep", "ws"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("sq,sk,causal,window,h,hk", [
    (128, 128, False, (-1, -1), 2, 2), (1000, 1000, False, (-1, -1), 4, 2), (17, 300, True, (-1, -1), 2, 1),
    (300, 17, True, (-1, -1), 2, 2), (513, 777, False, (64, 8), 3, 1), (1, 1, True, (-1, -1), 1, 1)])
def test_fwd_sm90_matches_reference(d, dtype, sq, sk, causal, window, h, hk, variant):
    """Each variant of the Hopper forward (cuflash.hopper, fwd_sm90.cu) under the suite's accuracy rule."""
    import cupy
    from cuflash import hopper, reference
    from tests.gpu.helpers import assert_close_to_reference, assert_lse_close, naive_lowp
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    rng = np.random.default_rng(sq * 7 + sk)
    dt = DTYPES[dtype]
    q = cupy.asarray(randn(rng, (2, sq, h, d), dt))
    k = cupy.asarray(randn(rng, (2, sk, hk, d), dt))
    v = cupy.asarray(randn(rng, (2, sk, hk, d), dt))
    out, lse = hopper.attention_sm90(q, k, v, causal=causal, window_size=window, return_lse=True, variant=variant)
    opts = dict(causal=causal, window_size=window)
    ref, ref_lse = reference.attention(q.get(), k.get(), v.get(), return_lse=True, **opts)
    naive = naive_lowp(q.get(), k.get(), v.get(), **opts)
    ctx = f"{variant} sq={sq} sk={sk} d={d} {dtype} {opts} h={h} hk={hk}"
    assert_close_to_reference(out.get(), ref, naive, context=ctx)
    assert_lse_close(lse.get(), ref_lse, context=ctx)

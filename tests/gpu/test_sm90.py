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

"""e4m3 quantization on the GPU (cuflash.quantize_e4m3, cuda_src/quantize.cu) against cuflash.reference.quantize_e4m3
on hypothesis shapes, strided views (rows aligned for 16-byte loads or not), GQA groups, per tensor and per head, with
and without power-of-two descales, or with given ones (a KV cache's, for appended rows); every fp16 and bf16 value
within e4m3's range bit for bit; non-finite inputs; the torch and JAX forms; and the FP8 forward on what it makes.
Outputs start as NaN (conftest), so a byte or descale left unwritten fails."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cuflash
from cuflash import reference as ref
from cuflash.ops import forward_fp8

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": forward_fp8.BF16}


def on_gpu(host, dtype, offset):
    """host (float64) as a CuPy array of `dtype`, or (offset, a number of elements) a strided view of a larger one
    whose rows start `offset` elements in (8: rows 16-byte aligned, the kernels' 16-byte loads; 1: 2-byte aligned,
    their 2-byte loads); and the values it holds, float64."""
    import cupy
    values = host.astype(dtype)
    if offset is None:
        return cupy.asarray(values), values.astype(np.float64)
    b, s, h, d = host.shape
    wide = np.zeros((b, s + 3, h + 1, d + 16), dtype)
    wide[:, 1:s + 1, :h, offset:d + offset] = values
    return cupy.asarray(wide)[:, 1:s + 1, :h, offset:d + offset], values.astype(np.float64)


def compare(x8, descale, want8, want_descale, exact: bool):
    """The GPU's e4m3 bytes and descales against the reference's. Where the descale is a power of two, x / descale
    is exact in float32 and every byte must match; otherwise the kernel's float32 quotient may, rarely, round to the
    other neighbour of an e4m3 midpoint: at most one step off, in under 0.1% of the elements."""
    import cupy
    descale = cupy.asnumpy(descale)
    assert descale.shape == np.shape(want_descale) and descale.dtype == np.float32
    np.testing.assert_array_equal(descale, want_descale)
    got = cupy.asnumpy(x8)
    want = np.asarray(want8).view(np.uint8)
    assert got.shape == want.shape and got.flags.c_contiguous
    off = got != want
    if exact:
        assert not off.any(), (np.flatnonzero(off)[:8], got[off][:8], want[off][:8])
        return
    assert off.mean() < 1e-3, off.mean()
    e4m3 = ref._float8_e4m3fn()
    a, b = got[off].view(e4m3).astype(np.float64), want[off].view(e4m3).astype(np.float64)
    assert np.all(np.abs(a - b) <= np.abs(b) / 8 + 2.0 ** -9), (a[:8], b[:8])  # neighbours: one step apart


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 3), s=st.integers(1, 200), hk=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([16, 48, 64, 128, 176, 256]), per=st.sampled_from(["tensor", "head"]),
       pow2=st.booleans(), dtype=st.sampled_from(sorted(DTYPES)), offset=st.sampled_from([None, 8, 1]),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2 ** 16))
def test_quantize_matches_reference(b, s, hk, group, d, per, pow2, dtype, offset, scale, seed):
    rng = np.random.default_rng(seed)
    host = rng.standard_normal((b, s, hk * group, d)) * scale
    x, values = on_gpu(host, DTYPES[dtype], offset)
    x8, descale = cuflash.quantize_e4m3(x, per=per, nheads_k=hk, pow2=pow2)
    want8, want_descale = ref.quantize_e4m3(values, per, nheads_k=hk, pow2=pow2)
    compare(x8, descale, want8, want_descale, exact=pow2)


@pytest.mark.parametrize("per", ["tensor", "head"])
def test_quantize_with_a_given_descale(per):
    """A given descale (per tensor as (1,), or per (sequence, KV head)) is read, not found: the bytes are the
    reference's with that descale, values past 448 descale saturate, and the descale comes back as given."""
    import cupy
    rng = np.random.default_rng(4)
    host = rng.standard_normal((3, 45, 4, 64)) * 3
    given = rng.uniform(0.001, 0.01, (1,) if per == "tensor" else (3, 2)).astype(np.float32)
    x, values = on_gpu(host, forward_fp8.BF16, 1)
    x8, back = cuflash.quantize_e4m3(x, descale=cupy.asarray(given))
    assert np.array_equal(cupy.asnumpy(back), given)
    want8, _ = ref.quantize_e4m3(values, descale=given)
    compare(x8, back, want8, given, exact=False)
    assert (cupy.asnumpy(x8) & 0x7F == 0x7E).any()  # some saturated: |x| / descale past 448


def test_quantized_rows_append_to_an_e4m3_cache():
    """A bf16 cache quantized per (sequence, KV head), then new rows quantized with the cache's descales and appended
    by attention_with_kvcache: the cache holds exactly the new rows' bytes, and the output is the bf16 cache's within
    FP8's error."""
    import cupy
    rng = np.random.default_rng(5)
    b, cap, hk, h, d, lens = 2, 96, 2, 4, 64, np.array([40, 71], np.int32)
    bf16 = forward_fp8.BF16
    k_cache, v_cache = (cupy.asarray(rng.standard_normal((b, cap, hk, d)).astype(bf16)) for _ in range(2))
    k_new, v_new = (cupy.asarray(rng.standard_normal((b, 1, hk, d)).astype(bf16)) for _ in range(2))
    q = cupy.asarray(rng.standard_normal((b, 1, h, d)).astype(bf16))
    (k8, kd), (v8, vd) = (cuflash.quantize_e4m3(c, per="head") for c in (k_cache, v_cache))
    (kn8, _), (vn8, _) = cuflash.quantize_e4m3(k_new, descale=kd), cuflash.quantize_e4m3(v_new, descale=vd)
    seqlens = cupy.asarray(lens)
    out = cuflash.attention_with_kvcache(q, k8, v8, k=kn8, v=vn8, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
    for i, n in enumerate(lens):
        assert cupy.array_equal(k8[i, n], kn8[i, 0]) and cupy.array_equal(v8[i, n], vn8[i, 0])
    want = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cupy.asarray(lens))
    error = float(cupy.abs(out.astype(cupy.float32) - want.astype(cupy.float32)).max())
    assert error < 0.1, error


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_half_value_in_range_rounds_as_the_reference(dtype):
    """Every finite fp16 (bf16) value of magnitude up to 448, with 448 itself, so that the descale is 1 and each
    byte is that value's e4m3 rounding: subnormals, ties and the largest values included."""
    import cupy
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(np.float16) if dtype == "float16" else bits.view(forward_fp8.BF16)
    with np.errstate(invalid="ignore"):  # the NaN bit patterns
        wide = values.astype(np.float64)
    values = values[np.isfinite(wide) & (np.abs(wide) <= 448)]
    values = np.concatenate([values, np.full((-len(values)) % 64 or 64, 448.0, values.dtype)])
    host = values.reshape(1, -1, 1, 64)
    x8, descale = cuflash.quantize_e4m3(cupy.asarray(host))
    assert float(descale) == 1.0
    compare(x8, descale, *ref.quantize_e4m3(host.astype(np.float64)), exact=True)


def test_non_finite_inputs_give_non_finite_descales():
    import cupy
    host = np.ones((2, 40, 2, 64), np.float16)
    host[0, 3, 1, 5] = np.inf
    host[1, 7, 0, 9] = np.nan
    _, descale = cuflash.quantize_e4m3(cupy.asarray(host), per="head")
    descale = cupy.asnumpy(descale)
    assert np.isinf(descale[0, 1]) and np.isnan(descale[1, 0])
    np.testing.assert_array_equal(descale[[0, 1], [0, 1]], np.float32(1 / 448))
    _, whole = cuflash.quantize_e4m3(cupy.asarray(host), pow2=True)
    assert np.isnan(float(whole))


def test_zeros_quantize_with_descale_one():
    import cupy
    x8, descale = cuflash.quantize_e4m3(cupy.zeros((1, 5, 3, 32), np.float16), per="head")
    assert np.all(cupy.asnumpy(x8) == 0) and np.all(cupy.asnumpy(descale) == 1)


def test_quantized_inputs_run_the_fp8_forward():
    """q, k, v quantized on the GPU per (sequence, KV head) with power-of-two descales, then attention_fp8: the bytes
    and descales are the reference's, so the output is bit for bit that of attention_fp8 on the reference's
    quantization, and its mean error against bf16 attention on the unquantized inputs is FP8's (under 0.02)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("attention_fp8 runs on Hopper")
    rng = np.random.default_rng(1)
    host = [rng.standard_normal((2, 300, h, 128)).astype(forward_fp8.BF16) for h in (8, 2, 2)]
    arrays = [cupy.asarray(a) for a in host]
    ours = [cuflash.quantize_e4m3(a, per="head", nheads_k=2, pow2=True) for a in arrays]
    out = cuflash.attention_fp8(*(x8 for x8, _ in ours), q_descale=ours[0][1], k_descale=ours[1][1],
                                v_descale=ours[2][1], causal=True)
    theirs = [ref.quantize_e4m3(a.astype(np.float64), "head", nheads_k=2, pow2=True) for a in host]
    want = cuflash.attention_fp8(*(cupy.asarray(x8.view(np.uint8)) for x8, _ in theirs),
                                 **{n: cupy.asarray(d) for n, (_, d) in zip(("q_descale", "k_descale", "v_descale"),
                                                                             theirs)}, causal=True)
    assert cupy.array_equal(out.view(cupy.uint16), want.view(cupy.uint16))
    bf16 = cuflash.attention(*arrays, causal=True)
    error = float(cupy.abs(out.astype(cupy.float32) - bf16.astype(cupy.float32)).mean())
    assert error < 0.02, error


def test_torch_quantize_matches_cupy():
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash.torch
    t = torch.randn(2, 70, 4, 64, device="cuda", dtype=torch.bfloat16)[:, :, ::2]  # a strided view
    x8, descale = cuflash.torch.quantize_e4m3(t, per="head", nheads_k=1)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == t.shape and x8.is_contiguous()
    assert descale.dtype == torch.float32 and descale.shape == (2, 1)
    want8, want_descale = cuflash.quantize_e4m3(cupy.from_dlpack(t.detach()), per="head", nheads_k=1)
    assert torch.equal(x8.view(torch.uint8), torch.from_dlpack(want8))
    assert torch.equal(descale, torch.from_dlpack(want_descale))
    compiled = torch.compile(lambda a: cuflash.torch.quantize_e4m3(a, pow2=True), fullgraph=True)
    c8, cd = compiled(t)
    e8, ed = cuflash.torch.quantize_e4m3(t, pow2=True)
    assert torch.equal(c8.view(torch.uint8), e8.view(torch.uint8)) and torch.equal(cd, ed)
    given = torch.full((2, 1), 0.01, device="cuda")
    g8, back = cuflash.torch.quantize_e4m3(t, descale=given)
    assert back is given
    assert torch.equal(g8.view(torch.uint8), torch.from_dlpack(
        cuflash.quantize_e4m3(cupy.from_dlpack(t.detach()), descale=cupy.from_dlpack(given))[0]))
    c8, cd = torch.compile(lambda a, s: cuflash.torch.quantize_e4m3(a, descale=s), fullgraph=True)(t, given)
    assert torch.equal(c8.view(torch.uint8), g8.view(torch.uint8)) and torch.equal(cd, given)


def test_jax_quantize_matches_cupy():
    jax = pytest.importorskip("jax")
    import cupy
    import jax.numpy as jnp
    import cuflash.jax
    host = np.random.default_rng(2).standard_normal((2, 50, 4, 128)).astype(np.float16)
    x8, descale = jax.jit(lambda a: cuflash.jax.quantize_e4m3(a, per="head", nheads_k=2))(jnp.asarray(host))
    assert x8.dtype == jnp.float8_e4m3fn and descale.shape == (2, 2)
    want8, want_descale = cuflash.quantize_e4m3(cupy.asarray(host), per="head", nheads_k=2)
    np.testing.assert_array_equal(np.asarray(x8).view(np.uint8), cupy.asnumpy(want8))
    np.testing.assert_array_equal(np.asarray(descale), cupy.asnumpy(want_descale))
    g8, back = jax.jit(lambda a, s: cuflash.jax.quantize_e4m3(a, descale=s))(jnp.asarray(host), descale)
    np.testing.assert_array_equal(np.asarray(g8).view(np.uint8), cupy.asnumpy(want8))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(descale))

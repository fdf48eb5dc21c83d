"""cuflash.attention_with_kvcache on an e4m3 cache (uint8 bits, k_descale / v_descale) on the GPU: against the
float64 reference run on the dequantized cache, within the naive low-precision bound of the 16-bit path; the append
writes exactly the new rows' bytes; contiguous and paged caches, cache_batch_idx, splits, GQA packing, speculative
rows, the masks, softcap and ALiBi; descales per tensor and per (batch row, KV head). Every allocation starts as NaN
(conftest)."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference
from tests.gpu.helpers import DTYPES, assert_close_to_reference, assert_lse_close, naive_lowp, randn
from tests.fixtures import configure  # noqa: F401  (a fixture)
from tests.gpu.test_kvcache import _logical, decode_path  # noqa: F401  (decode_path: cp.async and TMA kernels)

pytestmark = pytest.mark.gpu

E4M3 = ml_dtypes.float8_e4m3fn


def e4m3_bits(rng, shape, spread=1.0):
    """Random e4m3 values (normal, times `spread`, saturated), as uint8 bits."""
    x = np.clip(rng.standard_normal(shape) * spread, -448, 448)
    return x.astype(E4M3).view(np.uint8)


def dequantize(bits, descale, rows_of_batch, hk):
    """float64 values of e4m3 `bits` (a cache or pool: axis 0 cache rows or pages), each batch row's rows (or pages)
    `rows_of_batch[b]` scaled by its descale (None, shape (1,), or (batch, hk))."""
    x = bits.view(E4M3).astype(np.float64)
    if descale is None:
        return x
    if descale.size == 1:
        return x * float(descale.reshape(()))
    for b, rows in enumerate(rows_of_batch):
        x[rows] *= descale[b].reshape(1, 1, hk, 1)
    return x


def run_case(rng, *, b, sq, h, hk, d, dtype, capacity, lens, new_k=0, page_size=None, batch_idx=False,
             per="head", causal=False, window_size=(-1, -1), softcap=0.0, alibi=False, num_splits=0, spread=1.0):
    import cupy
    import cuflash
    dt = DTYPES[dtype]
    if page_size is None:
        rows = b + 2 if batch_idx else b
        kc, vc = e4m3_bits(rng, (rows, capacity, hk, d), spread), e4m3_bits(rng, (rows, capacity, hk, d), spread)
        idx = rng.permutation(rows)[:b].astype(np.int32) if batch_idx else np.arange(b, dtype=np.int32)
        layout = dict(cache_batch_idx=idx if batch_idx else None)
        rows_of_batch = [[int(idx[i])] for i in range(b)]
    else:
        max_pages = -(-capacity // page_size)
        pool = b * max_pages + 3
        kc, vc = e4m3_bits(rng, (pool, page_size, hk, d), spread), e4m3_bits(rng, (pool, page_size, hk, d), spread)
        table = rng.permutation(pool)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
        layout = dict(block_table=table)
        rows_of_batch = [table[i].tolist() for i in range(b)]
    q = randn(rng, (b, sq, h, d), dt)
    kn = vn = None
    if new_k:
        kn, vn = e4m3_bits(rng, (b, new_k, hk, d), spread), e4m3_bits(rng, (b, new_k, hk, d), spread)
    shape = (1,) if per == "tensor" else (b, hk)
    k_descale, v_descale = ((rng.uniform(0.25, 2.0, shape).astype(np.float32) for _ in range(2)) if per
                            else (None, None))
    slopes = rng.uniform(0.0, 0.5, (h,)).astype(np.float32) if alibi else None
    lens = np.asarray(lens, dtype=np.int32)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap)

    dev = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    kc_d, vc_d = dev(kc), dev(vc)
    out, lse = cuflash.attention_with_kvcache(
        dev(q), kc_d, vc_d, k=dev(kn), v=dev(vn), cache_seqlens=dev(lens), num_splits=num_splits,
        k_descale=dev(k_descale), v_descale=dev(v_descale), alibi_slopes=dev(slopes), return_lse=True,
        **{n: dev(x) for n, x in layout.items()}, **opts)
    cupy.cuda.get_current_stream().synchronize()
    ctx = (f"b={b} sq={sq} h={h} hk={hk} d={d} {dtype} capacity={capacity} lens={lens.tolist()} new_k={new_k} "
           f"page={page_size} batch_idx={batch_idx} per={per} {opts} alibi={alibi} splits={num_splits}")

    # the append: exactly the new rows' bytes, nothing else touched (the reference appends to uint8 copies too)
    kc_bytes, vc_bytes = kc.copy(), vc.copy()
    reference.attention_with_kvcache(q, kc_bytes, vc_bytes, k=kn, v=vn, cache_seqlens=lens, **layout)
    np.testing.assert_array_equal(kc_d.get(), kc_bytes, err_msg=ctx)
    np.testing.assert_array_equal(vc_d.get(), vc_bytes, err_msg=ctx)

    # attention: the float64 reference on the dequantized cache after the append
    kf, vf = (dequantize(c, s, rows_of_batch, hk) for c, s in ((kc_bytes, k_descale), (vc_bytes, v_descale)))
    ref_out, ref_lse = reference.attention_with_kvcache(q, kf, vf, cache_seqlens=lens + new_k, alibi_slopes=slopes,
                                                        return_lse=True, **layout, **opts)
    naive = np.zeros(q.shape, dtype=dt)
    for i in range(b):  # the 16-bit path's naive bound on each row's visible keys (dequantized, rounded to dt)
        n = int(lens[i]) + new_k
        if n == 0:
            continue
        naive[i] = naive_lowp(q[i:i + 1], _logical(kf, layout, i, n).astype(dt)[None],
                              _logical(vf, layout, i, n).astype(dt)[None], alibi_slopes=slopes, **opts)[0]
    assert out.shape == q.shape and out.dtype == q.dtype, ctx
    assert_close_to_reference(out.get(), ref_out, naive, context=ctx, floor=2e-3)
    assert lse.shape == (b, h, sq) and lse.dtype == np.float32, ctx
    assert_lse_close(lse.get(), ref_lse, context=ctx)
    return out.get(), lse.get()


@st.composite
def cases(draw):
    hk = draw(st.sampled_from([1, 2, 8]))
    group = draw(st.sampled_from([1, 2, 4, 5, 8]))
    b = draw(st.integers(1, 3))
    sq = draw(st.sampled_from([1, 1, 1, 2, 3, 17, 40]))
    capacity = draw(st.sampled_from([16, 64, 100, 257, 1000]) | st.integers(1, 400))
    paged = draw(st.booleans())
    new_k = min(draw(st.sampled_from([0, 0, 1, sq, 5])), capacity)
    top = capacity - new_k
    return dict(
        b=b, sq=sq, hk=hk, h=hk * group,
        d=draw(st.sampled_from([64, 128, 128, 48, 96, 256, 32])),
        dtype=draw(st.sampled_from(["fp16", "bf16"])),
        capacity=capacity, lens=[draw(st.sampled_from([0, top, top // 2]) | st.integers(0, top)) for _ in range(b)],
        new_k=new_k, page_size=draw(st.sampled_from([16, 32, 64, 256])) if paged else None,
        batch_idx=not paged and draw(st.booleans()),
        per=draw(st.sampled_from(["tensor", "head", None])),
        causal=draw(st.booleans()),
        window_size=draw(st.sampled_from([(-1, -1)] * 4 + [(32, 0), (100, -1), (7, 3)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 20.0])),
        alibi=draw(st.sampled_from([False, False, True])),
        num_splits=draw(st.sampled_from([0, 0, 1, 2, 5, 16])),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(), seed=st.integers(0, 2**31 - 1))
def test_e4m3_cache_matches_reference(compiled, case, seed):
    run_case(np.random.default_rng(seed), **case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_empty_rows_give_zero_and_minus_inf(compiled, dtype, d):
    """A row with no key (length 0) beside full ones, on every KV head of a per-head descale."""
    out, lse = run_case(np.random.default_rng(d), b=3, sq=1, h=8, hk=2, d=d, dtype=dtype, capacity=300,
                        lens=[0, 300, 17], per="head")
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("spread", [1e-3, 100.0])
def test_extreme_magnitudes(compiled, dtype, spread):
    """Subnormal e4m3 values (spread 1e-3) and values near 448 (spread 100, saturating) with large descales."""
    run_case(np.random.default_rng(7), b=2, sq=4, h=8, hk=2, d=128, dtype=dtype, capacity=700, lens=[700, 513],
             per="head", spread=spread)


def test_e4m3_cache_equals_a_bf16_cache_of_the_same_values(compiled):
    """The e4m3 cache and a bf16 cache holding the same (exactly representable) values give the same output up to
    the rounding of P (fp16 against bf16) and the order of the sums."""
    import cupy
    import cuflash
    rng = np.random.default_rng(3)
    b, sk, h, hk, d = 2, 900, 16, 2, 128
    kc, vc = e4m3_bits(rng, (b, sk, hk, d)), e4m3_bits(rng, (b, sk, hk, d))
    q = cupy.asarray(randn(rng, (b, 1, h, d), DTYPES["bf16"]))
    lens = cupy.asarray(np.array([900, 450], np.int32))
    got = cuflash.attention_with_kvcache(q, cupy.asarray(kc), cupy.asarray(vc), cache_seqlens=lens)
    as_bf16 = [cupy.asarray(x.view(E4M3).astype(DTYPES["bf16"])) for x in (kc, vc)]
    want = cuflash.attention_with_kvcache(q, *as_bf16, cache_seqlens=lens)
    np.testing.assert_allclose(got.get().astype(np.float32), want.get().astype(np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("paged", [False, True])
def test_torch_float8_cache_matches_cupy_bitwise(compiled, paged):
    """cuflash.torch.attention_with_kvcache on torch.float8_e4m3fn caches (appending in place) against the CuPy call
    on the same bytes: the same output, lse and cache bytes."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash
    import cuflash.torch
    rng = np.random.default_rng(11)
    b, sq, h, hk, d, cap, new = 2, 2, 8, 2, 128, 512, 2
    shape = (b * cap // 64, 64, hk, d) if paged else (b, cap, hk, d)
    kc, vc = e4m3_bits(rng, shape), e4m3_bits(rng, shape)
    kn, vn = e4m3_bits(rng, (b, new, hk, d)), e4m3_bits(rng, (b, new, hk, d))
    q = randn(rng, (b, sq, h, d), DTYPES["bf16"])
    lens = np.array([300, 17], np.int32)
    table = rng.permutation(b * cap // 64).reshape(b, cap // 64).astype(np.int32) if paged else None
    descales = [rng.uniform(0.5, 2.0, (b, hk)).astype(np.float32) for _ in range(2)]

    t = lambda x, dt=None: None if x is None else (  # noqa: E731
        torch.from_numpy(x).cuda() if dt is None else torch.from_numpy(x).cuda().view(dt))
    tk, tv = t(kc, torch.float8_e4m3fn), t(vc, torch.float8_e4m3fn)
    out_t, lse_t = cuflash.torch.attention_with_kvcache(
        t(q.view(np.int16), torch.bfloat16), tk, tv, k=t(kn, torch.float8_e4m3fn), v=t(vn, torch.float8_e4m3fn),
        cache_seqlens=t(lens), block_table=t(table), k_descale=t(descales[0]), v_descale=t(descales[1]), causal=True,
        return_lse=True)
    c = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    ck, cv = c(kc), c(vc)
    out_c, lse_c = cuflash.attention_with_kvcache(
        c(q), ck, cv, k=c(kn), v=c(vn), cache_seqlens=c(lens), block_table=c(table),
        k_descale=c(descales[0]), v_descale=c(descales[1]), causal=True, return_lse=True)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out_t.view(torch.int16).cpu().numpy(), out_c.view(np.int16).get())
    np.testing.assert_array_equal(lse_t.cpu().numpy(), lse_c.get())
    np.testing.assert_array_equal(tk.view(torch.uint8).cpu().numpy(), ck.get())
    np.testing.assert_array_equal(tv.view(torch.uint8).cpu().numpy(), cv.get())
    # flash-attn's name for the same call (k_descale / v_descale keyword arguments, as flash-attn 3's)
    import cuflash.flash_attn
    fk, fv = t(kc, torch.float8_e4m3fn), t(vc, torch.float8_e4m3fn)
    out_f, lse_f = cuflash.flash_attn.flash_attn_with_kvcache(
        t(q.view(np.int16), torch.bfloat16), fk, fv, t(kn, torch.float8_e4m3fn), t(vn, torch.float8_e4m3fn),
        cache_seqlens=t(lens), block_table=t(table), causal=True, return_softmax_lse=True, k_descale=t(descales[0]),
        v_descale=t(descales[1]))
    torch.cuda.synchronize()
    assert torch.equal(out_f.view(torch.int16), out_t.view(torch.int16)) and torch.equal(lse_f, lse_t)
    assert torch.equal(fk.view(torch.uint8), tk.view(torch.uint8)) and torch.equal(fv.view(torch.uint8),
                                                                                   tv.view(torch.uint8))

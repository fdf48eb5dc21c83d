"""cuflash.attention on the GPU against the float64 reference, shapes drawn by hypothesis."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference
from tests.fixtures import configure  # noqa: F401  (a fixture)
from tests.gpu.helpers import DTYPES, assert_close_to_reference, assert_lse_close, naive_lowp, randn

pytestmark = pytest.mark.gpu

ODD_LENGTHS = [1, 17, 63, 64, 65, 113, 128, 129, 255, 1000, 1031]
HEADDIMS = [8, 32, 40, 64, 72, 96, 128, 136, 160, 192, 224, 256]
WINDOWS = [(-1, -1), (16, 0), (64, 8), (0, 0), (300, -1), (-1, 40), (5, 5)]


def run_case(rng, *, b, sq, sk, h, hk, d, dtype, causal=False, window_size=(-1, -1), softcap=0.0,
             alibi=None, softmax_scale=None, return_lse=True, views=False):
    import cupy
    import cuflash
    dt = DTYPES[dtype]
    if views:  # q, k, v as strided slices of one packed (b, s, 3, h, d) tensor: no copies allowed
        packed = cupy.asarray(randn(rng, (b, sq, 3, h, d), dt))
        q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    else:
        q = cupy.asarray(randn(rng, (b, sq, h, d), dt))
        k = cupy.asarray(randn(rng, (b, sk, hk, d), dt))
        v = cupy.asarray(randn(rng, (b, sk, hk, d), dt))
    slopes = None
    if alibi is not None:
        shape = (h,) if alibi == "h" else (b, h)
        slopes = cupy.asarray(rng.uniform(0.0, 0.5, shape).astype(np.float32))
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    res = cuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=return_lse, **opts)
    out, lse = res if return_lse else (res, None)
    cupy.cuda.get_current_stream().synchronize()
    qh, kh, vh = q.get(), k.get(), v.get()
    sh = None if slopes is None else slopes.get()
    ref_out, ref_lse = reference.attention(qh, kh, vh, alibi_slopes=sh, return_lse=True, **opts)
    naive = naive_lowp(qh, kh, vh, alibi_slopes=sh, **opts)
    ctx = f"b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} {dtype} {opts} alibi={alibi}"
    assert out.shape == q.shape and out.dtype == q.dtype, ctx
    assert_close_to_reference(out.get(), ref_out, naive, context=ctx)
    if return_lse:
        assert lse.shape == (b, h, sq) and lse.dtype == np.float32, ctx
        assert_lse_close(lse.get(), ref_lse, context=ctx)
    return out, lse


def test_poisoned_allocations_are_nan():
    import cupy
    for dt in (np.float16, DTYPES["bf16"], np.float32):
        x = cupy.empty(1000, dtype=dt)
        assert np.isnan(x.get().astype(np.float32)).all(), dt


@st.composite
def forward_cases(draw):
    hk = draw(st.sampled_from([1, 2]))
    return dict(
        dtype=draw(st.sampled_from(["fp16", "bf16"])),
        d=draw(st.sampled_from(HEADDIMS)),
        sq=draw(st.sampled_from(ODD_LENGTHS) | st.integers(1, 300)),
        sk=draw(st.sampled_from(ODD_LENGTHS) | st.integers(1, 300)),
        b=draw(st.integers(1, 2)),
        hk=hk,
        h=hk * draw(st.sampled_from([1, 2, 3])),
        causal=draw(st.booleans()),
        window_size=draw(st.sampled_from(WINDOWS[:1] * 3 + WINDOWS)),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0, 30.0])),
        alibi=draw(st.sampled_from([None, None, None, "h", "bh"])),
        softmax_scale=draw(st.sampled_from([None, None, 0.05, 0.3])),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=forward_cases(), seed=st.integers(0, 2**31 - 1))
def test_forward_matches_reference(compiled, case, seed):
    run_case(np.random.default_rng(seed), **case)


@pytest.mark.parametrize("d", [40, 72, 96, 256])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (113, 17), (1000, 1031)])
def test_odd_sizes(compiled, d, sq, sk):
    run_case(np.random.default_rng(d * sq + sk), b=1, sq=sq, sk=sk, h=2, hk=1, d=d, dtype="bf16", causal=True)


@pytest.mark.parametrize("d", [72, 200])
def test_portable_forward_between_hopper_head_dims(configure, compiled, d):
    """Head dims that sm_90a runs on the Hopper kernel, on the portable one (the sm90 setting off; sm_80's path)."""
    configure(sm90=False)
    run_case(np.random.default_rng(d), b=2, sq=129, sk=300, h=4, hk=2, d=d, dtype="bf16", causal=True)


@pytest.mark.parametrize("option", [dict(causal=True), dict(window_size=(32, 7)), dict(softcap=10.0),
                                    dict(alibi="h"), dict(alibi="bh"), dict(softmax_scale=0.5),
                                    dict(causal=True, window_size=(48, 3), softcap=20.0, alibi="bh")])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_each_option(compiled, option, dtype):
    run_case(np.random.default_rng(7), b=2, sq=200, sk=333, h=4, hk=2, d=128, dtype=dtype, **option)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_packed_qkv_views(compiled, dtype):
    run_case(np.random.default_rng(3), b=2, sq=150, sk=150, h=4, hk=4, d=64, dtype=dtype, causal=True, views=True)


def test_empty_rows_give_zero_and_minus_inf(compiled):
    # causal with seqlen_q > seqlen_k: the first sq - sk query rows see no key at all
    out, lse = run_case(np.random.default_rng(11), b=1, sq=100, sk=30, h=2, hk=1, d=64, dtype="fp16", causal=True)
    assert not np.isnan(out.get().astype(np.float32)).any()
    assert (out.get()[:, :70].astype(np.float32) == 0).all()
    assert np.isneginf(lse.get()[:, :, :70]).all()


def test_without_lse(compiled):
    run_case(np.random.default_rng(5), b=1, sq=77, sk=99, h=2, hk=2, d=64, dtype="bf16", return_lse=False)


def test_mqa_many_heads(compiled):
    run_case(np.random.default_rng(9), b=1, sq=130, sk=260, h=8, hk=1, d=128, dtype="fp16", causal=True)


def test_stream_argument(compiled):
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run_case(np.random.default_rng(4), b=1, sq=64, sk=64, h=2, hk=2, d=64, dtype="bf16")


def test_offsets_beyond_32_bits(compiled):
    """Batch strides of 2^30 elements: batch 2 starts past 2^31 elements, which 32-bit offsets would wrap."""
    import cupy
    import cuflash
    rng = np.random.default_rng(1)
    b, s, h, d = 3, 48, 8, 128
    rows = (1 << 30) // (h * d)
    base = cupy.empty((b, rows, h, d), dtype=np.float16)  # 6 GiB: only the first s rows of each batch are used
    k = base[:, :s]
    k[...] = cupy.asarray(randn(rng, (b, s, h, d), np.float16))
    q = cupy.asarray(randn(rng, (b, s, h, d), np.float16))
    out = cuflash.attention(q, k, k)
    ref = reference.attention(q.get(), k.get(), k.get())
    assert_close_to_reference(out.get(), ref, naive_lowp(q.get(), k.get(), k.get()), context="64-bit offsets")
    del base, k


@pytest.mark.parametrize("wrong", ["no causal mask", "kv heads swapped"])
def test_checker_rejects_known_wrong_results(compiled, wrong):
    """The accuracy rule must fail plausible bugs; a checker that accepts these is broken."""
    import cupy
    import cuflash
    rng = np.random.default_rng(2)
    dt = DTYPES["bf16"]
    q = cupy.asarray(randn(rng, (1, 96, 4, 64), dt))
    k = cupy.asarray(randn(rng, (1, 96, 2, 64), dt))
    v = cupy.asarray(randn(rng, (1, 96, 2, 64), dt))
    if wrong == "no causal mask":
        bad = cuflash.attention(q, k, v, causal=False)
    else:
        bad = cuflash.attention(q, k[:, :, ::-1].copy(), v[:, :, ::-1].copy(), causal=True)
    ref = reference.attention(q.get(), k.get(), v.get(), causal=True)
    naive = naive_lowp(q.get(), k.get(), v.get(), causal=True)
    with pytest.raises(AssertionError):
        assert_close_to_reference(bad.get(), ref, naive, context=wrong)

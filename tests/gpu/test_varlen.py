"""cuflash.attention_varlen and its backward on the GPU: packed sequences against the float64 reference, and
against single-sequence cuflash.attention calls. Lengths are drawn by hypothesis, 0 and 1 included."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference
from tests.gpu.helpers import (DTYPES, assert_close_to_reference, assert_lse_close, naive_lowp, naive_lowp_backward,
                               randn)

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 17, 63, 64, 65, 113, 128, 129, 200, 333]
HEADDIMS_FWD = [8, 40, 64, 72, 96, 128, 160, 256]
HEADDIMS_BWD = [8, 32, 40, 64, 96, 128]
WINDOWS = [(-1, -1), (16, 0), (64, 8), (0, 0), (-1, 40), (5, 5)]
EPS = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_case(rng, *, lens_q, lens_k, h, hk, d, dtype, alibi=None, packed_qkv=False):
    """q (total_q, h, d), k/v (total_k, hk, d), dout like q, cu_seqlens and slopes, all on the device."""
    import cupy
    dt = DTYPES[dtype]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    if packed_qkv:  # strided views of one (total, 3, h, d) tensor (needs equal q and k lengths, h == hk)
        qkv = cupy.asarray(randn(rng, (total_q, 3, h, d), dt))
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    else:
        q = cupy.asarray(randn(rng, (total_q, h, d), dt))
        k = cupy.asarray(randn(rng, (total_k, hk, d), dt))
        v = cupy.asarray(randn(rng, (total_k, hk, d), dt))
    dout = cupy.asarray(randn(rng, (total_q, h, d), dt))
    slopes = None
    if alibi is not None:
        shape = (h,) if alibi == "h" else (len(lens_q), h)
        slopes = cupy.asarray(rng.uniform(0.0, 0.5, shape).astype(np.float32))
    return q, k, v, dout, cupy.asarray(cu_q), cupy.asarray(cu_k), slopes


def _slices(cu_q, cu_k, b):
    """Rows of sequence b in q and in k, as plain-int slices."""
    return slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def _sequence_slopes(slopes, b):
    if slopes is None or slopes.ndim == 1:
        return slopes
    return slopes[b:b + 1]


def naive_varlen(qh, kh, vh, cu_q, cu_k, slopes, opts):
    """naive_lowp applied to each sequence on its own (batch 1); rows of a sequence without keys are 0."""
    out = np.zeros(qh.shape, dtype=qh.dtype)
    for b in range(len(cu_q) - 1):
        sq, sk = _slices(cu_q, cu_k, b)
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        out[sq] = naive_lowp(qh[None, sq], kh[None, sk], vh[None, sk], alibi_slopes=_sequence_slopes(slopes, b),
                             **opts)[0]
    return out


def naive_varlen_backward(doh, qh, kh, vh, cu_q, cu_k, slopes, opts):
    grads = [np.zeros(x.shape, dtype=x.dtype) for x in (qh, kh, vh)]
    for b in range(len(cu_q) - 1):
        sq, sk = _slices(cu_q, cu_k, b)
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        g = naive_lowp_backward(doh[None, sq], qh[None, sq], kh[None, sk], vh[None, sk],
                                alibi_slopes=_sequence_slopes(slopes, b), **opts)
        grads[0][sq], grads[1][sk], grads[2][sk] = g[0][0], g[1][0], g[2][0]
    return grads


def _max_lengths(lens_q, lens_k):
    return max(1, max(lens_q)), max(1, max(lens_k))


def run_forward(rng, *, lens_q, lens_k, h, hk, d, dtype, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi=None, softmax_scale=None, packed_qkv=False):
    import cupy
    import cuflash
    q, k, v, _, cu_q, cu_k, slopes = make_case(rng, lens_q=lens_q, lens_k=lens_k, h=h, hk=hk, d=d, dtype=dtype,
                                                alibi=alibi, packed_qkv=packed_qkv)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    max_q, max_k = _max_lengths(lens_q, lens_k)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=slopes, return_lse=True,
                                        **opts)
    cupy.cuda.get_current_stream().synchronize()
    qh, kh, vh, cqh, ckh = (x.get() for x in (q, k, v, cu_q, cu_k))
    sh = None if slopes is None else slopes.get()
    ref_out, ref_lse = reference.attention_varlen(qh, kh, vh, cqh, ckh, max_q, max_k, alibi_slopes=sh,
                                                  return_lse=True, **opts)
    naive = naive_varlen(qh, kh, vh, cqh, ckh, sh, opts)
    ctx = f"lens_q={lens_q} lens_k={lens_k} h={h} hk={hk} d={d} {dtype} {opts} alibi={alibi}"
    assert out.shape == q.shape and out.dtype == q.dtype, ctx
    assert lse.shape == (h, q.shape[0]) and lse.dtype == np.float32, ctx
    assert_close_to_reference(out.get(), ref_out, naive, context=ctx)
    assert_lse_close(lse.get(), ref_lse, context=ctx)
    return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, slopes=slopes, out=out, lse=lse, opts=opts, max_q=max_q,
                max_k=max_k, ctx=ctx)


def run_backward(rng, *, lens_q, lens_k, h, hk, d, dtype, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi=None, softmax_scale=None, deterministic=False):
    import cuflash
    q, k, v, dout, cu_q, cu_k, slopes = make_case(rng, lens_q=lens_q, lens_k=lens_k, h=h, hk=hk, d=d, dtype=dtype,
                                                   alibi=alibi)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    max_q, max_k = _max_lengths(lens_q, lens_k)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=slopes, return_lse=True,
                                        **opts)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi_slopes=slopes,
                                              deterministic=deterministic, **opts)
    qh, kh, vh, doh, cqh, ckh = (x.get() for x in (q, k, v, dout, cu_q, cu_k))
    sh = None if slopes is None else slopes.get()
    _, ref_lse = reference.attention_varlen(qh, kh, vh, cqh, ckh, max_q, max_k, alibi_slopes=sh, return_lse=True,
                                            **opts)
    # the exact gradients given the (rounded) output the kernel was handed, as test_backward.run_case
    ref = reference.attention_varlen_backward(doh, qh, kh, vh, out.get().astype(np.float32), ref_lse, cqh, ckh,
                                              max_q, max_k, alibi_slopes=sh, **opts)
    naive = naive_varlen_backward(doh, qh, kh, vh, cqh, ckh, sh, opts)
    ctx = (f"lens_q={lens_q} lens_k={lens_k} h={h} hk={hk} d={d} {dtype} {opts} alibi={alibi} "
           f"det={deterministic}")
    for name, got, want, lowp, like in zip(("dq", "dk", "dv"), grads, ref, naive, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype, (name, ctx)
        assert_close_to_reference(got.get(), want, lowp, what=name, context=ctx)
    return dict(q=q, k=k, v=v, dout=dout, cu_q=cu_q, cu_k=cu_k, slopes=slopes, out=out, lse=lse, grads=grads,
                opts=opts, max_q=max_q, max_k=max_k)


def _nonempty(lengths):
    """At least one token in total: the packed token axis may not be empty."""
    return lengths if sum(lengths) else lengths[:-1] + [1]


@st.composite
def varlen_cases(draw, headdims, backward=False):
    hk = draw(st.sampled_from([1, 2]))
    n = draw(st.integers(1, 5))
    length = st.sampled_from(LENGTHS) | st.integers(0, 300)
    lens_q = _nonempty(draw(st.lists(length, min_size=n, max_size=n)))
    same = draw(st.booleans())  # self-attention lengths, or independent key lengths (causal with sq != sk)
    lens_k = lens_q if same else _nonempty(draw(st.lists(length, min_size=n, max_size=n)))
    case = dict(
        dtype=draw(st.sampled_from(["fp16", "bf16"])),
        d=draw(st.sampled_from(headdims)),
        lens_q=lens_q,
        lens_k=lens_k,
        hk=hk,
        h=hk * draw(st.sampled_from([1, 2, 3])),
        causal=draw(st.booleans()),
        window_size=draw(st.sampled_from(WINDOWS[:1] * 3 + WINDOWS)),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0])),
        alibi=draw(st.sampled_from([None, None, None, "h", "bh"])),
        softmax_scale=draw(st.sampled_from([None, None, 0.3])),
    )
    if backward:
        case["deterministic"] = draw(st.booleans())
    return case


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=varlen_cases(HEADDIMS_FWD), seed=st.integers(0, 2**31 - 1))
def test_forward_matches_reference(compiled, case, seed):
    run_forward(np.random.default_rng(seed), **case)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=varlen_cases(HEADDIMS_BWD, backward=True), seed=st.integers(0, 2**31 - 1))
def test_backward_matches_reference(compiled, case, seed):
    run_backward(np.random.default_rng(seed), **case)


def _assert_near(got, want, dtype, what, ctx):
    """Same kernels on the same data: equal up to a few units of the output's last place (the tile config may
    differ with the length it is chosen by)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{what}: -inf pattern differs ({ctx})"
    fin = np.isfinite(want)
    err = float(np.abs(got[fin] - want[fin]).max(initial=0.0))
    assert not np.isnan(got).any() and err <= 4 * EPS[dtype] * max(1.0, float(np.abs(want[fin]).max(initial=0))), \
        f"{what}: varlen differs from single-sequence calls by {err:.3g} ({ctx})"


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=varlen_cases([40, 64, 128]), seed=st.integers(0, 2**31 - 1))
def test_forward_equals_single_sequence_calls(compiled, case, seed):
    """Sequence b of a packed call gives what cuflash.attention gives for that sequence alone (batch 1)."""
    import cuflash
    r = run_forward(np.random.default_rng(seed), **case)
    cu_q, cu_k = r["cu_q"].get(), r["cu_k"].get()
    out, lse = r["out"].get(), r["lse"].get()
    for b in range(len(cu_q) - 1):
        sq, sk = _slices(cu_q, cu_k, b)
        if sq.stop == sq.start or sk.stop == sk.start:  # cuflash.attention needs non-empty sequences
            continue
        slopes = r["slopes"]
        one_out, one_lse = cuflash.attention(r["q"][None, sq], r["k"][None, sk], r["v"][None, sk],
                                             alibi_slopes=None if slopes is None else slopes[b] if slopes.ndim == 2
                                             else slopes, return_lse=True, **r["opts"])
        ctx = f"sequence {b} of {r['ctx']}"
        _assert_near(out[sq], one_out.get()[0], case["dtype"], "out", ctx)
        _assert_near(lse[:, sq], one_lse.get()[0], case["dtype"], "lse", ctx)


@pytest.mark.parametrize("option", [dict(causal=True), dict(window_size=(40, 7)), dict(softcap=8.0), dict(alibi="h"),
                                    dict(alibi="bh"), dict(softmax_scale=0.5),
                                    dict(causal=True, softcap=10.0, alibi="bh", window_size=(50, 0))])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_each_option(compiled, option, dtype):
    """Causal with seqlen_q != seqlen_k in every sequence (both ways), and each option, forward and backward."""
    lens = dict(lens_q=[150, 17, 1, 277, 64], lens_k=[277, 113, 40, 150, 1])
    run_forward(np.random.default_rng(3), h=4, hk=2, d=128, dtype=dtype, **lens, **option)
    run_backward(np.random.default_rng(3), h=4, hk=2, d=128, dtype=dtype, **lens, **option)


def test_empty_sequences(compiled):
    """Length 0 on either side: nothing to compute for q of length 0; q rows whose sequence has no key get
    out = 0, lse = -inf and zero gradients; keys whose sequence has no query get zero dk, dv."""
    import cupy
    lens = dict(lens_q=[0, 33, 17, 0, 5], lens_k=[12, 0, 40, 0, 70])
    r = run_backward(np.random.default_rng(4), h=2, hk=1, d=64, dtype="fp16", causal=True, **lens)
    out, lse = r["out"].get().astype(np.float32), r["lse"].get()
    assert not np.isnan(out).any()
    assert (out[0:33] == 0).all() and np.isneginf(lse[:, 0:33]).all(), "sequence 1 has no keys"
    dq, dk, dv = (g.get().astype(np.float32) for g in r["grads"])
    assert (dq[0:33] == 0).all()
    assert (dk[0:12] == 0).all() and (dv[0:12] == 0).all(), "sequence 0 has no queries"
    for g in r["grads"]:
        assert not bool(cupy.isnan(g.astype(np.float32)).any())


def test_causal_rows_without_keys(compiled):
    """Causal with seqlen_q > seqlen_k inside a sequence: its leading sq - sk rows see no key."""
    r = run_forward(np.random.default_rng(11), lens_q=[20, 100], lens_k=[50, 30], h=2, hk=1, d=64, dtype="bf16",
                    causal=True)
    out, lse = r["out"].get().astype(np.float32), r["lse"].get()
    assert (out[20:90] == 0).all() and np.isneginf(lse[:, 20:90]).all()
    assert np.isfinite(lse[:, 90:]).all() and np.isfinite(lse[:, :20]).all()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_packed_qkv_views(compiled, dtype):
    run_forward(np.random.default_rng(5), lens_q=[113, 1, 64, 200], lens_k=[113, 1, 64, 200], h=4, hk=4, d=64,
                dtype=dtype, causal=True, packed_qkv=True)


def test_one_sequence_equals_padded(compiled):
    """A single packed sequence is the padded batch of one: same kernels, same tile, the same bits."""
    import cupy
    import cuflash
    r = run_forward(np.random.default_rng(6), lens_q=[300], lens_k=[520], h=4, hk=2, d=128, dtype="bf16",
                    causal=True)
    out, lse = cuflash.attention(r["q"][None], r["k"][None], r["v"][None], return_lse=True, **r["opts"])
    assert bool(cupy.array_equal(out[0].view(np.uint16), r["out"].view(np.uint16)))
    assert bool(cupy.array_equal(lse[0], r["lse"]))


def test_max_seqlen_larger_than_needed(compiled):
    """max_seqlen_* are upper bounds: a looser bound launches more CTAs, which exit at once, and picks its tile
    config by the bound; the results stay right."""
    import cupy
    import cuflash
    rng = np.random.default_rng(7)
    q, k, v, _, cu_q, cu_k, _ = make_case(rng, lens_q=[17, 113], lens_k=[40, 129], h=2, hk=1, d=64, dtype="fp16")
    loose = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 5000, 5000, causal=True)
    host = [x.get() for x in (q, k, v, cu_q, cu_k)]
    ref = reference.attention_varlen(*host, 113, 129, causal=True)
    naive = naive_varlen(*host, None, dict(causal=True))
    assert_close_to_reference(loose.get(), ref, naive, context="max_seqlen 5000 for lengths <= 129")
    assert not bool(cupy.isnan(loose.astype(np.float32)).any())


@pytest.mark.parametrize("hk", [4, 1])
def test_deterministic_is_bitwise_repeatable(compiled, hk):
    import cupy
    import cuflash
    r = run_backward(np.random.default_rng(8), lens_q=[300, 0, 77, 520], lens_k=[520, 64, 77, 300], h=4, hk=hk,
                     d=128, dtype="bf16", causal=True, deterministic=True)
    args = (r["dout"], r["q"], r["k"], r["v"], r["out"], r["lse"], r["cu_q"], r["cu_k"], r["max_q"], r["max_k"])
    first = [g.view(np.uint16).copy() for g in r["grads"]]
    for _ in range(4):
        again = cuflash.attention_varlen_backward(*args, deterministic=True, **r["opts"])
        for a, g in zip(first, again):
            assert bool(cupy.array_equal(a, g.view(np.uint16))), "deterministic mode changed bits between runs"


def test_many_short_sequences(compiled):
    """Many sequences of mixed lengths in one call (the benchmark's shape, smaller)."""
    rng = np.random.default_rng(9)
    lens = _nonempty([int(x) for x in rng.integers(0, 300, size=24)])
    run_forward(rng, lens_q=lens, lens_k=lens, h=4, hk=1, d=128, dtype="bf16", causal=True)
    run_backward(rng, lens_q=lens, lens_k=lens, h=4, hk=1, d=64, dtype="fp16", causal=True)


def test_stream_argument(compiled):
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run_forward(np.random.default_rng(10), lens_q=[17, 64], lens_k=[33, 1], h=2, hk=2, d=64, dtype="bf16")


# --------------------------------------------------------------------------------------------
# Paged keys: block_table (chunked prefill against a page pool) and seqused_k
# --------------------------------------------------------------------------------------------

def _paged(rng, lens_k, page_size, hk, d, dt, spare=3, poison=False):
    """A shuffled page pool holding each sequence's keys and values (plus spare pages of noise), its block table,
    and the keys and values gathered back into packed rows (the unpaged equivalent). `poison`: the rows of each
    sequence's last page past its keys, and the spare pages, hold NaN (what an unwritten pool may hold)."""
    pages = [max(1, -(-n // page_size)) for n in lens_k]
    num_pages = sum(pages) + spare
    pool_k, pool_v = randn(rng, (num_pages, page_size, hk, d), dt), randn(rng, (num_pages, page_size, hk, d), dt)
    order = rng.permutation(num_pages)
    table = np.full((len(lens_k), max(pages)), num_pages - 1, np.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start:start + n]
        start += n
    if poison:
        for b, (n, used) in enumerate(zip(lens_k, pages)):
            pool_k[table[b, used - 1], n - (used - 1) * page_size:] = np.nan
            pool_v[table[b, used - 1], n - (used - 1) * page_size:] = np.nan
        pool_k[order[start:]] = pool_v[order[start:]] = np.nan
    rows = [(table[b, np.arange(n) // page_size], np.arange(n) % page_size) for b, n in enumerate(lens_k)]
    packed_k = np.concatenate([pool_k[r] for r in rows]) if sum(lens_k) else np.zeros((0, hk, d), dt)
    packed_v = np.concatenate([pool_v[r] for r in rows]) if sum(lens_k) else np.zeros((0, hk, d), dt)
    return pool_k, pool_v, table, packed_k, packed_v


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_paged_varlen_matches_the_reference(compiled, page_size, causal, dtype):
    """Chunked prefill: new query chunks of each sequence against its keys in a page pool (the chunk's own keys
    last, so causal masks align bottom-right as in a KV cache), GQA, lengths off the tile grid, an empty sequence,
    NaN in the pool past each sequence's keys; equal to the reference on the pool and to the unpaged call on the
    gathered keys. (On sm_90a the Hopper kernel's PAGED variant, in boxes of 16 rows for pages of 48.)"""
    import cupy
    import cuflash
    rng = np.random.default_rng(page_size + causal)
    dt = DTYPES[dtype]
    lens_q, lens_k = [17, 1, 64, 0, 40], [300, 33, 64, 5, 129]
    h, hk, d = 8, 2, 128
    pool_k, pool_v, table, packed_k, packed_v = _paged(rng, lens_k, page_size, hk, d, dt, poison=True)
    q = randn(rng, (sum(lens_q), h, d), dt)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    dev = cupy.asarray
    out, lse = cuflash.attention_varlen(dev(q), dev(pool_k), dev(pool_v), dev(cu_q), dev(cu_k), max(lens_q),
                                        max(lens_k), causal=causal, block_table=dev(table), return_lse=True)
    ref, ref_lse = reference.attention_varlen(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k),
                                              causal=causal, block_table=table, return_lse=True)
    naive = naive_varlen(q, packed_k, packed_v, cu_q, cu_k, None, dict(causal=causal))
    assert_close_to_reference(out.get(), ref, naive, context=f"page {page_size} causal {causal}")
    assert_lse_close(lse.get(), ref_lse)
    unpaged = cuflash.attention_varlen(dev(q), dev(packed_k), dev(packed_v), dev(cu_q), dev(cu_k), max(lens_q),
                                       max(lens_k), causal=causal)
    assert_close_to_reference(out.get(), unpaged.get().astype(np.float64), naive)


@pytest.mark.parametrize("d, page_size, opts", [(64, 32, dict(causal=True)), (64, 48, dict(window_size=(40, 8))),
                                                 (256, 32, dict(causal=True, softcap=30.0)), (256, 128, {}),
                                                 (96, 32, dict(causal=True))])
def test_paged_varlen_head_dims_and_options(compiled, d, page_size, opts):
    """Paged keys at the other head dims (the Hopper kernel's 64 and 256, the portable kernel's 96), with a local
    window, softcap and ALiBi, seqused_k below cu_seqlens_k's counts, and NaN in the pool past the keys."""
    import cupy
    import cuflash
    rng = np.random.default_rng(d + page_size)
    dt, h, hk = DTYPES["bf16"], 4, 2
    lens_q, lens_k = [33, 0, 70, 5], [200, 17, 70, 129]
    used = [190, 17, 64, 129]
    pool_k, pool_v, table, _, _ = _paged(rng, used, page_size, hk, d, dt, poison=True)
    q = randn(rng, (sum(lens_q), h, d), dt)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    slopes = rng.uniform(0.01, 0.5, size=h).astype(np.float32) if "softcap" in opts else None
    dev = cupy.asarray
    out, lse = cuflash.attention_varlen(dev(q), dev(pool_k), dev(pool_v), dev(cu_q), dev(cu_k), max(lens_q),
                                        max(lens_k), block_table=dev(table), seqused_k=dev(np.array(used, np.int32)),
                                        alibi_slopes=None if slopes is None else dev(slopes), return_lse=True, **opts)
    out, lse = out.get(), lse.get()
    for b in range(len(lens_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if not lens_q[b]:
            continue
        pos = np.arange(used[b])
        kb, vb = (pool[table[b, pos // page_size], pos % page_size] for pool in (pool_k, pool_v))
        args = (q[None, rows], kb[None], vb[None])
        want, want_lse = reference.attention(*args, return_lse=True, alibi_slopes=slopes, **opts)
        assert_close_to_reference(out[None, rows], want, naive_lowp(*args, alibi_slopes=slopes, **opts),
                                  context=f"d {d} page {page_size} row {b}")
        assert_lse_close(lse[:, rows], want_lse[0])


def test_paged_varlen_seqused_k_and_bounds(compiled):
    """seqused_k gives each sequence's key count; a count past the pages of its block-table row is cut to them,
    a negative one gives no keys (out 0, lse -inf), and a page index outside the pool reads as zero keys. The
    unpaged call with seqused_k reads at most the sequence's own rows."""
    import cupy
    import cuflash
    rng = np.random.default_rng(5)
    dt, h, hk, d, page = DTYPES["bf16"], 4, 1, 64, 16
    lens_q, lens_k = [2, 2, 2], [40, 20, 16]
    pool_k, pool_v, table, packed_k, packed_v = _paged(rng, lens_k, page, hk, d, dt, spare=0)
    q = randn(rng, (6, h, d), dt)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    used = np.array([1000, -4, 16], np.int32)  # row 0: cut to its 3 pages (48 keys); row 1: none
    table[2, 0] = 77  # row 2's page is not in the pool: its 16 keys read as zeros
    dev = cupy.asarray
    out, lse = cuflash.attention_varlen(dev(q), dev(pool_k), dev(pool_v), dev(cu_q), dev(cu_k), 2, 48,
                                        block_table=dev(table), seqused_k=dev(used), return_lse=True)
    out, lse = out.get(), lse.get()
    keys0 = pool_k[table[0, np.arange(48) // page], np.arange(48) % page]
    vals0 = pool_v[table[0, np.arange(48) // page], np.arange(48) % page]
    zeros = np.zeros((16, hk, d), dt)
    for b, (kb, vb) in ((0, (keys0, vals0)), (2, (zeros, zeros))):
        args = (q[None, 2 * b:2 * b + 2], kb[None], vb[None])
        want, want_lse = reference.attention(*args, return_lse=True)
        assert_close_to_reference(out[None, 2 * b:2 * b + 2], want, naive_lowp(*args), context=f"row {b}")
        assert_lse_close(lse[:, 2 * b:2 * b + 2], want_lse[0])
    assert (out[2:4] == 0).all() and np.isneginf(lse[:, 2:4]).all()

    used = np.array([40, 25, 3], np.int32)  # unpaged: row 1 asks for more than its 20 rows and gets 20
    out = cuflash.attention_varlen(dev(q), dev(packed_k), dev(packed_v), dev(cu_q), dev(cu_k), 2, 40,
                                   seqused_k=dev(used)).get()
    for b, n in enumerate([40, 20, 3]):
        rows = slice(int(cu_k[b]), int(cu_k[b]) + n)
        args = (q[None, 2 * b:2 * b + 2], packed_k[None, rows], packed_v[None, rows])
        assert_close_to_reference(out[None, 2 * b:2 * b + 2], reference.attention(*args), naive_lowp(*args),
                                  context=f"unpaged row {b}")

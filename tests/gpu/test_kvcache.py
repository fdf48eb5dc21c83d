"""cuflash.attention_with_kvcache on the GPU against the float64 reference: contiguous and paged caches,
in-place append, cache_batch_idx, split-KV, GQA packing, every option."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference
from cuflash.ops import decode
from tests.gpu.helpers import DTYPES, assert_close_to_reference, assert_lse_close, naive_lowp, randn
from tests.fixtures import configure  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["cp.async", "tma"])
def decode_path(configure, request):
    """Every test runs on the cp.async kernel and, on sm_90a, with the TMA kernel switched on (the decode_tma setting;
    the calls it does not cover, such as pages of 48 rows or more than 16 packed rows, stay on cp.async)."""
    from cuflash import build
    from cuflash.ops import decode
    if request.param == "tma":
        import cupy
        if build.device_arch(cupy.cuda.Device().id) != "sm_90a":
            pytest.skip("the TMA decode kernel needs sm_90a")
    configure(decode_tma=request.param == "tma")
    decode._calls.clear()
    decode.plan_decode.cache_clear()
    yield request.param
    decode._calls.clear()
    decode.plan_decode.cache_clear()


def make_cache(rng, *, b, capacity, hk, d, dt, page_size=None, batch_idx=False):
    """A cache filled with random keys/values, as NumPy arrays plus the layout arguments for the call.

    Contiguous: (batch_cache, capacity, hk, d), batch_cache > b when batch_idx (rows in shuffled order).
    Paged: a pool with pages shuffled (and spare pages), block_table mapping each row's logical pages."""
    if page_size is None:
        rows = b + 2 if batch_idx else b
        kc, vc = randn(rng, (rows, capacity, hk, d), dt), randn(rng, (rows, capacity, hk, d), dt)
        idx = rng.permutation(rows)[:b].astype(np.int32) if batch_idx else None
        return kc, vc, dict(cache_batch_idx=idx)
    max_pages = -(-capacity // page_size)
    num_pages = b * max_pages + 3
    kc, vc = randn(rng, (num_pages, page_size, hk, d), dt), randn(rng, (num_pages, page_size, hk, d), dt)
    table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    return kc, vc, dict(block_table=table)


def run_case(rng, *, b, sq, h, hk, d, dtype, capacity, lens, new_k=0, page_size=None, batch_idx=False,
             seqlens_kind="array", causal=False, window_size=(-1, -1), softcap=0.0, alibi=None,
             softmax_scale=None, num_splits=0, check_naive=True, rotary=None, rotary_dim=0, leftpad=False):
    """Runs one call on the GPU and the reference on the host; checks out, lse and the updated cache. rotary:
    "interleaved" or "half" (rotary_dim elements rotated, tables long enough for every position); leftpad: each
    row's keys start at a random position up to its length."""
    import cupy
    import cuflash
    dt = DTYPES[dtype]
    kc, vc, layout = make_cache(rng, b=b, capacity=capacity, hk=hk, d=d, dt=dt, page_size=page_size,
                                batch_idx=batch_idx)
    q = randn(rng, (b, sq, h, d), dt)
    kn = vn = None
    if new_k:
        kn, vn = randn(rng, (b, new_k, hk, d), dt), randn(rng, (b, new_k, hk, d), dt)
    lens = np.asarray(lens, dtype=np.int32)
    if seqlens_kind == "int":
        assert (lens == lens[0]).all()
        seqlens = int(lens[0])
    elif seqlens_kind == "none":
        assert new_k == 0
        seqlens = None
        lens = np.full(b, (kc.shape[1] * layout["block_table"].shape[1]) if page_size else capacity, np.int32)
    else:
        seqlens = lens
    slopes = None
    if alibi is not None:
        slopes = rng.uniform(0.0, 0.5, (h,) if alibi == "h" else (b, h)).astype(np.float32)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    extra = {}  # rotary tables and leftpad, given to both
    if rotary:
        angle = rng.uniform(0, 2 * np.pi, (capacity + sq, rotary_dim // 2))
        extra = dict(rotary_cos=np.cos(angle).astype(dt), rotary_sin=np.sin(angle).astype(dt),
                     rotary_interleaved=rotary == "interleaved")
    pads = np.zeros(b, np.int64)
    if leftpad:
        pads = np.array([rng.integers(0, n + 1) for n in lens])
        extra["cache_leftpad"] = pads.astype(np.int32)

    dev = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    kc_d, vc_d = dev(kc), dev(vc)
    out, lse = cuflash.attention_with_kvcache(
        dev(q), kc_d, vc_d, k=dev(kn), v=dev(vn), cache_seqlens=seqlens if seqlens_kind != "array" else dev(seqlens),
        cache_batch_idx=dev(layout.get("cache_batch_idx")), block_table=dev(layout.get("block_table")),
        alibi_slopes=dev(slopes), num_splits=num_splits, return_lse=True, **opts,
        **{n: dev(x) if isinstance(x, np.ndarray) else x for n, x in extra.items()})
    cupy.cuda.get_current_stream().synchronize()

    kc_ref, vc_ref = kc.copy(), vc.copy()
    ref_out, ref_lse = reference.attention_with_kvcache(
        q, kc_ref, vc_ref, k=kn, v=vn, cache_seqlens=seqlens, alibi_slopes=slopes, return_lse=True,
        **layout, **opts, **extra)
    q_used = q  # the queries the kernels attend with: rotated as the reference rotates them
    if rotary:
        per_query = causal or tuple(window_size) != (-1, -1)
        q_used = np.stack([reference.rotary(q[i], extra["rotary_cos"], extra["rotary_sin"],
                                            lens[i] + (np.arange(sq) if per_query else np.zeros(sq, np.int64)),
                                            extra["rotary_interleaved"]) for i in range(b)])
    ctx = (f"b={b} sq={sq} h={h} hk={hk} d={d} {dtype} capacity={capacity} lens={lens.tolist()} new_k={new_k} "
           f"page={page_size} batch_idx={batch_idx} seqlens={seqlens_kind} {opts} alibi={alibi} "
           f"splits={num_splits} rotary={rotary}/{rotary_dim} leftpad={pads.tolist()}")
    # the append, exactly; nothing else in the cache touched
    np.testing.assert_array_equal(kc_d.get().view(np.uint16), kc_ref.view(np.uint16), err_msg=ctx)
    np.testing.assert_array_equal(vc_d.get().view(np.uint16), vc_ref.view(np.uint16), err_msg=ctx)

    naive = np.zeros(q.shape, dtype=dt)
    if check_naive:
        for i in range(b):  # the naive low-precision bound, on each row's visible keys
            n = int(lens[i]) + new_k
            if n - pads[i] == 0:
                continue
            kb, vb = _logical(kc_ref, layout, i, n)[pads[i]:], _logical(vc_ref, layout, i, n)[pads[i]:]
            naive[i] = naive_lowp(q_used[i:i + 1], kb[None], vb[None], alibi_slopes=None if slopes is None else
                                  np.broadcast_to(slopes.reshape(-1, h), (b, h))[i], **opts)[0]
    assert out.shape == q.shape and out.dtype == q.dtype, ctx
    assert_close_to_reference(out.get(), ref_out, naive if check_naive else ref_out, context=ctx,
                              floor=1e-3 if check_naive else 2e-2)
    assert lse.shape == (b, h, sq) and lse.dtype == np.float32, ctx
    assert_lse_close(lse.get(), ref_lse, context=ctx)
    return out.get(), lse.get()


def _logical(cache, layout, row, n):
    """Positions 0..n-1 of batch row `row`, gathered from a contiguous or paged NumPy cache."""
    if layout.get("block_table") is not None:
        page_size = cache.shape[1]
        pos = np.arange(n)
        return cache[layout["block_table"][row, pos // page_size], pos % page_size]
    idx = layout.get("cache_batch_idx")
    return cache[row if idx is None else idx[row], :n]


@st.composite
def kvcache_cases(draw):
    hk = draw(st.sampled_from([1, 2, 8]))
    group = draw(st.sampled_from([1, 2, 4, 5, 8]))
    b = draw(st.integers(1, 3))
    sq = draw(st.sampled_from([1, 1, 1, 2, 3, 17, 40]))
    capacity = draw(st.sampled_from([16, 64, 100, 257, 1000, 1500]) | st.integers(1, 400))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 32, 48, 64, 256])) if paged else None
    new_k = draw(st.sampled_from([0, 0, 1, sq, 5]))
    new_k = min(new_k, capacity)
    seqlens_kind = draw(st.sampled_from(["array", "array", "int"] + (["none"] if new_k == 0 else [])))
    top = capacity - new_k
    if seqlens_kind == "int":
        lens = [draw(st.integers(0, top))] * b
    else:
        lens = [draw(st.sampled_from([0, top, top // 2]) | st.integers(0, top)) for _ in range(b)]
    return dict(
        b=b, sq=sq, hk=hk, h=hk * group,
        d=draw(st.sampled_from([64, 128, 128, 40, 96, 256])),
        dtype=draw(st.sampled_from(["fp16", "bf16"])),
        capacity=capacity, lens=lens, new_k=new_k, page_size=page_size,
        batch_idx=not paged and draw(st.booleans()),
        seqlens_kind=seqlens_kind,
        causal=draw(st.booleans()),
        window_size=draw(st.sampled_from([(-1, -1)] * 4 + [(32, 0), (100, -1), (7, 3)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 20.0])),
        alibi=draw(st.sampled_from([None, None, None, "h", "bh"])),
        num_splits=draw(st.sampled_from([0, 0, 1, 2, 5, 16])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=kvcache_cases(), seed=st.integers(0, 2**31 - 1))
def test_kvcache_matches_reference(compiled, case, seed):
    run_case(np.random.default_rng(seed), **case)


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_paged_equals_contiguous(configure, compiled, decode_path, page_size, dtype):
    """The same logical cache, contiguous and paged (shuffled pages): bitwise equal outputs and lse. Where the TMA
    kernel takes the contiguous cache but not the pages (pages of 48 rows: the cp.async kernel), both sides merge
    their splits with decode_combine, so that the two kernels' partial results are compared bitwise; the TMA
    kernel's own merge sums the splits in another order (test_split_merge_both_ways checks it)."""
    import cupy
    import cuflash
    if decode_path == "tma" and decode.page_boxes(page_size, decode.TMA_BLOCK_N, 128) == 0:
        configure(decode_fused_max_splits=0)
    rng = np.random.default_rng(page_size)
    dt = DTYPES[dtype]
    b, capacity, hk, h, d = 3, 1000, 2, 8, 128
    lens = np.array([1000 - 7, 0, 517], dtype=np.int32)
    kc, vc = randn(rng, (b, capacity, hk, d), dt), randn(rng, (b, capacity, hk, d), dt)
    max_pages = -(-capacity // page_size)
    table = rng.permutation(b * max_pages).reshape(b, max_pages).astype(np.int32)
    pool_k = np.zeros((b * max_pages, page_size, hk, d), dt)
    pool_v = np.zeros_like(pool_k)
    for i in range(b):
        for pg in range(max_pages):
            rows = kc[i, pg * page_size:(pg + 1) * page_size]
            pool_k[table[i, pg], :len(rows)] = rows
            pool_v[table[i, pg], :len(rows)] = vc[i, pg * page_size:(pg + 1) * page_size]
    q = cupy.asarray(randn(rng, (b, 1, h, d), dt))
    kn, vn = cupy.asarray(randn(rng, (b, 1, hk, d), dt)), cupy.asarray(randn(rng, (b, 1, hk, d), dt))
    seqlens = cupy.asarray(lens)
    for splits in (1, 4):
        # the same keys on both sides: the append goes into fresh copies each time
        c_out, c_lse = cuflash.attention_with_kvcache(q, cupy.asarray(kc), cupy.asarray(vc), k=kn, v=vn,
                                                      cache_seqlens=seqlens, num_splits=splits,
                                                      causal=True, return_lse=True)
        p_out, p_lse = cuflash.attention_with_kvcache(q, cupy.asarray(pool_k), cupy.asarray(pool_v), k=kn, v=vn,
                                                      cache_seqlens=seqlens, block_table=cupy.asarray(table),
                                                      num_splits=splits, causal=True, return_lse=True)
        np.testing.assert_array_equal(c_out.get().view(np.uint16), p_out.get().view(np.uint16))
        np.testing.assert_array_equal(c_lse.get(), p_lse.get())


def test_every_split_count_agrees(compiled):
    """num_splits = 1..N (and the heuristic's 0) all match the reference and each other closely."""
    rng = np.random.default_rng(7)
    outs = []
    for splits in [0] + list(range(1, 21)):
        out, _ = run_case(np.random.default_rng(3), b=2, sq=1, h=16, hk=4, d=128, dtype="bf16", capacity=1200,
                          lens=[1200, 731], num_splits=splits)
        outs.append(out.astype(np.float32))
    spread = max(float(np.abs(o - outs[1]).max()) for o in outs)
    assert spread < 2e-2, spread
    del rng


@pytest.mark.parametrize("fused", [False, True])
def test_split_merge_both_ways(configure, compiled, decode_path, fused):
    """The decode_fused_max_splits setting: the splits merged by the TMA decode kernel (the last CTA of each row
    tile) or by decode_combine (always, after the cp.async kernel), both against the reference: several split counts,
    speculative rows over several row tiles, an empty row, appends. The fused merge leaves its stream's counters at
    zero for the next call."""
    import cupy
    from cuflash.ops import decode
    configure(decode_fused_max_splits=128 if fused else 0)
    decode._calls.clear()
    cases = ((2, 1, [1200, 0], 0, 128), (5, 3, [731, 1197], 3, 64), (16, 1, [1200, 17], 1, 128),
             (7, 33, [1100, 900], 33, 128), (3, 1, [0, 5], 0, 64))  # splits, sq, lens, new_k, d
    for splits, sq, lens, new_k, d in cases:
        run_case(np.random.default_rng(splits), b=2, sq=sq, h=8, hk=2, d=d, dtype="bf16", capacity=1200 + new_k,
                 lens=lens, new_k=new_k, causal=sq > 1, num_splits=splits)
    cupy.cuda.Device().synchronize()
    if fused and decode_path == "tma":
        counters = decode._counters[cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr]
        assert int(cupy.abs(counters).max()) == 0
    decode._calls.clear()


def test_fused_merge_on_two_streams_repeats_bitwise(configure, compiled):
    """Calls on two streams at once each count on their own stream's counters (TMA kernel) or launch their own
    decode_combine (cp.async kernel); the merge's order is fixed, so every result equals the first bitwise."""
    import cupy
    import cuflash
    from cuflash.ops import decode
    configure(decode_fused_max_splits=128)
    decode._calls.clear()
    rng = np.random.default_rng(2)
    q = cupy.asarray(randn(rng, (1, 1, 32, 128), np.float16))
    kc = cupy.asarray(randn(rng, (1, 8192, 8, 128), np.float16))
    vc = cupy.asarray(randn(rng, (1, 8192, 8, 128), np.float16))
    first = cuflash.attention_with_kvcache(q, kc, vc, num_splits=32)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = []
    for _ in range(20):
        for s in streams:
            with s:
                outs.append(cuflash.attention_with_kvcache(q, kc, vc, num_splits=32))
    cupy.cuda.Device().synchronize()
    for out in outs:
        np.testing.assert_array_equal(out.get().view(np.uint16), first.get().view(np.uint16))


@pytest.mark.parametrize("splits", [1, 3])
def test_lengths_zero_to_capacity(compiled, splits):
    """Every row length 0..L in one batch; length 0 gives out 0 and lse -inf."""
    capacity = 70
    lens = list(range(0, capacity + 1))
    out, lse = run_case(np.random.default_rng(1), b=len(lens), sq=1, h=4, hk=2, d=64, dtype="fp16",
                        capacity=capacity, lens=lens, num_splits=splits)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert np.isfinite(lse[1:]).all()


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
def test_gqa_ratios(compiled, group):
    run_case(np.random.default_rng(group), b=2, sq=1, h=2 * group, hk=2, d=128, dtype="bf16", capacity=3000,
             lens=[2999, 1234], new_k=1, causal=True)


@pytest.mark.parametrize("sq", [4, 16, 33, 128])
def test_speculative_rows(compiled, sq):
    """Several new rows per step (more than one 16-row tile once packed): causal over the appended keys."""
    run_case(np.random.default_rng(sq), b=2, sq=sq, h=8, hk=2, d=128, dtype="fp16", capacity=2048,
             lens=[1500, 77], new_k=sq, causal=True, page_size=64)


def test_long_cache_many_splits(compiled):
    """64k keys, batch 1: the heuristic splits the keys across the GPU; the combine restores the result."""
    run_case(np.random.default_rng(5), b=1, sq=1, h=32, hk=8, d=128, dtype="bf16", capacity=65536,
             lens=[65536 - 1], new_k=1)


def test_append_with_batch_idx_leaves_other_rows(compiled):
    run_case(np.random.default_rng(11), b=3, sq=2, h=4, hk=4, d=64, dtype="bf16", capacity=300,
             lens=[10, 250, 0], new_k=2, batch_idx=True, causal=True)


def test_known_wrong_output_is_rejected():
    """The checker itself must fail a result that ignores the appended keys."""
    import cupy
    import cuflash
    rng = np.random.default_rng(0)
    dt = DTYPES["bf16"]
    q = randn(rng, (1, 1, 4, 64), dt)
    kc, vc = randn(rng, (1, 64, 2, 64), dt), randn(rng, (1, 64, 2, 64), dt)
    kn, vn = randn(rng, (1, 1, 2, 64), dt), randn(rng, (1, 1, 2, 64), dt)
    wrong = cuflash.attention_with_kvcache(cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc), cache_seqlens=20)
    ref = reference.attention_with_kvcache(q, kc.copy(), vc.copy(), k=kn, v=vn, cache_seqlens=20)
    naive = naive_lowp(q, np.concatenate([kc[:, :20], kn], axis=1), np.concatenate([vc[:, :20], vn], axis=1))
    with pytest.raises(AssertionError):
        assert_close_to_reference(wrong.get(), ref, naive)


def test_host_index_arrays_are_refused():
    import cupy
    import cuflash
    q = cupy.zeros((1, 1, 2, 64), dtype=np.float16)
    kc = cupy.zeros((1, 32, 2, 64), dtype=np.float16)
    with pytest.raises((TypeError, ValueError), match="cache_seqlens"):  # "on different devices (0 and host)"
        cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=np.array([3], dtype=np.int32))


@pytest.mark.parametrize("stages", [3, 6])
@pytest.mark.parametrize("page_size", [None, 64, 128])
def test_garbage_past_the_length_is_ignored(configure, compiled, decode_path, stages, page_size):
    """Cache rows past each row's length hold NaN: they must not reach the output (the cp.async kernel zero-fills
    them; the TMA kernel copies them and zeroes the tail block's V rows in shared memory). Both TMA rings."""
    import cupy
    import cuflash
    from cuflash.ops import decode
    if decode_path == "cp.async" and stages == 6:
        pytest.skip("the ring depth is the TMA kernel's")
    configure(decode_tma_stages=stages)
    decode._calls.clear()
    decode.plan_decode.cache_clear()
    rng = np.random.default_rng(stages)
    dt = DTYPES["bf16"]
    b, capacity, hk, h, d = 3, 640, 2, 8, 128
    lens = np.array([640 - 37, 1, 300], dtype=np.int32)
    kc, vc, layout = make_cache(rng, b=b, capacity=capacity, hk=hk, d=d, dt=dt, page_size=page_size)
    for i in range(b):  # NaN everywhere past the length, in the cache rows or pages the row reads
        pos = np.arange(int(lens[i]), capacity)
        if page_size is None:
            kc[i, pos], vc[i, pos] = np.nan, np.nan
        else:
            pages = layout["block_table"][i, pos // page_size]
            kc[pages, pos % page_size], vc[pages, pos % page_size] = np.nan, np.nan
    q = randn(rng, (b, 1, h, d), dt)
    for splits in (1, 3):
        out = cuflash.attention_with_kvcache(cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc),
                                             cache_seqlens=cupy.asarray(lens), num_splits=splits,
                                             block_table=None if page_size is None else
                                             cupy.asarray(layout["block_table"])).get()
        ref = reference.attention_with_kvcache(q, kc.copy(), vc.copy(), cache_seqlens=lens, **layout)
        assert np.isfinite(out.astype(np.float32)).all(), (stages, page_size, splits)
        assert_close_to_reference(out, ref, ref, floor=2e-2, context=f"stages={stages} page={page_size}")


# --------------------------------------------------------------------------------------------
# Bounds: values read from device memory never take a call outside a row's own cache
# --------------------------------------------------------------------------------------------

def _bounds_call(q, kc, vc, kn, vn, **layout):
    import cupy
    import cuflash
    dev = {n: None if x is None else cupy.asarray(x) for n, x in layout.items()}
    kc_d, vc_d = cupy.asarray(kc), cupy.asarray(vc)
    out, lse = cuflash.attention_with_kvcache(cupy.asarray(q), kc_d, vc_d, k=cupy.asarray(kn), v=cupy.asarray(vn),
                                              return_lse=True, **dev)
    return cupy.asnumpy(out), cupy.asnumpy(lse), cupy.asnumpy(kc_d), cupy.asnumpy(vc_d)


def _assert_rows(out, lse, q, rows):
    """Row b of out/lse is attention of q[b] over the dense keys and values rows[b] = (K, V), (L, hk, d)."""
    for b, (keys, vals) in enumerate(rows):
        args = (q[b:b + 1], keys[None], vals[None])
        ref, ref_lse = reference.attention(*args, return_lse=True)
        assert_close_to_reference(out[b:b + 1], ref, naive_lowp(*args), context=f"row {b}")
        assert_lse_close(lse[b:b + 1], ref_lse, context=f"row {b}")


def _assert_same_bits(got, want, what):
    bad = np.argwhere(got.view(np.uint16) != want.view(np.uint16))
    assert bad.size == 0, f"{what}: {len(bad)} elements changed, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("num_splits", [1, 2])
def test_seqlens_past_the_block_table_write_and_read_only_the_rows_pages(compiled, num_splits):
    """Four pages of 16 rows, block_table [[0, 1], [2, 3]], cache_seqlens [40, 10], one new token each: row 0's
    capacity is 32, so its new key (position 40, slot 2 of a 2-slot entry) is dropped and it attends to its 32 keys;
    row 1 appends at position 10 of its first page (page 2) as usual. A fifth page, outside the pool passed to the
    call, and every other row of every page, keep their bytes."""
    import cupy
    import cuflash
    rng = np.random.default_rng(40)
    dt, hk, h, d = DTYPES["bf16"], 2, 4, 64
    pool_k, pool_v = randn(rng, (5, 16, hk, d), dt), randn(rng, (5, 16, hk, d), dt)
    q, kn, vn = randn(rng, (2, 1, h, d), dt), randn(rng, (2, 1, hk, d), dt), randn(rng, (2, 1, hk, d), dt)
    table = np.array([[0, 1], [2, 3]], np.int32)
    k_all, v_all = cupy.asarray(pool_k), cupy.asarray(pool_v)
    out, lse = cuflash.attention_with_kvcache(cupy.asarray(q), k_all[:4], v_all[:4], k=cupy.asarray(kn),
                                              v=cupy.asarray(vn), cache_seqlens=cupy.asarray([40, 10], np.int32),
                                              block_table=cupy.asarray(table), num_splits=num_splits, return_lse=True)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    want_k[2, 10], want_v[2, 10] = kn[1, 0], vn[1, 0]
    _assert_same_bits(cupy.asnumpy(k_all), want_k, "k pool")
    _assert_same_bits(cupy.asnumpy(v_all), want_v, "v pool")
    _assert_rows(cupy.asnumpy(out), cupy.asnumpy(lse), q, [
        (np.concatenate([pool_k[0], pool_k[1]]), np.concatenate([pool_v[0], pool_v[1]])),  # its 32 keys
        (want_k[2, :11], want_v[2, :11])])                                                 # 10 cached + the new one


def test_page_and_cache_row_indices_outside_the_cache_touch_nothing(compiled):
    """A block-table entry naming no page of the pool (7 of 4 pages, -1) reads zeros there and writes nothing;
    cache_batch_idx outside the cache's rows, or a negative cache_seqlens, gives a row with no keys (out 0,
    lse -inf) that appends nothing. The caches keep their bytes everywhere else."""
    rng = np.random.default_rng(41)
    dt, hk, h, d = DTYPES["fp16"], 1, 2, 64
    kc, vc = randn(rng, (4, 16, hk, d), dt), randn(rng, (4, 16, hk, d), dt)
    q, kn, vn = randn(rng, (3, 1, h, d), dt), randn(rng, (3, 1, hk, d), dt), randn(rng, (3, 1, hk, d), dt)
    table = np.array([[0, 7], [1, -1], [2, 3]], np.int32)
    lens = np.array([20, 5, -3], np.int32)  # row 0 appends into page 7 (dropped); row 2 has a negative length
    out, lse, k_after, v_after = _bounds_call(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table)
    want_k, want_v = kc.copy(), vc.copy()
    want_k[1, 5], want_v[1, 5] = kn[1, 0], vn[1, 0]  # row 1's append lands in its first page
    _assert_same_bits(k_after, want_k, "k pool")
    _assert_same_bits(v_after, want_v, "v pool")
    zeros = np.zeros((5, hk, d), dt)  # row 0: page 0's 16 keys, then 5 positions of the missing page, read as 0
    _assert_rows(out[:2], lse[:2], q, [(np.concatenate([kc[0], zeros]), np.concatenate([vc[0], zeros])),
                                       (want_k[1, :6], want_v[1, :6])])
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()

    kc2, vc2 = randn(rng, (2, 32, hk, d), dt), randn(rng, (2, 32, hk, d), dt)
    idx = np.array([1, 2, -1], np.int32)  # rows 1 and 2 name no cache row
    out, lse, k_after, v_after = _bounds_call(q, kc2, vc2, kn, vn, cache_seqlens=np.array([4, 4, 4], np.int32),
                                              cache_batch_idx=idx)
    want_k, want_v = kc2.copy(), vc2.copy()
    want_k[1, 4], want_v[1, 4] = kn[0, 0], vn[0, 0]
    _assert_same_bits(k_after, want_k, "k cache")
    _assert_same_bits(v_after, want_v, "v cache")
    _assert_rows(out[:1], lse[:1], q, [(want_k[1, :5], want_v[1, :5])])
    assert (out[1:] == 0).all() and np.isneginf(lse[1:]).all()


@pytest.mark.parametrize("rotary", ["interleaved", "half"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_embedding_and_leftpad(compiled, rotary, paged, causal):
    """Rotary embedding of the appended keys (bitwise the reference's: the cache is compared exactly) and of the
    queries, interleaved or half split, part or all of the head dim, with GQA, splits, and cache_leftpad (on a
    contiguous and a paged cache; the TMA kernel leaves leftpad calls to the cp.async one)."""
    rng = np.random.default_rng(7 + 2 * paged + causal)
    run_case(rng, b=3, sq=2, h=8, hk=2, d=128, dtype="bf16", capacity=320, lens=[100, 0, 250], new_k=2,
             page_size=64 if paged else None, causal=causal, rotary=rotary, rotary_dim=64, leftpad=True,
             num_splits=3)
    run_case(rng, b=2, sq=1, h=4, hk=4, d=64, dtype="fp16", capacity=200, lens=[37, 199], new_k=1,
             page_size=16 if paged else None, causal=causal, rotary=rotary, rotary_dim=64)
    run_case(rng, b=2, sq=3, h=4, hk=1, d=96, dtype="bf16", capacity=128, lens=[5, 60], new_k=3,
             window_size=(16, 0), rotary=rotary, rotary_dim=32, leftpad=True)

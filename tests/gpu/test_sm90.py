"""Hopper primitives (cuda_src/sm90.cuh) on the GPU: TMA tile loads with the 128-byte swizzle, mbarrier
transaction counting and wgmma from shared-memory descriptors, checked as a small GEMM against NumPy; then the
Hopper forward (each variant) directly and as the planner's choice inside cuflash.attention."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash.ops import forward, forward_sm90
from tests.gpu.helpers import DTYPES, randn
from tests.sm90_selftest import PARAMS_DTYPE, SelftestSpec
from tests.fixtures import configure  # noqa: F401  (a fixture)

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


@pytest.mark.parametrize("variant", forward_sm90.VARIANTS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("sq,sk,causal,window,h,hk", [
    (128, 128, False, (-1, -1), 2, 2), (1000, 1000, False, (-1, -1), 4, 2), (17, 300, True, (-1, -1), 2, 1),
    (300, 17, True, (-1, -1), 2, 2), (513, 777, False, (64, 8), 3, 1), (1, 1, True, (-1, -1), 1, 1)])
def test_fwd_sm90_matches_reference(d, dtype, sq, sk, causal, window, h, hk, variant):
    """Each variant of the Hopper forward (cuflash.ops.forward_sm90, fwd_sm90.cu) under the suite's accuracy rule."""
    import cupy
    from cuflash import reference
    from cuflash.ops import forward_sm90
    from tests.gpu.helpers import assert_close_to_reference, assert_lse_close, naive_lowp
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    rng = np.random.default_rng(sq * 7 + sk)
    dt = DTYPES[dtype]
    q = cupy.asarray(randn(rng, (2, sq, h, d), dt))
    k = cupy.asarray(randn(rng, (2, sk, hk, d), dt))
    v = cupy.asarray(randn(rng, (2, sk, hk, d), dt))
    out, lse = forward_sm90.attention_sm90(q, k, v, causal=causal, window_size=window, return_lse=True, variant=variant)
    opts = dict(causal=causal, window_size=window)
    ref, ref_lse = reference.attention(q.get(), k.get(), v.get(), return_lse=True, **opts)
    naive = naive_lowp(q.get(), k.get(), v.get(), **opts)
    ctx = f"{variant} sq={sq} sk={sk} d={d} {dtype} {opts} h={h} hk={hk}"
    assert_close_to_reference(out.get(), ref, naive, context=ctx)
    assert_lse_close(lse.get(), ref_lse, context=ctx)


@pytest.mark.parametrize("variant", forward_sm90.VARIANTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk,window", [
    (512, 512, (-1, 0)), (200, 328, (-1, 0)), (392, 264, (-1, 0)), (300, 300, (-1, 16)), (136, 392, (-1, 48)),
    (256, 256, (-1, 8))])
def test_fwd_sm90_band_edge_on_16_column_boundaries(d, sq, sk, window, variant):
    """Bands with a right edge only, whose edge meets a warp's rows on a 16-column boundary of a key block (diag +
    right a multiple of 16): Mask::apply_diagonal's per-warp shapes, beside blocks cut by seqlen_k and an edge off
    the boundary (right = 8), which keep the general mask."""
    import cupy
    from cuflash import reference
    from cuflash.ops import forward_sm90
    from tests.gpu.helpers import assert_close_to_reference, assert_lse_close, naive_lowp
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    rng = np.random.default_rng(sq * 11 + sk + window[1])
    dt = DTYPES["bf16"]
    q, k, v = (cupy.asarray(randn(rng, (2, s, 2, d), dt)) for s in (sq, sk, sk))
    out, lse = forward_sm90.attention_sm90(q, k, v, window_size=window, return_lse=True, variant=variant)
    ref, ref_lse = reference.attention(q.get(), k.get(), v.get(), return_lse=True, window_size=window)
    naive = naive_lowp(q.get(), k.get(), v.get(), window_size=window)
    ctx = f"{variant} sq={sq} sk={sk} d={d} window={window}"
    assert_close_to_reference(out.get(), ref, naive, context=ctx)
    assert_lse_close(lse.get(), ref_lse, context=ctx)


def _check_variant(q, k, v, variant, context, **opts):
    """forward_sm90.attention_sm90 in `variant` against the float64 reference: out and lse under the suite's rules."""
    from cuflash import reference
    from cuflash.ops import forward_sm90
    from tests.gpu.helpers import assert_close_to_reference, assert_lse_close, naive_lowp
    out, lse = forward_sm90.attention_sm90(q, k, v, return_lse=True, variant=variant, **opts)
    ref, ref_lse = reference.attention(q.get(), k.get(), v.get(), return_lse=True, **opts)
    ctx = f"{variant} {context} {opts}"
    assert_close_to_reference(out.get(), ref, naive_lowp(q.get(), k.get(), v.get(), **opts), context=ctx)
    assert_lse_close(lse.get(), ref_lse, context=ctx)


@pytest.mark.parametrize("variant", forward_sm90.VARIANTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk,causal,window", [
    (512, 512, True, (-1, -1)), (448, 512, True, (-1, -1)), (130, 320, False, (-1, -1)), (300, 300, False, (100, 0)),
    (1, 200, False, (-1, -1))])
def test_fwd_sm90_first_block_left_half(d, sq, sk, causal, window, variant):
    """Tiles whose first key block has a right half that no row of a warpgroup sees (fwd_sm90.cu left_half: the
    softmax runs over the left half only): the upper warpgroup on the causal diagonal of equal lengths; both
    warpgroups where the diagonal is 64 keys right (448 x 512); keys ending 64 into the last block (320, 200); a
    window's left edge beside it (300 x 300). (Allocations are poisoned with NaN: tests/gpu/conftest.py.)"""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    rng = np.random.default_rng(sq * 13 + sk + d)
    dt = DTYPES["bf16"]
    q = cupy.asarray(randn(rng, (2, sq, 4, d), dt))
    k, v = (cupy.asarray(randn(rng, (2, sk, 2, d), dt)) for _ in range(2))
    _check_variant(q, k, v, variant, f"sq={sq} sk={sk} d={d}", causal=causal, window_size=window)


# --------------------------------------------------------------------------------------------------------------
# cuflash.attention with the planner sending eligible calls to the Hopper kernel (forward.sm90_variant)
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture
def sm90_planned(configure, monkeypatch):
    """use(variant): the planner chooses the Hopper kernel, in this variant, for every call it covers; the launch
    caches are emptied before and after, so no other test inherits a Hopper launch."""
    import sys
    import cupy
    from cuflash.ops import forward
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")

    def clear():
        forward._attention_calls.clear()
        forward._varlen_calls.clear()
        forward._launches.clear()
        if "cuflash.torch" in sys.modules:
            sys.modules["cuflash.torch"]._plans.clear()

    def use(variant):
        configure(sm90=True)
        monkeypatch.setattr(forward, "SM90_DEFAULT_VARIANTS", {64: variant, 128: variant, 256: variant})
        monkeypatch.setattr(forward, "SM90_SHORT_VARIANTS", {})  # every length
        clear()

    yield use
    clear()


def _routed_to_sm90() -> bool:
    """The launch caches hold a Hopper launch (attention() and attention_varlen() keep (call, ...) tuples, launch the
    calls)."""
    from cuflash.ops import forward, forward_sm90
    calls = [call for cache in (forward._attention_calls, forward._varlen_calls) for call, *_ in cache.values()]
    calls += forward._launches.values()
    return any(isinstance(call, forward_sm90.ForwardCall) for call in calls)


@st.composite
def sm90_cases(draw):
    """test_forward's cases (every option) at head dims the Hopper kernel runs: its compiled 64, 128 and 256, and
    multiples of 8 between them (the next compiled one's kernel, its columns past the head dim zero-filled)."""
    from tests.gpu.test_forward import forward_cases
    return dict(draw(forward_cases()), d=draw(st.sampled_from([40, 64, 96, 128, 200, 256])),
                return_lse=draw(st.booleans()))


@pytest.mark.parametrize("variant", forward_sm90.VARIANTS)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=sm90_cases(), seed=st.integers(0, 2**31 - 1))
def test_attention_planned_on_sm90_matches_reference(sm90_planned, variant, case, seed):
    """The public forward on the Hopper path (the planner's choice) under the suite's rule, hypothesis shapes."""
    from tests.gpu.test_forward import run_case
    sm90_planned(variant)
    run_case(np.random.default_rng(seed), **case)
    assert _routed_to_sm90()


@pytest.mark.parametrize("variant", forward_sm90.VARIANTS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_attention_planned_on_sm90_options_and_fallback(sm90_planned, variant, dtype):
    """Strided q/k/v views of one packed qkv tensor take the Hopper path without copies; so do softcap and ALiBi
    (each alone and all options at once); so does a head dim between the compiled ones (d 96 on the d 128 kernel),
    while one below plan.HOPPER_MIN_HEADDIM stays on the portable kernel (and is still right)."""
    from cuflash.ops import forward, forward_sm90
    from tests.gpu.test_forward import run_case
    sm90_planned(variant)
    run_case(np.random.default_rng(3), b=2, sq=150, sk=150, h=4, hk=4, d=64, dtype=dtype, causal=True, views=True)
    assert _routed_to_sm90()
    base = dict(b=2, sq=200, sk=333, h=4, hk=2, d=128, dtype=dtype)
    for option, sm90 in ((dict(softcap=10.0), True), (dict(alibi="h"), True), (dict(alibi="bh"), True),
                         (dict(causal=True, window_size=(48, 3), softcap=20.0, alibi="bh"), True),
                         (dict(d=96), True), (dict(d=32), False)):
        forward._attention_calls.clear()
        run_case(np.random.default_rng(5), **{**base, **option})
        assert _routed_to_sm90() == sm90, option


@pytest.mark.parametrize("variant", forward_sm90.VARIANTS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_attention_varlen_planned_on_sm90_matches_reference(sm90_planned, variant, data, seed):
    """cuflash.attention_varlen on the Hopper path (3-D tensor maps over the packed tokens; CTAs past a short
    sequence leave; rows of the next sequence in a box are masked): test_varlen's cases at d 64, 128, 256."""
    from tests.gpu.test_varlen import run_forward, varlen_cases
    sm90_planned(variant)
    run_forward(np.random.default_rng(seed), **data.draw(varlen_cases([64, 128, 256])))
    assert _routed_to_sm90()


# --------------------------------------------------------------------------------------------------------------
# The persistent variants with more tiles than SMs: each CTA walks several tiles, so the ring position and Q's
# barrier phases carry on from tile to tile (the cases above fit one tile per CTA).
# --------------------------------------------------------------------------------------------------------------

PERSISTENT = [v for v in forward_sm90.VARIANTS if forward_sm90.variant_options(v, 64).get("persistent")]


@pytest.mark.parametrize("variant", PERSISTENT)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,chunk", [(False, (-1, -1), 0), (True, (-1, -1), 0), (False, (200, 0), 0),
                                                 (True, (-1, -1), 5), (False, (200, 0), 7)])
def test_persistent_walks_several_tiles_per_cta(configure, variant, d, causal, window, chunk):
    """The default walk (one chunk of all 72 pairs under a band here) and chunks forced smaller than the pairs, the
    last one partial (5: 14 chunks and one of 2; 7: 10 and one of 2)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    configure(sm90_walk_chunk=chunk)
    rng = np.random.default_rng(d + 3 * causal)
    b, sq, sk, h, hk = 3, 700, 900, 24, 6  # 4-6 query blocks x 72 heads and sequences: 288-432 tiles
    q = cupy.asarray(randn(rng, (b, sq, h, d), DTYPES["bf16"]))
    k = cupy.asarray(randn(rng, (b, sk, hk, d), DTYPES["bf16"]))
    v = cupy.asarray(randn(rng, (b, sk, hk, d), DTYPES["bf16"]))
    _check_variant(q, k, v, variant, f"d={d} chunk={chunk}", causal=causal, window_size=window)


@pytest.mark.parametrize("variant", PERSISTENT)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_varlen_with_empty_tiles(sm90_planned, variant, causal):
    """40 packed sequences of lengths 0-600 (most query blocks of the longest's grid are past a sequence's end and
    skipped by both roles), softcap and ALiBi on one of the two cases."""
    from tests.gpu.test_varlen import run_forward
    sm90_planned(variant)
    rng = np.random.default_rng(11 + causal)
    lens = [int(x) for x in rng.integers(0, 600, size=40)]
    lens[7] = 600
    extra = dict(softcap=5.0, alibi="bh") if causal else {}
    run_forward(rng, lens_q=lens, lens_k=lens, h=8, hk=2, d=64, dtype="fp16", causal=causal, **extra)
    run_forward(rng, lens_q=lens, lens_k=[n + 50 for n in lens], h=8, hk=8, d=128, dtype="bf16", causal=causal)
    assert _routed_to_sm90()


SPLIT = [v for v in PERSISTENT if forward_sm90.variant_spec(v, "bf16", 64, False, False).split]


@pytest.mark.parametrize("o_tma", [0, 1])
@pytest.mark.parametrize("sq,sk,causal,window", [
    (1024, 1024, False, (-1, -1)), (1000, 1000, True, (-1, -1)), (577, 900, False, (-1, -1)),
    (1024, 200, False, (-1, -1)), (1016, 100, True, (-1, -1)), (1000, 1000, False, (300, 0)),
    (1024, 1024, False, (20, 20))])
@pytest.mark.parametrize("variant", SPLIT)
def test_split_tail_tiles(configure, variant, sq, sk, causal, window, o_tma):
    """Tiles whose rows all lie in their first 64 (1024 = 5 x 192 + 64, 1000, 577 = 3 x 192 + 1 queries), which the
    three-warpgroup persistent kernel splits by key blocks among its warpgroups and merges in warpgroup 0
    (fwd_sm90.cu SPLIT), several per CTA (72 pairs x 4-6 query blocks, the walk rotated): with 1 and 2 key blocks
    (100, 200 keys: warpgroups without a block of their own), under a window where a warpgroup's blocks can all be
    masked for some rows. With O by TMA stores in the table (o_tma=1) too: the split variant writes O from
    registers whatever it says (forward_sm90.forward_call; by TMA stores fwd_sm90.cu split_tile would not split)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma and TMA need compute capability 9.0")
    configure(sm90_o_tma=o_tma)
    rng = np.random.default_rng(sq + sk + o_tma)
    b, h, hk = 3, 24, 6
    q = cupy.asarray(randn(rng, (b, sq, h, 64), DTYPES["bf16"]))
    k = cupy.asarray(randn(rng, (b, sk, hk, 64), DTYPES["bf16"]))
    v = cupy.asarray(randn(rng, (b, sk, hk, 64), DTYPES["bf16"]))
    _check_variant(q, k, v, variant, f"o_tma={o_tma}", causal=causal, window_size=window)


@pytest.mark.parametrize("o_tma", [0, 1])
@pytest.mark.parametrize("variant", ["pingpong_n128", "ws3_n128"] + PERSISTENT)
def test_epilogue_through_shared_memory_or_registers(configure, sm90_planned, variant, o_tma):
    """The sm90_o_tma setting: O leaves by TMA stores from a staging tile (Q's, or the persistent kernel's own at d 64),
    or from registers, with the same results: tiles that end past a padded sequence (the map clips them) or a packed
    one (those rows go from registers), query blocks that see no key (where O is staged in Q's tile, a persistent
    CTA's Q slot may hold the next tile's Q then: registers), several tiles per CTA. With 600 more queries than keys
    under the causal mask the first query blocks' key range is empty or reversed (n_max < n_min), and the persistent
    kernels' snake walk deals some CTAs such a tile before tiles with keys (where the producer, counting reversed
    ranges as blocks, once ran out of step with the consumers: an illegal instruction)."""
    import cupy
    from cuflash import reference
    from cuflash.ops import forward_sm90
    from tests.gpu.helpers import assert_close_to_reference, assert_lse_close, naive_lowp
    from tests.gpu.test_varlen import run_forward
    configure(sm90_o_tma=o_tma)
    rng = np.random.default_rng(7 + o_tma)
    for d in (64, 128):
        b, sq, sk, h, hk = 2, 900, 300, 24, 6  # causal, bottom-right: query rows 0-599 see no key
        q = cupy.asarray(randn(rng, (b, sq, h, d), DTYPES["bf16"]))
        k = cupy.asarray(randn(rng, (b, sk, hk, d), DTYPES["bf16"]))
        v = cupy.asarray(randn(rng, (b, sk, hk, d), DTYPES["bf16"]))
        for opts in (dict(causal=True), dict(causal=False)):
            out, lse = forward_sm90.attention_sm90(q, k, v, return_lse=True, variant=variant, **opts)
            ref, ref_lse = reference.attention(q.get(), k.get(), v.get(), return_lse=True, **opts)
            ctx = f"{variant} o_tma={o_tma} d={d} {opts}"
            assert_close_to_reference(out.get(), ref, naive_lowp(q.get(), k.get(), v.get(), **opts), context=ctx)
            assert_lse_close(lse.get(), ref_lse, context=ctx)
    sm90_planned(variant)
    lens = [int(x) for x in rng.integers(1, 500, size=12)] + [64, 128, 192, 0]
    run_forward(rng, lens_q=lens, lens_k=[n + 30 for n in lens], h=8, hk=2, d=128, dtype="bf16", causal=True)
    run_forward(rng, lens_q=lens, lens_k=lens, h=8, hk=8, d=64, dtype="fp16")
    assert _routed_to_sm90()

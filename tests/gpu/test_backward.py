"""cuflash.attention_backward on the GPU against the float64 reference, shapes drawn by hypothesis."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference, settings as cuflash_settings
from cuflash.ops import backward, backward_sm90
from tests.gpu.helpers import DTYPES, assert_close_to_reference, naive_lowp_backward, randn
from tests.fixtures import configure  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu

LENGTHS = [1, 17, 63, 64, 65, 113, 128, 129, 200, 333]
HEADDIMS = [8, 32, 40, 64, 72, 96, 128]
WINDOWS = [(-1, -1), (16, 0), (64, 8), (0, 0), (-1, 40), (5, 5)]


def make_case(rng, *, b, sq, sk, h, hk, d, dtype, alibi=None):
    import cupy
    dt = DTYPES[dtype]
    q = cupy.asarray(randn(rng, (b, sq, h, d), dt))
    k = cupy.asarray(randn(rng, (b, sk, hk, d), dt))
    v = cupy.asarray(randn(rng, (b, sk, hk, d), dt))
    dout = cupy.asarray(randn(rng, (b, sq, h, d), dt))
    slopes = None
    if alibi is not None:
        slopes = cupy.asarray(rng.uniform(0.0, 0.5, (h,) if alibi == "h" else (b, h)).astype(np.float32))
    return q, k, v, dout, slopes


def run_case(rng, *, b, sq, sk, h, hk, d, dtype, causal=False, window_size=(-1, -1), softcap=0.0, alibi=None,
             softmax_scale=None, deterministic=False):
    q, k, v, dout, slopes = make_case(rng, b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, dtype=dtype, alibi=alibi)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    ctx = f"b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} {dtype} {opts} alibi={alibi} det={deterministic}"
    return check_case(q, k, v, dout, slopes, opts, deterministic, ctx)


def check_case(q, k, v, dout, slopes, opts, deterministic, ctx):
    """The backward of these inputs (forward run first for out and lse) against the reference."""
    import cuflash
    out, lse = cuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **opts)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, alibi_slopes=slopes, deterministic=deterministic,
                                       **opts)
    host = [x.get() for x in (q, k, v, dout)]
    sh = None if slopes is None else slopes.get()
    _, ref_lse = reference.attention(*host[:3], alibi_slopes=sh, return_lse=True, **opts)
    # The exact gradients given the output the kernel was handed (rounded to the dtype): D = rowsum(dO * out) takes
    # it as it is, and at d = 192 in fp16 that rounding alone moved one dq element by 8e-3, past the bound.
    ref = reference.attention_backward(host[3], *host[:3], out.get().astype(np.float32), ref_lse, alibi_slopes=sh,
                                       **opts)
    naive = naive_lowp_backward(host[3], *host[:3], alibi_slopes=sh, **opts)
    for name, got, want, lowp, like in zip(("dq", "dk", "dv"), grads, ref, naive, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype, (name, ctx)
        assert_close_to_reference(got.get(), want, lowp, what=name, context=ctx)
    return grads


def assert_bitwise_repeatable(seed, *, runs, b, sq, sk, h, hk, d, causal=True):
    """Deterministic backward (causal by default), called `runs` more times after a first: every call gives the
    same bits."""
    import cupy
    import cuflash
    q, k, v, dout, _ = make_case(np.random.default_rng(seed), b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, dtype="bf16")
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    first = [g.view(np.uint16).copy() for g in cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                          deterministic=True)]
    for _ in range(runs):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for a, g in zip(first, again):
            assert bool(cupy.array_equal(a, g.view(np.uint16))), "deterministic mode changed bits between runs"


@st.composite
def backward_cases(draw):
    hk = draw(st.sampled_from([1, 2]))
    return dict(
        dtype=draw(st.sampled_from(["fp16", "bf16"])),
        d=draw(st.sampled_from(HEADDIMS)),
        sq=draw(st.sampled_from(LENGTHS) | st.integers(1, 200)),
        sk=draw(st.sampled_from(LENGTHS) | st.integers(1, 200)),
        b=draw(st.integers(1, 2)),
        hk=hk,
        h=hk * draw(st.sampled_from([1, 2, 3])),
        causal=draw(st.booleans()),
        window_size=draw(st.sampled_from(WINDOWS[:1] * 3 + WINDOWS)),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0])),
        alibi=draw(st.sampled_from([None, None, None, "h", "bh"])),
        softmax_scale=draw(st.sampled_from([None, None, 0.3])),
        deterministic=draw(st.booleans()),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=backward_cases(), seed=st.integers(0, 2**31 - 1))
def test_backward_matches_reference(compiled, case, seed):
    run_case(np.random.default_rng(seed), **case)


@pytest.mark.parametrize("option", [dict(causal=True), dict(window_size=(40, 7)), dict(softcap=8.0), dict(alibi="bh"),
                                    dict(causal=True, softcap=10.0, alibi="h", window_size=(50, 0))])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_each_option(compiled, option, dtype):
    run_case(np.random.default_rng(3), b=2, sq=150, sk=277, h=4, hk=2, d=128, dtype=dtype, **option)


def test_longer_sequences(compiled):
    run_case(np.random.default_rng(8), b=1, sq=1000, sk=1031, h=2, hk=1, d=64, dtype="bf16", causal=True)


def test_empty_rows_get_zero_gradients(compiled):
    import cupy
    import cuflash
    rng = np.random.default_rng(4)
    q, k, v, dout, _ = make_case(rng, b=1, sq=90, sk=20, h=2, hk=1, d=64, dtype="fp16")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for g in (dq, dk, dv):
        assert not bool(cupy.isnan(g.astype(np.float32)).any())
    assert bool((dq[:, :70] == 0).all()), "rows 0..69 see no key: their dq must be 0"


@pytest.mark.parametrize("hk", [4, 1])
def test_deterministic_is_bitwise_repeatable(compiled, hk):
    assert_bitwise_repeatable(5, runs=4, b=2, sq=300, sk=520, h=4, hk=hk, d=128)


def test_finite_difference_spot_check(compiled):
    """<dq, u> matches the central difference of the float64 forward along a random direction u."""
    import cuflash
    rng = np.random.default_rng(6)
    q, k, v, dout, _ = make_case(rng, b=1, sq=40, sk=50, h=2, hk=1, d=32, dtype="fp16")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    qh, kh, vh, doh = (x.get().astype(np.float64) for x in (q, k, v, dout))
    for grad, which in ((dq, 0), (dk, 1), (dv, 2)):
        u = rng.standard_normal(grad.shape)
        eps = 1e-3
        args = [qh, kh, vh]

        def loss(sign):
            moved = list(args)
            moved[which] = args[which] + sign * eps * u
            return float((reference.attention(*moved, causal=True) * doh).sum())

        numeric = (loss(+1) - loss(-1)) / (2 * eps)
        analytic = float((grad.get().astype(np.float64) * u).sum())
        assert abs(analytic - numeric) <= 1e-2 * max(1.0, abs(numeric)), (which, analytic, numeric)


def test_large_head_dims_are_refused_before_launch(configure, compiled):
    """Without the wide backward (the bwd_wide setting off, or not sm_90a) head dims above 128 are refused."""
    import cuflash
    from cuflash.ops import backward
    configure(bwd_wide=False, bwd_sm90=False)
    backward._launches.clear()
    rng = np.random.default_rng(7)
    q, k, v, dout, _ = make_case(rng, b=1, sq=8, sk=8, h=1, hk=1, d=192, dtype="bf16")
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match="head dim 192"):
        cuflash.attention_backward(dout, q, k, v, out, lse)


# --------------------------------------------------------------------------------------------------------------
# Double-buffered Q/dO (the bwd_qbuf setting, on by default): the same checks with it chosen; the portable
# kernel with the Hopper one off (settings.override drops the cached launches on the way in and out)
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture
def double_buffered():
    """The planner picks two Q/dO buffers where the table has them (on the portable kernel: the Hopper one off)."""
    from cuflash.ops import backward
    with cuflash_settings.override(bwd_qbuf=True, bwd_sm90=False):
        assert backward.bwd_config(64).q_buffers == 2 and backward.bwd_config(128).q_buffers == 1
        yield


@pytest.fixture
def portable_backward():
    """The portable main kernel at every head dim (on sm_90a the planner picks the Hopper one at d 64 and 128)."""
    with cuflash_settings.override(bwd_sm90=False):
        yield


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=backward_cases(), d=st.sampled_from([64, 128]), seed=st.integers(0, 2**31 - 1))
def test_portable_backward_matches_reference(compiled, portable_backward, case, d, seed):
    run_case(np.random.default_rng(seed), **dict(case, d=d))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=backward_cases().filter(lambda c: c["d"] <= 96), seed=st.integers(0, 2**31 - 1))
def test_double_buffered_backward_matches_reference(compiled, double_buffered, case, seed):
    run_case(np.random.default_rng(seed), **case)


@pytest.mark.parametrize("option", [dict(causal=True), dict(window_size=(40, 7)), dict(softcap=8.0), dict(alibi="bh")])
def test_double_buffered_backward_options_and_gqa(compiled, double_buffered, option):
    """Several query heads per KV head (the next block crosses a head boundary) and several query blocks."""
    run_case(np.random.default_rng(9), b=2, sq=333, sk=200, h=6, hk=2, d=64, dtype="bf16", **option)
    run_case(np.random.default_rng(10), b=1, sq=130, sk=500, h=3, hk=1, d=96, dtype="fp16", deterministic=True,
             **option)


# --------------------------------------------------------------------------------------------------------------
# Head dims above 128 (backward.WIDE_CONFIG: 32 keys per CTA, compiled as 256; sm_90a only, on by default)
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture
def wide_backward():
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wide backward is offered on sm_90a only")
    with cuflash_settings.override(bwd_wide=True, bwd_sm90=False):  # (the Hopper kernel takes these head dims)
        yield


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=backward_cases(), d=st.sampled_from([136, 160, 192, 256]), seed=st.integers(0, 2**31 - 1))
def test_wide_backward_matches_reference(compiled, wide_backward, case, d, seed):
    run_case(np.random.default_rng(seed), **dict(case, d=d))


@pytest.mark.parametrize("hk", [4, 1])
def test_wide_backward_deterministic_is_bitwise_repeatable(compiled, wide_backward, hk):
    assert_bitwise_repeatable(6, runs=3, b=2, sq=200, sk=300, h=4, hk=hk, d=256)


# --------------------------------------------------------------------------------------------------------------
# The Hopper backward's main kernel (the bwd_sm90 setting: on by default; sm_90a, d 64/128/256, score mods too)
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(params=[64, 128], ids=["m64", "m128"])
def sm90_backward(configure, request):
    """The Hopper backward with 64 query rows per step, or 128 at d = 64 (backward_sm90.BLOCK_M_TABLE; score mods with
    dropout and d = 128 keep 64)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper backward needs compute capability 9.0")
    configure(bwd_sm90_block_m={64: request.param})
    with cuflash_settings.override(bwd_sm90=True):
        yield


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=backward_cases(), d=st.sampled_from([40, 56, 64, 72, 96, 128, 136, 200, 256]),
       seed=st.integers(0, 2**31 - 1))
def test_sm90_backward_matches_reference(compiled, sm90_backward, case, d, seed):
    """Every option, softcap and ALiBi on the score-mod kernels at every head dim. Head dims between the compiled
    ones and the one before run on the next one's kernel (40..56 on d 64's)."""
    run_case(np.random.default_rng(seed), **dict(case, d=d))


@pytest.mark.parametrize("hk", [4, 1])
@pytest.mark.parametrize("d", [48, 64, 96, 128, 200, 256])
def test_sm90_backward_several_blocks_and_repeatable(compiled, sm90_backward, hk, d):
    """Several 128-key blocks and 64-row query blocks, GQA, packed sequences with softcap; deterministic mode bitwise
    repeatable."""
    from tests.gpu.test_varlen import run_backward
    run_case(np.random.default_rng(12), b=2, sq=333, sk=300, h=4, hk=hk, d=d, dtype="bf16", causal=True)
    run_backward(np.random.default_rng(15), lens_q=[200, 1, 130], lens_k=[300, 70, 129], h=4, hk=hk, d=d,
                 dtype="fp16", causal=True, softcap=6.0)
    run_case(np.random.default_rng(13), b=1, sq=200, sk=700, h=4, hk=hk, d=d, dtype="fp16", window_size=(90, 30),
             deterministic=True)
    run_case(np.random.default_rng(14), b=2, sq=150, sk=260, h=4, hk=hk, d=d, dtype="bf16", causal=True, softcap=8.0,
             alibi="bh", deterministic=True)
    assert_bitwise_repeatable(6, runs=3, b=2, sq=200, sk=300, h=4, hk=hk, d=d)


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_deterministic_over_several_passes(configure, compiled, sm90_backward, slots, d):
    """Deterministic mode with a fixed slot count (bwd_sm90_det_slots), so that each slot takes several key blocks in
    its snake order (7 here: with 3 slots the last, odd pass leaves slots 0 and 1 without one), under causal, local and
    no masks, GQA and packed sequences: against the reference, and bitwise equal over repeated calls."""
    from cuflash.ops import backward
    configure(bwd_sm90_det_slots=slots)
    backward._launches.clear()
    try:
        run_deterministic_mix(d, (31, 32, 33, 34, 35), dict(b=1, sq=129, sk=850, h=2, hk=2))
    finally:
        backward._launches.clear()


def launch_sm90(problem, q, k, v, dout, out, lse, opts, **kw):
    """One `backward.launch` into NaN-filled gradients (kw: deterministic, workspace): the gradients and the
    parameters of its Hopper main kernel."""
    import cupy
    backward._launches.clear()
    grads = tuple(cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v))
    backward.launch(problem, dout, q, k, v, out, lse, *grads, alibi_slopes=None, **opts, **kw)
    (call,) = backward._launches.values()
    return grads, np.frombuffer(call.main.kernel_call.params(), backward.SM90_PARAMS_DTYPE)[0]


def run_deterministic_mix(d, seeds, plain):
    """Deterministic mode under causal (GQA), local and no masks (`plain`: the shape) and packed sequences against the
    reference, then bitwise equal over repeated calls; one seed each."""
    from tests.gpu.test_varlen import run_backward
    rngs = [np.random.default_rng(seed) for seed in seeds]
    run_case(rngs[0], b=2, sq=400, sk=850, h=4, hk=2, d=d, dtype="bf16", causal=True, deterministic=True)
    run_case(rngs[1], b=1, sq=700, sk=850, h=2, hk=1, d=d, dtype="fp16", window_size=(200, 60), deterministic=True)
    run_case(rngs[2], **plain, d=d, dtype="bf16", deterministic=True)
    run_backward(rngs[3], lens_q=[300, 0, 65], lens_k=[850, 17, 400], h=4, hk=2, d=d, dtype="bf16", causal=True,
                 deterministic=True)
    assert_bitwise_repeatable(seeds[4], runs=3, b=2, sq=300, sk=850, h=4, hk=2, d=d)


@pytest.mark.parametrize("d", [48, 64, 128, 200, 256])
def test_sm90_fixed_point_deterministic(configure, compiled, sm90_backward, d):
    """The bwd_sm90_det setting "fixed": dQ as int32 fixed point on the atomic grid (cuda_src/fixed_dq.cuh; not with the
    d = 64 kernel of 64 query rows, which keeps the slices), under causal, local and no masks, GQA, lengths off the
    tiles and packed sequences, softcap and ALiBi: against the reference and bitwise equal over repeated calls. Then
    rows of dO over five orders of magnitude, some all zero (their dq exactly 0), and one outlier in K (a bound 30x
    looser for every row)."""
    import cupy
    import cuflash
    from cuflash import checks
    from cuflash.ops import backward, backward_sm90
    configure(bwd_sm90_det="fixed")
    problem = checks.Problem(2, 400, 850, 4, 2, d, np.dtype(np.float16))
    kernel_d = backward_sm90.compiled_headdim(d)  # d 48 runs on d 64's kernel, of 64 or 128 rows (sm90_backward)
    tma_dq = backward_sm90.tma_dq(kernel_d, backward_sm90.block_m(kernel_d, False))
    assert backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132).fixed_point == tma_dq
    backward._launches.clear()
    try:
        run_deterministic_mix(d, (41, 42, 43, 45, 46), dict(b=3, sq=129, sk=333, h=3, hk=1))
        run_case(np.random.default_rng(44), b=1, sq=17, sk=1, h=2, hk=2, d=d, dtype="bf16", deterministic=True)
        run_case(np.random.default_rng(48), b=2, sq=150, sk=400, h=4, hk=2, d=d, dtype="fp16", causal=True,
                 softcap=8.0, alibi="bh", deterministic=True)  # the score-mod kernels' fixed point
        rng = np.random.default_rng(47)
        q, _, v, _, _ = make_case(rng, b=2, sq=300, sk=500, h=4, hk=2, d=d, dtype="bf16")
        host_do = randn(rng, (2, 300, 4, d), np.float32) * 10.0 ** rng.uniform(-3, 2, (2, 300, 4, 1))
        host_do[:, 5:12] = 0
        host_k = randn(rng, (2, 500, 2, d), np.float32)
        host_k[1, 3, 0, 5] = 120.0
        dout, k = (cupy.asarray(x.astype(DTYPES["bf16"])) for x in (host_do, host_k))
        opts = dict(causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None)
        dq = check_case(q, k, v, dout, None, opts, True, "rows of dO 1e-3..1e2, zero rows, a K outlier")[0]
        assert not bool(dq[:, 5:12].view(np.uint16).any()), "rows with dO = 0 must get dq = 0"
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)[0]
        assert bool(cupy.array_equal(dq.view(np.uint16), again.view(np.uint16)))
    finally:
        backward._launches.clear()


@pytest.mark.parametrize("d", [48, 64, 96, 128, 200, 256])
def test_sm90_ordered_deterministic(configure, compiled, sm90_backward, d):
    """The bwd_sm90_det setting "ordered": each query block's dQ added to by its key blocks in turn (BwdSm90::dq_turn;
    the dQ warp's kernels, so not d = 64 with 64 rows), in a workspace of 0xFF bytes (NaN accumulator, counters -1
    until the preprocess): causal with GQA, more queries than keys and far fewer, a window with a right edge, no
    mask with the walks started apart (partial last blocks, fewer query blocks than key blocks), against the
    reference and bitwise equal over repeated calls; packed sequences and score mods keep another mode."""
    import cupy
    import cuflash
    from cuflash import checks
    configure(bwd_sm90_det="ordered")
    kernel_d = backward_sm90.compiled_headdim(d)
    block_m = backward_sm90.block_m(kernel_d, False)
    applies = backward_sm90.tma_dq(kernel_d, block_m)
    plan = backward.plan_backward(checks.Problem(2, 400, 850, 4, 2, d, np.dtype(np.float16)), -1, 0, False, True,
                                  "sm_90a", 132)
    assert plan.ordered == applies and not (applies and (plan.slices > 1 or plan.fixed_point))
    assert not backward.plan_backward(checks.Problem(2, 400, 850, 4, 2, d, np.dtype(np.float16)), -1, 0, True, True,
                                      "sm_90a", 132).ordered  # softcap / ALiBi
    cases = [dict(b=2, sq=400, sk=850, h=4, hk=2, causal=True), dict(b=2, sq=333, sk=200, h=4, hk=4, causal=True),
             dict(b=1, sq=50, sk=900, h=2, hk=1, causal=True), dict(b=1, sq=700, sk=850, h=2, hk=1,
                                                                    window_size=(200, 60)),
             dict(b=3, sq=129, sk=333, h=3, hk=1), dict(b=2, sq=50, sk=1000, h=4, hk=2),
             dict(b=1, sq=1000, sk=130, h=2, hk=2)]
    backward._launches.clear()
    try:
        for i, case in enumerate(cases):
            b, sq, sk, h, hk = (case[x] for x in ("b", "sq", "sk", "h", "hk"))
            q, k, v, dout, _ = make_case(np.random.default_rng(60 + i), b=b, sq=sq, sk=sk, h=h, hk=hk, d=d,
                                         dtype="bf16")
            opts = dict(softmax_scale=None, causal=case.get("causal", False),
                        window_size=case.get("window_size", (-1, -1)), softcap=0.0)
            out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
            problem = checks.Problem(b, sq, sk, h, hk, d, np.dtype(q.dtype))
            runs = []
            for _ in range(3):
                grads, params = launch_sm90(problem, q, k, v, dout, out, lse, opts, deterministic=True,
                                            workspace=cupy.full(1 << 24, 0xFF, np.uint8))
                assert (int(params["deterministic"]) == backward_sm90.DQ_ORDERED) == applies, case
                runs.append(grads)
            host = [x.get() for x in (q, k, v, dout)]
            _, ref_lse = reference.attention(*host[:3], return_lse=True, **opts)
            ref = reference.attention_backward(host[3], *host[:3], out.get().astype(np.float32), ref_lse, **opts)
            naive = naive_lowp_backward(host[3], *host[:3], **opts)
            ctx = f"d={d} {case}"
            for name, x, want, lowp in zip(("dq", "dk", "dv"), runs[0], ref, naive):
                assert_close_to_reference(x.get(), want, lowp, what=name, context=ctx)
            for again in runs[1:]:
                for x, y in zip(runs[0], again):
                    assert bool(cupy.array_equal(x.view(np.uint16), y.view(np.uint16))), ctx
        from tests.gpu.test_varlen import run_backward
        run_backward(np.random.default_rng(70), lens_q=[300, 0, 65], lens_k=[850, 17, 400], h=4, hk=2, d=d,
                     dtype="bf16", causal=True, deterministic=True)
        run_case(np.random.default_rng(71), b=2, sq=150, sk=400, h=4, hk=2, d=d, dtype="fp16", causal=True,
                 softcap=8.0, alibi="bh", deterministic=True)
    finally:
        backward._launches.clear()


@pytest.mark.parametrize("d,b,s,h", [(128, 24, 512, 8), (256, 24, 512, 8), (128, 3, 8192, 3), (64, 3, 8192, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_ordered_on_many_waves(configure, compiled, sm90_backward, d, b, s, h, causal):
    """The ordered mode on a grid of several waves of CTAs (24 x 8 heads x 512 keys: 768 CTAs at d = 128, 1,536 at
    d = 256; 3 x 3 heads x 8k keys at d = 64 and 128: 9 groups of 64 key blocks, 576 CTAs). A key block's turn waits
    on key blocks of its own group only, so a group that a wave cuts in two goes on once earlier groups leave their
    SMs; the small grids above run all at once and do not reach this. Bitwise equal over two calls into NaN-filled
    gradients and close to the atomic mode's (sums in another order: without a mask the walks start apart, dK and dV
    too)."""
    import cupy
    import cuflash
    from cuflash import checks
    configure(bwd_sm90_det="ordered")
    if not backward_sm90.tma_dq(d, backward_sm90.block_m(d, False)):
        pytest.skip("the d = 64 kernel with 64 rows has no dQ warp, so no ordered mode (sm90_backward's m64)")
    q, k, v, dout, _ = make_case(np.random.default_rng(80), b=b, sq=s, sk=s, h=h, hk=h, d=d, dtype="bf16")
    opts = dict(softmax_scale=None, causal=causal, window_size=(-1, -1), softcap=0.0)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    problem = checks.Problem(b, s, s, h, h, d, np.dtype(q.dtype))

    def grads(deterministic):
        got, params = launch_sm90(problem, q, k, v, dout, out, lse, opts, deterministic=deterministic)
        assert (int(params["deterministic"]) == backward_sm90.DQ_ORDERED) == deterministic
        return got

    try:
        first, again, atomic = grads(True), grads(True), grads(False)
        for name, x, y, want in zip(("dq", "dk", "dv"), first, again, atomic):
            assert bool(cupy.array_equal(x.view(np.uint16), y.view(np.uint16))), name
            x, want = x.astype(np.float32), want.astype(np.float32)
            assert float(cupy.abs(x - want).max()) <= 1e-2 * float(cupy.abs(want).max()), name
    finally:
        backward._launches.clear()


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_backward_varlen(compiled, sm90_backward, deterministic):
    """Packed sequences (3-D tensor maps; keys and queries of the next sequence in a box are masked)."""
    from tests.gpu.test_varlen import run_backward
    run_backward(np.random.default_rng(21), lens_q=[0, 17, 200, 1, 130], lens_k=[5, 17, 260, 1, 0], h=4, hk=2, d=64,
                 dtype="bf16", causal=True, deterministic=deterministic)
    run_backward(np.random.default_rng(22), lens_q=[129, 64, 300], lens_k=[129, 64, 300], h=2, hk=2, d=128,
                 dtype="fp16", deterministic=deterministic)
    run_backward(np.random.default_rng(23), lens_q=[70, 0, 190], lens_k=[129, 3, 200], h=4, hk=1, d=256,
                 dtype="bf16", causal=True, deterministic=deterministic)


@pytest.mark.parametrize("mode", ["atomic", "slices", "fixed point"])
def test_sm90_backward_packed_rows_past_the_sequences(configure, compiled, mode):
    """Packed q, k and v with rows past their last sequence (a buffer longer than cu_seqlens' total), holding
    garbage: NaN in O's, huge values in K's and V's. Their dq is 0 in every mode, and the fixed point's scales come
    from the sequences' rows alone (a K bound of 1e30 would zero every dq). Sequences with no keys, no queries and
    lengths off the tiles, against the reference."""
    import cupy
    import cuflash
    from tests.gpu.test_varlen import make_case as make_varlen, naive_varlen_backward
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper backward needs compute capability 9.0")
    configure(bwd_sm90=True)
    configure(bwd_sm90_det={"atomic": "auto", "slices": "slices", "fixed point": "fixed"}[mode])
    deterministic = mode != "atomic"
    lens_q, lens_k, pad = [130, 0, 70, 200], [260, 9, 0, 150], 45
    rng = np.random.default_rng(52)
    q, k, v, dout, cu_q, cu_k, _ = make_varlen(rng, lens_q=lens_q, lens_k=lens_k, h=4, hk=2, d=128, dtype="bf16")
    dt = DTYPES["bf16"]
    q, dout = (cupy.asarray(np.concatenate([x.get(), randn(rng, (pad,) + x.shape[1:], dt)])) for x in (q, dout))
    k, v = (cupy.asarray(np.concatenate([x.get(), np.full((pad,) + x.shape[1:], 1e30, np.float32).astype(dt)]))
            for x in (k, v))
    opts = dict(causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None)
    cu = (cu_q, cu_k, max(lens_q), max(lens_k))
    backward._launches.clear()
    try:
        out, lse = cuflash.attention_varlen(q, k, v, *cu, return_lse=True, **opts)
        total, total_k = sum(lens_q), sum(lens_k)
        out[total:].view(np.uint16)[...] = 0x7FC0  # NaN
        dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *cu, deterministic=deterministic,
                                                       **opts)
        assert not bool(dq[total:].view(np.uint16).any()), "rows past the last sequence: dq = 0"
        qh, kh, vh, doh, cqh, ckh = (x.get() for x in (q[:total], k[:total_k], v[:total_k], dout[:total], cu_q, cu_k))
        _, ref_lse = reference.attention_varlen(qh, kh, vh, cqh, ckh, *cu[2:], return_lse=True, **opts)
        ref = reference.attention_varlen_backward(doh, qh, kh, vh, out[:total].get().astype(np.float32), ref_lse,
                                                  cqh, ckh, *cu[2:], **opts)
        naive = naive_varlen_backward(doh, qh, kh, vh, cqh, ckh, None, opts)
        for name, got, want, lowp in zip(("dq", "dk", "dv"), (dq[:total], dk[:total_k], dv[:total_k]), ref, naive):
            assert_close_to_reference(got.get(), want, lowp, what=name, context=mode)
    finally:
        backward._launches.clear()


@pytest.mark.parametrize("mode", ["atomic", "fixed point"])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_sm90_first_dq_additions_are_stores(configure, compiled, mode, d):
    """BwdParams::dq_first_store: the first CTA to add to each whole query block stores its tiles (a ticket per
    block), in a workspace of 0xFF bytes (NaN accumulator, tickets and flags -1 until the preprocess): GQA, several
    key blocks per head, rows off the blocks (a partial last block, added to as before), causal with more queries
    than keys (rows that see no key: dq 0), d 64 with 128-row blocks, against the reference; the fixed point bitwise
    equal to the preprocess zeroing the whole accumulator."""
    import cupy
    import cuflash
    from cuflash import checks
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper backward needs compute capability 9.0")
    configure(bwd_sm90=True)
    configure(bwd_sm90_det="fixed")
    deterministic = mode != "atomic"
    opts = dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)

    def grads(problem, q, k, v, dout, out, lse):
        got, params = launch_sm90(problem, q, k, v, dout, out, lse, opts, deterministic=deterministic,
                                  workspace=cupy.full(1 << 24, 0xFF, np.uint8))
        return got, int(params["dq_first_store"])

    b, h, hk = 2, 4, 2
    try:
        for sq, sk in ((333, 900), (333, 200), (50, 300), (256, 256)):
            q, k, v, dout, _ = make_case(np.random.default_rng(sk + d), b=b, sq=sq, sk=sk, h=h, hk=hk, d=d,
                                         dtype="bf16")
            out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
            problem = checks.Problem(b, sq, sk, h, hk, d, np.dtype(q.dtype))
            got, blocks = grads(problem, q, k, v, dout, out, lse)
            assert blocks > 0
            host = [x.get() for x in (q, k, v, dout)]
            _, ref_lse = reference.attention(*host[:3], return_lse=True, **opts)
            ref = reference.attention_backward(host[3], *host[:3], out.get().astype(np.float32), ref_lse, **opts)
            naive = naive_lowp_backward(host[3], *host[:3], **opts)
            ctx = f"d={d} {mode} sq={sq} sk={sk}"
            for name, x, want, lowp in zip(("dq", "dk", "dv"), got, ref, naive):
                assert_close_to_reference(x.get(), want, lowp, what=name, context=ctx)
            assert not bool(got[0][:, :max(0, sq - sk)].view(np.uint16).any()), "rows that see no key: dq = 0"
            with cuflash_settings.override(bwd_sm90_dq_first_store=False):
                before, blocks = grads(problem, q, k, v, dout, out, lse)
            assert blocks == 0
            if deterministic:
                for x, y in zip(got, before):
                    assert bool(cupy.array_equal(x.view(np.uint16), y.view(np.uint16))), ctx
    finally:
        backward._launches.clear()

"""The FP8 (e4m3) forward on the GPU (cuflash.attention_fp8, cuda_src/fwd_fp8_sm90.cu) against the float64 FP8
reference: within docs/fp8.md's bounds (2x the error of bf16 attention on the same dequantized inputs plus the e4m3
quantization of P, in the form of the head dim's row sums: forward_fp8.quantized_sums), on hypothesis shapes off the
128 x 128 tile grid, with GQA, causal and local windows, per-tensor and per-head descales, inputs with outlier
channels, and rows of 16k keys. Every allocation starts as NaN (conftest), so a row or column the kernel forgets
fails."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cuflash
from cuflash import checks, reference as ref
from cuflash.ops import forward_fp8

pytestmark = pytest.mark.gpu

HEADDIMS = [16, 64, 80, 128, 176, 256]


def hopper():
    import cupy
    return cupy.cuda.Device().compute_capability == "90"


def make(rng, b, sq, sk, h, hk, d, per, outliers=0, v_offset=0.0, pow2=False):
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, sk, hk, d))
    v = rng.standard_normal((b, sk, hk, d)) + v_offset
    if outliers:
        cols = rng.choice(d, outliers, replace=False)
        q[..., cols] *= 100.0
        k[..., cols] *= 100.0
    out = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        out[name + "8"], out[name + "_descale"] = ref.quantize_e4m3(x, per, nheads_k=hk, pow2=pow2)
    return out


def banded(options) -> bool:
    """Whether a call with these options runs the FP8 kernel with a mask band (causal or a window), by the window
    attention_fp8 takes from them."""
    left, right = checks.window(options.get("causal", False), options.get("window_size", (-1, -1)))
    return left >= 0 or right >= 0


def run_and_check(args, **options):
    import cupy
    q8, k8, v8 = (cupy.asarray(args[n + "8"].view(np.uint8)) for n in "qkv")
    descales = {n + "_descale": cupy.asarray(np.asarray(args[n + "_descale"], dtype=np.float32).reshape(
        np.shape(args[n + "_descale"]) or (1,))) for n in "qkv"}
    out, lse = cuflash.attention_fp8(q8, k8, v8, **descales, return_lse=True, **options)
    out = cupy.asnumpy(out).astype(np.float64)
    fp8_args = dict(q_descale=args["q_descale"], k_descale=args["k_descale"], v_descale=args["v_descale"],
                    quantized_sums=forward_fp8.quantized_sums(args["q8"].shape[-1], banded(options)), **options)
    want = ref.attention_fp8(args["q8"], args["k8"], args["v8"], **fp8_args)
    # bf16 attention on the same dequantized inputs: the errors the bounds double
    deq = [ref.dequantize_e4m3(args[n + "8"], args[n + "_descale"]) for n in "qkv"]
    exact, exact_lse = ref.attention(*deq, return_lse=True, **options)
    bf16 = [cupy.asarray(x.astype(forward_fp8.BF16)) for x in deq]
    bf16_out, bf16_lse = cuflash.attention(*bf16, return_lse=True, **options)
    bf16_error = float(np.abs(cupy.asnumpy(bf16_out).astype(np.float64) - exact).max())
    lse, bf16_lse = (cupy.asnumpy(x).astype(np.float64) for x in (lse, bf16_lse))
    finite = np.isfinite(exact_lse)
    bf16_lse_error = float(np.abs(bf16_lse[finite] - exact_lse[finite]).max(initial=0.0))
    bound, lse_bound = ref.fp8_error_bound(args["q8"], args["k8"], args["v8"], bf16_error=bf16_error,
                                           bf16_lse_error=bf16_lse_error, tensor_core_scores=True, return_lse=True,
                                           **fp8_args)
    err = np.abs(out - exact)
    assert np.all(np.isfinite(out)), "non-finite output"
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound + 1e-6), (f"FP8 error above the bound at {worst}: {err[worst]:.3g} > {bound[worst]:.3g}"
                                         f" (bf16 error {bf16_error:.3g}); max |out - attention_fp8| "
                                         f"{np.abs(out - want).max():.3g}")
    assert np.array_equal(np.isfinite(lse), finite)
    lse_err = np.where(finite, np.abs(lse - np.where(finite, exact_lse, 0.0)), 0.0)
    worst = np.unravel_index(np.argmax(lse_err - lse_bound), lse_err.shape)
    assert np.all(lse_err <= lse_bound + 1e-4), (f"lse error above the bound at {worst}: {lse_err[worst]:.3g} > "
                                                 f"{lse_bound[worst]:.3g}")


@pytest.fixture(params=[(0, 0), (1, 0), (0, 1), (1, 1)], ids=["simple", "pipelined", "simple-vt", "pipelined-vt"])
def fp8_form(request):
    """Both forms of the FP8 kernel (fwd_fp8_sm90.cu PIPE), whatever forward_fp8.FORMS picks, each with V transposed
    in the kernel and with V^T from the pass (VT_PASS), whatever forward_fp8.VT_PASS_FROM picks; with the forms'
    warpgroups (forward_fp8.kernel_spec) every compiled FP8 kernel runs in one of the four."""
    from cuflash import settings as cf_settings
    pipelined, vt_pass = request.param
    with cf_settings.override(fp8_pipelined=pipelined, fp8_vt_pass=vt_pass):
        yield request.param


@pytest.fixture(params=[0, 1], ids=["in-kernel", "vt-pass"])
def vt_pass(request):
    """V transposed in the kernel, and V^T from the pass with its workspace (forward_fp8.vt_pass)."""
    from cuflash import settings as cf_settings
    with cf_settings.override(fp8_vt_pass=request.param):
        yield request.param


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), sq=st.integers(1, 300), sk=st.integers(1, 400), hk=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), d=st.sampled_from(HEADDIMS), per=st.sampled_from(["tensor", "head"]),
       mask=st.sampled_from(["none", "causal", "window"]), seed=st.integers(0, 2 ** 16))
def test_fp8_forward_within_bound(fp8_form, b, sq, sk, hk, group, d, per, mask, seed):
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    options = {"none": {}, "causal": {"causal": True}, "window": {"window_size": (37, 5)}}[mask]
    run_and_check(make(np.random.default_rng(seed), b, sq, sk, hk * group, hk, d, per), **options)


@pytest.mark.parametrize("outliers", [0, 4])
@pytest.mark.parametrize("d", HEADDIMS)
def test_fp8_one_key_lse_is_the_score(d, outliers):
    """One row against one key, a call per seed: the lse is that key's score, off by the FP8 tensor cores' sums of S
    alone (the lse bound's E_S, docs/fp8.md), while the bf16 kernel's lse error, which the rest of the bound doubles,
    can be near 0 for a single row."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    for seed in range(8):
        run_and_check(make(np.random.default_rng(100 * d + 10 * outliers + seed), 1, 1, 1, 1, 1, d, "tensor",
                           outliers=outliers))


@pytest.mark.parametrize("outliers", [0, 4])
@pytest.mark.parametrize("d", [64, 128, 176, 256])
def test_fp8_forward_power_of_two_descales(fp8_form, d, outliers):
    """Descales that are powers of two: the dequantized inputs are exact in bf16, so the bf16 kernel's error, which
    the bounds double, is its fp32 sums' alone, and the bound's scores' term (docs/fp8.md, the scores' accumulator)
    alone covers the FP8 tensor cores' sums of S: without it every case with outlier channels fails."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    for seed in range(2):
        rng = np.random.default_rng(1000 * d + 10 * outliers + seed)
        run_and_check(make(rng, 2, 150, 333, 4, 2, d, "head", outliers=outliers, pow2=True), causal=seed == 1)


@pytest.mark.parametrize("sk", [150, 300, 600, 1000, 1800])
@pytest.mark.parametrize("d", [112, 128])
def test_fp8_forward_partial_last_blocks(fp8_form, sk, d):
    """d 128 without a window at lengths whose last 128-key block is partial."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    run_and_check(make(np.random.default_rng(sk + d), 2, 333, sk, 6, 2, d, "head"))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_forward_outlier_channels(fp8_form, d):
    """A few head-dim columns of q and k 100x the rest (what per-tensor scaling of activations meets)."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    run_and_check(make(np.random.default_rng(d), 2, 257, 515, 4, 2, d, "head", outliers=3), causal=True)


@pytest.mark.parametrize("v_offset", [0.0, 4.0])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_forward_long_rows(vt_pass, d, v_offset):
    """Rows of 16k keys, V's values around 0 or all around 4: FP8 wgmma's accumulator keeps fewer bits than fp32,
    so one accumulator over the whole row would lose most small terms (O 25% low at 16k keys; the row sums of d 64
    too). Each block's P V in its own accumulator, added to O in fp32, stays within the bounds."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    run_and_check(make(np.random.default_rng(d), 1, 130, 16384, 2, 1, d, "tensor", v_offset=v_offset))


@pytest.mark.parametrize("jump", [1.0, 8.0, 200.0])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_forward_row_max_jumps(fp8_form, d, jump):
    """The first key block's scores `jump` (log2 units) above the rest: the kernel walks the key blocks from the last,
    so the running max of the blocks before meets the jump in the last block it reads, where O and the row sums are
    rescaled by up to 2^-200 and P, taken against the new max, stays within e4m3's range."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    rng = np.random.default_rng(int(jump) + d)
    b, sq, sk, h, hk = 1, 150, 600, 2, 1
    q = rng.standard_normal((b, sq, h, d))
    k, v = rng.standard_normal((b, sk, hk, d)), rng.standard_normal((b, sk, hk, d))
    c = np.sqrt(jump / np.log2(np.e) * np.sqrt(d))  # q_0 k_0 / sqrt(d) in log2 units is `jump`
    q[..., 0] = c
    k[..., 0] = 0.0
    k[:, :128, :, 0] = c
    args = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        args[name + "8"], args[name + "_descale"] = ref.quantize_e4m3(x, "tensor")
    run_and_check(args)


def test_fp8_forward_rows_without_keys(fp8_form):
    """seqlen_q > seqlen_k under a bottom-right causal mask: the leading rows see no key (out 0, lse -inf)."""
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    run_and_check(make(np.random.default_rng(1), 1, 200, 70, 2, 1, 128, "tensor"), causal=True)


def test_fp8_forward_without_descales_is_unscaled():
    """No descales: the e4m3 values as they are (descale 1)."""
    import cupy
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    args = make(np.random.default_rng(3), 1, 130, 140, 2, 2, 64, "tensor")
    q8, k8, v8 = (cupy.asarray(args[n + "8"].view(np.uint8)) for n in "qkv")
    out = cupy.asnumpy(cuflash.attention_fp8(q8, k8, v8)).astype(np.float64)
    want = ref.attention_fp8(args["q8"], args["k8"], args["v8"], quantized_sums=forward_fp8.quantized_sums(64))
    np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2)


def test_fp8_forward_off_hopper_raises():
    import cupy
    if hopper():
        pytest.skip("the error is for GPUs other than sm_90a")
    x = cupy.zeros((1, 8, 1, 64), dtype=np.uint8)
    with pytest.raises(NotImplementedError, match="sm_90a"):
        cuflash.attention_fp8(x, x, x)


def test_fp8_forward_from_torch_matches_cupy(vt_pass):
    """cuflash.torch.attention_fp8 on float8_e4m3fn tensors, eager and under torch.compile: the CuPy call's result,
    bit for bit."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash.torch as cft
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    args = make(np.random.default_rng(5), 2, 150, 333, 4, 2, 128, "head")
    q8, k8, v8 = (torch.from_numpy(args[n + "8"].view(np.uint8)).cuda().view(torch.float8_e4m3fn) for n in "qkv")
    ds = {n + "_descale": torch.from_numpy(np.asarray(args[n + "_descale"], np.float32)).cuda() for n in "qkv"}
    out, lse = cft.attention_fp8(q8, k8, v8, causal=True, return_lse=True, **ds)
    torch.cuda.synchronize()
    cq, ck, cv = (cupy.asarray(args[n + "8"].view(np.uint8)) for n in "qkv")
    cds = {n + "_descale": cupy.asarray(np.asarray(args[n + "_descale"], np.float32)) for n in "qkv"}
    want, want_lse = cuflash.attention_fp8(cq, ck, cv, causal=True, return_lse=True, **cds)
    assert out.dtype == torch.bfloat16
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), cupy.asnumpy(want.view(cupy.int16)))
    assert np.array_equal(lse.cpu().numpy(), cupy.asnumpy(want_lse))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: cft.attention_fp8(*a, causal=True, return_lse=True, **ds), fullgraph=True)
    got, got_lse = compiled(q8, k8, v8)
    assert torch.equal(got.view(torch.int16), out.view(torch.int16)) and torch.equal(got_lse, lse)
    with pytest.raises(TypeError, match="q: dtype torch.bfloat16 is not supported; expected torch.float8_e4m3fn"):
        cft.attention_fp8(q8.to(torch.bfloat16), k8, v8)


def test_fp8_forward_from_jax_matches_cupy(vt_pass):
    """cuflash.jax.attention_fp8 under jit on float8_e4m3fn arrays: the CuPy call's result, bit for bit."""
    jax = pytest.importorskip("jax")
    import cupy
    import jax.numpy as jnp
    import cuflash.jax as cfj
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    args = make(np.random.default_rng(9), 2, 150, 333, 4, 2, 128, "head")
    q8, k8, v8 = (jnp.asarray(args[n + "8"]) for n in "qkv")
    ds = {n + "_descale": jnp.asarray(np.asarray(args[n + "_descale"], np.float32)) for n in "qkv"}
    f = jax.jit(lambda q, k, v, qd, kd, vd: cfj.attention_fp8(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                                               window_size=(50, 3), return_lse=True))
    out, lse = f(q8, k8, v8, ds["q_descale"], ds["k_descale"], ds["v_descale"])
    cq, ck, cv = (cupy.asarray(args[n + "8"].view(np.uint8)) for n in "qkv")
    cds = {n + "_descale": cupy.asarray(np.asarray(args[n + "_descale"], np.float32)) for n in "qkv"}
    want, want_lse = cuflash.attention_fp8(cq, ck, cv, window_size=(50, 3), return_lse=True, **cds)
    assert np.array_equal(np.asarray(out).view(np.uint16), cupy.asnumpy(want).view(np.uint16))
    assert np.array_equal(np.asarray(lse), cupy.asnumpy(want_lse))


def packed(rng, lens_q, lens_k, h, hk, d, per):
    """Sequences of the given lengths, each quantized as its own batch entry of make(), and their packed e4m3 bits:
    (per-sequence args, q8, k8, v8 packed, cu_seqlens_q, cu_seqlens_k, per-sequence descales stacked)."""
    seqs = [make(rng, 1, max(sq, 1), max(sk, 1), h, hk, d, per) for sq, sk in zip(lens_q, lens_k)]
    cat = {n: np.concatenate([s[n + "8"].view(np.uint8)[0, :sq] for s, sq in
                              zip(seqs, lens_q if n == "q" else lens_k)]) for n in "qkv"}
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lens)]).astype(np.int32) for lens in (lens_q, lens_k))
    descales = {n: np.concatenate([np.asarray(s[n + "_descale"], np.float32).reshape(1, -1) for s in seqs])
                for n in "qkv"}
    if per == "tensor":  # one value for every sequence: the first's
        descales = {n: x[:1, :1].reshape(1) for n, x in descales.items()}
        for s in seqs:
            for n in "qkv":
                s[n + "_descale"] = descales[n]
    return seqs, cat, cu_q, cu_k, descales


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=4),
       hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), d=st.sampled_from([64, 80, 128, 256]),
       per=st.sampled_from(["tensor", "head"]), mask=st.sampled_from(["none", "causal", "window"]),
       seed=st.integers(0, 2 ** 16))
def test_fp8_varlen_matches_each_sequence_alone(fp8_form, lens, hk, group, d, per, mask, seed):
    """cuflash.attention_varlen_fp8 on packed sequences (empty ones included) gives, row for row and bit for bit,
    what attention_fp8 gives each sequence as a batch of one (whose error the tests above bound); rows past the last
    sequence stay unwritten (NaN from the poisoning allocator). K and V have rows of e4m3 NaN past the last sequence,
    which its last key block reads: the key bound masks K's, and the kernel zeroes V's before P V."""
    import cupy
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    options = {"none": {}, "causal": {"causal": True}, "window": {"window_size": (37, 5)}}[mask]
    lens_q, lens_k = [x for x, _ in lens], [y for _, y in lens]
    h = hk * group
    seqs, cat, cu_q, cu_k, descales = packed(np.random.default_rng(seed), lens_q, lens_k, h, hk, d, per)
    spare = 5  # rows past the last sequence
    q8 = cupy.zeros((cat["q"].shape[0] + spare, h, d), np.uint8)
    q8[:cat["q"].shape[0]] = cupy.asarray(cat["q"])
    k8, v8 = (cupy.full((cat[n].shape[0] + spare, hk, d), 0x7F, np.uint8) for n in "kv")  # 0x7F: e4m3 NaN
    for x, n in ((k8, "k"), (v8, "v")):
        x[:cat[n].shape[0]] = cupy.asarray(cat[n])
    ds = {n + "_descale": cupy.asarray(descales[n]) for n in "qkv"}
    out, lse = cuflash.attention_varlen_fp8(q8, k8, v8, cupy.asarray(cu_q), cupy.asarray(cu_k), max(max(lens_q), 1),
                                            max(max(lens_k), 1), return_lse=True, **ds, **options)
    out, lse = cupy.asnumpy(out.view(cupy.uint16)), cupy.asnumpy(lse)
    for b, (s, sq, sk) in enumerate(zip(seqs, lens_q, lens_k)):
        if sq == 0:
            continue
        one = {n + "_descale": cupy.asarray(np.asarray(s[n + "_descale"], np.float32).reshape(
            (1, hk) if per == "head" else (1,))) for n in "qkv"}
        qs = cupy.asarray(s["q8"].view(np.uint8)[:, :sq])
        ks, vs = (cupy.asarray(s[n + "8"].view(np.uint8)[:, :max(sk, 1)]) for n in "kv")
        if sk == 0:  # no keys: out 0, lse -inf
            assert np.all(out[cu_q[b]:cu_q[b + 1]] == 0) and np.all(lse[:, cu_q[b]:cu_q[b + 1]] == -np.inf)
            continue
        want, want_lse = cuflash.attention_fp8(qs, ks, vs, return_lse=True, **one, **options)
        assert np.array_equal(out[cu_q[b]:cu_q[b + 1]], cupy.asnumpy(want.view(cupy.uint16))[0]), f"sequence {b}"
        assert np.array_equal(lse[:, cu_q[b]:cu_q[b + 1]], cupy.asnumpy(want_lse)[0]), f"sequence {b} lse"
    tail = out[cu_q[-1]:].view(forward_fp8.BF16).astype(np.float32)
    assert np.all(np.isnan(tail)), "rows past the last sequence were written"


def test_fp8_varlen_from_torch_matches_cupy(vt_pass):
    """cuflash.torch.attention_varlen_fp8, eager and under torch.compile: the CuPy call's result, bit for bit."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash.torch as cft
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    _, cat, cu_q, cu_k, descales = packed(np.random.default_rng(7), [100, 0, 260], [300, 5, 129], 4, 2, 128, "head")
    tq, tk, tv = (torch.from_numpy(cat[n]).cuda().view(torch.float8_e4m3fn) for n in "qkv")
    tds = {n + "_descale": torch.from_numpy(descales[n]).cuda() for n in "qkv"}
    out, lse = cft.attention_varlen_fp8(tq, tk, tv, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(),
                                        260, 300, causal=True, return_lse=True, **tds)
    torch.cuda.synchronize()
    cds = {n + "_descale": cupy.asarray(descales[n]) for n in "qkv"}
    want, want_lse = cuflash.attention_varlen_fp8(*(cupy.asarray(cat[n]) for n in "qkv"), cupy.asarray(cu_q),
                                                  cupy.asarray(cu_k), 260, 300, causal=True, return_lse=True, **cds)
    assert out.shape == (360, 4, 128) and lse.shape == (4, 360)
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), cupy.asnumpy(want.view(cupy.int16)))
    assert np.array_equal(lse.cpu().numpy(), cupy.asnumpy(want_lse))
    torch._dynamo.reset()
    cu = (torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda())
    compiled = torch.compile(lambda *a: cft.attention_varlen_fp8(*a, *cu, 260, 300, causal=True, return_lse=True,
                                                                 **tds), fullgraph=True)
    got, got_lse = compiled(tq, tk, tv)
    assert torch.equal(got.view(torch.int16), out.view(torch.int16)) and torch.equal(got_lse, lse)


def test_fp8_varlen_from_jax_matches_cupy(vt_pass):
    """cuflash.jax.attention_varlen_fp8 under jit on float8_e4m3fn arrays (GQA 2:1, causal, a sequence without queries
    and one without keys, per-head descales, lse): the CuPy call's result, bit for bit."""
    jax = pytest.importorskip("jax")
    import cupy
    import jax.numpy as jnp
    import cuflash.jax as cfj
    if not hopper():
        pytest.skip("the FP8 kernel is sm_90a's")
    lens_q, lens_k = [100, 0, 260, 7], [300, 5, 129, 0]
    _, cat, cu_q, cu_k, descales = packed(np.random.default_rng(13), lens_q, lens_k, 4, 2, 128, "head")
    jq, jk, jv = (jnp.asarray(cat[n].view(jnp.float8_e4m3fn)) for n in "qkv")
    jds = {n + "_descale": jnp.asarray(descales[n]) for n in "qkv"}
    f = jax.jit(lambda q, k, v, cq, ck, ds: cfj.attention_varlen_fp8(q, k, v, cq, ck, 260, 300, causal=True,
                                                                     return_lse=True, **ds))
    out, lse = f(jq, jk, jv, jnp.asarray(cu_q), jnp.asarray(cu_k), jds)
    cds = {n + "_descale": cupy.asarray(descales[n]) for n in "qkv"}
    want, want_lse = cuflash.attention_varlen_fp8(*(cupy.asarray(cat[n]) for n in "qkv"), cupy.asarray(cu_q),
                                                  cupy.asarray(cu_k), 260, 300, causal=True, return_lse=True, **cds)
    assert out.shape == (367, 4, 128) and out.dtype == jnp.bfloat16 and lse.shape == (4, 367)
    assert np.array_equal(np.asarray(out).view(np.uint16), cupy.asnumpy(want).view(np.uint16))
    assert np.array_equal(np.asarray(lse), cupy.asnumpy(want_lse))
    assert np.all(np.asarray(lse)[:, 360:] == -np.inf)  # the sequence without keys

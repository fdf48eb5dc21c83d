"""CPU tests of the FP8 (e4m3) reference and its accuracy contract (cuflash.reference.attention_fp8,
fp8_error_bound, quantize_e4m3, dequantize_e4m3; docs/fp8.md).

The FP8 kernel's GPU tests rest on three facts checked here: without P's quantization the FP8 reference is
``reference.attention`` on the dequantized inputs; the quantization of P stays within the documented bound, on
random inputs and on inputs with outlier channels, with every mask option, GQA and per-head descales; and the bound
is tight enough that a kernel which skips P's scaling fails it. The same holds for both forms of the row sums: those
of the fp32 P (compiled head dims 128 and 256) and those of the e4m3 P (``quantized_sums``, head dim 64, whose
bound also covers the lse and any tiling of the keys).
"""

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference as ref

E4M3 = ml_dtypes.float8_e4m3fn
TINY = 1e-12  # float64 rounding of the reference's own sums


def make_fp8(rng, *, batch=2, seqlen_q=24, seqlen_k=96, nheads=4, nheads_k=2, d=32, per="tensor", outliers=0,
             amplitude=1.0, v_mean=0.0):
    """Random q, k, v (outliers: that many head-dim columns of q and k times 100) quantized to e4m3: the keyword
    arguments of attention_fp8 / fp8_error_bound."""
    q = amplitude * rng.standard_normal((batch, seqlen_q, nheads, d))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, d))
    v = v_mean + rng.standard_normal((batch, seqlen_k, nheads_k, d))
    if outliers:
        cols = rng.choice(d, outliers, replace=False)
        q[..., cols] *= 100.0
        k[..., cols] *= 100.0
    args = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        args[name + "8"], args[name + "_descale"] = ref.quantize_e4m3(x, per, nheads_k=nheads_k)
    return args


def dequantized(args):
    return [ref.dequantize_e4m3(args[n + "8"], args[n + "_descale"]) for n in "qkv"]


OPTIONS = [
    {},
    {"causal": True},
    {"window_size": (5, 3)},
    {"causal": True, "window_size": (7, -1)},
    {"softcap": 2.0, "softmax_scale": 0.3},
    {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
]


# --------------------------------------------------------------------------------------------
# quantize_e4m3 / dequantize_e4m3
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per", ["tensor", "head"])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_amax_scaling_and_rounding(per, pow2):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 6, 8)) * np.array([1, 10, 0.1])[None, None, :, None].repeat(2, axis=2)
    x8, descale = ref.quantize_e4m3(x, per, nheads_k=3, pow2=pow2)
    assert x8.dtype == E4M3 and descale.dtype == np.float32
    assert descale.shape == (() if per == "tensor" else (2, 3))
    # the largest magnitude of each scaling group lands on 448 (pow2: in [224, 448])
    mags = np.abs(x8.astype(np.float64)).reshape(2, 16, 3, 2, 8)
    top = mags.max() if per == "tensor" else mags.max(axis=(1, 3, 4))
    assert np.all(top <= 448) and np.all(top >= (224 if pow2 else 448))
    if pow2:
        assert np.all(np.log2(descale) == np.round(np.log2(descale)))
    # e4m3 rounding of x / descale: relative 2^-4 when normal, half the subnormal step 2^-9 below
    back = ref.dequantize_e4m3(x8, descale)
    d = np.broadcast_to(descale, (2, 3)).astype(np.float64).repeat(2, axis=1)[:, None, :, None]
    assert np.all(np.abs(back - x) <= np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * d) * (1 + 1e-6))
    # the uint8 bits mean the same
    assert np.array_equal(ref.dequantize_e4m3(x8.view(np.uint8), descale), back)


def test_quantize_edge_cases():
    x8, descale = ref.quantize_e4m3(np.zeros((1, 2, 1, 4)))
    assert descale == 1 and not np.any(x8.astype(np.float64))
    with pytest.raises(ValueError, match="per"):
        ref.quantize_e4m3(np.ones((1, 2, 2, 4)), "row")
    with pytest.raises(ValueError, match="divide"):
        ref.quantize_e4m3(np.ones((1, 2, 4, 4)), "head", nheads_k=3)
    with pytest.raises(ValueError, match="finite"):
        ref.quantize_e4m3(np.full((1, 2, 1, 4), np.inf))
    with pytest.raises(ValueError, match="divide"):
        ref.dequantize_e4m3(np.zeros((1, 2, 4, 4), E4M3), np.ones((1, 3), np.float32))


def test_fp8_input_checks():
    args = make_fp8(np.random.default_rng(1), batch=1, nheads=2, nheads_k=1)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ref.attention_fp8(**dict(args, q8=args["q8"].astype(np.float32)))
    with pytest.raises(ValueError, match="k_descale"):
        ref.attention_fp8(**dict(args, k_descale=np.ones((1, 2), np.float32)))
    with pytest.raises(ValueError, match="p_scale"):
        ref.attention_fp8(**args, p_scale=0.0)
    with pytest.raises(ValueError, match="p_scale"):
        ref.fp8_error_bound(**args, p_scale=512.0)


# --------------------------------------------------------------------------------------------
# The reference: attention on the dequantized inputs, with P quantized for P V
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per", ["tensor", "head"])
@pytest.mark.parametrize("options", OPTIONS)
def test_unquantized_p_is_attention_on_dequantized_inputs(per, options):
    args = make_fp8(np.random.default_rng(2), seqlen_q=40, seqlen_k=33, per=per)
    out, lse = ref.attention_fp8(**args, **options, quantize_p=False, return_lse=True)
    want, want_lse = ref.attention(*dequantized(args), **options, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)
    # quantizing P changes the output, never the lse (the row sums are those of the unquantized P)
    out_q, lse_q = ref.attention_fp8(**args, **options, return_lse=True)
    assert np.array_equal(lse_q, lse) and np.abs(out_q - out).max() > 0


def test_per_head_descales_scale_their_heads():
    """q_descale[b, g] scales the query heads of kv head g; k/v_descale[b, g] kv head g."""
    args = make_fp8(np.random.default_rng(3), per="tensor")
    base = ref.attention_fp8(**args, quantize_p=False)
    per_head = {n: np.full((2, 2), args[n], np.float32) for n in ("q_descale", "k_descale", "v_descale")}
    per_head["v_descale"][1, 0] *= 2    # batch 1, kv head 0: query heads 0, 1 double
    per_head["q_descale"][0, 1] *= 0.0  # batch 0, kv head 1: query heads 2, 3 see uniform scores
    out = ref.attention_fp8(**dict(args, **per_head), quantize_p=False)
    np.testing.assert_allclose(out[1, :, :2], 2 * base[1, :, :2], rtol=1e-13)
    v = dequantized(args)[2]
    np.testing.assert_allclose(out[0, :, 2:], np.broadcast_to(v[0, :, 1].mean(axis=0), out[0, :, 2:].shape),
                               rtol=1e-12)
    same = np.ones(out.shape, bool)
    same[1, :, :2] = same[0, :, 2:] = False
    assert np.array_equal(out[same], base[same])


def test_quantized_p_matches_a_row_loop():
    """An independent loop over rows: P = exp(s - max) over the visible keys, P V with e4m3(256 P) / 256, divided by
    the sum of the unquantized P."""
    args = make_fp8(np.random.default_rng(4), batch=1, seqlen_q=9, seqlen_k=13, nheads=2, nheads_k=1, d=16)
    q, k, v = dequantized(args)
    out = ref.attention_fp8(**args, causal=True)
    scale = 1 / math.sqrt(16)
    for h in range(2):
        for i in range(9):
            keys = np.arange(i + 13 - 9 + 1)           # causal, bottom-right
            s = scale * k[0, keys, 0] @ q[0, i, h]
            p = np.exp(s - s.max())
            pq = np.clip(256 * p, -448, 448).astype(E4M3).astype(np.float64) / 256
            np.testing.assert_allclose(out[0, i, h], pq @ v[0, keys, 0] / p.sum(), rtol=0, atol=1e-13)


# --------------------------------------------------------------------------------------------
# The bound
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outliers", [0, 3])
@pytest.mark.parametrize("per", ["tensor", "head"])
@pytest.mark.parametrize("options", OPTIONS)
def test_p_quantization_within_bound(outliers, per, options):
    args = make_fp8(np.random.default_rng(5 + outliers), per=per, outliers=outliers)
    exact = ref.attention_fp8(**args, **options, quantize_p=False)
    err = np.abs(ref.attention_fp8(**args, **options) - exact)
    bound = ref.fp8_error_bound(**args, **options)
    assert np.all(err <= bound + TINY)
    if not outliers:  # spread softmax rows: the bound is within a small factor of the error (not vacuous)
        assert err.max() > 0.05 * bound.max()


@pytest.mark.parametrize("amplitude,seqlen_k", [(1.0, 128), (4.0, 2048)])
def test_bound_is_within_a_small_factor_of_the_error(amplitude, seqlen_k):
    """Spread rows (amplitude 1) and rows concentrated on a few keys (amplitude 4, 2048 keys): somewhere the error
    reaches a fifth of the bound (0.24 and 0.41 with these inputs), so the bound is tight up to a small factor."""
    args = make_fp8(np.random.default_rng(6), batch=1, seqlen_q=16, nheads=2, nheads_k=2, d=64, per="head",
                    seqlen_k=seqlen_k, amplitude=amplitude)
    err = np.abs(ref.attention_fp8(**args) - ref.attention_fp8(**args, quantize_p=False))
    assert 0.2 < (err / ref.fp8_error_bound(**args)).max() <= 1


def test_bound_adds_twice_the_bf16_error():
    args = make_fp8(np.random.default_rng(7))
    base = ref.fp8_error_bound(**args)
    np.testing.assert_array_equal(ref.fp8_error_bound(**args, bf16_error=0.01), base + 0.02)


def test_p_scale_forgotten_fails_the_bound_by_flushing():
    """One key at score 0, the others at -8: P = e^-8 ~ 3.4e-4 is below half the smallest e4m3 subnormal (2^-10)
    unscaled, so p_scale = 1 flushes it to 0 and the output, V = 1 everywhere, drops from 1 to 1 / l; times 256 it is
    a normal e4m3 number (rounding error < 2^-4 relative)."""
    seqlen_k, d = 512, 16
    q = np.zeros((1, 1, 1, d))
    q[..., 0] = 1.0
    k = np.zeros((1, seqlen_k, 1, d))
    k[0, 1:, 0, 0] = -8.0
    v = np.ones((1, seqlen_k, 1, d))
    args = {"q8": ref._to_e4m3(q), "k8": ref._to_e4m3(k), "v8": ref._to_e4m3(v), "softmax_scale": 1.0}
    bound = ref.fp8_error_bound(**args)
    np.testing.assert_allclose(bound, 2.0 ** -4)            # sum_j 2^-4 P_j |V_j| / l = 2^-4
    good = ref.attention_fp8(**args)
    assert np.abs(good - 1).max() < 1e-3
    flushed = ref.attention_fp8(**args, p_scale=1.0)
    l = 1 + (seqlen_k - 1) * math.exp(-8)
    np.testing.assert_allclose(flushed, 1 / l, rtol=1e-12)
    assert np.all(np.abs(flushed - 1) > 2 * bound)


def test_p_scale_forgotten_fails_the_bound_on_random_inputs():
    """Long rows of small probabilities and values with a nonzero mean: P = exp(s - max) below 2^-6 is subnormal in
    e4m3 without the scale, and its rounding errors no longer average out over V."""
    args = make_fp8(np.random.default_rng(8), batch=1, seqlen_q=32, seqlen_k=2048, nheads=2, nheads_k=2, d=64,
                    per="head", amplitude=3.0, v_mean=3.0)
    exact = ref.attention_fp8(**args, quantize_p=False)
    bound = ref.fp8_error_bound(**args)
    assert np.all(np.abs(ref.attention_fp8(**args) - exact) <= bound)
    assert (np.abs(ref.attention_fp8(**args, p_scale=1.0) - exact) / bound).max() > 1.25


def test_outlier_channels_defeat_the_inputs_quantization_not_the_contract():
    """With outlier channels (a few head-dim columns of q and k x100) the e4m3 inputs themselves are far from the
    unquantized ones, per tensor or per head: their attention misses the original by orders of magnitude more than
    the contract allows. The contract is about the kernel, so it is measured against the dequantized inputs."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, 32, 2, 64)) for _ in range(3))
    q[..., :3] *= 100.0
    k[..., :3] *= 100.0
    original = ref.attention(q, k, v)
    for per in ("tensor", "head"):
        args = {}
        for name, x in (("q", q), ("k", k), ("v", v)):
            args[name + "8"], args[name + "_descale"] = ref.quantize_e4m3(x, per)
        bound = ref.fp8_error_bound(**args)
        assert np.abs(ref.attention_fp8(**args) - ref.attention_fp8(**args, quantize_p=False)).max() <= bound.max()
        assert np.abs(ref.attention_fp8(**args, quantize_p=False) - original).max() > 10 * bound.max()


# --------------------------------------------------------------------------------------------
# Row sums from the quantized P (the kernel at compiled head dim 64)
# --------------------------------------------------------------------------------------------

MASKS = [{}, {"causal": True}, {"window_size": (5, 3)}, {"causal": True, "window_size": (7, -1)}]


def dequantize_by_hand(x8, descale, nheads_k):
    """x8 (batch, seqlen, nheads, d) times descale, () or (batch, nheads_k): head h reads kv head h // group."""
    d = np.broadcast_to(np.asarray(descale, np.float64), (x8.shape[0], nheads_k))
    return x8.astype(np.float64) * np.repeat(d, x8.shape[2] // nheads_k, axis=1)[:, None, :, None]


def visible_by_hand(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Query i at key position i + seqlen_k - seqlen_q sees keys pos - left .. pos + right (-1: unbounded)."""
    left, right = window_size
    right = 0 if causal else right
    keep = np.zeros((seqlen_q, seqlen_k), bool)
    for i in range(seqlen_q):
        pos = i + seqlen_k - seqlen_q
        for j in range(seqlen_k):
            keep[i, j] = (left < 0 or j >= pos - left) and (right < 0 or j <= pos + right)
    return keep


def inputs_by_hand(args, nheads_k, options):
    """Dequantized q, k, v (kv heads as they are), the visible mask and the softmax scale of a plain dense call."""
    q, k, v = (dequantize_by_hand(args[n + "8"], args[n + "_descale"], nheads_k) for n in "qkv")
    mask = {key: options[key] for key in ("causal", "window_size") if key in options}
    return q, k, v, visible_by_hand(q.shape[1], k.shape[1], **mask), 1 / math.sqrt(q.shape[-1])


def round_p(p, p_scale=256.0):
    return np.clip(p * p_scale, -448, 448).astype(E4M3).astype(np.float64) / p_scale


@pytest.mark.parametrize("per", ["tensor", "head"])
@pytest.mark.parametrize("options", MASKS)
def test_quantized_sums_match_a_row_loop(per, options):
    """An independent loop over rows: P = exp(s - max) over the visible keys, Pq = e4m3(256 P) / 256, out = Pq V /
    sum Pq, lse = max + log(sum Pq). GQA (two query heads per kv head); 14 queries against 11 keys, so that causal
    leaves the first rows without keys (out 0, lse -inf)."""
    args = make_fp8(np.random.default_rng(10), batch=2, seqlen_q=14, seqlen_k=11, nheads=4, nheads_k=2, d=16, per=per)
    out, lse = ref.attention_fp8(**args, **options, quantized_sums=True, return_lse=True)
    q, k, v, visible, scale = inputs_by_hand(args, 2, options)
    for b in range(2):
        for h in range(4):
            for i in range(14):
                keys = np.flatnonzero(visible[i])
                if keys.size == 0:
                    assert np.all(out[b, i, h] == 0) and lse[b, h, i] == -np.inf
                    continue
                s = scale * k[b, keys, h // 2] @ q[b, i, h]
                pq = round_p(np.exp(s - s.max()))
                np.testing.assert_allclose(out[b, i, h], pq @ v[b, keys, h // 2] / pq.sum(), rtol=0, atol=1e-13)
                np.testing.assert_allclose(lse[b, h, i], s.max() + math.log(pq.sum()), rtol=0, atol=1e-13)


@pytest.mark.parametrize("options", OPTIONS)
def test_quantized_sums_without_quantized_p_is_attention(options):
    """The row sums are those of the P that multiplies V: without P's quantization, the exact one."""
    args = make_fp8(np.random.default_rng(11), seqlen_q=40, seqlen_k=33)
    out, lse = ref.attention_fp8(**args, **options, quantize_p=False, quantized_sums=True, return_lse=True)
    want, want_lse = ref.attention(*dequantized(args), **options, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)


def assert_within_bounds(out, lse, want, want_lse, bound, lse_bound):
    assert np.all(np.abs(out - want) <= bound + TINY)
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(lse), empty) and np.all(lse_bound[empty] == 0)
    assert np.all(np.abs(lse[~empty] - want_lse[~empty]) <= lse_bound[~empty] + TINY)


@pytest.mark.parametrize("outliers", [0, 3])
@pytest.mark.parametrize("per", ["tensor", "head"])
@pytest.mark.parametrize("options", OPTIONS + [{"causal": True, "window_size": (4, -1)}])
def test_quantized_sums_within_bounds(outliers, per, options):
    """Both bounds, output and lse, on random and outlier-channel inputs with every option, GQA and both descale
    forms; 30 queries against 24 keys, so that causal leaves the first rows without keys."""
    args = make_fp8(np.random.default_rng(12 + outliers), seqlen_q=30, seqlen_k=24, per=per, outliers=outliers)
    want, want_lse = ref.attention(*dequantized(args), **options, return_lse=True)
    out, lse = ref.attention_fp8(**args, **options, quantized_sums=True, return_lse=True)
    bound, lse_bound = ref.fp8_error_bound(**args, **options, quantized_sums=True, return_lse=True)
    assert_within_bounds(out, lse, want, want_lse, bound, lse_bound)
    # the fp32 sums: the output's bound E_P, the lse exact
    out, lse = ref.attention_fp8(**args, **options, return_lse=True)
    bound, lse_bound = ref.fp8_error_bound(**args, **options, return_lse=True)
    assert np.all(lse_bound == 0)
    assert_within_bounds(out, lse, want, want_lse, bound, lse_bound)


def test_quantized_sums_change_out_and_lse():
    """The flag does something: on random inputs the output and the lse move. With V = 1 everywhere the quantized
    sums give exactly 1 (sum Pq / sum Pq) and their bound is 0 (|V_j - O| = 0), while the fp32 sums give
    sum Pq / sum P, off by about 2^-4 eta: a model or kernel that normalized by the wrong sums fails that bound."""
    args = make_fp8(np.random.default_rng(13))
    out_fp32, lse_fp32 = ref.attention_fp8(**args, return_lse=True)
    out, lse = ref.attention_fp8(**args, quantized_sums=True, return_lse=True)
    assert np.abs(out - out_fp32).max() > 1e-3 and np.abs(lse - lse_fp32).max() > 1e-3
    args["v8"], args["v_descale"] = ref._to_e4m3(np.ones(args["v8"].shape)), None
    bound, lse_bound = ref.fp8_error_bound(**args, quantized_sums=True, return_lse=True)
    assert bound.max() < TINY and lse_bound.min() > 1e-3
    np.testing.assert_allclose(ref.attention_fp8(**args, quantized_sums=True), 1.0, rtol=0, atol=TINY)
    assert np.abs(ref.attention_fp8(**args) - 1.0).max() > 1e-3


@pytest.mark.parametrize("v_mean", [0.0, 3.0])
def test_quantized_sums_bound_is_tight_and_not_vacuous(v_mean):
    """Spread rows: the error reaches a tenth of the bound somewhere, output and lse, and the bound stays below a
    quarter of the largest |O|. It measures |V_j - O_i|, not |V_j|: with values of mean 3 it is under half of E_P, and
    a twentieth of |O|."""
    args = make_fp8(np.random.default_rng(14), batch=1, seqlen_q=16, seqlen_k=128, nheads=2, nheads_k=2, d=64,
                    per="head", v_mean=v_mean)
    want, want_lse = ref.attention(*dequantized(args), return_lse=True)
    out, lse = ref.attention_fp8(**args, quantized_sums=True, return_lse=True)
    bound, lse_bound = ref.fp8_error_bound(**args, quantized_sums=True, return_lse=True)
    assert 0.1 < (np.abs(out - want) / bound).max() <= 1
    assert 0.1 < (np.abs(lse - want_lse) / lse_bound).max() <= 1
    assert bound.max() < 0.25 * np.abs(want).max()
    if v_mean:
        assert bound.max() < 0.05 * np.abs(want).max()
        assert bound.max() < 0.5 * ref.fp8_error_bound(**args).max()


def test_bounds_add_twice_the_bf16_errors():
    args = make_fp8(np.random.default_rng(15), seqlen_q=30, seqlen_k=24)
    base, base_lse = ref.fp8_error_bound(**args, causal=True, quantized_sums=True, return_lse=True)
    bound, lse_bound = ref.fp8_error_bound(**args, causal=True, quantized_sums=True, return_lse=True,
                                           bf16_error=0.01, bf16_lse_error=0.001)
    np.testing.assert_array_equal(bound, base + 0.02)
    empty = np.zeros((2, 4, 30), bool)
    empty[..., :6] = True                                   # queries 0..5 see no key
    np.testing.assert_array_equal(lse_bound, np.where(empty, 0.0, base_lse + 0.002))
    assert np.all(base_lse[~empty] > 0)


def test_quantized_sums_bound_needs_eta_below_one():
    """One key at score 0 and 1023 at -30 with p_scale 1: every s_j of the small ones is 2^-10, so eta = 2^-4 + 1023
    2^-10 > 1 and the quantized sums' bound is undefined; the fp32 sums' bound is not affected."""
    seqlen_k, d = 1024, 16
    q = np.zeros((1, 1, 1, d))
    q[..., 0] = 1.0
    k = np.zeros((1, seqlen_k, 1, d))
    k[0, 1:, 0, 0] = -30.0
    args = {"q8": ref._to_e4m3(q), "k8": ref._to_e4m3(k), "v8": ref._to_e4m3(np.ones((1, seqlen_k, 1, d))),
            "softmax_scale": 1.0, "p_scale": 1.0}
    with pytest.raises(ValueError, match="eta"):
        ref.fp8_error_bound(**args, quantized_sums=True)
    assert np.all(np.isfinite(ref.fp8_error_bound(**args)))
    ref.fp8_error_bound(**dict(args, p_scale=256.0), quantized_sums=True)


def online_softmax_fp8(q, k, v, visible, scale, block, reverse=False, p_scale=256.0):
    """The kernel's loop, in float64: key blocks in order (or reversed), a running row max m, P = exp(s - m)
    quantized against it, the accumulators and the quantized row sums rescaled by exp(m_old - m) as m rises."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    out = np.zeros((batch, seqlen_q, nheads, v.shape[-1]))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    starts = list(range(0, seqlen_k, block))
    for b in range(batch):
        for h in range(nheads):
            s = np.where(visible, scale * q[b, :, h] @ k[b, :, h // group].T, -np.inf)
            m = np.full(seqlen_q, -np.inf)
            acc, sums = np.zeros((seqlen_q, v.shape[-1])), np.zeros(seqlen_q)
            for j0 in reversed(starts) if reverse else starts:
                tile = s[:, j0:j0 + block]
                m_new = np.maximum(m, tile.max(axis=1))
                shift = np.where(np.isneginf(m_new), 0.0, m_new)
                alpha = np.exp(m - shift)                   # 0 while the row has seen no key
                pq = round_p(np.exp(tile - shift[:, None]), p_scale)
                acc = alpha[:, None] * acc + pq @ v[b, j0:j0 + block, h // group]
                sums = alpha * sums + pq.sum(axis=1)
                m = m_new
            seen = sums > 0
            out[b, :, h] = acc / np.where(seen, sums, 1.0)[:, None]
            lse[b, h] = np.where(seen, shift + np.log(np.where(seen, sums, 1.0)), -np.inf)
    return out, lse


@pytest.mark.parametrize("outliers", [0, 3])
@pytest.mark.parametrize("block,reverse", [(8, False), (8, True), (32, False)])
@pytest.mark.parametrize("options", MASKS)
def test_online_softmax_within_quantized_sums_bound(outliers, block, reverse, options):
    """Any tiling: P quantized against the running max of key blocks, then rescaled, stays within the quantized
    sums' bounds (output and lse). Where rows span several blocks the result differs from the one-tile model's."""
    args = make_fp8(np.random.default_rng(16 + outliers), seqlen_q=30, seqlen_k=72, per="head", outliers=outliers,
                    amplitude=2.0)
    q, k, v, visible, scale = inputs_by_hand(args, 2, options)
    out, lse = online_softmax_fp8(q, k, v, visible, scale, block, reverse)
    want, want_lse = ref.attention(*dequantized(args), **options, return_lse=True)
    bound, lse_bound = ref.fp8_error_bound(**args, **options, quantized_sums=True, return_lse=True)
    assert_within_bounds(out, lse, want, want_lse, bound, lse_bound)
    if not outliers and "window_size" not in options:   # the running max rises somewhere
        assert np.abs(out - ref.attention_fp8(**args, **options, quantized_sums=True)).max() > 0


def score_error_loop(q_row, k_row, scale):
    """_fp8_score_errors of one score, by a loop over the head dim's groups of 32."""
    err, partial = 0.0, 0.0
    for g in range(0, len(q_row), 32):
        qg, kg = q_row[g:g + 32], k_row[g:g + 32]
        err += max(np.abs(qg).max() * np.abs(kg).max(), abs(partial))
        partial += float(qg @ kg)
    return 2.0 ** -8 * scale * err


def test_tensor_core_scores_term():
    """With tensor_core_scores the lse bound adds E_S = the largest score error bound over the visible keys (the FP8
    tensor cores' score sums by groups of 32, docs/fp8.md), and the output bound grows by exp(2 E_S) on the P term
    plus the scores' term, at most the farthest value from O. One key: E_S is that key's term and O is V's row, so the
    scores' term is 0, from a loop over rows."""
    args = make_fp8(np.random.default_rng(14), seqlen_q=5, seqlen_k=1, d=80, outliers=2)
    q, k, _ = dequantized(args)
    bound, lse_bound = ref.fp8_error_bound(**args, return_lse=True)
    with_s, lse_with_s = ref.fp8_error_bound(**args, tensor_core_scores=True, return_lse=True)
    assert np.all(lse_bound == 0)
    group = q.shape[2] // k.shape[2]
    for b, i, h in np.ndindex(q.shape[0], q.shape[1], q.shape[2]):
        want = score_error_loop(q[b, i, h], k[b, 0, h // group], 1.0 / np.sqrt(q.shape[-1]))
        assert lse_with_s[b, h, i] == pytest.approx(want, rel=1e-12)
        grow = np.exp(min(2.0 * want, 40.0))
        assert np.allclose(with_s[b, i, h], grow * bound[b, i, h], rtol=1e-12, atol=0)
    empty = ref.fp8_error_bound(**dict(args, k8=args["k8"][:, :0], v8=args["v8"][:, :0]), tensor_core_scores=True,
                                 return_lse=True)
    assert np.all(empty[0] == 0) and np.all(empty[1] == 0)  # rows without keys


def test_tensor_core_scores_output_term():
    """Many keys: the output bound with tensor_core_scores is the bound without it times exp(2 E_S), plus
    min((exp(2 E_S) - 1) sigma, max_j |V_j - O|) (sigma: the values' standard deviation under P / l), computed here by
    loops over rows."""
    args = make_fp8(np.random.default_rng(15), batch=1, seqlen_q=3, seqlen_k=40, nheads=2, nheads_k=1, d=64,
                    outliers=1)
    q, k, v = dequantized(args)
    bound = ref.fp8_error_bound(**args, causal=True)
    with_s, lse_with_s = ref.fp8_error_bound(**args, causal=True, tensor_core_scores=True, return_lse=True)
    c = 1.0 / np.sqrt(q.shape[-1])
    for i, h in np.ndindex(q.shape[1], q.shape[2]):
        keys = range(k.shape[1] - q.shape[1] + i + 1)  # bottom-right causal
        s = np.array([c * q[0, i, h] @ k[0, j, 0] for j in keys])
        p = np.exp(s - s.max())
        o = p @ v[0, list(keys), 0] / p.sum()
        e_s = max(score_error_loop(q[0, i, h], k[0, j, 0], c) for j in keys)
        assert lse_with_s[0, h, i] == pytest.approx(e_s, rel=1e-12)
        grow = np.exp(min(2.0 * e_s, 40.0))
        spread = np.sqrt(p @ (v[0, list(keys), 0] - o) ** 2 / p.sum())
        farthest = np.maximum(v[0, :, 0].max(axis=0) - o, o - v[0, :, 0].min(axis=0))
        want = grow * bound[0, i, h] + np.minimum((grow - 1.0) * spread, farthest)
        assert np.allclose(with_s[0, i, h], want, rtol=1e-9, atol=1e-12)

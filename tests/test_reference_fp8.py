"""CPU tests of the FP8 (e4m3) reference and its accuracy contract (cuflash.reference.attention_fp8,
fp8_error_bound, quantize_e4m3, dequantize_e4m3; docs/fp8.md).

The FP8 kernel's GPU tests rest on three facts checked here: without P's quantization the FP8 reference is
``reference.attention`` on the dequantized inputs; the quantization of P stays within the documented bound, on
random inputs and on inputs with outlier channels, with every mask option, GQA and per-head descales; and the bound
is tight enough that a kernel which skips P's scaling fails it.
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

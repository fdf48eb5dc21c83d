"""Shared pieces of the GPU tests: inputs, a naive low-precision attention, the accuracy rule."""
from __future__ import annotations

import numpy as np

from cuflash.reference import _bhsd  # (b, s, h, d) <-> (b, h, s, d), for batched matrix products

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # CPU-only runs never reach the GPU tests
    BF16 = None

DTYPES = {"fp16": np.dtype(np.float16), "bf16": BF16}


def randn(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def naive_lowp(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None):
    """Attention computed the naive way in the inputs' low precision: scores, probabilities and output are
    each rounded to the input dtype (float32 arithmetic in between), as a plain framework implementation
    would. Its error against float64 sets the bar a kernel must meet."""
    lowp = q.dtype
    qf, kf, vf = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    kf, vf = np.repeat(kf, g, axis=2), np.repeat(vf, g, axis=2)
    s = (_bhsd(qf) @ _bhsd(kf).swapaxes(-1, -2)).astype(lowp).astype(np.float32) * scale
    s = s.astype(lowp).astype(np.float32)
    if softcap > 0:
        s = (softcap * np.tanh(s / softcap)).astype(lowp).astype(np.float32)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float32).reshape(-1, h), (b, h))
        s = s - slopes[:, :, None, None] * np.abs(i + sk - sq - j)[None, None]
    visible = reference_visible(sq, sk, causal, window_size)
    s = np.where(visible[None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = (p / np.where(l > 0, l, 1)).astype(lowp).astype(np.float32)
    out = _bhsd(p @ _bhsd(vf))
    return out.astype(lowp)


def reference_visible(sq, sk, causal, window_size):
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def assert_close_to_reference(out, ref, naive, *, what="out", floor=1e-3, context=""):
    """|out - ref| <= 2 max|naive - ref| + floor + half an ulp of ref in out's dtype, elementwise, with a report that
    helps when it fails. The half ulp: both out and naive end rounded to the low-precision dtype, and where a value
    lies near a rounding midpoint an error far below naive's can still round one ulp away (seen once: a bf16 dv of
    32 elements, naive's worst error 0.005, out one ulp from the nearest bf16 to the reference)."""
    out = np.asarray(out)
    eps = float(ml_dtypes.finfo(out.dtype).eps) if out.dtype == BF16 else float(np.finfo(out.dtype).eps)
    out = out.astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    n_nan, n_inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
    err = np.abs(out - ref)
    bound = 2 * float(np.max(np.abs(naive - ref), initial=0.0)) + floor
    worst = float(np.max(err, initial=0.0)) if n_nan == 0 else float("nan")
    if n_nan or n_inf or not bool(np.all(err <= bound + 0.5 * eps * np.abs(ref))):
        idx = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), err.shape) if err.size else ()
        raise AssertionError(
            f"{what}: max error {worst:.3g} > bound {bound:.3g} ({context}); NaN {n_nan}, inf {n_inf}, "
            f"shape {out.shape}, worst at {tuple(int(i) for i in idx)}: got {out[idx] if err.size else None}, "
            f"want {ref[idx] if err.size else None}")


def assert_lse_close(lse, ref, *, tol=2e-3, context=""):
    lse = np.asarray(lse, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    inf_ref = np.isneginf(ref)
    assert np.array_equal(np.isneginf(lse), inf_ref), (
        f"lse: -inf pattern differs ({context}): got {int(np.isneginf(lse).sum())}, want {int(inf_ref.sum())}; "
        f"NaN {int(np.isnan(lse).sum())}")
    fin = ~inf_ref
    err = np.abs(lse[fin] - ref[fin])
    worst = float(err.max(initial=0.0)) if not np.isnan(err).any() else float("nan")
    assert worst <= tol * (1 + float(np.abs(ref[fin]).max(initial=0.0))), f"lse: max error {worst:.3g} ({context})"


def naive_lowp_backward(dout, q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        softmax_scale=None):
    """Gradients computed the naive way in low precision: every intermediate a framework would materialize
    (P, O, dP, dS, the gradients) rounded to the input dtype, float32 arithmetic in between."""
    lowp = q.dtype
    r = lambda x: np.asarray(x, dtype=np.float32).astype(lowp).astype(np.float32)  # noqa: E731
    qf, kf, vf, dof = (np.asarray(x, dtype=np.float32) for x in (q, k, v, dout))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    kf, vf = np.repeat(kf, g, axis=2), np.repeat(vf, g, axis=2)
    s = r((_bhsd(qf) @ _bhsd(kf).swapaxes(-1, -2)) * scale)
    dtanh = np.ones_like(s)
    if softcap > 0:
        t = np.tanh(s / softcap)
        dtanh = 1 - t * t
        s = r(softcap * t)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float32).reshape(-1, h), (b, h))
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        s = s - slopes[:, :, None, None] * np.abs(i + sk - sq - j)[None, None]
    visible = reference_visible(sq, sk, causal, window_size)
    s = np.where(visible[None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    p = r(p / np.where(l > 0, l, 1))
    o = r(_bhsd(p @ _bhsd(vf)))
    dv = _bhsd(p.swapaxes(-1, -2) @ _bhsd(dof))
    dp = r(_bhsd(dof) @ _bhsd(vf).swapaxes(-1, -2))
    dsum = np.einsum("bqhd,bqhd->bhq", dof, o)[..., None]
    ds = r(p * (dp - dsum) * dtanh)
    dq = _bhsd(ds @ _bhsd(kf)) * scale
    dk = _bhsd(ds.swapaxes(-1, -2) @ _bhsd(qf)) * scale
    group = lambda x: x.reshape(b, sk, hk, g, d).sum(axis=3)  # noqa: E731
    return r(dq).astype(lowp), r(group(dk)).astype(lowp), r(group(dv)).astype(lowp)

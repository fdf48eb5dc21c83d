"""Property tests of cuflash.reference, the float64 definition every kernel is checked against.

CPU only and fast: shapes are tiny, hypothesis draws the shapes, options and data. The central
check is an independent naive implementation (a plain loop over query i and key j that restates
the mask rules from DESIGN.md); the rest are algebraic properties that any correct attention has.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuflash import reference as ref

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

OPTION_NAMES = ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes")


# --------------------------------------------------------------------------------------------
# An independent naive implementation: one query row at a time, one key at a time
# --------------------------------------------------------------------------------------------


def naive_visible(i, j, seqlen_q, seqlen_k, causal, window_size):
    """The mask rules of DESIGN.md, spelled out for one (query, key) pair."""
    left, right = window_size
    if causal:
        right = 0
    diagonal = i + seqlen_k - seqlen_q          # the key aligned with query i (bottom-right)
    if left != -1 and j < diagonal - left:
        return False
    if right != -1 and j > diagonal + right:
        return False
    return True


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, keys=None):
    """Loop implementation; ``keys`` (a set of key indices) further restricts what is visible."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    out = np.zeros((batch, seqlen_q, nheads, v.shape[-1]))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            kh = h // (nheads // nheads_k)
            slope = 0.0
            if alibi_slopes is not None:
                slopes = np.asarray(alibi_slopes, dtype=np.float64)
                slope = slopes[h] if slopes.ndim == 1 else slopes[b, h]
            for i in range(seqlen_q):
                scores, values = [], []
                for j in range(seqlen_k):
                    if not naive_visible(i, j, seqlen_q, seqlen_k, causal, window_size):
                        continue
                    if keys is not None and j not in keys:
                        continue
                    s = scale * sum(q[b, i, h, e] * k[b, j, kh, e] for e in range(headdim))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    s -= slope * abs(i + seqlen_k - seqlen_q - j)
                    scores.append(s)
                    values.append(v[b, j, kh])
                if scores:
                    m = max(scores)
                    w = [math.exp(s - m) for s in scores]
                    z = sum(w)
                    out[b, i, h] = sum(wj * vj for wj, vj in zip(w, values)) / z
                    lse[b, h, i] = m + math.log(z)
    return out, lse


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


@st.composite
def cases(draw, max_batch=2, max_seqlen=6, max_headdim=4, min_seqlen_k=0, options=True):
    """(q, k, v, opts, rng) with tiny shapes, GQA groups and, if ``options``, every option."""
    batch = draw(st.integers(1, max_batch))
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 3))
    seqlen_q = draw(st.integers(1, max_seqlen))
    seqlen_k = draw(st.integers(min_seqlen_k, max_seqlen))
    headdim = draw(st.integers(1, max_headdim))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    amp = draw(st.sampled_from([0.3, 1.0, 3.0]))
    q = amp * rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = amp * rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    opts = {}
    if options:
        opts = draw(option_sets(batch, nheads, rng))
    return q, k, v, opts, rng


@st.composite
def option_sets(draw, batch, nheads, rng):
    alibi = draw(st.sampled_from([None, "h", "bh"]))
    slopes = None
    if alibi == "h":
        slopes = rng.uniform(0, 1, nheads).astype(np.float32)
    elif alibi == "bh":
        slopes = rng.uniform(0, 1, (batch, nheads)).astype(np.float32)
    return dict(
        softmax_scale=draw(st.sampled_from([None, 0.3, 1.7])),
        causal=draw(st.booleans()),
        window_size=(draw(st.integers(-1, 4)), draw(st.integers(-1, 4))),
        softcap=draw(st.sampled_from([0.0, 0.7, 5.0])),
        alibi_slopes=slopes,
    )


def assert_close(actual, expected, rtol=1e-10, atol=1e-12, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in result"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(cases())
def test_matches_naive_implementation_with_every_option(case):
    q, k, v, opts, _ = case
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    out_n, lse_n = naive_attention(q, k, v, **opts)
    assert out.dtype == lse.dtype == np.float64
    assert_close(out, out_n, what="out")
    assert_close(lse, lse_n, what="lse")


@SETTINGS
@given(cases(options=False))
def test_causal_equals_explicit_bottom_right_mask(case):
    q, k, v, _, _ = case
    sq, sk = q.shape[1], k.shape[1]
    mask = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        for j in range(sk):
            mask[i, j] = j <= i + sk - sq
    # Explicit masked softmax, independent of the reference's helpers.
    ke = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    ve = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, ke) / math.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    for i in range(sq):
        if not mask[i].any():
            assert np.all(out[:, i] == 0) and np.all(lse[:, :, i] == -np.inf)
            continue
        row = s[:, :, i, :]                                    # (b, h, sk)
        lse_i = np.logaddexp.reduce(row, axis=-1)
        p = np.exp(row - lse_i[..., None])
        assert_close(lse[:, :, i], lse_i, what="lse")
        assert_close(out[:, i], np.einsum("bhj,bjhd->bhd", p, ve), what="out")


@SETTINGS
@given(cases(), st.integers(-1, 5))
def test_window_equivalences(case, left):
    q, k, v, opts, _ = case
    base = {n: opts[n] for n in ("softmax_scale", "softcap", "alibi_slopes")}
    no_window = ref.attention(q, k, v, **base)
    assert_close(ref.attention(q, k, v, window_size=(-1, -1), **base), no_window, what="(-1,-1)")
    huge = max(q.shape[1], k.shape[1]) + 1
    assert_close(ref.attention(q, k, v, window_size=(huge, huge), **base), no_window, what="huge window")
    causal = ref.attention(q, k, v, causal=True, **base)
    assert_close(ref.attention(q, k, v, window_size=(-1, 0), **base), causal, what="causal vs (-1, 0)")
    for right in (-1, 0, 3):     # causal forces right = 0, keeps left
        assert_close(ref.attention(q, k, v, causal=True, window_size=(left, right), **base),
                     ref.attention(q, k, v, window_size=(left, 0), **base), what=f"causal + ({left}, {right})")


@SETTINGS
@given(cases())
def test_gqa_equals_repeated_kv_heads(case):
    q, k, v, opts, rng = case
    group = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    out_r, lse_r = ref.attention(q, kr, vr, return_lse=True, **opts)
    assert_close(out, out_r, what="out")
    assert_close(lse, lse_r, what="lse")
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    dq_r, dk_r, dv_r = ref.attention_backward(dout, q, kr, vr, out_r, lse_r, **opts)
    sum_groups = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(axis=3)  # noqa: E731
    assert_close(dq, dq_r, what="dq")
    assert_close(dk, sum_groups(dk_r), what="dk")
    assert_close(dv, sum_groups(dv_r), what="dv")


@SETTINGS
@given(cases())
def test_output_rows_lie_in_convex_hull_of_visible_values(case):
    q, k, v, opts, _ = case
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    for i in range(sq):
        vis = [j for j in range(sk) if naive_visible(i, j, sq, sk, opts["causal"], opts["window_size"])]
        for h in range(q.shape[2]):
            if not vis:
                assert np.all(out[:, i, h] == 0) and np.all(lse[:, h, i] == -np.inf)
                continue
            rows = v[:, vis, h // group]                       # (b, n_visible, d)
            assert np.all(out[:, i, h] >= rows.min(axis=1) - 1e-12)
            assert np.all(out[:, i, h] <= rows.max(axis=1) + 1e-12)


@SETTINGS
@given(cases())
def test_lse_is_logsumexp_of_scores(case):
    q, k, v, opts, _ = case
    _, lse = ref.attention(q, k, v, return_lse=True, **opts)
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    scale = opts["softmax_scale"] or 1 / math.sqrt(q.shape[-1])
    slopes = opts["alibi_slopes"]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(sq):
                terms = []
                for j in range(sk):
                    if naive_visible(i, j, sq, sk, opts["causal"], opts["window_size"]):
                        s = scale * float(q[b, i, h] @ k[b, j, h // group])
                        if opts["softcap"]:
                            s = opts["softcap"] * math.tanh(s / opts["softcap"])
                        if slopes is not None:
                            s -= float(slopes[h] if slopes.ndim == 1 else slopes[b, h]) * abs(i + sk - sq - j)
                        terms.append(s)
                expected = np.logaddexp.reduce(terms) if terms else -np.inf
                np.testing.assert_allclose(lse[b, h, i], expected, rtol=1e-12, atol=1e-12)


@FEW
@given(cases(options=False))
def test_default_scale_and_low_precision_inputs(case):
    q, k, v, _, _ = case
    d = q.shape[-1]
    assert_close(ref.attention(q, k, v), ref.attention(q, k, v, softmax_scale=1 / math.sqrt(d)), what="scale")
    for dtype in (np.float16, np.float32, ml_dtypes.bfloat16):
        ql, kl, vl = (x.astype(dtype) for x in (q, k, v))
        out = ref.attention(ql, kl, vl)
        assert out.dtype == np.float64
        expected = ref.attention(*(x.astype(np.float64) for x in (ql, kl, vl)))
        assert_close(out, expected, rtol=0, atol=0, what=str(dtype))


# --------------------------------------------------------------------------------------------
# Empty rows: out 0, lse -inf, zero gradients, never NaN
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(cases(min_seqlen_k=0), st.sampled_from(["sq>sk causal", "sq>sk window", "no keys"]))
def test_empty_rows_give_zero_out_neg_inf_lse_and_zero_grads(case, how):
    q, k, v, opts, rng = case
    opts = dict(opts)
    if how == "no keys":
        k, v = k[:, :0], v[:, :0]
    else:                            # fewer keys than queries: the top rows sit left of key 0
        k, v = k[:, : q.shape[1] // 2], v[:, : q.shape[1] // 2]
        if how == "sq>sk causal":
            opts["causal"] = True
        else:                        # a window with right = 0 and no causal flag does the same
            opts.update(causal=False, window_size=(opts["window_size"][0], 0))
    sq, sk = q.shape[1], k.shape[1]
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    for x in (out, lse, *grads):
        assert not np.isnan(x).any()
    empty = [i for i in range(sq)
             if not any(naive_visible(i, j, sq, sk, opts["causal"], opts["window_size"]) for j in range(sk))]
    assert empty, "the case was built to have empty rows"
    assert np.all(out[:, empty] == 0)
    assert np.all(lse[:, :, empty] == -np.inf)
    assert np.all(grads[0][:, empty] == 0)
    if len(empty) == sq:
        assert np.all(grads[1] == 0) and np.all(grads[2] == 0)


# --------------------------------------------------------------------------------------------
# combine
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(cases(min_seqlen_k=1), st.data())
def test_combine_of_key_chunks_reproduces_the_whole(case, data):
    q, k, v, opts, _ = case
    sk = k.shape[1]
    cuts = sorted(data.draw(st.lists(st.integers(0, sk), max_size=3)))
    bounds = [0, *cuts, sk]
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o, l = naive_attention(q, k, v, keys=set(range(lo, hi)), **opts)
        o[np.isneginf(l).transpose(0, 2, 1)] = np.nan      # an empty split's out must be ignored
        outs.append(o.transpose(0, 2, 1, 3))                   # combine wants lse-shaped leading axes
        lses.append(l)
    out, lse = ref.combine(np.stack(outs), np.stack(lses))
    out_whole, lse_whole = ref.attention(q, k, v, return_lse=True, **opts)
    assert_close(out, out_whole.transpose(0, 2, 1, 3), what="out")
    assert_close(lse, lse_whole, what="lse")


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_combine_exact_formula_and_all_empty(splits, rows, seed):
    rng = np.random.default_rng(seed)
    lses = 5 * rng.standard_normal((splits, rows))
    lses[rng.random((splits, rows)) < 0.3] = -np.inf
    outs = rng.standard_normal((splits, rows, 3))
    out, lse = ref.combine(outs, lses)
    for r in range(rows):
        live = [s for s in range(splits) if np.isfinite(lses[s, r])]
        if not live:
            assert lse[r] == -np.inf and np.all(out[r] == 0)
            continue
        total = sum(math.exp(lses[s, r]) for s in live)
        np.testing.assert_allclose(lse[r], math.log(total), rtol=1e-12)
        np.testing.assert_allclose(out[r], sum(math.exp(lses[s, r]) * outs[s, r] for s in live) / total,
                                   rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@FEW
@given(cases(max_batch=1, max_seqlen=4, max_headdim=3))
def test_backward_matches_central_finite_differences(case):
    q, k, v, opts, rng = case
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    inputs = [q, k, v]
    eps = 1e-6
    for which, grad in enumerate(grads):
        assert grad.shape == inputs[which].shape
        numeric = np.zeros_like(grad)
        for idx in np.ndindex(*grad.shape):
            loss = []
            for sign in (1, -1):
                args = [x.copy() for x in inputs]
                args[which][idx] += sign * eps
                loss.append(np.sum(dout * ref.attention(*args, **opts)))
            numeric[idx] = (loss[0] - loss[1]) / (2 * eps)
        assert_close(grad, numeric, rtol=1e-5, atol=1e-7, what="d" + "qkv"[which])


# --------------------------------------------------------------------------------------------
# varlen
# --------------------------------------------------------------------------------------------


@st.composite
def varlen_cases(draw):
    batch = draw(st.integers(1, 3))
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 2))
    headdim = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    lens_k = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((sum(lens_q), nheads, headdim))
    k = rng.standard_normal((sum(lens_k), nheads_k, headdim))
    v = rng.standard_normal((sum(lens_k), nheads_k, headdim))
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    opts = draw(option_sets(batch, nheads, rng))
    return q, k, v, cu_q, cu_k, opts, rng


@SETTINGS
@given(varlen_cases())
def test_varlen_equals_loop_over_sequences(case):
    q, k, v, cu_q, cu_k, opts, rng = case
    max_q, max_k = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
    out, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = ref.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **opts)
    slopes = opts["alibi_slopes"]
    for b in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = dict(opts, alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1]))
        o, l = ref.attention(q[None, sq], k[None, sk], v[None, sk], return_lse=True, **one)
        assert_close(out[sq], o[0], what="out")
        assert_close(lse[:, sq], l[0], what="lse")
        g = ref.attention_backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], o, l, **one)
        assert_close(dq[sq], g[0][0], what="dq")
        assert_close(dk[sk], g[1][0], what="dk")
        assert_close(dv[sk], g[2][0], what="dv")


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


@st.composite
def kvcache_cases(draw):
    batch = draw(st.integers(1, 3))
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 2))
    headdim = draw(st.integers(1, 4))
    seqlen_new = draw(st.integers(1, 3))
    seqlen_new_k = draw(st.sampled_from([None, 0, 1, 2]))          # None: no append
    max_len = draw(st.integers(1, 8)) + (seqlen_new_k or 0)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lens = rng.integers(0, max_len - (seqlen_new_k or 0) + 1, batch)
    cache_seqlens = draw(st.sampled_from(["array", "int", "none"]))
    if cache_seqlens == "int":
        lens[:] = lens[0]
    elif cache_seqlens == "none":
        lens[:] = max_len - (seqlen_new_k or 0)
        if seqlen_new_k:
            cache_seqlens = "array"      # appending needs room, so give the lengths explicitly
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    q = rng.standard_normal((batch, seqlen_new, nheads, headdim))
    k_cache = rng.standard_normal((batch, max_len, nheads_k, headdim)).astype(dtype)
    v_cache = rng.standard_normal((batch, max_len, nheads_k, headdim)).astype(dtype)
    k_new = v_new = None
    if seqlen_new_k is not None:
        k_new = rng.standard_normal((batch, seqlen_new_k, nheads_k, headdim))
        v_new = rng.standard_normal((batch, seqlen_new_k, nheads_k, headdim))
    seqlens_arg = {"array": lens.astype(np.int32), "int": int(lens[0]), "none": None}[cache_seqlens]
    opts = draw(option_sets(batch, nheads, rng))
    return q, k_cache, v_cache, k_new, v_new, lens, seqlens_arg, opts, rng


@SETTINGS
@given(kvcache_cases(), st.booleans())
def test_kvcache_appends_in_place_and_equals_attention(case, permute):
    q, k_cache, v_cache, k_new, v_new, lens, seqlens_arg, opts, rng = case
    batch = q.shape[0]
    batch_idx = rng.permutation(batch).astype(np.int32) if permute else None
    rows = batch_idx if permute else np.arange(batch)
    k0, v0 = k_cache.copy(), v_cache.copy()
    out, lse = ref.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens_arg,
                                         cache_batch_idx=batch_idx, num_splits=3, return_lse=True, **opts)
    n_new = 0 if k_new is None else k_new.shape[1]
    # In place: exactly the appended rows changed, holding the new keys in the cache's dtype.
    k_exp, v_exp = k0.copy(), v0.copy()
    for b in range(batch):
        r, lo = rows[b], lens[b]
        if n_new:
            k_exp[r, lo:lo + n_new] = k_new[b].astype(k0.dtype)
            v_exp[r, lo:lo + n_new] = v_new[b].astype(v0.dtype)
    np.testing.assert_array_equal(k_cache, k_exp)
    np.testing.assert_array_equal(v_cache, v_exp)
    # Attention: each batch row against its first lens + n_new cache positions.
    slopes = opts["alibi_slopes"]
    for b in range(batch):
        r, length = rows[b], lens[b] + n_new
        one = dict(opts, alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1]))
        o, l = ref.attention(q[b:b + 1], k_exp[r:r + 1, :length], v_exp[r:r + 1, :length], return_lse=True, **one)
        assert_close(out[b], o[0], what="out")
        assert_close(lse[b], l[0], what="lse")


@SETTINGS
@given(kvcache_cases(), st.sampled_from([1, 2, 3, 5]), st.integers(0, 3))
def test_paged_cache_equals_contiguous(case, page_size, spare_pages):
    q, k_cache, v_cache, k_new, v_new, lens, seqlens_arg, opts, rng = case
    batch, max_len = k_cache.shape[:2]
    pages_per_seq = -(-max_len // page_size)
    pad = pages_per_seq * page_size - max_len
    if seqlens_arg is None and pad:          # "whole cache" differs once padded to full pages
        seqlens_arg = np.full(batch, max_len, dtype=np.int32)
    k_contig = np.pad(k_cache, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v_contig = np.pad(v_cache, ((0, 0), (0, pad), (0, 0), (0, 0)))
    num_pages = batch * pages_per_seq + spare_pages
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
    k_pool = rng.standard_normal((num_pages, page_size) + k_cache.shape[2:]).astype(k_cache.dtype)
    v_pool = rng.standard_normal((num_pages, page_size) + v_cache.shape[2:]).astype(v_cache.dtype)
    for b in range(batch):
        for p in range(pages_per_seq):
            k_pool[table[b, p]] = k_contig[b, p * page_size:(p + 1) * page_size]
            v_pool[table[b, p]] = v_contig[b, p * page_size:(p + 1) * page_size]
    spare = np.setdiff1d(np.arange(num_pages), table)
    k_spare, v_spare = k_pool[spare].copy(), v_pool[spare].copy()

    out_c, lse_c = ref.attention_with_kvcache(q, k_contig, v_contig, k=k_new, v=v_new, cache_seqlens=seqlens_arg,
                                             return_lse=True, **opts)
    out_p, lse_p = ref.attention_with_kvcache(q, k_pool, v_pool, k=k_new, v=v_new, cache_seqlens=seqlens_arg,
                                             block_table=table, return_lse=True, **opts)
    assert_close(out_p, out_c, rtol=0, atol=0, what="out")
    assert_close(lse_p, lse_c, rtol=0, atol=0, what="lse")
    for b in range(batch):                    # the pool, read through the table, is the contiguous cache
        np.testing.assert_array_equal(k_pool[table[b]].reshape(k_contig[b].shape), k_contig[b])
        np.testing.assert_array_equal(v_pool[table[b]].reshape(v_contig[b].shape), v_contig[b])
    np.testing.assert_array_equal(k_pool[spare], k_spare)     # pages outside the table are untouched
    np.testing.assert_array_equal(v_pool[spare], v_spare)


def test_kvcache_rejects_overflow_and_paged_with_batch_idx():
    q = np.zeros((1, 1, 1, 2))
    cache = np.zeros((1, 3, 1, 2))
    with pytest.raises(ValueError, match="overflows"):
        ref.attention_with_kvcache(q, cache, cache.copy(), k=np.ones((1, 2, 1, 2)), v=np.ones((1, 2, 1, 2)),
                                   cache_seqlens=2)
    assert np.all(cache == 0)
    with pytest.raises(ValueError, match="block_table"):
        ref.attention_with_kvcache(q, cache, cache, block_table=np.zeros((1, 1), np.int32),
                                   cache_batch_idx=np.zeros(1, np.int32))


def test_bad_head_counts_are_rejected():
    with pytest.raises(ValueError, match="multiple of nheads_k"):
        ref.attention(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_turns_each_pair_by_its_angle(interleaved):
    """Pairs (2j, 2j + 1), or (j, j + R / 2), as complex numbers times exp(i angle_j) of the row's position; the
    elements past R and rows past the tables unchanged."""
    rng = np.random.default_rng(0)
    rows, h, d, r, seqlen_ro = 5, 2, 48, 32, 7
    x = rng.standard_normal((rows, h, d)).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi, (seqlen_ro, r // 2))
    positions = np.array([0, 3, 6, 7, -1])  # the last two outside the tables
    got = ref.rotary(x, np.cos(angle), np.sin(angle), positions, interleaved)
    for i, pos in enumerate(positions):
        if not 0 <= pos < seqlen_ro:
            np.testing.assert_array_equal(got[i], x[i])
            continue
        first, second = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2), slice(r // 2, r))
        z = (x[i][:, first] + 1j * x[i][:, second].astype(np.float64)) * np.exp(1j * angle[pos])
        np.testing.assert_allclose(got[i][:, first], z.real, atol=1e-5)
        np.testing.assert_allclose(got[i][:, second], z.imag, atol=1e-5)
        np.testing.assert_array_equal(got[i][:, r:], x[i][:, r:])


def test_kvcache_leftpad_attends_from_the_pad_on():
    """cache_leftpad[b] = s: row b attends to cache positions s .. L_b - 1 as a sequence of its own."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 2, 16))
    kc, vc = rng.standard_normal((2, 12, 1, 16)), rng.standard_normal((2, 12, 1, 16))
    lens, pads = np.array([9, 5]), np.array([3, 0])
    got = ref.attention_with_kvcache(q, kc.copy(), vc.copy(), cache_seqlens=lens, cache_leftpad=pads,
                                           causal=True)
    for b in range(2):
        want = ref.attention(q[b:b + 1], kc[b:b + 1, pads[b]:lens[b]], vc[b:b + 1, pads[b]:lens[b]],
                                   causal=True)
        np.testing.assert_allclose(got[b:b + 1], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page_size", [16, 48])
def test_paged_varlen_equals_varlen_on_the_gathered_keys(page_size):
    """attention_varlen with block_table (and seqused_k) equals attention_varlen on each sequence's keys gathered
    from its pages into packed rows."""
    rng = np.random.default_rng(page_size)
    lens_q, lens_k = [3, 1, 5], [40, 7, 0]
    pages = [-(-n // page_size) for n in lens_k]
    num_pages = sum(pages) + 2
    pool_k, pool_v = rng.standard_normal((2, num_pages, page_size, 2, 16))
    order = rng.permutation(num_pages)
    table = np.zeros((3, max(pages)), np.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
    q = rng.standard_normal((sum(lens_q), 4, 16))
    cu_q = np.cumsum([0] + lens_q).astype(np.int32)
    cu_k = np.cumsum([0] + lens_k).astype(np.int32)
    got = ref.attention_varlen(q, pool_k, pool_v, cu_q, cu_k, 5, 40, causal=True, block_table=table,
                               seqused_k=np.array(lens_k, np.int32))
    gather = lambda pool: np.concatenate([  # noqa: E731
        pool[table[b, np.arange(n) // page_size], np.arange(n) % page_size] for b, n in enumerate(lens_k)])
    want = ref.attention_varlen(q, gather(pool_k), gather(pool_v), cu_q, cu_k, 5, 40, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Dropout: the generator and the mask
# --------------------------------------------------------------------------------------------

def test_philox_known_answers():
    """Random123's known-answer vectors for Philox 4x32-10."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        assert [int(x) for x in ref.philox4x32([np.uint32(c) for c in counter], key)] == list(want)


def test_dropout_mask_keeps_one_minus_p_independently():
    """The kept fraction is 1 - p (to the threshold's 1/256) within 4 sigma, over batches, heads, rows and keys; masks
    of different seeds or offsets, and of neighbouring rows, heads and batches, are uncorrelated (chi-square of the
    2 x 2 table of pairs, 1 degree of freedom, below 15)."""
    p = 0.3
    keep = ref.dropout_keep(seed=1234, offset=7, batch=2, nheads=3, seqlen_q=96, seqlen_k=160, dropout_p=p)
    pk = ref.dropout_threshold(p) / ref.DROPOUT_LEVELS
    n = keep.size
    assert abs(keep.mean() - pk) < 4 * math.sqrt(pk * (1 - pk) / n)

    def chi2(a, b):
        a, b = a.ravel(), b.ravel()
        table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]], dtype=np.float64)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        return float(((table - expected) ** 2 / expected).sum())

    for a, b in ((keep[:, :, 1:], keep[:, :, :-1]), (keep[:, :, :, 1:], keep[:, :, :, :-1]),
                 (keep[:, 1:], keep[:, :-1]), (keep[1:], keep[:-1]), (keep[:, :, 8:], keep[:, :, :-8]),
                 (keep[:, :, :, 8:], keep[:, :, :, :-8])):
        assert chi2(a, b) < 15
    other_seed = ref.dropout_keep(seed=1235, offset=7, batch=2, nheads=3, seqlen_q=96, seqlen_k=160, dropout_p=p)
    other_offset = ref.dropout_keep(seed=1234, offset=8, batch=2, nheads=3, seqlen_q=96, seqlen_k=160, dropout_p=p)
    assert chi2(keep, other_seed) < 15 and chi2(keep, other_offset) < 15
    again = ref.dropout_keep(seed=1234, offset=7, batch=2, nheads=3, seqlen_q=96, seqlen_k=160, dropout_p=p)
    assert np.array_equal(keep, again)
    # a sub-block of a bigger problem is the same mask: the index of an element is its own (b, h, i, j)
    big = ref.dropout_keep(seed=1234, offset=7, batch=2, nheads=3, seqlen_q=200, seqlen_k=300, dropout_p=p)
    assert np.array_equal(big[:, :, :96, :160], keep)


def _pair_bits(seed, offset, bh, R, C, a, t, threshold):
    """The keep bits of pair (R, C, a, t) as cuda_src/dropout.cuh's keep_bits computes them: bit 8 s + u for draw u
    of set s (byte u % 4 of output word 2 s + u / 4)."""
    key = (seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    words = [int(w) for w in ref.philox4x32([np.uint32(C), np.uint32(R), np.uint32(16 * bh + 4 * a + t),
                                             np.uint32(offset & 0xFFFFFFFF)], key)]
    return sum(int(((words[v // 4] >> (8 * (v % 4))) & 0xFF) < threshold) << v for v in range(16))


def _shared_pairs(draw, tiles):
    """Dropout::shared_pairs for all 32 lanes: draw(lane, x) -> the pair bits that lane computes for tile x; each lane
    draws tiles 2j + g % 2 and takes the others from lane ^ 4 (the shuffle), a last odd tile it draws itself."""
    out = {}
    for lane in range(32):
        odd, bits = (lane // 4) % 2, []
        for x in range(tiles):
            drawer = lane if x == tiles - 1 and tiles % 2 else (lane if x % 2 == odd else lane ^ 4)
            bits.append(draw(drawer, x))
        out[lane] = bits
    return out


@pytest.mark.parametrize("nt", [2, 4, 6, 8])
def test_dropout_thread_layouts_cover_the_reference_mask(nt):
    """The bit maps of cuda_src/dropout.cuh, lane by lane: keep_rows (the forward's layout) and keep_mask_cols (the
    backward's transposed layout), each lane drawing the call of every other tile and taking the rest from lane ^ 4,
    give every element of nt / 2 16 x 16 tiles the reference's keep bit, in the mma.sync C-fragment positions."""
    seed, offset, bh, p = (5 << 40) + 77, (3 << 33) + 9, 7, 0.4
    threshold = ref.dropout_threshold(p)
    tiles = nt // 2
    keep = ref.dropout_keep(seed, offset, 1, bh + 1, 16 * (tiles + 2), 16 * (tiles + 2), p)[0, bh]  # (query, key)
    R, C = 1, 1

    def bit(value, i):
        return bool((value >> i) & 1)

    # keep_rows<nt>(words, R, C, lane): lane (g, c) draws pair (a = g / 2, t = c) of key tile C + x
    rows = _shared_pairs(lambda drawer, x: _pair_bits(seed, offset, bh, R, C + x, (drawer // 4) // 2, drawer % 4,
                                                      threshold), tiles)
    for lane in range(32):
        g, c, odd = lane // 4, lane % 4, (lane // 4) % 2
        for n in range(nt):
            m, ch = n // 2, n % 2
            for e in range(4):
                row, col = 16 * R + g + 8 * (e // 2), 16 * (C + m) + 8 * ch + 2 * c + e % 2
                got = bit(rows[lane][m] >> odd, 8 * (e % 2) + 4 * (e // 2) + 2 * ch)
                assert got == keep[row, col], ("keep_rows", nt, lane, n, e)
    # keep_mask_cols<nt>(key16 = C, query16 = R, lane): lane (g, c) draws pair (a = c, t = g / 2) of query tile R + x
    cols = _shared_pairs(lambda drawer, x: _pair_bits(seed, offset, bh, R + x, C, drawer % 4, (drawer // 4) // 2,
                                                      threshold), tiles)
    for lane in range(32):
        g, c, odd = lane // 4, lane % 4, (lane // 4) % 2
        for n in range(nt):
            m, ch = n // 2, n % 2
            for e in range(4):
                key, query = 16 * C + g + 8 * (e // 2), 16 * (R + m) + 8 * ch + 2 * c + e % 2
                assert bit(cols[lane][m] >> (8 * odd), 4 * ch + e) == keep[query, key], (
                    "keep_mask_cols", nt, lane, n, e)


def test_dropout_forward_and_backward_match_finite_differences():
    """The reference's gradients with dropout equal central differences of its forward (float64), GQA, causal."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 20, 2, 8)), rng.standard_normal((1, 24, 1, 8)), rng.standard_normal((1, 24, 1, 8))
    dout = rng.standard_normal((1, 20, 2, 8))
    opts = dict(causal=True, dropout_p=0.4, dropout_seed=99, dropout_offset=3)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    no_drop = ref.attention(q, k, v, causal=True)
    assert not np.allclose(out, no_drop)
    grads = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    for x, g in zip((q, k, v), grads):
        for idx in [(0, 3, 0, 1), (0, 17, 0, 5)]:
            idx = idx[:x.ndim] if x.shape[2] > idx[2] else idx
            e = np.zeros_like(x)
            e[idx] = 1e-6
            args = [q, k, v]
            pos = [y is x for y in args].index(True)
            plus, minus = list(args), list(args)
            plus[pos], minus[pos] = x + e, x - e
            numeric = ((ref.attention(*plus, **opts) - ref.attention(*minus, **opts)) * dout).sum() / 2e-6
            assert abs(numeric - g[idx]) < 1e-6 * max(1.0, abs(numeric))


def test_varlen_dropout_is_each_sequence_as_batch_row_b():
    """Sequence b of a varlen batch drops as batch row b of a dense call of its lengths does."""
    rng = np.random.default_rng(5)
    lens = [7, 0, 20]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), 2, 8)) for _ in range(3))
    opts = dict(dropout_p=0.25, dropout_seed=11, dropout_offset=2, causal=True)
    got = ref.attention_varlen(q, k, v, cu, cu, 20, 20, **opts)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dense_q, dense_k, dense_v = (np.zeros((b + 1, n, 2, 8)) for _ in range(3))
        dense_q[b], dense_k[b], dense_v[b] = q[rows], k[rows], v[rows]
        want = ref.attention(dense_q, dense_k, dense_v, **opts)[b]
        np.testing.assert_allclose(got[rows], want, rtol=1e-12, atol=1e-12)

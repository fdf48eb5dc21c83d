"""cuflash.jax without a GPU: the custom_vjp, the ffi_call plumbing and the typed-FFI handler's parsing.

The same target names are registered for XLA's CPU backend with a host handler that reads the call frame
exactly like the CUDA one (``cuflash.jax._parse``) and computes with ``cuflash.reference``. So jit, grad,
option passing, the workspace output and error reporting all run for real against the installed jaxlib;
only the CuPy launch is left to the GPU tests (tests/gpu/test_jax.py).
"""
import ctypes

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cuflash.jax  # noqa: E402
from cuflash import _xla_ffi, reference, settings  # noqa: E402
from cuflash.ops import backward, forward_fp8

_host_handlers = []


def _np(buf):
    ptr, shape, dtype = buf
    dtype = cuflash.jax._DTYPES[dtype]
    raw = (ctypes.c_char * _xla_ffi.nbytes(shape, dtype)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _optional(ins, fixed, options):
    """The alibi slopes and the dropout generator's (seed, offset) of a call, read as the CUDA handler finds them
    (cuflash.jax._optional_inputs); the generator from the state's four uint32 words, as the kernels read them."""
    state, alibi = cuflash.jax._optional_inputs(ins, fixed, options)
    extra = {}
    if state is not None:
        w = _np(state).astype(np.uint64)
        extra = dict(dropout_seed=int(w[0] | (w[1] << np.uint64(32))), dropout_offset=int(w[2] | (w[3] << np.uint64(32))))
    return (None if alibi is None else _np(alibi).astype(np.float64)), extra


def _host_forward(frame):
    options, _, _, ins, outs = cuflash.jax._parse_call(frame, False, 0)
    q, k, v = (_np(b).astype(np.float64) for b in ins[:3])
    alibi, generator = _optional(ins, 3, options)
    out, lse = (_np(b) for b in outs)
    o, l = reference.attention(q, k, v, alibi_slopes=alibi, return_lse=True, **options, **generator)
    out[...], lse[...] = o.astype(out.dtype), l


def _host_backward(frame):
    options, deterministic, _, ins, outs = cuflash.jax._parse_call(frame, False, 1)
    dout, q, k, v, out, lse = (_np(b).astype(np.float64) for b in ins[:6])
    alibi, generator = _optional(ins, 6, options)
    grads = reference.attention_backward(dout, q, k, v, out, lse, alibi_slopes=alibi,
                                         deterministic=deterministic, **options, **generator)
    for dst, g in zip(outs[:3], grads):
        _np(dst)[...] = g.astype(_np(dst).dtype)
    _np(outs[3])[...] = 0xAB  # the workspace is ours to scribble on
    if options["softcap"] == 1.25:  # a marker value: report an error the way the CUDA handler would
        raise ValueError("softcap 1.25 refused by the test handler")


def _check_problem(problem, q, k, cu_q):
    """The problem the CUDA handler would launch with must describe these buffers (the host reference below
    reads the buffers themselves, so a wrong problem would otherwise go unseen)."""
    want = (len(cu_q) - 1, q.shape[1], k.shape[1], q.shape[2], q.dtype.itemsize)
    got = (problem.batch, problem.nheads, problem.nheads_k, problem.headdim, 8)  # the buffers are float64 here
    assert got == want, f"handler problem {problem} does not match the buffers {want}"


def _host_varlen_forward(frame):
    options, _, problem, ins, outs = cuflash.jax._parse_call(frame, True, 0)
    q, k, v = (_np(b).astype(np.float64) for b in ins[:3])
    cu_q, cu_k = (_np(b) for b in ins[3:5])
    alibi, generator = _optional(ins, 5, options)
    _check_problem(problem, q, k, cu_q)
    out, lse = (_np(b) for b in outs)
    o, l = reference.attention_varlen(q, k, v, cu_q, cu_k, problem.seqlen_q, problem.seqlen_k,
                                      alibi_slopes=alibi, return_lse=True, **options, **generator)
    out[...], lse[...] = o.astype(out.dtype), l


def _host_varlen_backward(frame):
    options, deterministic, problem, ins, outs = cuflash.jax._parse_call(frame, True, 1)
    dout, q, k, v, out, lse = (_np(b).astype(np.float64) for b in ins[:6])
    cu_q, cu_k = (_np(b) for b in ins[6:8])
    alibi, generator = _optional(ins, 8, options)
    _check_problem(problem, q, k, cu_q)
    grads = reference.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, problem.seqlen_q,
                                                problem.seqlen_k, alibi_slopes=alibi,
                                                deterministic=deterministic, **options, **generator)
    for dst, g in zip(outs[:3], grads):
        _np(dst)[...] = g.astype(_np(dst).dtype)


def _fp8_descales(ins, slots):
    """The descales an FP8 call's handler finds at `slots` (cuflash.jax._parse_fp8), as the reference takes them."""
    descales = {n: None if j is None else _np(ins[j]) for n, j in zip(("q_descale", "k_descale", "v_descale"), slots)}
    return {n: d if d is None or d.size > 1 else d.reshape(()) for n, d in descales.items()}  # (1,): per tensor


def _host_fp8(frame):
    """The FP8 call as the CUDA handler parses it (cuflash.jax._parse_fp8), computed by reference.attention_fp8;
    V^T's workspace, where the call has one, scribbled on."""
    (scale, left, right), problem, packed, ins, outs, slots = cuflash.jax._parse_fp8(frame)
    assert packed is None and (problem.batch, problem.seqlen_q, problem.nheads, problem.headdim) == ins[0][1]
    _check_workspace(problem, left, right, outs)
    q8, k8, v8 = (_np(b) for b in ins[:3])
    out, lse = (_np(b) for b in outs[:2])
    o, l = reference.attention_fp8(q8, k8, v8, softmax_scale=scale, window_size=(left, right), return_lse=True,
                                   **_fp8_descales(ins, slots))
    out[...], lse[...] = o.astype(out.dtype), l


def _host_varlen_fp8(frame):
    """The packed FP8 call as the CUDA handler parses it, computed sequence by sequence by reference.attention_fp8
    (per-head descales: row b for sequence b)."""
    (scale, left, right), problem, packed, ins, outs, slots = cuflash.jax._parse_fp8(frame)
    q8, k8, v8 = (_np(b) for b in ins[:3])
    cu_q, cu_k = (_np(b) for b in ins[3:5])
    assert packed == (q8.shape[0], k8.shape[0]) and problem.batch == len(cu_q) - 1
    assert (problem.nheads, problem.nheads_k, problem.headdim) == (q8.shape[1], k8.shape[1], q8.shape[2])
    _check_workspace(problem, left, right, outs)
    assert problem.seqlen_q == np.diff(cu_q).max() and problem.seqlen_k == np.diff(cu_k).max()  # the test's maxima
    descales = _fp8_descales(ins, slots)
    out, lse = (_np(b) for b in outs[:2])
    for b in range(problem.batch):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = {n: d if d is None or d.ndim == 0 else d[b:b + 1] for n, d in descales.items()}
        o, l = reference.attention_fp8(q8[None, sq], k8[None, sk], v8[None, sk], softmax_scale=scale,
                                       window_size=(left, right), return_lse=True, **one)
        out[sq], lse[:, sq] = o[0].astype(out.dtype), l[0]


def _check_workspace(problem, left, right, outs):
    """out and lse, then V^T's workspace where forward_fp8.vt_shape says the call takes V^T from the pass."""
    vt = forward_fp8.vt_shape(problem, left >= 0 or right >= 0)
    assert [o[1] for o in outs[2:]] == ([] if vt is None else [vt])
    if vt is not None:
        _np(outs[2])[...] = 0xAB


@pytest.fixture(scope="module", autouse=True)
def host_targets():
    if not _host_handlers:
        for name, run in ((cuflash.jax.FWD_TARGET, _host_forward), (cuflash.jax.BWD_TARGET, _host_backward),
                          (cuflash.jax.VARLEN_FWD_TARGET, _host_varlen_forward),
                          (cuflash.jax.VARLEN_BWD_TARGET, _host_varlen_backward),
                          (cuflash.jax.FP8_TARGET, _host_fp8),
                          (cuflash.jax.VARLEN_FP8_TARGET, _host_varlen_fp8)):
            handler = _xla_ffi.make_handler(run)
            _host_handlers.append(handler)
            jax.ffi.register_ffi_target(name, _xla_ffi.capsule(handler), platform="cpu", api_version=1)


def _inputs(b=2, sq=33, sk=47, h=4, hk=2, d=32, dtype=jnp.float16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, sk, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, sk, hk, d), jnp.float32).astype(dtype)
    dout = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32).astype(dtype)
    return q, k, v, dout


def _xla_reference(q, k, v, causal):
    return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        is_causal=causal, implementation="xla")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jit_grad_matches_jax_xla_attention(dtype, causal):
    q, k, v, dout = _inputs(sq=40, sk=40, dtype=getattr(jnp, dtype))  # equal lengths: is_causal agrees

    def loss(fn, q, k, v):
        return (fn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    ours = jax.jit(jax.value_and_grad(lambda *a: loss(lambda *x: cuflash.jax.attention(*x, causal=causal), *a),
                                      argnums=(0, 1, 2)))
    want = jax.value_and_grad(lambda *a: loss(lambda *x: _xla_reference(*x, causal), *a), argnums=(0, 1, 2))
    (l1, g1), (l2, g2) = ours(q, k, v), want(q, k, v)
    tol = 3e-2 if dtype == "bfloat16" else 4e-3
    assert abs(float(l1) - float(l2)) <= tol * max(1.0, abs(float(l2)))
    for got, ref in zip(g1, g2):
        assert got.dtype == q.dtype and got.shape == ref.shape
        err = float(jnp.abs(got.astype(jnp.float32) - ref).max()) / max(1.0, float(jnp.abs(ref).max()))
        assert err < 4 * tol, err


@pytest.mark.parametrize("d", [200, 256])
def test_wide_head_dim_backward_traces_and_matches(d, monkeypatch):
    """Head dims above 128 have a backward on sm_90a only: with an H200 visible (or no GPU) the workspace is
    planned for it and jit(grad) runs; with only sm_80 GPUs it fails at trace time, naming the head dim."""
    monkeypatch.setattr(cuflash.jax, "_archs", lambda: ("sm_90a",))
    q, k, v, dout = _inputs(sq=9, sk=14, h=2, hk=1, d=d)

    def loss(q, k, v):
        return (cuflash.jax.attention(q, k, v, causal=True).astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    q64, k64, v64, dout64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, causal=True, return_lse=True)
    for got, ref in zip(grads, reference.attention_backward(dout64, q64, k64, v64, want, lse, causal=True)):
        assert np.abs(np.asarray(got, np.float64) - ref).max() < 2e-2
    monkeypatch.setattr(cuflash.jax, "_archs", lambda: ("sm_80",))
    with pytest.raises(NotImplementedError, match=f"head dim {d}"):
        jax.grad(loss)(q, k, v)


@pytest.mark.parametrize("d", [59, 1])
def test_head_dim_not_a_multiple_of_8_runs_padded(d):
    """Zero-padded copies inside the call: out and the gradients of the caller's shapes, at scale 1 / sqrt(d)."""
    q, k, v, dout = _inputs(sq=21, sk=30, d=d)

    def loss(q, k, v):
        return (cuflash.jax.attention(q, k, v, causal=True).astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    out = cuflash.jax.attention(q, k, v, causal=True)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    q64, k64, v64, dout64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, causal=True, return_lse=True)
    want_grads = reference.attention_backward(dout64, q64, k64, v64, want, lse, causal=True)
    assert out.shape == q.shape and np.abs(np.asarray(out, np.float64) - want).max() < 4e-3
    for got, ref in zip(grads, want_grads):
        assert got.shape == ref.shape and np.abs(np.asarray(got, np.float64) - ref).max() < 2e-2


def test_eager_forward_and_options_reach_the_handler():
    q, k, v, _ = _inputs()
    slopes = jnp.linspace(0.1, 0.5, q.shape[2], dtype=jnp.float32)
    out = cuflash.jax.attention(q, k, v, causal=True, window_size=(7, -1), softcap=3.0, softmax_scale=0.2,
                                alibi_slopes=slopes)
    want = reference.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True, window_size=(7, -1),
                               softcap=3.0, softmax_scale=0.2, alibi_slopes=np.asarray(slopes))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.abs(np.asarray(out, np.float64) - want).max() < 4e-3


def test_grad_with_alibi_gives_zero_slope_cotangent():
    q, k, v, _ = _inputs()
    slopes = jnp.full((q.shape[0], q.shape[2]), 0.25, jnp.float32)
    g = jax.grad(lambda s: cuflash.jax.attention(q, k, v, alibi_slopes=s).astype(jnp.float32).sum())(slopes)
    assert g.shape == slopes.shape and not np.asarray(g).any()


def test_lowering_is_two_custom_calls_with_a_workspace_output():
    q, k, v, _ = _inputs()
    f = jax.jit(jax.grad(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True).astype(jnp.float32).sum(),
                         argnums=(0, 1, 2)))
    text = f.lower(q, k, v).as_text()
    assert text.count("@cuflash_attention_fwd") == 1 and text.count("@cuflash_attention_bwd") == 1
    assert "callback" not in text  # no host round trip (pure_callback / io_callback lower to *callback*)
    problem = cuflash.checks.Problem(2, 33, 47, 4, 2, 32, np.dtype(np.float16))
    workspace = cuflash.jax.backward_workspace_bytes(problem, -1, 0, False, False)
    assert f"tensor<{workspace}xui8>" in text
    aligned = lambda n: -(-n // backward.WORKSPACE_ALIGN) * backward.WORKSPACE_ALIGN  # noqa: E731
    counters = 2 * 2 * 4 * 1  # the first stores' ticket and flag per query block of 64 rows
    assert workspace == 2 * aligned(2 * 4 * 33 * 4) + aligned(2 * 33 * 4 * 32 * 4 + counters * 4)


def test_bad_input_fails_at_trace_time_with_cuflash_messages():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 16 but q's is 32"):
        cuflash.jax.attention(q, k[..., :16], v[..., :16])
    with pytest.raises(TypeError, match="q: dtype float32 is not supported"):
        jax.jit(cuflash.jax.attention)(q.astype(jnp.float32), k, v)
    with pytest.raises(TypeError, match="deterministic"):
        cuflash.jax.attention(q, k, v, deterministic=1)


def test_handler_errors_surface_as_jax_errors():
    q, k, v, _ = _inputs()
    grad = jax.grad(lambda q: cuflash.jax.attention(q, k, v, softcap=1.25).astype(jnp.float32).sum())
    with pytest.raises(Exception, match="softcap 1.25 refused by the test handler"):
        jax.block_until_ready(grad(q))


def test_deterministic_backward_is_repeatable():
    q, k, v, _ = _inputs()
    grad = jax.jit(jax.grad(lambda q, k, v: cuflash.jax.attention(q, k, v, deterministic=True)
                            .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    a, b = grad(q, k, v), grad(q, k, v)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


@pytest.mark.slow  # XLA compiles the per-sequence reference
@pytest.mark.parametrize("d", [32, 59])  # 59: zero-padded copies inside the call
def test_varlen_jit_grad_matches_per_sequence_xla_attention(d):
    """Packed sequences (lengths 5, 0, 17 against 9, 3, 17): value and gradients of jit(grad) equal those of
    jax.nn.dot_product_attention run on each sequence alone (equal lengths: is_causal agrees)."""
    lens_q, lens_k = [5, 0, 17], [5, 3, 17]
    cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(n)]), jnp.int32) for n in (lens_q, lens_k))
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (sum(lens_q), 4, d), jnp.float32).astype(jnp.float16)
    k = jax.random.normal(keys[1], (sum(lens_k), 2, d), jnp.float32).astype(jnp.float16)
    v = jax.random.normal(keys[2], (sum(lens_k), 2, d), jnp.float32).astype(jnp.float16)
    w = jax.random.normal(keys[3], q.shape, jnp.float32)

    def ours(q, k, v):
        out = cuflash.jax.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        return (out.astype(jnp.float32) * w).sum()

    def want(q, k, v):
        total, oq, ok = 0.0, 0, 0
        for nq, nk in zip(lens_q, lens_k):
            if nq:
                o = _xla_reference(q[None, oq:oq + nq], k[None, ok:ok + nk], v[None, ok:ok + nk], True)[0]
                total = total + (o * w[oq:oq + nq]).sum()
            oq, ok = oq + nq, ok + nk
        return total

    (l1, g1) = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v)
    (l2, g2) = jax.value_and_grad(want, argnums=(0, 1, 2))(q, k, v)
    assert abs(float(l1) - float(l2)) <= 4e-3 * max(1.0, abs(float(l2)))
    for got, ref in zip(g1, g2):
        assert got.shape == ref.shape and got.dtype == q.dtype
        err = float(jnp.abs(got.astype(jnp.float32) - ref).max()) / max(1.0, float(jnp.abs(ref).max()))
        assert err < 2e-2, err


def test_varlen_lowering_and_trace_time_checks():
    cu = jnp.asarray([0, 7, 20], jnp.int32)
    q = jnp.zeros((20, 4, 32), jnp.bfloat16)
    k = jnp.zeros((20, 2, 32), jnp.bfloat16)
    f = jax.jit(jax.grad(lambda q: cuflash.jax.attention_varlen(q, k, k, cu, cu, 13, 13).astype(jnp.float32)
                         .sum()))
    text = f.lower(q).as_text()
    assert text.count("@cuflash_attention_varlen_fwd") == 1 and text.count("@cuflash_attention_varlen_bwd") == 1
    assert "callback" not in text
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        cuflash.jax.attention_varlen(q, k, k, cu.astype(jnp.float32), cu, 13, 13)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cuflash.jax.attention_varlen(q, k, k, cu, cu, 0, 13)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_from_a_key_under_jit_and_grad(causal):
    """dropout_p with a traced PRNG key: the handler hands the kernels the four uint32 words the key gives, and
    the result and gradients are the reference's with the generator of those words (seed, then offset); the
    same key repeats bitwise, another key gives another mask."""
    from jax import config as jax_config
    q, k, v, dout = _inputs(sq=33, sk=47, dtype=jnp.float16)
    p = 0.25

    def loss(q, k, v, key):
        out = cuflash.jax.attention(q, k, v, causal=causal, dropout_p=p, dropout_key=key)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum(), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    key = jax.random.key(7)
    (l1, out), grads = step(q, k, v, key)
    (l2, again), _ = step(q, k, v, key)
    assert np.array_equal(np.asarray(out), np.asarray(again))
    (_, other), _ = step(q, k, v, jax.random.key(8))
    assert not np.array_equal(np.asarray(out), np.asarray(other))

    w = np.asarray(jax.random.bits(key, (4,), jnp.uint32)).astype(np.uint64)
    drop = dict(dropout_p=p, dropout_seed=int(w[0] | (w[1] << np.uint64(32))),
                dropout_offset=int(w[2] | (w[3] << np.uint64(32))))
    args = [np.asarray(x).astype(np.float64) for x in (q, k, v)]
    want, lse = reference.attention(*args, causal=causal, return_lse=True, **drop)
    want_grads = reference.attention_backward(np.asarray(dout).astype(np.float64), *args, want, lse, causal=causal,
                                              **drop)
    assert np.abs(np.asarray(out, np.float64) - want).max() < 4e-3
    for got, w_ in zip(grads, want_grads):
        assert np.abs(np.asarray(got, np.float64) - w_).max() < 2e-2
    keep = reference.dropout_keep(drop["dropout_seed"], drop["dropout_offset"], 2, 4, 33, 47, p)
    assert 0.6 < keep.mean() < 0.9  # the mask drops about p of the probabilities


def test_dropout_needs_a_key_and_a_valid_p():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="dropout_key: a PRNG key is required"):
        cuflash.jax.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        cuflash.jax.attention(q, k, v, dropout_p=1.5, dropout_key=jax.random.key(0))


def test_varlen_dropout_from_a_key_with_alibi():
    """Packed sequences with dropout and ALiBi together (the state, then the slopes, after the fixed inputs): value
    and gradients are the reference's under the key's generator."""
    lens_q, lens_k = [5, 0, 17], [9, 3, 17]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    q = jax.random.normal(keys[0], (sum(lens_q), 4, 32), jnp.float32).astype(jnp.float16)
    k = jax.random.normal(keys[1], (sum(lens_k), 2, 32), jnp.float32).astype(jnp.float16)
    v = jax.random.normal(keys[2], (sum(lens_k), 2, 32), jnp.float32).astype(jnp.float16)
    dout = jax.random.normal(keys[3], q.shape, jnp.float32).astype(jnp.float16)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    key = jax.random.key(11)

    def loss(q, k, v):
        out = cuflash.jax.attention_varlen(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), 17, 17, causal=True,
                                           alibi_slopes=slopes, dropout_p=0.3, dropout_key=key)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    w = np.asarray(jax.random.bits(key, (4,), jnp.uint32)).astype(np.uint64)
    drop = dict(dropout_p=0.3, dropout_seed=int(w[0] | (w[1] << np.uint64(32))),
                dropout_offset=int(w[2] | (w[3] << np.uint64(32))))
    args = [np.asarray(x).astype(np.float64) for x in (q, k, v)]
    want, lse = reference.attention_varlen(*args, cu_q, cu_k, 17, 17, causal=True, alibi_slopes=np.asarray(slopes),
                                           return_lse=True, **drop)
    want_grads = reference.attention_varlen_backward(np.asarray(dout).astype(np.float64), *args, want, lse, cu_q,
                                                     cu_k, 17, 17, causal=True, alibi_slopes=np.asarray(slopes),
                                                     **drop)
    assert np.abs(np.asarray(out, np.float64) - want).max() < 4e-3
    for got, w_ in zip(grads, want_grads):
        assert np.abs(np.asarray(got, np.float64) - w_).max() < 2e-2


def test_unsupported_dropout_backward_fails_at_trace_time():
    """The backward's workspace is planned while tracing, so a backward the kernels do not have (dropout at head dim
    200 with the Hopper backward switched off: the portable kernel regenerates the mask up to 128) fails there, not
    inside XLA; the forward alone runs."""
    q, k, v, dout = _inputs(sq=16, sk=16, d=200)
    key = jax.random.key(0)
    cuflash.jax.attention(q, k, v, softcap=10.0, dropout_p=0.1, dropout_key=key)

    def loss(q):
        return cuflash.jax.attention(q, k, v, softcap=10.0, dropout_p=0.1, dropout_key=key).astype(jnp.float32).sum()

    with cuflash.settings.override(bwd_sm90=False):
        with pytest.raises(NotImplementedError, match="dropout at head dim 200"):
            jax.grad(loss)(q)


@pytest.mark.parametrize("per", ["tensor", "head", None])
def test_fp8_under_jit_reaches_the_handler(per):
    """cuflash.jax.attention_fp8 under jit: e4m3 arrays, the descales present (or none) and the options reach the
    handler in the order it reads them; the result is the FP8 reference's."""
    rng = np.random.default_rng(3)
    x = {n: rng.standard_normal(shape) for n, shape in (("q", (2, 40, 4, 32)), ("k", (2, 70, 2, 32)),
                                                         ("v", (2, 70, 2, 32)))}
    args, descales = {}, {}
    for n, a in x.items():
        args[n], d = reference.quantize_e4m3(a, per or "tensor", nheads_k=2)
        if per:
            descales[n + "_descale"] = jnp.asarray(np.asarray(d, np.float32).reshape(np.shape(d) or (1,)))
    f = jax.jit(lambda q, k, v, ds: cuflash.jax.attention_fp8(q, k, v, causal=True, window_size=(9, -1),
                                                              softmax_scale=0.3, return_lse=True, **ds))
    out, lse = f(*(jnp.asarray(args[n]) for n in "qkv"), descales)
    want, want_lse = reference.attention_fp8(args["q"], args["k"], args["v"], causal=True, window_size=(9, -1),
                                             softmax_scale=0.3, return_lse=True,
                                             **{n: np.asarray(d).reshape(np.shape(d) if per == "head" else ())
                                                for n, d in descales.items()})
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)


def test_fp8_trace_time_checks():
    q = jnp.zeros((1, 8, 2, 32), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="q: dtype bfloat16 is not supported; expected float8_e4m3fn"):
        cuflash.jax.attention_fp8(q.astype(jnp.bfloat16), q, q)
    with pytest.raises(ValueError, match="multiples of 16"):
        cuflash.jax.attention_fp8(*(jnp.zeros((1, 8, 2, 40), jnp.float8_e4m3fn),) * 3)
    with pytest.raises(ValueError, match="cannot be mixed"):
        cuflash.jax.attention_fp8(q, q, q, q_descale=jnp.ones((1, 2), jnp.float32),
                                  k_descale=jnp.ones((1,), jnp.float32))



def _packed_fp8(lens_q, lens_k, h, hk, d, per, seed=0):
    """e4m3 q, k, v packed from sequences of the given lengths, each quantized as its own batch entry (per-head
    descales stacked, row b for sequence b; per-tensor: one value), and cu_seqlens_q / cu_seqlens_k."""
    rng = np.random.default_rng(seed)
    x8 = {n: [] for n in "qkv"}
    descales = {n: [] for n in "qkv"}
    for sq, sk in zip(lens_q, lens_k):
        for n, rows, heads in (("q", sq, h), ("k", sk, hk), ("v", sk, hk)):
            a, ds = reference.quantize_e4m3(rng.standard_normal((1, rows, heads, d)), per, nheads_k=hk)
            x8[n].append(a[0])
            descales[n].append(np.asarray(ds, np.float32).reshape(1, -1))
    x8 = {n: np.concatenate(a) for n, a in x8.items()}
    descales = {n: np.concatenate(a) if per == "head" else a[0][0, :1] for n, a in descales.items()}
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    return x8, descales, cu_q, cu_k


@pytest.mark.parametrize("vt_pass", [0, 1])
@pytest.mark.parametrize("per", ["tensor", "head", None])
def test_fp8_varlen_under_jit_reaches_the_handler(per, vt_pass):
    """cuflash.jax.attention_varlen_fp8 under jit (lengths 0, 30, 17 against 11, 0, 40; GQA 2:1; causal): the
    cu_seqlens, the descales present (or none), max_seqlen and the options reach the handler in the order it reads
    them; each sequence's rows are the FP8 reference's for that sequence alone, and V^T is the call's third result
    where it comes from the pass."""
    lens_q, lens_k = [0, 30, 17], [11, 0, 40]
    x8, descales, cu_q, cu_k = _packed_fp8(lens_q, lens_k, 4, 2, 32, per or "tensor", seed=4)
    ds = {n + "_descale": jnp.asarray(d) for n, d in descales.items()} if per else {}
    f = jax.jit(lambda q, k, v, cq, ck, ds: cuflash.jax.attention_varlen_fp8(
        q, k, v, cq, ck, 30, 40, causal=True, softmax_scale=0.3, return_lse=True, **ds))
    args = (*(jnp.asarray(x8[n]) for n in "qkv"), jnp.asarray(cu_q), jnp.asarray(cu_k), ds)
    with settings.override(fp8_vt_pass=vt_pass):
        text = f.lower(*args).as_text()
        assert text.count("@cuflash_attention_varlen_fp8") == 1 and "callback" not in text
        # V^T: 3 sequences, 2 KV heads, d 32, max_seqlen_k 40 to 64 keys
        assert ("tensor<3x2x32x64xui8>" in text) == bool(vt_pass)
        out, lse = f(*args)
    assert out.shape == (47, 4, 32) and out.dtype == jnp.bfloat16 and lse.shape == (4, 47)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = {n + "_descale": d[b:b + 1] if per == "head" else d.reshape(()) for n, d in descales.items()} if per \
            else {}
        want, want_lse = reference.attention_fp8(*(x8[n][None, s] for n, s in (("q", sq), ("k", sk), ("v", sk))),
                                                 causal=True, softmax_scale=0.3, return_lse=True, **one)
        np.testing.assert_allclose(np.asarray(out[sq], np.float64), want[0], atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(np.asarray(lse[:, sq]), want_lse[0].astype(np.float32))


def test_fp8_varlen_trace_time_checks():
    """Bad packed FP8 input raises at trace time with cuflash.checks' messages (argument, axis, expected, got)."""
    cu = jnp.asarray([0, 7, 20], jnp.int32)
    q = jnp.zeros((20, 4, 32), jnp.float8_e4m3fn)
    k = jnp.zeros((20, 2, 32), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="k: dtype bfloat16 is not supported; expected float8_e4m3fn"):
        cuflash.jax.attention_varlen_fp8(q, k.astype(jnp.bfloat16), k, cu, cu, 13, 13)
    with pytest.raises(ValueError, match=r"q: head dim \(axis 2\) is 40; the FP8 kernel takes multiples of 16"):
        cuflash.jax.attention_varlen_fp8(*(jnp.zeros((20, 2, 40), jnp.float8_e4m3fn),) * 3, cu, cu, 13, 13)
    with pytest.raises(ValueError, match="not a multiple of nheads_k"):
        cuflash.jax.attention_varlen_fp8(q[:, :3], k, k, cu, cu, 13, 13)
    with pytest.raises(TypeError, match="cu_seqlens_k: dtype float32"):
        cuflash.jax.attention_varlen_fp8(q, k, k, cu, cu.astype(jnp.float32), 13, 13)
    with pytest.raises(ValueError, match="max_seqlen_k: expected a positive int, got 0"):
        cuflash.jax.attention_varlen_fp8(q, k, k, cu, cu, 13, 0)
    with pytest.raises(TypeError, match="max_seqlen_q: expected a positive int"):
        jax.jit(lambda n: cuflash.jax.attention_varlen_fp8(q, k, k, cu, cu, n, 13))(13)
    with pytest.raises(ValueError, match=r"v_descale: expected shape \(\) or \(1,\).*\(2, 2\), got \(3, 2\)"):
        cuflash.jax.attention_varlen_fp8(q, k, k, cu, cu, 13, 13, v_descale=jnp.ones((3, 2), jnp.float32))
    with pytest.raises(ValueError, match="cannot be mixed"):
        cuflash.jax.attention_varlen_fp8(q, k, k, cu, cu, 13, 13, q_descale=jnp.ones((2, 2), jnp.float32),
                                         k_descale=jnp.ones((1,), jnp.float32))
    with pytest.raises(ValueError, match="window_size"):
        cuflash.jax.attention_varlen_fp8(q, k, k, cu, cu, 13, 13, window_size=(-2, 0))

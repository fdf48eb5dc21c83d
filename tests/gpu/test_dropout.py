"""Dropout on the GPU (the CuPy API): outputs and gradients equal the float64 reference evaluated with the same mask
(cuflash.reference.dropout_keep, which the kernels regenerate), and not with another one; the same seed and offset
repeat bitwise; the lse is dropout's none; the backward's limits raise."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference
from tests.gpu.helpers import DTYPES, randn

pytestmark = pytest.mark.gpu
TOL = {"fp16": 4e-3, "bf16": 3e-2}  # max |got - reference| over max |reference|


def _close(got, want, dtype, what):
    got = np.asarray(got, dtype=np.float64)
    err = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))
    assert err <= TOL[dtype], f"{what}: relative max error {err:.3g} > {TOL[dtype]}"
    return err


def _far(got, want, dtype, what):
    """The result is not that of another mask (the check above can tell masks apart)."""
    err = float(np.abs(np.asarray(got, dtype=np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))
    assert err > 4 * TOL[dtype], f"{what}: another mask gives the same result ({err:.3g})"


CASES = [  # dtype, b, sq, sk, h, hk, d, options
    ("bf16", 2, 97, 130, 4, 2, 64, dict(causal=True)),
    ("fp16", 1, 200, 200, 4, 4, 128, dict()),
    ("bf16", 2, 33, 77, 6, 2, 40, dict(window_size=(20, 5))),
    ("fp16", 1, 64, 300, 2, 1, 32, dict(softcap=10.0)),
    ("bf16", 1, 50, 90, 2, 2, 256, dict(causal=True)),  # above d 128 the backward on sm_90a's d 256 kernel only
    ("fp16", 2, 70, 150, 4, 2, 200, dict(causal=True)),  # d 136-248 on the d 256 kernel
    ("bf16", 1, 90, 130, 2, 1, 96, dict(window_size=(30, 10))),  # on the d 128 kernel
    # on sm_90a the Hopper backward's dropout kernels at d 64, 128 and 256, with softcap too, causal, local, GQA
    # (at d 40-56 on the d 64 kernels); the Hopper forward's dropout variants with softcap at every head dim
    ("bf16", 2, 150, 260, 8, 2, 128, dict(causal=True)),
    ("fp16", 2, 130, 190, 4, 2, 128, dict(window_size=(50, 10))),
    ("bf16", 1, 140, 70, 2, 1, 64, dict(window_size=(-1, 30))),
    ("bf16", 1, 100, 120, 4, 4, 128, dict(softcap=15.0)),
    ("bf16", 2, 120, 150, 4, 2, 64, dict(softcap=20.0, causal=True)),
    ("fp16", 2, 230, 180, 4, 2, 64, dict()),  # d 64 without a band: three consumer warpgroups, a partial second tile
    ("fp16", 1, 70, 130, 2, 2, 256, dict(softcap=10.0, window_size=(40, 8))),
    ("fp16", 2, 90, 140, 4, 2, 48, dict(softcap=8.0, causal=True)),  # d 64's lockstep kernel (mod, dropout), 48 columns
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[6]}-{'-'.join(c[7]) or 'plain'}")
def test_dropout_forward_and_backward_match_the_reference(compiled, case):
    _check_case(case, dict(dropout_p=0.3, dropout_seed=2 ** 40 + 123, dropout_offset=2 ** 33 + 7),
                np.random.default_rng(case[2] + case[6]), other_mask=True)


@st.composite
def dropout_cases(draw):
    hk = draw(st.sampled_from([1, 2]))
    options = draw(st.sampled_from([{}, {}, dict(causal=True), dict(window_size=(37, 5)), dict(softcap=6.0)]))
    return (draw(st.sampled_from(["fp16", "bf16"])), draw(st.integers(1, 2)), draw(st.integers(1, 260)),
            draw(st.integers(1, 300)), hk * draw(st.sampled_from([1, 2, 3])), hk,
            draw(st.sampled_from([32, 40, 64, 96, 128, 136, 256])), options)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=dropout_cases(), p=st.sampled_from([0.05, 0.3, 0.6]), seed=st.integers(0, 2 ** 64 - 1),
       offset=st.integers(0, 2 ** 64 - 1), data=st.integers(0, 2 ** 31 - 1))
def test_dropout_on_hypothesis_shapes(compiled, case, p, seed, offset, data):
    """Shapes off every tile grid (rows and keys from 1), every head-dim path, seeds and offsets over the whole
    64-bit range. (Whether another mask would pass is the cases above's check: a small shape's two masks can agree.)"""
    _check_case(case, dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset), np.random.default_rng(data))


def _check_case(case, drop, rng, other_mask=False):
    """Forward (out, lse) and, where the head dim has one, both backwards against the reference with the same mask
    (and, with ``other_mask``, not the reference with the next offset's); the same seed and offset repeat bitwise."""
    import cupy
    import cuflash
    dtype, b, sq, sk, h, hk, d, options = case
    dt = DTYPES[dtype]
    q, k, v = randn(rng, (b, sq, h, d), dt), randn(rng, (b, sk, hk, d), dt), randn(rng, (b, sk, hk, d), dt)
    dout = randn(rng, (b, sq, h, d), dt)
    dev = [cupy.asarray(x) for x in (q, k, v, dout)]
    out, lse = cuflash.attention(*dev[:3], return_lse=True, **options, **drop)
    want, want_lse = reference.attention(q, k, v, return_lse=True, **options, **drop)
    _close(out.get(), want, dtype, "out")
    np.testing.assert_allclose(lse.get(), reference.attention(q, k, v, return_lse=True, **options)[1], atol=2e-3)
    if other_mask:
        other = dict(drop, dropout_offset=drop["dropout_offset"] + 1)
        _far(out.get(), reference.attention(q, k, v, **options, **other), dtype, "out")
    again = cuflash.attention(*dev[:3], **options, **drop)
    assert bool(cupy.array_equal(out.view(cupy.uint16), again.view(cupy.uint16))), "the same seed and offset"
    from cuflash import build, plan
    from cuflash.ops import backward_sm90
    hopper = build.device_arch(dev[0].device.id) == "sm_90a"
    if d > 128 and not (hopper and plan.hopper_headdim(d) in backward_sm90.DROPOUT_HEADDIMS):
        with pytest.raises(NotImplementedError, match="dropout at head dim"):
            cuflash.attention_backward(dev[3], *dev[:3], out, lse, **options, **drop)
        return
    want_grads = reference.attention_backward(dout, q, k, v, out.get(), lse.get(), **options, **drop)
    atomic = cuflash.attention_backward(dev[3], *dev[:3], out, lse, **options, **drop)
    for name, g, w in zip(("dq", "dk", "dv"), atomic, want_grads):
        _close(g.get(), w, dtype, name)
    grads = cuflash.attention_backward(dev[3], *dev[:3], out, lse, deterministic=True, **options, **drop)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(g.get(), w, dtype, f"deterministic {name}")
    again = cuflash.attention_backward(dev[3], *dev[:3], out, lse, deterministic=True, **options, **drop)
    for g, a in zip(grads, again):
        assert bool(cupy.array_equal(g.view(cupy.uint16), a.view(cupy.uint16))), "deterministic and the same mask"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dropout_matches_the_reference(compiled, causal):
    import cupy
    import cuflash
    rng = np.random.default_rng(8 + causal)
    lens_q, lens_k = [17, 0, 70, 1], [40, 12, 70, 0]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    dt = DTYPES["bf16"]
    q = randn(rng, (sum(lens_q), 4, 64), dt)
    k, v = randn(rng, (sum(lens_k), 2, 64), dt), randn(rng, (sum(lens_k), 2, 64), dt)
    dout = randn(rng, q.shape, dt)
    drop = dict(dropout_p=0.2, dropout_seed=5, dropout_offset=9)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k, dout)]
    out, lse = cuflash.attention_varlen(*dev[:5], 70, 70, causal=causal, return_lse=True, **drop)
    want = reference.attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=causal, **drop)
    _close(out.get(), want, "bf16", "out")
    grads = cuflash.attention_varlen_backward(dev[5], *dev[:3], out, lse, *dev[3:5], 70, 70, causal=causal, **drop)
    want_grads = reference.attention_varlen_backward(dout, q, k, v, out.get(), lse.get(), cu_q, cu_k, 70, 70,
                                                     causal=causal, **drop)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(g.get(), w, "bf16", name)


def test_dropout_arguments_are_checked():
    import cupy
    import cuflash
    q = cupy.zeros((1, 8, 2, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="dropout_p: expected a float with 0 <= p < 1, got 1.0"):
        cuflash.attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="dropout_seed: expected 0 <= dropout_seed < 2\\*\\*64, got -1"):
        cuflash.attention(q, q, q, dropout_p=0.1, dropout_seed=-1)


def test_torch_dropout_follows_torch_manual_seed():
    """cuflash.torch draws the mask's seed and offset from torch's CUDA generator: torch.manual_seed repeats a
    call bitwise (gradients too, in deterministic mode), the generator's offset advances by 4 per call, and the
    result is the reference's with that seed and offset."""
    torch = pytest.importorskip("torch")
    import cuflash.torch
    rng = np.random.default_rng(3)
    dt = DTYPES["bf16"]
    q, k, v = randn(rng, (2, 70, 4, 64), dt), randn(rng, (2, 90, 2, 64), dt), randn(rng, (2, 90, 2, 64), dt)
    dout = randn(rng, q.shape, dt)

    def run():
        tensors = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda().requires_grad_()
                   for x in (q, k, v)]
        out = cuflash.torch.attention(*tensors, causal=True, dropout_p=0.25, deterministic=True)
        out.backward(torch.from_numpy(dout.view(np.int16)).view(torch.bfloat16).cuda())
        return [x.detach().view(torch.int16).cpu().numpy() for x in (out, *(t.grad for t in tensors))]

    torch.cuda.init()  # torch's CUDA generators exist once CUDA is initialized
    torch.manual_seed(1234)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    seed, offset = generator.initial_seed(), generator.get_offset()
    first = run()
    assert generator.get_offset() == offset + 4
    torch.manual_seed(1234)
    second = run()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    want = reference.attention(q, k, v, causal=True, dropout_p=0.25, dropout_seed=seed, dropout_offset=offset)
    _close(first[0].view(dt), want, "bf16", "out")
    third = run()  # the generator moved on: another mask
    _far(third[0].view(dt), want, "bf16", "out")


def test_torch_dropout_under_torch_compile(monkeypatch):
    """Under torch.compile (inductor, fullgraph) the graph draws the mask's seed and offset from torch's generator:
    torch.manual_seed repeats a run bitwise (gradients too, in deterministic mode) and the next run draws another
    mask. With the two words fixed, the compiled forward and backward are the reference's with those words."""
    torch = pytest.importorskip("torch")
    import cuflash.torch
    rng = np.random.default_rng(5)
    dt = DTYPES["bf16"]
    q, k, v = randn(rng, (2, 70, 4, 64), dt), randn(rng, (2, 90, 2, 64), dt), randn(rng, (2, 90, 2, 64), dt)
    dout = randn(rng, q.shape, dt)
    as_torch = lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()  # noqa: E731

    def run(step):
        tensors = [as_torch(x).requires_grad_() for x in (q, k, v)]
        out = step(*tensors)
        out.backward(as_torch(dout))
        return [x.detach().view(torch.int16).cpu().numpy() for x in (out, *(t.grad for t in tensors))]

    def compiled():
        torch._dynamo.reset()
        return torch.compile(lambda q, k, v: cuflash.torch.attention(q, k, v, causal=True, dropout_p=0.25,
                                                                     deterministic=True), fullgraph=True)

    step = compiled()
    torch.manual_seed(99)
    first = run(step)
    torch.manual_seed(99)
    for a, b in zip(first, run(step)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(run(step)[0], first[0]), "the next run draws another mask"
    monkeypatch.setattr(cuflash.torch, "_graph_dropout", lambda q, p: (
        torch.tensor([2 ** 40 + 5, 12], dtype=torch.int64, device=q.device), float(p)))
    got = run(compiled())
    drop = dict(causal=True, dropout_p=0.25, dropout_seed=2 ** 40 + 5, dropout_offset=12)
    want, lse = reference.attention(q, k, v, return_lse=True, **drop)
    _close(got[0].view(dt), want, "bf16", "out")
    want_grads = reference.attention_backward(dout, q, k, v, got[0].view(dt), lse, **drop)
    for name, g, w in zip(("dq", "dk", "dv"), got[1:], want_grads):
        _close(g.view(dt), w, "bf16", name)
    torch._dynamo.reset()


def test_jax_dropout_from_a_key():
    """cuflash.jax under jit and grad with a PRNG key: the kernels read the key's four words from device memory
    (dropout_state); the result is the reference's with that seed and offset, the same key repeats bitwise and the
    gradients match the reference's backward."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cuflash.jax
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    rng = np.random.default_rng(4)
    dt = DTYPES["bf16"]
    q, k, v = randn(rng, (2, 70, 4, 64), dt), randn(rng, (2, 90, 2, 64), dt), randn(rng, (2, 90, 2, 64), dt)
    dout = randn(rng, q.shape, dt)
    key = jax.random.key(21)

    def loss(q, k, v):
        out = cuflash.jax.attention(q, k, v, causal=True, dropout_p=0.2, dropout_key=key)
        return (out.astype(jnp.float32) * jnp.asarray(dout).astype(jnp.float32)).sum(), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = step(*(jnp.asarray(x) for x in (q, k, v)))
    (_, again), _ = step(*(jnp.asarray(x) for x in (q, k, v)))
    assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16))
    w = np.asarray(jax.random.bits(key, (4,), jnp.uint32)).astype(np.uint64)
    drop = dict(dropout_p=0.2, dropout_seed=int(w[0] | (w[1] << np.uint64(32))),
                dropout_offset=int(w[2] | (w[3] << np.uint64(32))))
    want, lse = reference.attention(q, k, v, causal=True, return_lse=True, **drop)
    _close(np.asarray(out), want, "bf16", "out")
    want_grads = reference.attention_backward(dout, q, k, v, np.asarray(out), lse, causal=True, **drop)
    for name, g, w_ in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(np.asarray(g), w_, "bf16", name)

"""Ring attention on one GPU: N ranks simulated in one process (cuflash.torch_distributed.ring_attention_local, the
ring's own programs with the transport swapped for copies), forward and backward, against single-GPU attention on
the whole sequence. Both are measured against the float64 reference; the ring may lose at most the rounding of its
merge (its partial outputs are rounded to the input dtype before they merge) beyond what one call loses.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from cuflash import reference, ring  # noqa: E402


def _sequence(b, s, h, hk, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d))
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for shape in shapes]


UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def _err(got, want):
    return float(np.abs(got.detach().double().cpu().numpy() - want).max())


def _within_merge_rounding(got, single, want, world, dtype, what):
    """The ring's error against float64 is at most twice single-GPU attention's plus the rounding of its merge: up
    to ``world`` partial results, each rounded once to the input dtype before it is added."""
    floor = world * UNIT_ROUNDOFF[dtype] * float(np.abs(want).max())
    assert _err(got, want) <= 2 * _err(single, want) + floor, \
        f"{what}: ring error {_err(got, want):.3g}, single GPU {_err(single, want):.3g}, merge floor {floor:.3g}"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_simulated_ring_matches_single_gpu_attention(world, layout, causal, dtype):
    import cuflash.torch
    import cuflash.torch_distributed as cfd
    dt = getattr(torch, dtype)
    s = 2 * 113 * world if layout == "zigzag" else 226 * world  # chunks off every tile size
    q, k, v, dout = _sequence(2, s, 8, 2, 128, dt)
    shard = lambda x: [cfd.shard(x, layout=layout, rank=r, world=world).requires_grad_()  # noqa: E731
                       for r in range(world)]
    qs, ks, vs = shard(q), shard(k), shard(v)
    outs = cfd.ring_attention_local(qs, ks, vs, causal=causal, layout=layout)
    torch.autograd.backward(outs, [cfd.shard(dout, layout=layout, rank=r, world=world) for r in range(world)])
    gather = lambda xs: cfd.gather(xs, layout=layout)  # noqa: E731
    ring_out = gather(outs)
    ring_grads = [gather([x.grad for x in xs]) for xs in (qs, ks, vs)]

    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
    one_out = cuflash.torch.attention(q1, k1, v1, causal=causal)
    one_out.backward(dout)

    q64, k64, v64, d64 = (x.double().cpu().numpy() for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, causal=causal, return_lse=True)
    want_grads = reference.attention_backward(d64, q64, k64, v64, want, lse, causal=causal)
    _within_merge_rounding(ring_out, one_out, want, world, dtype, "out")
    for name, got, one, ref in zip(("dq", "dk", "dv"), ring_grads, (q1.grad, k1.grad, v1.grad), want_grads):
        assert got.dtype == dt and got.shape == one.shape
        _within_merge_rounding(got, one, ref, world, dtype, name)


def test_simulated_ring_window_and_softcap():
    import cuflash.torch
    import cuflash.torch_distributed as cfd
    world, layout = 4, "zigzag"
    q, k, v, dout = _sequence(1, 8 * 97, 4, 4, 64, torch.bfloat16, seed=1)
    options = dict(causal=True, window_size=(150, -1), softcap=5.0)
    shard = lambda x: [cfd.shard(x, layout=layout, rank=r, world=world).requires_grad_()  # noqa: E731
                       for r in range(world)]
    qs, ks, vs = shard(q), shard(k), shard(v)
    outs = cfd.ring_attention_local(qs, ks, vs, layout=layout, **options)
    torch.autograd.backward(outs, [cfd.shard(dout, layout=layout, rank=r, world=world) for r in range(world)])
    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
    one_out = cuflash.torch.attention(q1, k1, v1, **options)
    one_out.backward(dout)
    q64, k64, v64, d64 = (x.double().cpu().numpy() for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, return_lse=True, **options)
    want_grads = reference.attention_backward(d64, q64, k64, v64, want, lse, **options)
    _within_merge_rounding(cfd.gather(outs, layout=layout), one_out, want, world, "bfloat16", "out")
    for name, xs, one, ref in zip(("dq", "dk", "dv"), (qs, ks, vs), (q1.grad, k1.grad, v1.grad), want_grads):
        _within_merge_rounding(cfd.gather([x.grad for x in xs], layout=layout), one, ref, world, "bfloat16", name)


def test_deterministic_ring_gradients_are_bitwise_repeatable():
    import cuflash.torch_distributed as cfd
    world, layout = 4, "zigzag"
    q, k, v, dout = _sequence(1, 8 * 64, 8, 2, 128, torch.bfloat16, seed=2)

    def grads():
        qs, ks, vs = ([cfd.shard(x, layout=layout, rank=r, world=world).requires_grad_() for r in range(world)]
                      for x in (q, k, v))
        outs = cfd.ring_attention_local(qs, ks, vs, causal=True, layout=layout, deterministic=True)
        torch.autograd.backward(outs, [cfd.shard(dout, layout=layout, rank=r, world=world) for r in range(world)])
        return [x.grad for xs in (qs, ks, vs) for x in xs]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_jax_ring_over_the_local_gpus():
    """cuflash.jax_ring under shard_map over every GPU here (one GPU: a ring of one, the FFI path on the device)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cuflash.jax_ring
    try:
        devices = jax.devices("gpu")
    except RuntimeError as err:
        pytest.skip(f"JAX has no GPU backend here: {err}")
    world = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    spec = jax.sharding.PartitionSpec(None, "sp")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    s = 2 * 96 * world
    q, dout = (jax.random.normal(key, (2, s, 8, 128), jnp.float32).astype(jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, s, 2, 128), jnp.float32).astype(jnp.bfloat16) for key in keys[2:])
    order = cuflash.jax_ring.zigzag_order(s, world)
    attend = jax.shard_map(lambda q, k, v: cuflash.jax_ring.ring_attention(q, k, v, "sp", causal=True,
                                                                           layout="zigzag"),
                           mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    loss = lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * dout[:, order].astype(jnp.float32)).sum()  # noqa: E731
    out = jax.jit(attend)(q[:, order], k[:, order], v[:, order])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[:, order], k[:, order], v[:, order])
    undo = np.argsort(order)
    q64, k64, v64, d64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, causal=True, return_lse=True)
    want_grads = reference.attention_backward(d64, q64, k64, v64, want, lse, causal=True)
    assert np.abs(np.asarray(out, np.float64)[:, undo] - want).max() < 3e-2
    for got, ref in zip(grads, want_grads):
        err = np.abs(np.asarray(got, np.float64)[:, undo] - ref).max() / max(1.0, np.abs(ref).max())
        assert err < 6e-2

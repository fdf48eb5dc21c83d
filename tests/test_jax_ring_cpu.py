"""cuflash.jax_ring without a GPU: jax.shard_map over CPU devices, ppermute carrying the keys, jit and grad, against
the float64 reference on the whole sequence.

The cuflash FFI targets are registered for XLA's CPU backend with test_jax_cpu's host handlers (cuflash.reference
on the call frame's buffers), so everything but the CuPy launch runs as on GPUs.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

WORLD = 4
try:  # before any backend starts: WORLD CPU devices for the mesh
    jax.config.update("jax_num_cpu_devices", WORLD)
except Exception:  # noqa: BLE001  (a backend already started: the tests below skip if it has too few devices)
    pass

import cuflash.jax_ring  # noqa: E402
from cuflash import reference, ring  # noqa: E402
from test_jax_cpu import host_targets  # noqa: E402,F401  (the autouse fixture; the module pytest loaded)

P = jax.sharding.PartitionSpec


def _mesh(world):
    devices = jax.devices("cpu")
    if len(devices) < world:
        pytest.skip(f"needs {world} CPU devices (jax_num_cpu_devices), has {len(devices)}")
    return jax.sharding.Mesh(np.array(devices[:world]), ("sp",))


def _inputs(b=2, s=32, h=4, hk=2, d=32, dtype=jnp.float16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, hk, d), jnp.float32).astype(dtype)
    dout = jax.random.normal(keys[3], (b, s, h, d), jnp.float32).astype(dtype)
    return q, k, v, dout


def _ring_and_grads(world, layout, q, k, v, dout, **options):
    """out and (dq, dk, dv) of the ring over ``world`` CPU devices, in the sequence's own order."""
    mesh = _mesh(world)
    order = cuflash.jax_ring.zigzag_order(q.shape[1], world) if layout == "zigzag" else np.arange(q.shape[1])
    undo = np.argsort(order)
    spec = P(None, "sp")
    attend = jax.shard_map(lambda q, k, v: cuflash.jax_ring.ring_attention(q, k, v, "sp", layout=layout, **options),
                           mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)

    def loss(q, k, v):
        return (attend(q, k, v).astype(jnp.float32) * dout[:, order].astype(jnp.float32)).sum()

    permuted = [x[:, order] for x in (q, k, v)]
    out = jax.jit(attend)(*permuted)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*permuted)
    return np.asarray(out, np.float64)[:, undo], [np.asarray(g, np.float64)[:, undo] for g in grads]


def _close(got, want, tol, what):
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < tol, f"{what}: relative error {err:.3g} (tolerance {tol})"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_shard_map_ring_matches_attention_on_the_whole_sequence(world, layout, causal):
    q, k, v, dout = _inputs(s=8 * world)
    out, grads = _ring_and_grads(world, layout, q, k, v, dout, causal=causal)
    q64, k64, v64, d64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, causal=causal, return_lse=True)
    want_grads = reference.attention_backward(d64, q64, k64, v64, want, lse, causal=causal)
    _close(out, want, 4e-3, "out")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(got, ref, 1e-2, name)


@pytest.mark.slow
def test_shard_map_ring_window_softcap_and_odd_head_dim():
    q, k, v, dout = _inputs(s=24, d=20, dtype=jnp.bfloat16, seed=3)
    options = dict(causal=True, window_size=(5, -1), softcap=2.0)
    out, grads = _ring_and_grads(2, "zigzag", q, k, v, dout, **options)
    q64, k64, v64, d64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    want, lse = reference.attention(q64, k64, v64, return_lse=True, **options)
    want_grads = reference.attention_backward(d64, q64, k64, v64, want, lse, **options)
    _close(out, want, 3e-2, "out")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(got, ref, 6e-2, name)

"""cuflash.jax under jax.jit and jax.grad: gradients beside jax.nn.dot_product_attention's, then a few
steps of gradient descent through a jitted train step.

    python examples/jax_example.py         # from the repository root, on a GPU
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import cuflash.jax
    from cuflash.runtime import require_gpu
    require_gpu()  # CuPy installed and a CUDA device present, or one line saying what is missing
except (ImportError, RuntimeError) as err:
    sys.exit(f"jax_example.py: {err}")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main():
    b, s, h, hk, d = 4, 512, 8, 2, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hk, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hk, d), jnp.float32).astype(jnp.bfloat16)
    target = jax.random.normal(keys[3], (b, s, h, d), jnp.float32)

    def loss(attn, q, k, v):
        return jnp.mean((attn(q, k, v).astype(jnp.float32) - target) ** 2)

    ours = lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True)  # noqa: E731
    xla = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True, implementation="xla")

    grad_ours = jax.jit(jax.value_and_grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))
    grad_xla = jax.jit(jax.value_and_grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2)))
    (l1, g1), (l2, g2) = grad_ours(q, k, v), grad_xla(q, k, v)
    print(f"loss: cuflash {float(l1):.6f}   jax xla (float32) {float(l2):.6f}")
    for name, a, r in zip(("dq", "dk", "dv"), g1, g2):
        err = float(jnp.abs(a.astype(jnp.float32) - r).max() / jnp.abs(r).max())
        print(f"{name}: {a.shape} {a.dtype}, max rel. diff to xla {err:.2e}")
    print("jitted program calls:", sorted({t for t in ("cuflash_attention_fwd", "cuflash_attention_bwd")
                                           if t in grad_ours.lower(q, k, v).as_text()}))

    @jax.jit
    def step(q, k, v):
        value, (dq, dk, dv) = jax.value_and_grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(q, k, v)
        lr = 2e-3 * target.size  # the loss is a mean: keep the step per element fixed
        return value, *(x - (lr * g.astype(jnp.float32)).astype(x.dtype) for x, g in zip((q, k, v), (dq, dk, dv)))

    t0 = time.perf_counter()
    for i in range(50):
        value, q, k, v = step(q, k, v)
        if i % 10 == 0 or i == 49:
            print(f"step {i:2d}  loss {float(value):.5f}")
    jax.block_until_ready(q)
    print(f"50 jitted train steps in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()

"""Bisects a failure of cuflash.jax.attention_varlen on the GPU, one synchronized step at a time:
the CuPy API on the same shapes, then the JAX FFI forward eagerly, under jit, then jit(grad).

    python scripts/debug_jax_varlen.py        (run it under compute-sanitizer to name the kernel)
"""
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


def step(name, fn):
    try:
        fn()
        print(f"ok    {name}", flush=True)
        return True
    except Exception:
        print(f"FAIL  {name}", flush=True)
        traceback.print_exc(limit=4)
        return False


def main():
    import cupy
    import cuflash
    lens = [0, 1, 70, 200]
    cu_np = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu_np[-1])
    rng = np.random.default_rng(0)
    qn = rng.standard_normal((total, 4, 64)).astype(np.float16)
    kn = rng.standard_normal((total, 2, 64)).astype(np.float16)
    vn = rng.standard_normal((total, 2, 64)).astype(np.float16)

    def cupy_api():
        q, k, v, cu = map(cupy.asarray, (qn, kn, vn, cu_np))
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 200, 200, causal=True, return_lse=True)
        cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu, cu, 200, 200, causal=True)
        cupy.cuda.Device().synchronize()
    if not step("cupy api fwd+bwd", cupy_api):
        return

    import jax
    import jax.numpy as jnp
    import cuflash.jax as cj
    q, k, v = (jnp.asarray(x) for x in (qn, kn, vn))
    cu = jnp.asarray(cu_np)
    f = lambda q, k, v: cj.attention_varlen(q, k, v, cu, cu, 200, 200, causal=True)  # noqa: E731
    step("jax eager fwd", lambda: f(q, k, v).block_until_ready())
    step("jax jit fwd", lambda: jax.jit(f)(q, k, v).block_until_ready())
    loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    step("jax eager grad", lambda: jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
    step("jax jit grad", lambda: jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)))


if __name__ == "__main__":
    main()

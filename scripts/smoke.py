"""A few-second first look on a GPU: one forward call per feature against the reference."""
import sys
import time

import numpy as np

sys.path.insert(0, ".")
import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cuflash  # noqa: E402
from cuflash import reference  # noqa: E402

rng = np.random.default_rng(0)
for dt in (np.float16, ml_dtypes.bfloat16):
    for opts in (dict(), dict(causal=True), dict(window_size=(20, 5)), dict(softcap=5.0), dict(causal=True, return_lse=True)):
        for d in (64, 128, 40):
            q = rng.standard_normal((2, 77, 4, d), dtype=np.float32).astype(dt)
            k = rng.standard_normal((2, 130, 2, d), dtype=np.float32).astype(dt)
            v = rng.standard_normal((2, 130, 2, d), dtype=np.float32).astype(dt)
            t = time.time()
            res = cuflash.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), **opts)
            out = (res[0] if isinstance(res, tuple) else res).get().astype(np.float64)
            ref = reference.attention(q, k, v, **opts)
            ref = ref[0] if isinstance(ref, tuple) else ref
            print(f"{np.dtype(dt).name} d={d} {opts}: max err {np.abs(out - ref).max():.2e} ({time.time() - t:.1f}s)",
                  flush=True)

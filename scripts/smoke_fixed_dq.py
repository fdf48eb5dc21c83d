"""A first look at the Hopper backward's deterministic fixed point (the bwd_sm90_det setting "fixed",
cuda_src/fixed_dq.cuh): against atomic mode and against a second deterministic call, at d 64 and 128, with and without
a causal mask, and the GPU time of both modes. Exits nonzero on a mismatch."""
import sys

import numpy as np

sys.path.insert(0, ".")
import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import settings  # noqa: E402

settings.override(bwd_sm90_det="fixed").__enter__()  # for the whole script
rng = np.random.default_rng(0)
bad = 0
for d in (64, 128):
    for causal in (False, True):
        b, s, h, hk = 2, 1000, 4, 2
        q, dout = (cupy.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32)).astype(cupy.float16)
                   for _ in range(2))
        k, v = (cupy.asarray(rng.standard_normal((b, s, hk, d), dtype=np.float32)).astype(cupy.float16)
                for _ in range(2))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        atomic = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        det = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        errs = [float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max()) for x, y in zip(atomic, det)]
        scale = float(cupy.abs(atomic[0].astype(cupy.float32)).max())
        same = all(bool(cupy.array_equal(x, y)) for x, y in zip(det, again))
        ok = same and max(errs) < 0.05 and errs[0] <= 0.02 * scale
        bad += not ok
        times = []
        for deterministic in (False, True):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(10):
                cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 10)
        print(f"d={d} causal={causal}: det-atomic max |diff| dq/dk/dv {errs} (max |dq| {scale:.3g}), repeat bitwise"
              f" {same}; ms atomic {times[0]:.3f} det {times[1]:.3f} {'ok' if ok else 'MISMATCH'}", flush=True)
sys.exit(1 if bad else 0)

"""cuflash on CuPy arrays: forward (causal, GQA), its lse, the backward, checked against the float64 reference.

    python examples/cupy_example.py        # from the repository root; a few seconds after the first compile
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash.runtime import require_gpu  # noqa: E402


def main():
    import cupy
    b, sq, sk, h, hk, d = 2, 1000, 1500, 16, 4, 128
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((b, sq, h, d), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((b, sk, hk, d), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((b, sk, hk, d), dtype=cupy.float32).astype(ml_dtypes.bfloat16)

    # causal with seqlen_q < seqlen_k is bottom-right aligned: the last query sees every key
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    print(f"out {out.shape} {out.dtype}, lse {lse.shape} {lse.dtype}")

    dout = rng.standard_normal(out.shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    print(f"dq {dq.shape}, dk {dk.shape}, dv {dv.shape}  (GQA: dk/dv summed over the {h // hk} heads of a group)")

    # against the float64 reference, on one batch entry to keep it quick
    host = [x[:1].get().astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = cuflash.reference.attention(*host[:3], causal=True, return_lse=True)
    ref_grads = cuflash.reference.attention_backward(host[3], *host[:3], ref_out, ref_lse, causal=True)
    print(f"max |out - ref| = {np.abs(out[:1].get().astype(np.float64) - ref_out).max():.2e}  (bf16 output)")
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        err = np.abs(got[:1].get().astype(np.float64) - ref).max() / np.abs(ref).max()
        print(f"max |{name} - ref| / max |ref| = {err:.2e}")

    for _ in range(3):
        cuflash.attention(q, k, v, causal=True)
    cupy.cuda.Device().synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        cuflash.attention(q, k, v, causal=True)
    cupy.cuda.Device().synchronize()
    ms = (time.perf_counter() - t0) / n * 1e3
    flops = 4 * b * h * sq * sk * d / 2  # roughly half the scores are masked
    print(f"forward: {ms:.3f} ms, ~{flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    try:
        require_gpu()  # CuPy installed and a CUDA device present, or one line saying what is missing
    except (ImportError, RuntimeError) as err:
        sys.exit(f"cupy_example.py: {err}")
    main()

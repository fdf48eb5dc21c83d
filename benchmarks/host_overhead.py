"""Host-side cost of one cuflash call: wall time per call with the GPU never the bottleneck, and a cProfile
of the Python layer (which functions the time goes to).

    python benchmarks/host_overhead.py [--calls 2000] [--profile]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import cupy
    import numpy as np
    import cuflash
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    rs = cupy.random.RandomState(0)
    q = rs.standard_normal((1, 1, 32, 128), dtype=np.float32).astype(bf16)
    kc = rs.standard_normal((1, 8192, 8, 128), dtype=np.float32).astype(bf16)
    vc = rs.standard_normal((1, 8192, 8, 128), dtype=np.float32).astype(bf16)
    qa = rs.standard_normal((1, 128, 16, 64), dtype=np.float32).astype(bf16)
    cases = {
        "kvcache b1 8k": lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=8192),
        "attention 1x128x16x64": lambda: cuflash.attention(qa, qa, qa),
    }
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        cupy.cuda.Device().synchronize()
        print(f"{name}: {1e6 * (time.perf_counter() - t) / args.calls:.1f} us per call (wall, {args.calls} calls)")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            cupy.cuda.Device().synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What a split tile costs (fwd_sm90.cu SPLIT): the Hopper forward at d 64, non-causal, timed per variant on shapes
whose tiles are all split tiles (64 query rows per sequence: every tile fits one warpgroup's rows) and on the 1k cell
of the benchmark, with CUDA events (median of 50 after 10 warm-up launches).

    python3 scripts/time_split_tiles.py [--variants ws3_n128_p,ws3_n128_p_split] [--keys 1024]

Prints microseconds per call; at 64 rows, ws3_n128_p_split over ws3_n128_p is the split tile's time as a fraction of
an unsplit one's (both walk the same tiles)."""
import argparse

import cupy
import numpy as np

from cuflash.ops import forward_sm90


def time_call(fn, warmup: int = 10, reps: int = 50) -> float:
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="ws3_n128_p,ws3_n128_p_split")
    ap.add_argument("--keys", type=int, default=1024)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sk = args.keys
    # (batch, query rows, heads): all-split tiles, then the benchmark's 1k cell (16k tokens x 32 heads)
    for b, sq, h in ((256, 64, 32), (16, sk, 32)):
        q = cupy.asarray(rng.standard_normal((b, sq, h, 64), dtype=np.float32)).astype(cupy.float16)
        k = cupy.asarray(rng.standard_normal((b, sk, h, 64), dtype=np.float32)).astype(cupy.float16)
        v = cupy.asarray(rng.standard_normal((b, sk, h, 64), dtype=np.float32)).astype(cupy.float16)
        flops = 4 * b * h * sq * sk * 64
        for variant in args.variants.split(","):
            us = time_call(lambda: forward_sm90.attention_sm90(q, k, v, variant=variant))
            print(f"b={b:4d} sq={sq:5d} sk={sk:5d} h={h} {variant:18s} {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()

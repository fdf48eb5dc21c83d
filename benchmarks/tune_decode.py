"""Decode tile/ring tuning: times attention_with_kvcache (bf16, d 128, 32 query heads, 8 KV heads, one new row)
for several (block_n, stages) configs on a few cells, same run. The winner goes into plan.DECODE_TABLE with
this output as its record (docs/bench/tune_decode.txt).

    python benchmarks/tune_decode.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = ((64, 2), (64, 3), (64, 4), (64, 6), (128, 2), (128, 3))
CELLS = ((1, 8192), (1, 262144), (8, 65536), (32, 8192), (32, 65536), (64, 262144))


def main():
    import cupy
    import numpy as np
    import ml_dtypes
    from triton.testing import do_bench
    import cuflash
    from cuflash import api, plan

    original = plan.decode_config
    rs = cupy.random.RandomState(0)
    print(f"{'batch':>5} {'len':>7} | " + " ".join(f"n{bn}s{st}".rjust(9) for bn, st in CONFIGS) + "   (TB/s)")
    for b, n in CELLS:
        kc = rs.standard_normal((b, n, 8, 128), dtype=np.float32).astype(ml_dtypes.bfloat16)
        vc = rs.standard_normal((b, n, 8, 128), dtype=np.float32).astype(ml_dtypes.bfloat16)
        q = rs.standard_normal((b, 1, 32, 128), dtype=np.float32).astype(ml_dtypes.bfloat16)
        ref = None
        row = []
        for bn, st in CONFIGS:
            plan.decode_config = lambda d, rows, bn=bn, st=st: plan.DecodeConfig(1 if rows <= 16 else 4, bn, st)
            plan.plan_decode.cache_clear()
            api._decode_calls.clear()
            fn = lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=n)  # noqa: E731
            out = fn()
            if ref is None:
                ref = out
            assert float(cupy.abs(out.astype(np.float32) - ref.astype(np.float32)).max()) < 2e-2
            us = 1e3 * do_bench(fn, warmup=10, rep=60, return_mode="median")
            row.append(2 * kc.nbytes / us / 1e6)
        print(f"{b:>5} {n:>7} | " + " ".join(f"{x:9.2f}" for x in row), flush=True)
        del kc, vc
        cupy.get_default_memory_pool().free_all_blocks()
    plan.decode_config = original


if __name__ == "__main__":
    main()

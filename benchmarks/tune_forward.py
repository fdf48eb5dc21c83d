"""Measures forward tile configs on this GPU, to choose the planner's table (cuflash/ops/forward.py).

For each (head dim, causal) it times every candidate config on the ANCHORS shapes (16k tokens,
hidden 2048) and prints TFLOP/s, with PyTorch SDPA's flash backend beside it when torch is there.

    python benchmarks/tune_forward.py [--seqlens 1024 4096 16384] [--json tune.json]
"""
import argparse
import json
import math
import sys

import numpy as np

sys.path.insert(0, ".")
import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cuflash  # noqa: E402
from cuflash import build  # noqa: E402
from cuflash.ops import forward  # noqa: E402
from cuflash.ops.forward import FwdConfig  # noqa: E402

CANDIDATES = {  # spill-free ones (tests/test_compile.py would reject the others from the table)
    64: [FwdConfig(128, 64, 4, False), FwdConfig(64, 64, 4, True), FwdConfig(64, 128, 4, True)],
    128: [FwdConfig(128, 128, 8, True), FwdConfig(64, 128, 4, True), FwdConfig(64, 64, 4, True)],
}


def time_ms(fn, reps=30):
    """Median time of fn, measured as the benchmark does (triton's do_bench: L2 flushed between runs)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return time_ms_events(fn, reps)
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_ms_events(fn, reps=30):
    """Median of `reps` launches, enqueued back to back (like triton's do_bench) so that host-side call
    overhead overlaps the previous launch instead of idling the GPU between events."""
    for _ in range(3):
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in events]))


def sdpa_flash_ms(q, k, v, causal):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return float("nan")
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=sorted(CANDIDATES))
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--json")
    ap.add_argument("--configs", nargs="+", help="only these candidates, e.g. 64x128w4q 128x128w8q")
    args = ap.parse_args()
    arch = build.device_arch(cupy.cuda.Device().id)
    rows = []
    for d in args.dims:
        for causal in {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]:
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                rng = np.random.default_rng(0)
                q, k, v = (cupy.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16))
                           for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                ref = sdpa_flash_ms(q, k, v, causal)
                line = [f"d={d:3d} causal={int(causal)} s={s:5d} flash {flops / ref / 1e9:6.1f}"]
                for cfg in CANDIDATES[d]:
                    label = f"{cfg.block_m}x{cfg.block_n}w{cfg.warps}{'q' if cfg.q_in_regs else ''}"
                    if args.configs and label not in args.configs:
                        continue
                    forward.FWD_TABLE_SM90[("sm90", d, causal)] = ((None, cfg),)
                    forward.FWD_TABLE[("sm80", d, causal)] = ((None, cfg),)
                    forward.plan_forward.cache_clear()
                    try:
                        ms = time_ms(lambda: cuflash.attention(q, k, v, causal=causal))
                        tflops = flops / ms / 1e9
                    except Exception as err:  # a config that does not launch (smem, registers)
                        print(f"  {cfg}: {type(err).__name__}: {err}", file=sys.stderr)
                        tflops = float("nan")
                    rows.append(dict(d=d, causal=causal, seqlen=s, config=cfg.__dict__, tflops=tflops,
                                     flash_tflops=flops / ref / 1e9))
                    line.append(f"{label} {tflops:6.1f}")
                print(" | ".join(line), flush=True)
                del q, k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Which kernels a forward call runs, ours and SDPA's cuDNN backend's, with their launch shapes.

For each cell (head dim, causal, seqlen on the ANCHORS grid: batch 16384 // seqlen, heads 2048 // head dim) both
implementations run --iters times under torch.profiler after --warmup calls; per kernel it prints the name, grid,
block, registers per thread, shared memory, and the mean GPU time per call. That is how to see a peer's tile shape
(the grid's CTA count, the block's warps) without its source.

    python3 benchmarks/peer_kernels.py --cells 64:0:512,64:1:512,128:0:1024
    ncu -k regex:cudnn --launch-skip 2 -c 1 python3 benchmarks/peer_kernels.py --cells 64:0:512 --impls cudnn --plain
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  -- stack import, interop; no GPU at import


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="64:0:512,64:0:1024,64:1:512,64:1:1024,64:1:2048,128:0:512,128:0:1024",
                   help="head dim:causal (0/1):seqlen, comma-separated")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--impls", default="cuflash,cudnn", help="cuflash, cudnn or both")
    p.add_argument("--plain", action="store_true", help="only call them, no profiler (to run under Nsight Compute)")
    return p.parse_args(argv)


def kernel_rows(fn, iters: int, torch) -> list:
    """(name, grid, block, registers, shared memory, mean us per call) per kernel name of `iters` calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = {}
    for ev in events:
        if ev.get("cat") != "kernel":
            continue
        a = ev.get("args", {})
        key = (ev["name"], str(a.get("grid")), str(a.get("block")), a.get("registers per thread"),
               a.get("shared memory"))
        kernels.setdefault(key, []).append(ev.get("dur", 0.0))
    return [(*key, len(durs) / iters, statistics.mean(durs)) for key, durs in kernels.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import cuflash.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for cell in args.cells.split(","):
        d, causal, seqlen = (int(x) for x in cell.split(":"))
        batch, heads = ba.TOKENS_PER_BATCH // seqlen, ba.HIDDEN // d
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def ours():
            return cuflash.torch.attention(q, k, v, causal=bool(causal))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))

        print(f"\n=== d {d} causal {bool(causal)} seqlen {seqlen} batch {batch} heads {heads}")
        for name, fn in (("cuflash", ours), ("cudnn", cudnn)):
            if name not in args.impls.split(","):
                continue
            try:
                for _ in range(args.warmup + (args.iters if args.plain else 0)):
                    fn()
                torch.cuda.synchronize()
                if args.plain:
                    continue
                for kname, grid, block, regs, smem, per_call, us in kernel_rows(fn, args.iters, torch):
                    print(f"{name:8s} {us:9.1f} us x{per_call:.0f} grid {grid} block {block} regs {regs} "
                          f"smem {smem} {kname[:150]}")
            except Exception as e:  # noqa: BLE001
                print(f"{name:8s} failed: {ba.short_error(e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

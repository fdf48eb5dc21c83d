#!/usr/bin/env python3
"""Sustained speed under the GPU's power limit: each workload called back to back for --seconds, with the SM clock,
the board power and the throttle reasons sampled by nvidia-smi meanwhile.

    python3 benchmarks/bench_sustained.py [--workloads fp8,scaled_mm,bf16] [--seconds 10] [--d 128] [--seqlen 16384]

Workloads, on one (batch 16384 / seqlen, seqlen, 2048 / d heads, d) non-causal cell of the FA2-paper grid:
  fp8        cuflash.attention_fp8 on e4m3 tensors (descales of 1)
  bf16       cuflash.attention in bf16
  bf16_bwd   cuflash.torch.attention's backward alone (torch.autograd.grad of one forward, the graph kept)
  cudnn      SDPA's cuDNN backend, the forward
  cudnn_bwd  SDPA's cuDNN backend, its backward alone, as bf16_bwd
  scaled_mm  torch._scaled_mm's e4m3 GEMM, 8192^3, bf16 out (bench_fp8.scaled_mm, its ceiling)
Per workload: TFLOP/s over the whole loop after its first calls (a backward counts 2.5x the forward's FLOPs), then
the median and range of the SM clock and the board power over the second half of the samples taken under load, the
energy a FLOP (median power over the TFLOP/s), and the throttle reasons seen there (nvidia-smi's
bit mask: 0x4 is the software power cap). bench_attention.py's do_bench times a cell in a fraction of a second, often
before the clock settles at the power cap; this shows where it settles (docs/perf-notes.md, "the SM clock and board
power under sustained load").
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (its GPU stack and FLOP count)
import bench_fp8  # noqa: E402  (its FP8 ceiling)

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def workload(name: str, args):
    """(callable, FLOPs a call) for one workload."""
    torch = ba.torch
    b, s, h, d = ba.TOKENS_PER_BATCH // args.seqlen, args.seqlen, ba.HIDDEN // args.d, args.d
    flops = ba.forward_flops(b, h, s, s, d, False)
    import cuflash.torch as ct
    if name == "fp8":
        x8 = [torch.randn(b, s, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
        return (lambda: ct.attention_fp8(*x8)), flops
    if name == "bf16":
        x = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        return (lambda: ct.attention(*x)), flops
    if name in ("bf16_bwd", "cudnn", "cudnn_bwd"):  # SDPA's (b, h, s, d) views of (b, s, h, d) storage
        from torch.nn.attention import SDPBackend, sdpa_kernel
        x = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        xt = [t.transpose(1, 2) for t in x]

        def cudnn(*t):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(*t)
        if name == "cudnn":  # inference, as bf16's cuflash.attention: inputs that do not require grad
            xd = [t.detach() for t in xt]
            return (lambda: cudnn(*xd)), flops
        out = ct.attention(*x) if name == "bf16_bwd" else cudnn(*xt)
        grad = torch.randn_like(out)
        return (lambda: torch.autograd.grad(out, x, grad, retain_graph=True)), ba.backward_flops(b, h, s, s, d, False)
    if name == "scaled_mm":
        return bench_fp8.scaled_mm()
    raise SystemExit(f"--workloads: unknown workload {name!r} (fp8, bf16, bf16_bwd, cudnn, cudnn_bwd, scaled_mm)")


def loaded_samples(path: str) -> list[tuple[int, float, str]]:
    """(MHz, W, reasons) of the samples under load (above 200 W), their second half."""
    rows = []
    with open(path) as log:
        for line in log:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0].endswith("MHz"):
                rows.append((int(parts[0].split()[0]), float(parts[1].split()[0]), parts[2]))
    busy = [r for r in rows if r[1] > 200.0]
    return busy[len(busy) // 2:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="fp8,scaled_mm,bf16")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--interval-ms", type=int, default=200, help="nvidia-smi's sampling interval")
    p.add_argument("--pause", type=float, default=3.0, help="seconds idle between workloads")
    args = p.parse_args(argv)
    if not ba.import_stack_with_cuflash("bench_sustained"):
        return 2
    torch = ba.torch
    for i, name in enumerate(w for w in args.workloads.split(",") if w):
        if i:
            time.sleep(args.pause)
        fn, flops = workload(name, args)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader",
                                    f"-lms={args.interval_ms}"], stdout=log, stderr=subprocess.DEVNULL)
            try:
                calls, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < args.seconds:
                    for _ in range(10):
                        fn()
                    torch.cuda.synchronize()
                    calls += 10
                elapsed = time.perf_counter() - t0
            finally:
                smi.terminate()
                smi.wait()
            samples = loaded_samples(log.name)
        tflops = flops * calls / elapsed / 1e12
        line = f"{name:>9}: {tflops:7.1f} TFLOP/s over {elapsed:.1f} s"
        if samples:
            mhz, watts = [r[0] for r in samples], [r[1] for r in samples]
            line += (f"; SM clock median {statistics.median(mhz):.0f} MHz ({min(mhz)}-{max(mhz)}), power median "
                     f"{statistics.median(watts):.0f} W ({min(watts):.0f}-{max(watts):.0f}), "
                     f"{statistics.median(watts) / tflops:.3f} pJ a FLOP, throttle reasons "
                     f"{sorted({r[2] for r in samples})} ({len(samples)} samples)")
        else:
            line += "; no samples under load"
        print(line, flush=True)
        del fn
        ba.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())

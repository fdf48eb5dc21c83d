#!/usr/bin/env python3
"""e4m3 quantization (cuflash.quantize_e4m3) beside torch's own, in one run: bf16 q-shaped tensors (batch, seqlen,
nheads, d) with hidden 2048, per tensor and per (sequence, head).

    python3 benchmarks/bench_quantize.py [--tokens 16384,131072] [--dims 64,128,256]

Per cell, microseconds (the median of do_bench), the bandwidth of the bytes that must move, 2 bytes read and 1
written per element (the kernels read x twice: once for the maxima, once to quantize), and the share of e4m3 bytes
unlike torch's (torch may divide as a multiply by the reciprocal, which rounds differently now and then):
  cuflash        cuflash.quantize_e4m3 on CuPy arrays (two kernels)
  cuflash_torch  cuflash.torch.quantize_e4m3
  torch          the same in torch ops: amax, the descale, x / descale, .to(torch.float8_e4m3fn)
  torch_compile  that function under torch.compile (fused by Inductor)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (its GPU stack and timing)

HIDDEN = 2048


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=ba._int_list, default=[16384, 131072])
    p.add_argument("--dims", type=ba._int_list, default=[64, 128, 256])
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    return p.parse_args(argv)


def torch_quantize(x, per: str):
    """x (b, s, h, d) -> (e4m3 x, float32 descale) in torch ops, as cuflash.reference.quantize_e4m3 states it."""
    torch = ba.torch
    amax = x.abs().amax() if per == "tensor" else x.abs().amax(dim=(1, 3))
    amax = amax.float()
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    scale = descale if per == "tensor" else descale[:, None, :, None]
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), descale


def main(argv=None) -> int:
    args = parse_args(argv)
    if not ba.import_stack_with_cuflash("bench_quantize"):
        return 2
    torch, cuflash = ba.torch, ba.cuflash
    import cuflash.torch as cft
    ba.warm_up_gpu()
    torch._dynamo.config.cache_size_limit = 64  # a graph per cell, not torch's eager fallback after 8
    compiled = torch.compile(torch_quantize, dynamic=False)
    print(f"{'tokens':>7} {'d':>4} {'per':>6} {'cuflash':>8} {'cf_torch':>8} {'torch':>8} {'compile':>8}   "
          f"(us; then GB/s of 3 bytes an element; then the share of bytes unlike torch's)")
    for tokens in args.tokens:
        for d in args.dims:
            for per in ("tensor", "head"):
                x = torch.randn(tokens // 1024, 1024, HIDDEN // d, d, device="cuda", dtype=torch.bfloat16)
                with ba.cupy_stream():
                    xc = ba.to_cupy(x)
                    ms = {"cuflash": ba.time_ms(lambda: cuflash.quantize_e4m3(xc, per=per), args)}
                    ours8, ours = cuflash.quantize_e4m3(xc, per=per)
                ms["cf_torch"] = ba.time_ms(lambda: cft.quantize_e4m3(x, per=per), args)
                ms["torch"] = ba.time_ms(lambda: torch_quantize(x, per), args)
                ms["compile"] = ba.time_ms(lambda: compiled(x, per), args)
                theirs8, theirs = torch_quantize(x, per)
                differ = float((ba.to_torch(ours8) != theirs8.view(torch.uint8)).float().mean())
                same = torch.equal(ba.to_torch(ours), theirs)
                gbs = {k: 3 * x.numel() / (v * 1e-3) / 1e9 for k, v in ms.items()}
                cells = " ".join(f"{ms[k] * 1e3:>8.1f}" for k in ("cuflash", "cf_torch", "torch", "compile"))
                rates = " ".join(f"{gbs[k]:>6.0f}" for k in ("cuflash", "cf_torch", "torch", "compile"))
                print(f"{tokens:>7} {d:>4} {per:>6} {cells}   {rates}   {differ:.1e}"
                      f"{'' if same else '  (descales differ from torch)'}", flush=True)
                ba.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())

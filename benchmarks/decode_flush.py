#!/usr/bin/env python3
"""How the L2 flush before each timed call moves the small decode cells, cuflash beside SDPA's cuDNN backend.

bench_decode.py times with triton's do_bench, which zeroes a 256 MB buffer before every call: the call then starts
with an L2 full of dirty lines. This script times the same calls (one new row, 32 query heads, 8 KV heads, d 128,
bf16; K/V shared as in bench_decode.py) after four kinds of flush, with CUDA events around each call:
    memset       the 256 MB zeroed (do_bench's flush)
    memset+read  the same, then the buffer read (a sum): the L2 ends full of clean lines
    read         the buffer read only
    none         nothing: K/V partly in L2 from the last call
    memset+sleep the memset, then a 100 us spin kernel (torch.cuda._sleep): the L2 as after memset, and the host
                 surely ahead of the GPU, so the events time the call's GPU work and not its host path
and prints the median microseconds per call; "read K/V" is a torch sum over the same K/V bytes (one reduction
kernel), a floor for what reading them costs after each flush.

    python3 benchmarks/decode_flush.py [--cells 1x8192,1x1024,8x1024] [--iters 200]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
H, HK, D = 32, 8, 128


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="1x8192,1x1024,8x1024", help="batch x KV length, comma-separated")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import cuflash

    buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    flushes = {"memset": lambda: buf.zero_(), "memset+read": lambda: (buf.zero_(), buf.sum(dtype=torch.int32)),
               "read": lambda: buf.sum(dtype=torch.int32), "none": lambda: None,
               "memset+sleep": lambda: (buf.zero_(), torch.cuda._sleep(200_000))}
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    print(f"{'cell':>8} {'impl':>8} " + " ".join(f"{m:>12}" for m in flushes) + "   (median us per call)")
    for cell in args.cells.split(","):
        b, n = map(int, cell.split("x"))
        kv = torch.randn(2, b, HK, n, D, device="cuda", dtype=torch.bfloat16)
        k, v = kv[0], kv[1]
        q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16)
        kc, vc, qc = (cupy.from_dlpack(x.transpose(1, 2)) for x in (k, v, q))

        def cf():
            with stream:
                return cuflash.attention_with_kvcache(qc, kc, vc, cache_seqlens=n)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def read():  # one reduction kernel over the K/V bytes: what reading them alone takes after each flush
            return kv.sum(dtype=torch.float32)

        for name, fn in (("cuflash", cf), ("cudnn", cudnn), ("read K/V", read)):
            fn()
            medians = []
            for flush in flushes.values():
                pairs = []
                for _ in range(args.iters):
                    flush()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    pairs.append((start, end))
                torch.cuda.synchronize()
                medians.append(statistics.median(1e3 * s.elapsed_time(e) for s, e in pairs))
            print(f"{cell:>8} {name:>8} " + " ".join(f"{m:>12.1f}" for m in medians), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Does a forward cell's speed depend on where its tensors lie? Per cell of --cells, --trials times: a pad of random
size is allocated first (its addresses move every later tensor), then fresh q, k, v; cuflash and SDPA's cuDNN backend
are timed on them as bench_attention.py times a cell (do_bench, L2 flushed). Prints TFLOP/s per trial and impl, and
the spread of each impl over the trials, so a bimodal peer or kernel shows as two clusters.

    python3 scripts/placement_probe.py --cells 128:0:8192:2:16,64:1:512:32:32 --trials 8
"""
import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402


def impls(q, k, v, causal: bool) -> dict:
    """{impl: call} on these (b, s, h, d) tensors: cuflash on CuPy views, SDPA's cuDNN on (b, h, s, d) views."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qc, kc, vc = (ba.to_cupy(x) for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    stream = ba.cupy_stream()

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return {"cuflash": lambda: ba.cuflash.attention(qc, kc, vc, causal=causal, stream=stream), "cudnn": cudnn}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="128:0:8192:2:16,128:0:2048:8:16,64:1:512:32:32,64:0:512:32:32",
                   help="d:causal:seqlen:batch:heads, comma-separated")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not ba.import_stack_with_cuflash("placement_probe"):
        return 2
    import torch
    bench_args = argparse.Namespace(warmup=25, rep=100)
    rng = random.Random(args.seed)
    for text in args.cells.split(","):
        d, causal, s, b, h = (int(x) for x in text.split(":"))
        flops = ba.forward_flops(b, h, s, s, d, bool(causal))
        rows = {"cuflash": [], "cudnn": []}
        print(f"=== d {d} causal {bool(causal)} seqlen {s} batch {b} heads {h}")
        for trial in range(args.trials):
            pad = torch.empty(rng.randrange(0, 64 << 20), dtype=torch.uint8, device="cuda")
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            line = f"trial {trial}: pad {pad.numel() >> 20:3d} MiB, q at {q.data_ptr() % (1 << 30):#x}"
            for name, fn in impls(q, k, v, bool(causal)).items():
                fn()
                torch.cuda.synchronize()
                tf = flops / (ba.time_ms(fn, bench_args) * 1e-3) / 1e12
                rows[name].append(tf)
                line += f"  {name} {tf:6.1f}"
            print(line + f"  ratio {rows['cuflash'][-1] / rows['cudnn'][-1]:.3f}", flush=True)
            del q, k, v, pad
        for name, xs in rows.items():
            print(f"{name:8s} min {min(xs):6.1f} median {statistics.median(xs):6.1f} max {max(xs):6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

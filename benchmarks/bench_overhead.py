"""Per-call host overhead of cuflash.torch.attention beside torch's scaled_dot_product_attention.

    python benchmarks/bench_overhead.py [--json out.json] [--calls 3000]

A tiny shape (default b=1, s=16, h=4, d=64, fp16), eager mode, no CUDA graphs: the kernels take a few
microseconds, so the wall time per call of a long loop of calls (one synchronize at the end) is the
host-side cost of a call -- Python, dispatch, checks, allocation, launch. Each row is the median of
--repeats loops; the GPU time per call (CUDA events over the same loop) is printed beside it to show the
GPU is not the bottleneck. The target is cuflash within 2x of SDPA's forward call overhead.

Rows: the forward of each (no autograd), forward+backward of each (requires_grad inputs), cuflash's own
CuPy API on the same memory, the op path (torch.ops.cuflash.attention_fwd called directly: what an eager call
would cost through the torch.library dispatcher, which cuflash.torch skips in plain eager calls),
cuflash.torch.attention_varlen on the same tokens packed as one sequence, a one-token decode step with
attention_with_kvcache (append to a 256-key cache) beside the CuPy API's, and the per-tensor cost of the two
ways to see a torch tensor from CuPy (cupy.from_dlpack vs the pointer view cuflash.torch uses).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def per_call_us(fn, calls, repeats):
    """Median over `repeats` loops of (wall time of `calls` calls + one synchronize) / calls, and GPU time."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    walls, gpus = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / calls * 1e6)
        gpus.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(walls), statistics.median(gpus)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,16,4,64", help="b,s,h,d")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    import cupy
    import cuflash
    import cuflash.torch

    b, s, h, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (b, h, s, d) view of the same memory
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qgt, kgt, vgt = (x.clone().transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    cq, ck, cv = (cuflash.torch._view(x) for x in (q, k, v))
    # varlen: batch row 0 as one packed sequence
    cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
    pq, pk, pv = (x[0] for x in (q, k, v))
    pqg, pkg, pvg = (x.clone().requires_grad_() for x in (pq, pk, pv))
    # decode: one new token per row, appended to a 256-key cache that holds 128
    dq, dk, dv = (torch.randn(b, 1, h, d, device="cuda", dtype=dtype) for _ in range(3))
    k_cache, v_cache = (torch.randn(b, 256, h, d, device="cuda", dtype=dtype) for _ in range(2))
    lens = torch.full((b,), 128, dtype=torch.int32, device="cuda")
    cdq, cdk, cdv, ckc, cvc, clens = (cuflash.torch._view(x) for x in (dq, dk, dv, k_cache, v_cache, lens))

    def fwd_bwd(fn, *xs):
        def run():
            fn(*xs).sum().backward()
        return run

    rows = []
    no_grad = [
        ("sdpa forward", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)),
        ("cuflash.torch forward", lambda: cuflash.torch.attention(q, k, v, causal=True)),
        ("cuflash (CuPy API) forward", lambda: cuflash.attention(cq, ck, cv, causal=True)),
        ("cuflash.torch forward, op path",
         lambda: torch.ops.cuflash.attention_fwd(q, k, v, None, None, True, -1, -1, 0.0, False)),
        ("cuflash.torch varlen forward", lambda: cuflash.torch.attention_varlen(pq, pk, pv, cu, cu, s, s, causal=True)),
        ("cuflash.torch kvcache decode", lambda: cuflash.torch.attention_with_kvcache(
            dq, k_cache, v_cache, k=dk, v=dv, cache_seqlens=lens, causal=True)),
        ("cuflash (CuPy API) kvcache decode", lambda: cuflash.attention_with_kvcache(
            cdq, ckc, cvc, k=cdk, v=cdv, cache_seqlens=clens, causal=True)),
    ]
    with_grad = [
        ("sdpa forward+backward",
         fwd_bwd(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True), qgt, kgt, vgt)),
        ("cuflash.torch forward+backward", fwd_bwd(lambda *x: cuflash.torch.attention(*x, causal=True), qg, kg, vg)),
        ("cuflash.torch varlen fwd+bwd",
         fwd_bwd(lambda *x: cuflash.torch.attention_varlen(*x, cu, cu, s, s, causal=True), pqg, pkg, pvg)),
    ]
    views = [
        ("cupy.from_dlpack (1 tensor)", lambda: cupy.from_dlpack(q)),
        ("cuflash.torch._view (1 tensor)", lambda: cuflash.torch._view(q)),
    ]
    with torch.no_grad():
        for name, fn in no_grad:
            rows.append((name, *per_call_us(fn, args.calls, args.repeats)))
    for name, fn in with_grad:
        rows.append((name, *per_call_us(fn, max(1, args.calls // 3), args.repeats)))
    for name, fn in views:
        rows.append((name, *per_call_us(fn, args.calls, args.repeats)))

    gpu = torch.cuda.get_device_name()
    print(f"=== per-call host overhead, {args.dtype} (b, s, h, d) = ({b}, {s}, {h}, {d}), causal, eager, "
          f"no CUDA graphs; {gpu}; torch {torch.__version__}, cupy {cupy.__version__}")
    print(f"{'':34} {'wall us/call':>12} {'GPU us/call':>12}")
    for name, wall, g in rows:
        print(f"{name:34} {wall:12.1f} {g:12.1f}")
    walls = {name: wall for name, wall, _ in rows}
    fwd_ratio = walls["cuflash.torch forward"] / walls["sdpa forward"]
    bwd_ratio = walls["cuflash.torch forward+backward"] / walls["sdpa forward+backward"]
    print(f"cuflash.torch / sdpa: forward {fwd_ratio:.2f}x, forward+backward {bwd_ratio:.2f}x "
          f"(target: forward within 2x) -> {'OK' if fwd_ratio <= 2 else 'OVER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [b, s, h, d], "dtype": args.dtype, "gpu": gpu, "torch": torch.__version__,
                       "rows": [{"name": n, "wall_us": w, "gpu_us": g} for n, w, g in rows],
                       "forward_ratio": fwd_ratio, "forward_backward_ratio": bwd_ratio}, f, indent=1)


if __name__ == "__main__":
    main()

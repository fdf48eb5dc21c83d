#!/usr/bin/env python3
"""Where the GPU time of one cuflash call goes, per kernel: kernel time against launch gaps.

torch.profiler (CUDA activity only: kineto/CUPTI records every kernel, memset and memcpy of the process,
CuPy's launches included) over --iters back-to-back calls on torch's current stream, after --warmup calls
(compiles). Prints per kernel: calls per iteration, mean GPU us per call, us per iteration (--shapes: its launch
shape from the trace: grid, block, registers per thread, shared memory); then over the
iterations (a call's kernels, in start order): span (first start to last end), busy (sum of kernel times),
idle (span - busy: launch gaps inside the call), the gap before each kernel of a call, and the gap from one
call's end to the next call's start (the host's per-call cost, where it exceeds the GPU time). --sync-each
synchronizes after every call, so each one starts on an idle GPU.

    python3 benchmarks/profile_kernels.py --op decode --batch 1 --seqlen 8192    # + SDPA cuDNN, same K/V
    python3 benchmarks/profile_kernels.py --op bwd --batch 4 --seqlen 4096 --heads 16 --headdim 128
    python3 benchmarks/profile_kernels.py --op bwd --batch 1 --seqlen 16384 --peer --shapes   # cuDNN's kernels too
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  -- stack import, interop (to_cupy, cupy_stream); no GPU at import

H, HK, D = 32, 8, 128  # decode shapes, as bench_decode.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("decode", "fwd", "bwd"), default="decode")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=8192, help="KV cache length (decode) or seqlen (fwd, bwd)")
    p.add_argument("--num-splits", type=int, default=0, help="decode: 0 = the planner's heuristic")
    p.add_argument("--heads", type=int, default=16, help="fwd, bwd")
    p.add_argument("--headdim", type=int, default=128, help="fwd, bwd")
    p.add_argument("--causal", action="store_true", help="fwd, bwd")
    p.add_argument("--deterministic", action="store_true", help="bwd")
    p.add_argument("--peer", action="store_true", help="fwd, bwd: SDPA's cuDNN backend too, on the same tensors (bwd: "
                   "its backward through autograd, the forward's kernels left out)")
    p.add_argument("--shapes", action="store_true", help="each kernel's launch shape, from the profiler's trace")
    p.add_argument("--warmup", type=int, default=5, help="calls before profiling (the first compiles)")
    p.add_argument("--iters", type=int, default=20, help="profiled calls")
    p.add_argument("--sync-each", action="store_true", help="synchronize after every profiled call")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    return p.parse_args(argv)


def _plan(describe) -> list:
    """The planner's choice as a line; a planner whose internals changed costs the line, not the run."""
    try:
        return [describe()]
    except Exception as e:  # noqa: BLE001
        return [f"plan: unavailable ({type(e).__name__}: {e})"]


def _sdpa_cudnn(q, k, v, **kwargs):
    """A call of SDPA's cuDNN backend on these (b, h, s, d) tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return cudnn


def setup(args):
    """(plan lines, {impl: fn}) for --op: cuflash on torch's current stream, and SDPA cuDNN (decode; --peer)."""
    import torch
    from cuflash import build, checks, options
    from cuflash.ops import backward, backward_sm90, decode, forward
    torch.manual_seed(0)
    cf, stream, dev, bf16 = ba.cuflash, ba.cupy_stream(), torch.cuda.current_device(), torch.bfloat16
    if args.op == "decode":  # as bench_decode.py: SDPA's (b, hk, n, d) storage, cuflash's (b, n, hk, d) view of it
        b, n = args.batch, args.seqlen
        k, v = (torch.randn(b, HK, n, D, device="cuda", dtype=bf16) for _ in range(2))
        q = torch.randn(b, H, 1, D, device="cuda", dtype=bf16)
        qc, kc, vc = (ba.to_cupy(x.transpose(1, 2)) for x in (q, k, v))
        seqlens = ba.cupy.full((b,), n, dtype=ba.cupy.int32)  # a device array: the planner bounds by capacity
        fns = {"cuflash": lambda: cf.attention_with_kvcache(qc, kc, vc, cache_seqlens=seqlens,
                                                           num_splits=args.num_splits, stream=stream)}
        fns["sdpa_cudnn"] = _sdpa_cudnn(q, k, v, enable_gqa=True)

        def describe():  # as decode.prepare: a seqlens array bounds the splits by the capacity
            pb = checks.check_kvcache(qc, kc, vc, cache_seqlens=seqlens, num_splits=args.num_splits)
            left, right = options.normalize_window(*checks.window(False, (-1, -1)), pb.seqlen_q, pb.seqlen_k)
            launch = decode.plan_decode(pb, left, right, False, args.num_splits, build.sm_count(dev))
            return f"plan_decode: splits {launch.splits}, grid {launch.grid}, {launch.spec}"
        return _plan(describe), fns
    b, s, h, d = args.batch, args.seqlen, args.heads, args.headdim
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=bf16) for _ in range(4))
    qc, kc, vc, doc = (ba.to_cupy(x) for x in (q, k, v, dout))
    left, right = options.normalize_window(*checks.window(args.causal, (-1, -1)), s, s)

    def describe():  # as forward.forward_call / backward.backward_call
        pb, arch = checks.check_attention(qc, kc, vc, causal=args.causal), build.device_arch(dev)
        if args.op == "fwd":
            variant = forward.sm90_variant(pb, arch, left >= 0 or right >= 0)
            return (f"forward: Hopper variant {variant}" if variant else
                    f"plan_forward: {forward.plan_forward(pb, left, right, False, arch)}")
        launch = backward.plan_backward(pb, left, right, False, args.deterministic, arch, build.sm_count(dev),
                                         memory=build.memory_system(dev))
        return (f"plan_backward: grid {launch.grid}, slices {launch.slices}, Hopper "
                f"kernel {backward_sm90.applies(pb, False, arch)}, portable spec {launch.spec}")
    if args.op == "fwd":
        fns = {"cuflash": lambda: cf.attention(qc, kc, vc, causal=args.causal, stream=stream)}
        if args.peer:  # SDPA's (b, h, s, d) view of the same storage
            fns["sdpa_cudnn"] = _sdpa_cudnn(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=args.causal)
        return _plan(describe), fns
    out, lse = cf.attention(qc, kc, vc, causal=args.causal, return_lse=True, stream=stream)
    fns = {"cuflash": lambda: cf.attention_backward(
        doc, qc, kc, vc, out, lse, causal=args.causal, deterministic=args.deterministic, stream=stream)}
    if args.peer:  # one forward with grad, then its backward alone is profiled, the graph kept
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        o = _sdpa_cudnn(qt, kt, vt, is_causal=args.causal)()
        grad = dout.transpose(1, 2)
        fns["sdpa_cudnn"] = lambda: torch.autograd.grad(o, (qt, kt, vt), grad, retain_graph=True)
    return _plan(describe), fns


def launch_shapes(prof) -> dict:
    """{kernel name: "grid, block, registers, shared memory"} from the profiler's Chrome trace (kineto's args)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    shapes = {}
    for e in trace.get("traceEvents", []):
        a = e.get("args") or {}
        if e.get("cat") == "kernel" and "grid" in a:
            shapes[e["name"]] = (f"grid {a.get('grid')} block {a.get('block')} "
                                 f"{a.get('registers per thread')} registers, {a.get('shared memory')} B shared")
    return shapes


def profile(fn, args):
    """Device events [(name, start_us, end_us)] in start order, or None and key_averages [(name, count, us)];
    the launch shapes (launch_shapes) where --shapes asks."""
    import torch
    from torch.profiler import ProfilerActivity
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            fn()
            if args.sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    shapes = {}
    if args.shapes:
        try:
            shapes = launch_shapes(prof)
        except Exception as e:  # noqa: BLE001  -- the shapes are extra; the times still stand
            print(f"note: launch shapes unavailable ({type(e).__name__}: {e})")
    cuda = torch.autograd.DeviceType.CUDA
    try:
        evs = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if getattr(e, "device_type", None) == cuda and getattr(e, "time_range", None) is not None]
        if evs:
            return sorted(evs, key=lambda e: e[1]), None, shapes
    except Exception as e:  # noqa: BLE001  -- a changed event API: the averages still say something
        print(f"note: per-event times unavailable ({type(e).__name__}: {e}); key_averages only")
    avgs = [(a.key, a.count, getattr(a, "device_time_total", getattr(a, "cuda_time_total", 0)))
            for a in prof.key_averages() if getattr(a, "device_type", None) == cuda]
    return None, avgs, shapes


def report(impl, evs, avgs, shapes, args) -> dict:
    n = args.iters
    totals = {}
    for name, t0, t1 in evs or ():
        c, us = totals.get(name, (0, 0.0))
        totals[name] = (c + 1, us + t1 - t0)
    for name, count, us in avgs or ():
        totals[name] = (count, us)
    kernels = [dict(name=k, calls_per_iter=c / n, mean_us=us / c, us_per_iter=us / n)
               for k, (c, us) in sorted(totals.items(), key=lambda kv: -kv[1][1]) if c]
    print(f"\n=== {impl}: {args.op}, {n} iterations{', synchronized each' if args.sync_each else ''} ===")
    print(f"{'kernel':<60} {'calls/it':>8} {'us/call':>9} {'us/it':>9}")
    for r in kernels:
        name = r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..."
        print(f"{name:<60} {r['calls_per_iter']:>8.2f} {r['mean_us']:>9.2f} {r['us_per_iter']:>9.2f}")
        if r["name"] in shapes:
            r["shape"] = shapes[r["name"]]
            print(f"    {r['name']}\n    {r['shape']}")
    res = dict(impl=impl, op=args.op, kernels=kernels, iterations=[])
    if not evs:
        return res
    if len(evs) % n:
        print(f"note: {len(evs)} device events over {n} iterations, not a whole number per call: no per-call split")
        return res
    per = len(evs) // n
    calls = [evs[i * per:(i + 1) * per] for i in range(n)]
    for i, c in enumerate(calls):
        span, busy = c[-1][2] - c[0][1], sum(t1 - t0 for _, t0, t1 in c)
        nxt = calls[i + 1][0][1] - max(t1 for _, _, t1 in c) if i + 1 < n else None
        res["iterations"].append(dict(span_us=span, busy_us=busy, idle_us=span - busy, gap_to_next_us=nxt,
                                      gaps_before_us=[c[j][1] - c[j - 1][2] for j in range(1, per)]))
    its = res["iterations"]
    for key in ("span_us", "busy_us", "idle_us", "gap_to_next_us"):
        xs = [it[key] for it in its if it[key] is not None]
        if xs:
            print(f"per call {key[:-3]:<12} median {statistics.median(xs):9.2f}  min {min(xs):9.2f}  "
                  f"max {max(xs):9.2f} us")
    if per > 1:
        gaps = [statistics.median(it["gaps_before_us"][j] for it in its) for j in range(per - 1)]
        print(f"median gap before kernels 2..{per} of a call: {', '.join(f'{g:.2f}' for g in gaps)} us")
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if not ba.import_stack_with_cuflash("profile_kernels"):
        return 2
    import torch
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  args {vars(args)}")
    plan_lines, fns = setup(args)
    for line in plan_lines:
        print(line)
    rows, rc = [], 0
    for impl, fn in fns.items():
        try:
            rows.append(report(impl, *profile(fn, args), args))
        except Exception as e:  # noqa: BLE001  -- a peer that refuses the shape is reported, not fatal
            print(f"\n=== {impl}: failed: {ba.short_error(e)}")
            rc = rc or int(impl == "cuflash")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), plan=plan_lines, rows=rows), f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())

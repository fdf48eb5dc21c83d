#!/usr/bin/env python3
"""Context-parallel attention across GPUs: cuflash's ring (cuflash.torch_distributed.ring_attention) against
torch's own context parallelism over SDPA (torch.distributed.tensor.experimental.context_parallel), in one run.

One sequence of S tokens (batch 1, --heads heads, head dim 128, bf16, causal by default) is sharded over w GPUs for
every w in 1, 2, 4, .., N (the first w ranks of the torchrun job, through subgroups); w = 1 is plain single-GPU
attention (cuflash.torch.attention and SDPA), the baseline. For each S and w the table gives the forward and the
forward+backward time, tokens per second (S / time) and the scaling efficiency ``tokens/s(w) / (w * tokens/s(1))``.
cuflash shards in its zigzag layout; torch's context_parallel balances causal work with its own round-robin
split. Times are medians of --rep runs after --warmup, from CUDA events on rank 0 between barriers. The
single-GPU baseline of a 1M-token cell takes minutes; --seqlens picks fewer.

Usage (a machine with 2 or more GPUs):
    torchrun --nproc-per-node 4 benchmarks/bench_ring.py                        # S = 128k, 256k, 512k, 1M
    torchrun --nproc-per-node 8 benchmarks/bench_ring.py --seqlens 262144 --json out/ring.json
    torchrun --nproc-per-node 4 benchmarks/bench_ring.py --no-causal --layout contiguous

Exit status: 0 measured; 1 some cuflash cell failed; 2 nothing could run (fewer than 2 GPUs, not under torchrun,
torch missing).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="131072,262144,524288,1048576")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=0, help="GQA key/value heads (default: --heads)")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rep", type=int, default=3)
    parser.add_argument("--no-bwd", dest="bwd", action="store_false")
    parser.add_argument("--impls", default="cuflash,sdpa_cp")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("bench_ring: needs torch; nothing measured")
        return 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "LOCAL_RANK" not in os.environ or gpus < 2 or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        print(f"bench_ring: needs 2 or more GPUs under torchrun (found {gpus} GPU(s), WORLD_SIZE "
              f"{os.environ.get('WORLD_SIZE', 'unset')}): torchrun --nproc-per-node N benchmarks/bench_ring.py; "
              f"nothing measured")
        return 2

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    worlds = [w for w in (1, 2, 4, 8, 16, 32) if w <= world]
    groups = {w: dist.new_group(list(range(w))) for w in worlds if w > 1}
    impls = args.impls.split(",")
    rows, failed = [], False
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for w in worlds:
            for impl in impls:
                try:
                    cell = _cell(impl, seqlen, w, groups.get(w), args)
                except Exception as err:  # noqa: BLE001  (a cell that cannot run is reported, the run goes on)
                    failed |= impl == "cuflash"
                    cell = dict(error=f"{type(err).__name__}: {err}".splitlines()[0][:120])
                    if os.environ.get("BENCH_TRACEBACK") and rank == 0:
                        traceback.print_exc()
                    torch.cuda.empty_cache()
                rows.append(dict(impl=impl, seqlen=seqlen, gpus=w, **cell))
                if rank == 0:
                    _print_row(rows, rows[-1])
    if rank == 0:
        _print_summary(rows, args)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(dict(config=vars(args), gpus=world, device=torch.cuda.get_device_name(), rows=rows), f,
                          indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def _inputs(seqlen, args, device):
    import torch
    gen = torch.Generator(device=device).manual_seed(0)
    kv_heads = args.kv_heads or args.heads
    shape_q, shape_kv = (1, seqlen, args.heads, args.headdim), (1, seqlen, kv_heads, args.headdim)
    return [torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen)
            for s in (shape_q, shape_kv, shape_kv, shape_q)]


def _timed(fn, group, args) -> float:
    """Median seconds of fn() between barriers of `group` (rank 0's CUDA events)."""
    import torch
    import torch.distributed as dist
    times = []
    for i in range(args.warmup + args.rep):
        if group is not None:
            dist.barrier(group=group)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def _cell(impl: str, seqlen: int, w: int, group, args) -> dict:
    """Times of one (implementation, seqlen, GPUs) cell; ranks outside the first w wait at the end barrier."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    result = {}
    if rank < w:
        device = torch.device("cuda", torch.cuda.current_device())
        q, k, v, dout = _inputs(seqlen, args, device)
        with contextlib.ExitStack() as stack:  # what an implementation keeps entered while it is timed
            fwd, step = (_cuflash if impl == "cuflash" else _sdpa_cp)(q, k, v, dout, w, group, args, stack)
            del q, k, v
            result["fwd_s"] = _timed(fwd, group, args)
            if args.bwd:
                result["fwd_bwd_s"] = _timed(step, group, args)
        torch.cuda.empty_cache()
    dist.barrier()
    return result


def _cuflash(q, k, v, dout, w, group, args, stack):
    """(forward, forward + backward) closures: cuflash.torch.attention on one GPU, the ring on several."""
    import torch
    import cuflash.torch
    import cuflash.torch_distributed as cfd
    if w == 1:
        attend = lambda q, k, v: cuflash.torch.attention(q, k, v, causal=args.causal)  # noqa: E731
    else:
        q, k, v, dout = (cfd.shard(x, group, layout=args.layout) for x in (q, k, v, dout))
        attend = lambda q, k, v: cfd.ring_attention(q, k, v, group, causal=args.causal,  # noqa: E731
                                                    layout=args.layout)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            attend(q, k, v)

    def step():
        attend(*leaves).backward(dout)
    return forward, step


def _sdpa_cp(q, k, v, dout, w, group, args, stack):
    """(forward, forward + backward) closures: SDPA on one GPU; SDPA under torch's context_parallel on a device
    mesh of the first w ranks, entered on ``stack`` (it shards its buffers in place on entry and swaps SDPA for
    its ring until the stack closes)."""
    import torch
    import torch.nn.functional as F
    q, k, v, dout = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))  # SDPA's (b, h, s, d)
    gqa = dict(enable_gqa=True) if q.shape[1] != k.shape[1] else {}
    if w > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = DeviceMesh.from_group(group, "cuda")  # the subgroup all ranks made: no collective here
        stack.enter_context(context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]))

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, **gqa)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        F.scaled_dot_product_attention(*leaves, is_causal=args.causal, **gqa).backward(dout)
    return forward, step


def _rate(row, key):
    return row["seqlen"] / row[key] if key in row else None


def _print_row(rows, row):
    if "error" in row:
        print(f"{row['impl']:>8} S={row['seqlen']:>8} gpus={row['gpus']}: n/a ({row['error']})", flush=True)
        return
    base = next((r for r in rows if r["impl"] == row["impl"] and r["seqlen"] == row["seqlen"] and r["gpus"] == 1
                 and "error" not in r), None)
    parts = [f"{row['impl']:>8} S={row['seqlen']:>8} gpus={row['gpus']}"]
    for key, name in (("fwd_s", "fwd"), ("fwd_bwd_s", "fwd+bwd")):
        if key in row:
            eff = (f" eff {_rate(row, key) / (row['gpus'] * _rate(base, key)):6.1%}"
                   if base is not None and key in base else "")
            parts.append(f"{name} {row[key] * 1e3:9.1f} ms {_rate(row, key) / 1e3:9.1f} ktok/s{eff}")
    print("  ".join(parts), flush=True)


def _print_summary(rows, args):
    print(f"\nscaling efficiency, fwd+bwd{' (causal)' if args.causal else ''}: tokens/s(w) / (w * tokens/s(1))")
    key = "fwd_bwd_s" if args.bwd else "fwd_s"
    for impl in sorted({r["impl"] for r in rows}):
        for seqlen in sorted({r["seqlen"] for r in rows}):
            cells = {r["gpus"]: r for r in rows if r["impl"] == impl and r["seqlen"] == seqlen and key in r}
            if 1 not in cells:
                continue
            effs = "  ".join(f"{w} GPUs {_rate(c, key) / (w * _rate(cells[1], key)):6.1%}"
                             for w, c in sorted(cells.items()) if w > 1)
            print(f"{impl:>8} S={seqlen:>8}: {effs}")


if __name__ == "__main__":
    sys.exit(main())

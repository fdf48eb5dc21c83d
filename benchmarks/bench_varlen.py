#!/usr/bin/env python3
"""Packed variable-length sequences: cuflash.attention_varlen against padding.

Two parts, bf16 by default, every implementation in one process on the same data:

(a) equal lengths (16k tokens, hidden 2048, as bench_attention.py): attention_varlen on the
    packed tokens against attention on the (batch, seqlen, ...) tensor. The same kernels run
    either way, so the two should be within a few percent (target: 5%).
(b) mixed lengths: 64 sequences, lengths drawn uniformly from [16, 4096] (seeded), nheads 16,
    head dims 128 and 64, causal off and on. cuflash varlen on the packed tokens; cuflash padded,
    and PyTorch SDPA (flash, cudnn backends) on the batch padded to the longest sequence.
    Throughput is *effective*: only real work counts, forward FLOPs = 4 * d * h * sum over
    sequences of the visible (query, key) pairs (L^2, or L(L+1)/2 when causal), so padding shows
    up as lost TFLOP/s. (The padded runs also attend to padding keys when not causal; a real
    padded run would need a key mask on top, which SDPA's flash backend cannot take.)

With --bwd, part (b) also times the backward of cuflash varlen and cuflash padded
(2.5 x the forward's FLOPs). With --paged 16,256 (page sizes), part (b) also times cuflash varlen
reading the same keys from a shuffled page pool through block_table (chunked prefill against a
paged KV cache): the cost of paging, beside the packed call. With --fp8 (sm_90a), part (b) also times
cuflash.attention_varlen_fp8 on the same tokens in e4m3 (per-tensor descales of 1), beside the bf16 call.

Timing as bench_attention.py: triton.testing.do_bench (CUDA events, L2 flushed before every
call), median. Spot check: varlen against per-sequence SDPA on a few sequences.

Usage (repository root, GPU machine):
    python3 benchmarks/bench_varlen.py
    python3 benchmarks/bench_varlen.py --json out/varlen.json [--append] [--bwd] [--quick]

--append adds the rows (field "op" = "varlen") to an existing JSON list at that path (the
GPU check puts them into bench.json). Exit status: 0 ok, 1 a cuflash cell failed or its spot
check failed, 2 nothing could run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  -- shared timing, interop and stack import

SEED = 0
N_SEQUENCES = 64
MIN_LEN, MAX_LEN = 16, 4096
MIXED_NHEADS = 16
EQUAL_SEQLENS = (512, 2048, 8192)
QUICK_EQUAL_SEQLENS = (2048,)
CHECK_SEQUENCES = 4
TOL = 2e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=ba._int_list, default=[128, 64])
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--quick", action="store_true", help=f"part (a) at seqlen {QUICK_EQUAL_SEQLENS} only")
    p.add_argument("--bwd", action="store_true", help="also time the backward in part (b)")
    p.add_argument("--paged", type=ba._int_list, default=[], help="page sizes for the paged varlen rows of (b)")
    p.add_argument("--fp8", action="store_true", help="also time attention_varlen_fp8 in part (b) (sm_90a)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--tol", type=float, default=TOL, help="spot-check max abs diff")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--append", action="store_true", help="extend the JSON list at --json instead of replacing it")
    args = p.parse_args(argv)
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    args.equal_seqlens = QUICK_EQUAL_SEQLENS if args.quick else EQUAL_SEQLENS
    return args


def visible_pairs(lengths, causal: bool) -> int:
    """(query, key) pairs that attention computes, summed over sequences (sq = sk = L each)."""
    return sum(L * (L + 1) // 2 if causal else L * L for L in lengths)


def packed_and_padded(lengths, h: int, d: int, dtype):
    """Random packed q, k, v (total, h, d), their cu_seqlens, and the same tokens padded to
    (batch, max_len, h, d) with zeros after each sequence."""
    torch = ba.torch
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, device="cuda", dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    total, longest = int(sum(lengths)), max(lengths)
    packed = [torch.randn(total, h, d, device="cuda", dtype=dtype) for _ in range(3)]
    # token t of sequence b goes to row b * longest + t of the padded tensor
    seq = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), lens)
    pos = torch.arange(total, device="cuda") - cu[:-1].long()[seq]
    index = seq * longest + pos
    padded = []
    for x in packed:
        y = torch.zeros(len(lengths) * longest, h, d, device="cuda", dtype=dtype)
        y[index] = x
        padded.append(y.view(len(lengths), longest, h, d))
    return packed, cu, padded


def paged_pool(keys, cu, lengths, page_size: int, seed: int):
    """The packed keys (total, h, d) of each sequence placed in a shuffled page pool (num_pages, page_size, h, d),
    and the block table (batch, max_pages) that finds them."""
    torch = ba.torch
    pages = [-(-L // page_size) for L in lengths]
    num_pages = sum(pages)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to("cuda")
    table = torch.zeros(len(lengths), max(pages), device="cuda", dtype=torch.int32)
    pool = torch.zeros(num_pages, page_size, *keys.shape[1:], device="cuda", dtype=keys.dtype)
    start, first = cu.tolist(), 0
    for b, (L, n) in enumerate(zip(lengths, pages)):
        ids = order[first:first + n]
        table[b, :n] = ids.to(torch.int32)
        rows = torch.arange(L, device="cuda")
        pool[ids[rows // page_size], rows % page_size] = keys[start[b]:start[b] + L]
        first += n
    return pool, table


def _record(row, name, flops, ms=None, err=None):
    row[f"ms_{name}"] = ms
    row[f"tflops_{name}"] = (flops / (ms * 1e-3) / 1e12) if ms else None
    row[f"error_{name}"] = err


def _timed(row, name, flops, fn, args):
    try:
        fn()  # the first call compiles
        ba.torch.cuda.synchronize()
        _record(row, name, flops, ms=ba.time_ms(fn, args))
    except Exception as e:  # noqa: BLE001
        _record(row, name, flops, err=ba.short_error(e))
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()


def spot_check(out_varlen, packed, cu, lengths, causal) -> float:
    """max |varlen - SDPA| over the first few sequences, each attended on its own."""
    import torch.nn.functional as F
    torch = ba.torch
    out = ba.to_torch(out_varlen)
    worst = 0.0
    starts = cu.tolist()
    for b in range(min(CHECK_SEQUENCES, len(lengths))):
        s = slice(starts[b], starts[b + 1])
        q, k, v = (x[s].transpose(0, 1)[None] for x in packed)  # (1, h, L, d)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)[0].transpose(0, 1)
        worst = max(worst, float((out[s].float() - ref.float()).abs().max().item()))
    torch.cuda.synchronize()
    return worst


def equal_cell(d: int, causal: bool, seqlen: int, args) -> dict:
    """Part (a): the same tokens packed and padded, all sequences of one length."""
    torch, cupy, cuflash = ba.torch, ba.cupy, ba.cuflash
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    b, h = max(1, ba.TOKENS_PER_BATCH // seqlen), max(1, ba.HIDDEN // d)
    flops = ba.forward_flops(b, h, seqlen, seqlen, d, causal)
    row = dict(op="varlen", part="equal", dtype=args.dtype, d=d, causal=causal, seqlen=seqlen, batch=b, nheads=h,
               flops=flops)
    qkv = [torch.randn(b, seqlen, h, d, device="cuda", dtype=dtype) for _ in range(3)]
    cu = torch.arange(0, (b + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)
    stream = ba.cupy_stream()
    qc, kc, vc = (ba.to_cupy(x) for x in qkv)
    pq, pk, pv = (x.reshape(b * seqlen, h, d) for x in (qc, kc, vc))
    cuc = cupy.from_dlpack(cu)
    _timed(row, "varlen", flops, lambda: cuflash.attention_varlen(pq, pk, pv, cuc, cuc, seqlen, seqlen,
                                                                  causal=causal, stream=stream), args)
    _timed(row, "padded", flops, lambda: cuflash.attention(qc, kc, vc, causal=causal, stream=stream), args)
    a, p = row.get("tflops_varlen"), row.get("tflops_padded")
    row["ratio_padded"] = (a / p) if (a and p) else None
    return row


def mixed_cell(d: int, causal: bool, args) -> dict:
    """Part (b): 64 sequences of mixed lengths, packed against padded to the longest."""
    import numpy as np
    torch, cupy, cuflash = ba.torch, ba.cupy, ba.cuflash
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in rng.integers(MIN_LEN, MAX_LEN + 1, size=N_SEQUENCES)]
    h, longest = MIXED_NHEADS, max(lengths)
    flops = 4.0 * d * h * visible_pairs(lengths, causal)
    row = dict(op="varlen", part="mixed", dtype=args.dtype, d=d, causal=causal, sequences=len(lengths),
               tokens=sum(lengths), max_len=longest, nheads=h, seed=args.seed, flops=flops,
               padded_flops=ba.forward_flops(len(lengths), h, longest, longest, d, causal))
    packed, cu, padded = packed_and_padded(lengths, h, d, dtype)
    stream = ba.cupy_stream()
    qc, kc, vc = (ba.to_cupy(x) for x in packed)
    cuc = cupy.from_dlpack(cu)
    pqc, pkc, pvc = (ba.to_cupy(x) for x in padded)

    def run_varlen():
        return cuflash.attention_varlen(qc, kc, vc, cuc, cuc, longest, longest, causal=causal, stream=stream)

    _timed(row, "varlen", flops, run_varlen, args)
    for page_size in args.paged:
        try:
            (kpool, table), (vpool, _) = (paged_pool(x, cu, lengths, page_size, args.seed) for x in packed[1:])
            kpc, vpc, tc = ba.to_cupy(kpool), ba.to_cupy(vpool), cupy.from_dlpack(table)
            _timed(row, f"paged{page_size}", flops, lambda: cuflash.attention_varlen(
                qc, kpc, vpc, cuc, cuc, longest, longest, causal=causal, block_table=tc, stream=stream), args)
        except Exception as e:  # noqa: BLE001
            _record(row, f"paged{page_size}", flops, err=ba.short_error(e))
    if args.fp8:  # the same tokens in e4m3 (|x| < 448: descale 1)
        q8, k8, v8 = (cupy.from_dlpack(x.to(torch.float8_e4m3fn).view(torch.uint8)) for x in packed)
        _timed(row, "varlen_fp8", flops, lambda: cuflash.attention_varlen_fp8(
            q8, k8, v8, cuc, cuc, longest, longest, causal=causal, stream=stream), args)
        del q8, k8, v8
    _timed(row, "padded", flops, lambda: cuflash.attention(pqc, pkc, pvc, causal=causal, stream=stream), args)
    qt, kt, vt = (x.transpose(1, 2) for x in padded)
    for name in ("flash", "cudnn"):
        try:
            with sdpa_kernel(getattr(SDPBackend, ba.SDPA_BACKENDS[name])):
                _timed(row, name, flops, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), args)
        except Exception as e:  # noqa: BLE001
            _record(row, name, flops, err=ba.short_error(e))

    if args.bwd:
        bflops = 2.5 * flops
        try:
            out, lse = cuflash.attention_varlen(qc, kc, vc, cuc, cuc, longest, longest, causal=causal,
                                                return_lse=True, stream=stream)
            dout = out.copy()  # any gradient of the right shape
            _timed(row, "varlen_bwd", bflops, lambda: cuflash.attention_varlen_backward(
                dout, qc, kc, vc, out, lse, cuc, cuc, longest, longest, causal=causal, stream=stream), args)
            pout, plse = cuflash.attention(pqc, pkc, pvc, causal=causal, return_lse=True, stream=stream)
            pdout = pout.copy()
            _timed(row, "padded_bwd", bflops, lambda: cuflash.attention_backward(
                pdout, pqc, pkc, pvc, pout, plse, causal=causal, stream=stream), args)
            del out, lse, dout, pout, plse, pdout
        except Exception as e:  # noqa: BLE001
            _record(row, "varlen_bwd", bflops, err=ba.short_error(e))

    row["max_abs_diff"], row["check_ok"] = None, None
    if row.get("tflops_varlen"):
        try:
            diff = spot_check(run_varlen(), packed, cu, lengths, causal)
            row["max_abs_diff"], row["check_ok"] = diff, bool(math.isfinite(diff) and diff <= args.tol)
        except Exception as e:  # noqa: BLE001
            row["check_ok"], row["check_error"] = False, ba.short_error(e)
    for name in ("padded", "flash", "cudnn") + tuple(f"paged{n}" for n in args.paged):
        a, p = row.get("tflops_varlen"), row.get(f"tflops_{name}")
        row[f"ratio_{name}"] = (a / p) if (a and p) else None
    return row


def _f(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "n/a"


def print_tables(rows, args) -> None:
    eq = [r for r in rows if r["part"] == "equal"]
    if eq:
        print(f"\n=== cuflash varlen (a): equal lengths, {args.dtype}, effective TFLOP/s (16k tokens, hidden 2048)")
        print(f"{'d':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'varlen':>8} {'padded':>8} {'varlen/padded':>14}")
        for r in eq:
            print(f"{r['d']:>4} {str(r['causal']):>6} {r['seqlen']:>6} {r['batch']:>5} "
                  f"{_f(r.get('tflops_varlen'), '8.1f'):>8} {_f(r.get('tflops_padded'), '8.1f'):>8} "
                  f"{_f(r.get('ratio_padded'), '14.3f'):>14}")
        print()
    mx = [r for r in rows if r["part"] == "mixed"]
    if mx:
        print(f"\n=== cuflash varlen (b): {N_SEQUENCES} sequences, lengths U[{MIN_LEN}, {MAX_LEN}] seed {args.seed}, "
              f"nheads {MIXED_NHEADS}, {args.dtype}; effective TFLOP/s (real tokens only)")
        bwd = " varlen_bwd padded_bwd" if args.bwd else ""
        print(f"{'d':>4} {'causal':>6} {'tokens':>7} {'max':>5} {'varlen':>7} {'padded':>7} {'flash':>7} "
              f"{'cudnn':>7} {'/padded':>7} {'/flash':>7} {'/cudnn':>7} {'check':>6}" + bwd)
        for r in mx:
            line = (f"{r['d']:>4} {str(r['causal']):>6} {r['tokens']:>7} {r['max_len']:>5} "
                    + " ".join(f"{_f(r.get('tflops_' + n), '7.1f'):>7}" for n in ("varlen", "padded", "flash", "cudnn"))
                    + " " + " ".join(f"{_f(r.get('ratio_' + n), '7.2f'):>7}" for n in ("padded", "flash", "cudnn"))
                    + f" {'ok' if r.get('check_ok') else 'FAIL' if r.get('check_ok') is False else 'n/a':>6}")
            if args.bwd:
                line += f" {_f(r.get('tflops_varlen_bwd'), '10.1f'):>10} {_f(r.get('tflops_padded_bwd'), '10.1f'):>10}"
            if args.fp8:
                line += f"  fp8 {_f(r.get('tflops_varlen_fp8'), '7.1f')}"
            for n in args.paged:  # paged keys: TFLOP/s and the packed call's speed over it
                line += f"  paged{n} {_f(r.get(f'tflops_paged{n}'), '7.1f')} ({_f(r.get(f'ratio_paged{n}'), '.2f')}x)"
            print(line)
        print()
    for r in rows:
        for key, val in r.items():
            if key.startswith("error_") and val:
                print(f"n/a {key[6:]} (d={r['d']} causal={r['causal']} {r['part']}): {val}")


def write_json(path: str, rows, meta, append: bool) -> None:
    data = []
    if append and os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except Exception:  # noqa: BLE001  -- an unreadable file is replaced
            data = []
        if not isinstance(data, list):
            data = [data]
    data += ba.json_rows(rows, meta)
    ba.dump_json(path, data)
    print(f"wrote {path} ({len(rows)} varlen rows{', appended' if append else ''})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not ba.import_stack_with_cuflash("bench_varlen"):
        return 2
    if not hasattr(ba.cuflash, "attention_varlen"):
        print("bench_varlen: skipped: cuflash has no attention_varlen", file=sys.stderr)
        return 2
    meta = ba.run_meta()
    print(f"### Varlen: device {meta['device']}  torch {meta['torch_version']}  cupy {meta['cupy_version']}",
          flush=True)
    cells = [("equal", d, c, s) for d in args.dims for c in args.causals for s in args.equal_seqlens]
    cells += [("mixed", d, c, None) for d in args.dims for c in args.causals]
    rows, bad = [], False
    for n, (part, d, causal, seqlen) in enumerate(cells, 1):
        try:
            row = equal_cell(d, causal, seqlen, args) if part == "equal" else mixed_cell(d, causal, args)
        except Exception as e:  # noqa: BLE001  -- setup failure (out of memory, ...)
            traceback.print_exc()
            row = dict(op="varlen", part=part, d=d, causal=causal, seqlen=seqlen, error_cell=ba.short_error(e))
        rows.append(row)
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                 if k.startswith(("tflops_", "ratio_", "error_")) or k in ("max_abs_diff", "check_ok")}
        print(f"[{n}/{len(cells)}] {part} d={d} causal={causal} seqlen={seqlen}: {shown}", flush=True)
        bad = bad or row.get("check_ok") is False or not row.get("tflops_varlen")
        if not ba.context_alive():
            print("CUDA context is broken (see the error above); stopping the run.")
            bad = True
            break
        ba.free_memory()
    print_tables(rows, args)
    if args.json:
        write_json(args.json, rows, meta, args.append)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

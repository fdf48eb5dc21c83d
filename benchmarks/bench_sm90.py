#!/usr/bin/env python3
"""Hopper forward variants (cuflash.ops.forward_sm90.attention_sm90) beside the portable kernel and SDPA.

Grid (as bench_attention.py, see shared ANCHORS.md): 16k tokens per batch (batch = 16384 //
seqlen), hidden size 2048 (nheads = 2048 // headdim), head dims 64 and 128 (--dims adds 256, the
Hopper kernel's third), causal off and on, seqlen 1024, 4096, 16384, bf16 (or --dtype fp16).

Four forwards per cell, in one process, on the same torch tensors (b, s, h, d):
- sm90: cuflash.ops.forward_sm90.attention_sm90 (wgmma/TMA, fwd_sm90.cu; the variant given by --variant), on
  zero-copy CuPy views (DLPack) inside torch's current stream;
- portable: cuflash.attention with the Hopper forward switched off (the mma.sync kernels the planner
  picks), same views, same stream;
- flash, cudnn: torch SDPA with one backend forced, on (b, h, s, d) views of the same storage.
A call that raises is reported as n/a with its error; the run goes on with the next one.

Timing and FLOPs are bench_attention.py's (imported, not copied): triton do_bench median with
the L2 flushed before every call, forward = 4*b*h*s*s*d, halved when causal. Shorter defaults
(--warmup 10 --rep 50 ms) keep the whole grid, compiles included, well inside 90 s on an H200.
Sanity check per cell: max |sm90 - portable| over the output (against SDPA flash or cudnn when
the portable kernel did not run); above --tol (2e-2) or NaN the cell is marked BAD. This guards
the benchmark against timing a wrong kernel; accuracy is tests/gpu/test_sm90.py's job.

Usage (from the repository root, on the H200):
    python3 benchmarks/bench_sm90.py [--quick] [--dtype bf16|fp16] [--json PATH]
    python3 benchmarks/bench_sm90.py --quick                 # seqlens 1024 and 4096 only
    python3 benchmarks/bench_sm90.py --json out/sm90.json    # the rows, with the run's versions

Exit status: 0 every sm90 cell ran and passed its check, or the GPU is not compute capability 9.0
(nothing to measure); 1 some sm90 cell failed, was BAD, hung (no completion within --hang-timeout
seconds: the process prints what it has and exits at once) or broke the CUDA context; 2 nothing
could run (no GPU, torch/triton/cupy/cuflash missing).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  -- shared stack import, interop, timing, FLOPs, table

DEFAULT_SEQLENS = (1024, 4096, 16384)
QUICK_SEQLENS = (1024, 4096)
HEADDIMS = (64, 128)  # the ANCHORS grid's; forward_sm90.HEADDIMS (ALL_HEADDIMS) adds 256
from cuflash.ops.forward_sm90 import HEADDIMS as ALL_HEADDIMS, VARIANTS  # noqa: E402  -- pure Python, no GPU needed
IMPLS = ("sm90", "portable", "flash", "cudnn")
PEERS = ("portable", "flash", "cudnn")
CHECK_REFS = ("portable", "flash", "cudnn")  # the first that ran is the sanity check's reference
HANG_TIMEOUT_S = 30.0

# The table: ba.format_row / ba.table_header with these columns after the TFLOP/s ones.
OP = ba.Op(title="Hopper forward (sm90)", unit="TFLOP/s", grid=ba.training_grid, run_cell=None,
           impls=IMPLS,
           columns=(ba.Column("sm90/port", "ratio_portable", "9.3f", 9),
                    ba.Column("sm90/flash", "ratio_flash", "10.3f", 10),
                    ba.Column("sm90/cudnn", "ratio_cudnn", "10.3f", 10),
                    ba.Column("  maxdiff", "max_abs_diff", "9.2e", 9)))

hopper = None  # cuflash.ops.forward_sm90, imported in main() after ba._import_gpu_stack()


class KernelHung(RuntimeError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"seqlens {','.join(map(str, QUICK_SEQLENS))} only")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--variant", choices=VARIANTS, default="lockstep",
                   help="the Hopper kernel's variant (cuflash.ops.forward_sm90.VARIANTS): lockstep (first version), ws "
                        "(warp-specialized producer, deeper ring), pingpong (ws, consumer warpgroups take turns), "
                        "ws_n128 and pingpong_n128 (those with 128-key blocks), ws3_n128 (three consumer "
                        "warpgroups at d 64), ws_n128_p and pingpong_n128_p (ws_n128 and pingpong_n128, persistent), "
                        "lockstep_n128")
    p.add_argument("--dims", type=ba._int_list, default=list(HEADDIMS),
                   help="head dims, comma-separated, from 64,128,256 (default 64,128)")
    p.add_argument("--seqlens", type=ba._int_list, default=None,
                   help="sequence lengths, comma-separated (default "
                        f"{','.join(map(str, DEFAULT_SEQLENS))})")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms (default 50)")
    p.add_argument("--repeats", type=int, default=2,
                   help="do_bench measurements per implementation and cell, the least median counts (default 2: "
                        "the 512-2k cells of single measurements swung up to 2x between runs of one kernel)")
    p.add_argument("--tol", type=float, default=ba.CHECK_TOL,
                   help=f"max |sm90 - reference| above which a cell is BAD (default {ba.CHECK_TOL:g})")
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT_S, metavar="S",
                   help="seconds to wait for the first sm90 launch of a cell to complete before "
                        f"declaring the kernel hung and exiting (default {HANG_TIMEOUT_S:g})")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    bad = [d for d in args.dims if d not in ALL_HEADDIMS]
    if bad:
        p.error(f"--dims: the Hopper kernel has head dims {ALL_HEADDIMS}, not {bad}")
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


def _wait(stream, seconds: float) -> None:
    """Wait for `stream` (a CuPy stream) to drain, polling; KernelHung after `seconds`."""
    event = ba.cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    deadline = time.perf_counter() + seconds
    while not event.done:
        if time.perf_counter() > deadline:
            raise KernelHung(f"no completion after {seconds:g} s")
        time.sleep(0.005)


def sm90_cell(cell: dict, args) -> dict:
    torch, cuflash = ba.torch, ba.cuflash
    b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    flops = ba.forward_flops(b, h, s, s, d, causal)
    row = dict(op="fwd_sm90", variant=args.variant, dtype=args.dtype, d=d, causal=causal, seqlen=s, batch=b,
               nheads=h, flops=flops)

    # Inputs as bench_attention's forward: once per cell, random, (b, s, h, d).
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    qc, kc, vc = ba.to_cupy(q), ba.to_cupy(k), ba.to_cupy(v)  # zero-copy
    stream = ba.cupy_stream()  # torch's current stream, seen by CuPy
    outs = {}  # impl -> output as torch (b, s, h, d)

    def record(name, ms=None, err=None):
        row[f"ms_{name}"] = ms
        row[f"tflops_{name}"] = (flops / (ms * 1e-3) / 1e12) if ms else None
        row[f"error_{name}"] = err

    def run_sm90():
        with stream:  # attention_sm90 takes no stream: it launches on CuPy's current one
            return forward_sm90.attention_sm90(qc, kc, vc, causal=causal, variant=args.variant)

    def run_portable():
        return cuflash.attention(qc, kc, vc, causal=causal, stream=stream)

    for name, fn in (("sm90", run_sm90), ("portable", run_portable)):
        try:
            t0 = time.perf_counter()
            out = fn()  # the first call compiles (NVRTC)
            if name == "sm90":
                _wait(stream, args.hang_timeout)  # a new kernel variant may deadlock on an mbarrier
            torch.cuda.synchronize()
            row[f"first_call_s_{name}"] = time.perf_counter() - t0
            outs[name] = ba.to_torch(out)
            del out
            record(name, ms=ba.time_ms(fn, args))
        except KernelHung:
            raise
        except Exception as e:  # noqa: BLE001
            record(name, err=ba.short_error(e))
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()

    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (b, h, s, d) views, no copy

    def run_sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    for name in ("flash", "cudnn"):
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    sdpa_kernel(getattr(SDPBackend, ba.SDPA_BACKENDS[name])):
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                out = run_sdpa()  # untimed first call (cuDNN's plan)
                torch.cuda.synchronize()
                row[f"first_call_s_{name}"] = time.perf_counter() - t0
                outs[name] = out.transpose(1, 2)
                del out
                record(name, ms=ba.time_ms(run_sdpa, args))
        except Exception as e:  # noqa: BLE001
            record(name, err=ba.short_error(e, caught))

    # Sanity check: sm90 against the portable kernel (or the first SDPA backend that ran).
    ref = next((r for r in CHECK_REFS if r in outs), None) if "sm90" in outs else None
    row["check_ref"], row["max_abs_diff"], row["check_ok"] = ref, None, None
    if ref is not None:
        diff = ba.max_abs_diff(outs["sm90"], outs[ref])
        row["max_abs_diff"] = diff
        row["check_ok"] = bool(math.isfinite(diff) and diff <= args.tol)

    for name in PEERS:
        a, p = row.get("tflops_sm90"), row.get(f"tflops_{name}")
        row[f"ratio_{name}"] = (a / p) if (a and p) else None
    return row


def format_row(row: dict) -> str:
    # ba.format_row marks check_ok False as "<<< FAIL"; this table says BAD.
    line = ba.format_row({**row, "check_ok": None}, OP, list(IMPLS))
    return line + ("  BAD" if row.get("check_ok") is False else "")


def _spread(xs) -> str:
    xs = sorted(xs)
    return f"min {xs[0]:.3f}, median {xs[len(xs) // 2]:.3f}, max {xs[-1]:.3f}" if xs else "n/a"


def print_table(rows: list[dict], args) -> None:
    print()
    print(f"=== {OP.title} {OP.unit} ({args.dtype}, variant {args.variant}; ratios = sm90 / peer; "
          f"maxdiff = max |sm90 - portable|) ===")
    print(ba.table_header(OP, list(IMPLS)))
    for r in rows:
        print(format_row(r))
    for peer in PEERS:
        ratios = [r[f"ratio_{peer}"] for r in rows if r.get(f"ratio_{peer}")]
        print(f"sm90/{peer} over {len(ratios)}/{len(rows)} cells: {_spread(ratios)}")
    errors = {(i, r.get(f"error_{i}")) for r in rows for i in IMPLS if r.get(f"error_{i}")}
    for impl, err in sorted(errors, key=str):
        print(f"n/a {impl}: {err}")
    other_refs = sorted({r["check_ref"] for r in rows if r.get("check_ref") not in (None, "portable")})
    if other_refs:
        print(f"note: where portable did not run, maxdiff is against SDPA {', '.join(other_refs)}")
    bad = [r for r in rows if r.get("check_ok") is False]
    if bad:
        print(f"BAD: {len(bad)} cell(s) with max |sm90 - reference| > {args.tol:g} (or NaN)")
    print()


def _finish(rows: list[dict], args, meta: dict) -> None:
    print_table(rows, args)
    if args.json:
        ba.write_json(args.json, rows, meta)
    sys.stdout.flush()


def main(argv=None) -> int:
    global hopper
    args = parse_args(argv)
    reason = ba._import_gpu_stack()
    if reason:
        print(f"bench_sm90: skipped: {reason}", file=sys.stderr)
        return 2
    torch = ba.torch
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        print(f"bench_sm90: {torch.cuda.get_device_name()} is compute capability {cc[0]}.{cc[1]}; "
              "the Hopper kernel (wgmma, TMA) needs 9.0. Nothing to measure.")
        return 0
    if ba.cuflash is None:
        print(f"bench_sm90: skipped: cuflash: {ba.CUFLASH_IMPORT_ERROR}", file=sys.stderr)
        return 2
    try:
        from cuflash import settings
        from cuflash.ops import forward_sm90
        hopper = forward_sm90
        settings.override(sm90=False).__enter__()  # the "portable" column is the portable kernel, for the whole run
    except Exception as e:  # noqa: BLE001
        print(f"bench_sm90: skipped: cuflash.ops.forward_sm90: {ba.short_error(e)}", file=sys.stderr)
        return 2
    meta = ba.run_meta()
    print(f"device {meta['device']}  torch {meta['torch_version']}  triton "
          f"{meta['triton_version']}  cupy {meta['cupy_version']}  cudnn {meta['cudnn_version']}")

    cells = ba.training_grid(args)
    print(f"### {OP.title}: {len(cells)} cells, do_bench warmup {args.warmup} ms rep {args.rep} ms, least of "
          f"{args.repeats}", flush=True)
    ba.warm_up_gpu()
    rows, bad, t_start = [], False, time.perf_counter()
    for n, cell in enumerate(cells, 1):
        t0 = time.perf_counter()
        try:
            row = sm90_cell(cell, args)
        except KernelHung as e:
            row = dict(op="fwd_sm90", dtype=args.dtype, **cell, error_sm90=f"hung: {e}")
            rows.append(row)
            print(f"[{n}/{len(cells)}] d={cell['d']} causal={cell['causal']} seqlen={cell['seqlen']}: "
                  f"the sm90 kernel did not complete within {args.hang_timeout:g} s; stopping "
                  "(the CUDA context cannot be recovered).", flush=True)
            _finish(rows, args, meta)
            os._exit(1)  # a kernel still running would block every later CUDA call, exit included
        except Exception as e:  # noqa: BLE001  -- setup failure (out of memory, ...)
            traceback.print_exc()
            row = dict(op="fwd_sm90", dtype=args.dtype, **cell, error_cell=ba.short_error(e))
        rows.append(row)
        print(f"[{n}/{len(cells)}] " + format_row(row) + f"   [{time.perf_counter() - t0:.1f} s]",
              flush=True)
        for key in ("error_sm90", "error_portable", "error_cell"):
            if row.get(key):
                print(f"    {key}: {row[key]}", flush=True)
        if row.get("check_ok") is False:
            print(f"    BAD: max |sm90 - {row['check_ref']}| = {row['max_abs_diff']} > {args.tol:g}",
                  flush=True)
        bad = bad or row.get("check_ok") is False or not row.get("tflops_sm90")
        if not ba.context_alive():
            print("CUDA context is broken (see the error above); stopping the run.", flush=True)
            bad = True
            break
        ba.free_memory()
    print(f"### {len(rows)}/{len(cells)} cells in {time.perf_counter() - t_start:.1f} s")
    _finish(rows, args, meta)
    return 1 if bad or len(rows) < len(cells) else 0


if __name__ == "__main__":
    sys.exit(main())

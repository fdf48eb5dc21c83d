#!/usr/bin/env python3
"""Side-by-side attention benchmark: cuflash against PyTorch SDPA's backends.

Grid (FlashAttention-2 paper's, see shared ANCHORS.md): 16k tokens per batch
(batch = 16384 // seqlen), hidden size 2048 (nheads = 2048 // headdim), bf16,
head dims 64 and 128, causal off and on, seqlen 512 .. 16384.

Every implementation runs in the same process on the same torch tensors:
- cuflash gets them zero-copy through DLPack and runs on torch's current stream;
- SDPA gets (b, h, s, d) views of the same (b, s, h, d) storage (no copy) with one
  backend forced at a time: flash (FlashAttention-2), cudnn, efficient.
A backend that raises is reported as n/a; the run goes on.

Timing: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``
(CUDA events, L2 flushed before every timed call). TFLOP/s forward = 4*b*h*sq*sk*d,
halved when causal.

Usage (from the repository root, on a GPU machine):
    python3 benchmarks/bench_attention.py                    # the whole grid
    python3 benchmarks/bench_attention.py --quick            # seqlens 1024 and 4096
    python3 benchmarks/bench_attention.py --dims 128 --seqlens 2048,8192 --causal true
    python3 benchmarks/bench_attention.py --json out/bench.json --png out/bench.png

Exit status: 0 all good; 1 some cuflash cell failed to run or failed the spot
check; 2 nothing could run (no GPU, torch/triton missing).

Adding an operation (backward, decode with the KV cache) means writing one cell
function like ``forward_cell`` and one entry in ``OPS``; the grid, the table, the
JSON and the plot are shared.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # run from a checkout without pip install

TOKENS_PER_BATCH = 16384
HIDDEN = 2048
DEFAULT_DIMS = (64, 128)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096)
CHECK_TOL = 2e-2  # max |cuflash - reference| in the output, bf16/fp16

IMPLS = ("cuflash", "flash", "cudnn", "efficient")  # table and plot order
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION"}
CHECK_REFS = ("flash", "cudnn", "efficient")  # first one that runs is the reference

# Filled by _import_gpu_stack(); kept global so cell functions stay short.
torch = None
cupy = None
triton_testing = None
cuflash = None
CUFLASH_IMPORT_ERROR = None


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", ",").split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=sorted(OPS), default="fwd",
                   help="which operation to benchmark (default fwd)")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlens {','.join(map(str, QUICK_SEQLENS))} only")
    p.add_argument("--dims", type=_int_list, default=None,
                   help="head dims, comma-separated (default 64,128)")
    p.add_argument("--seqlens", type=_int_list, default=None,
                   help="sequence lengths, comma-separated (default 512..16384)")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help=f"subset of {','.join(IMPLS)} (default all)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--tol", type=float, default=CHECK_TOL,
                   help="spot-check tolerance on max abs diff (default 2e-2)")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    p.add_argument("--png", metavar="PATH", help="write a TFLOP/s-vs-seqlen plot")
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    if args.dims is None:
        args.dims = list(DEFAULT_DIMS)
    args.impls = list(IMPLS) if args.impls is None else args.impls
    bad = [i for i in args.impls if i not in IMPLS]
    if bad:
        p.error(f"--impls: unknown {bad}, known {list(IMPLS)}")
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


# --------------------------------------------------------------------------- #
# GPU stack and interop
# --------------------------------------------------------------------------- #
def _import_gpu_stack() -> str | None:
    """Import torch/cupy/triton/cuflash. Returns a reason to skip, or None."""
    global torch, cupy, triton_testing, cuflash, CUFLASH_IMPORT_ERROR
    try:
        import torch as _torch
    except Exception as e:  # noqa: BLE001
        return f"torch is not importable ({e})"
    if not _torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import triton.testing as _tt
    except Exception as e:  # noqa: BLE001
        return f"triton is not importable ({e})"
    try:
        import cupy as _cupy
    except Exception as e:  # noqa: BLE001
        return f"cupy is not importable ({e})"
    torch, cupy, triton_testing = _torch, _cupy, _tt
    cupy.cuda.Device(torch.cuda.current_device()).use()
    try:
        import cuflash as _cuflash
        if not hasattr(_cuflash, "attention"):
            raise AttributeError("cuflash has no attribute 'attention'")
        cuflash = _cuflash
    except Exception as e:  # noqa: BLE001  -- peers still get measured
        CUFLASH_IMPORT_ERROR = f"{type(e).__name__}: {e}"
    return None


def to_cupy(t):
    """Zero-copy torch -> CuPy (bf16 through an int16 view if DLPack refuses it)."""
    try:
        return cupy.from_dlpack(t)
    except Exception:  # noqa: BLE001
        if t.dtype != torch.bfloat16:
            raise
        import ml_dtypes
        return cupy.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)


def to_torch(a):
    """Zero-copy CuPy -> torch (bf16 through an int16 view if DLPack refuses it)."""
    try:
        return torch.from_dlpack(a)
    except Exception:  # noqa: BLE001
        if a.dtype.itemsize != 2 or a.dtype.kind == "f":  # bf16's numpy kind is "V"
            raise
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)


def cupy_stream():
    """CuPy view of torch's current stream: cuflash and the timing events share it."""
    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


def context_alive() -> bool:
    """False once the CUDA context is broken (illegal address and the like)."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def short_error(e: BaseException, caught_warnings=()) -> str:
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    reasons = [str(w.message).strip().splitlines()[0] for w in caught_warnings]
    if reasons:  # SDPA explains why a backend declined in warnings
        msg += " | " + " | ".join(dict.fromkeys(reasons))
    return msg[:400]


def time_ms(fn: Callable[[], object], args) -> float:
    return float(triton_testing.do_bench(fn, warmup=args.warmup, rep=args.rep,
                                         return_mode="median"))


def max_abs_diff(a, b) -> float:
    """max |a - b| in float32; nan if either holds a nan/inf."""
    return float((a.float() - b.float()).abs().max().item())


# --------------------------------------------------------------------------- #
# Operations
# --------------------------------------------------------------------------- #
@dataclass
class Op:
    title: str                     # table heading
    unit: str                      # what the per-impl numbers are
    grid: Callable[[argparse.Namespace], list[dict]]
    run_cell: Callable[[dict, argparse.Namespace], dict]


def training_grid(args) -> list[dict]:
    """ANCHORS grid: batch*seqlen = 16384 tokens, nheads*d = 2048."""
    cells = []
    for d in args.dims:
        for causal in args.causals:
            for s in args.seqlens:
                cells.append(dict(d=d, causal=causal, seqlen=s,
                                  batch=max(1, TOKENS_PER_BATCH // s),
                                  nheads=max(1, HIDDEN // d)))
    return cells


def forward_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """4*b*h*sq*sk*d (two matmuls, 2 FLOP per MAC), halved when causal."""
    f = 4.0 * b * h * sq * sk * d
    return f / 2 if causal else f


def forward_cell(cell: dict, args) -> dict:
    b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    flops = forward_flops(b, h, s, s, d, causal)
    row = dict(op="fwd", dtype=args.dtype, d=d, causal=causal, seqlen=s, batch=b, nheads=h,
               flops=flops)

    # Inputs: created once per cell, (b, s, h, d), random (never zeros: zeros flatter
    # the matmul units and hide masking bugs).
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    outs = {}

    def record(name, ms=None, err=None):
        row[f"ms_{name}"] = ms
        row[f"tflops_{name}"] = (flops / (ms * 1e-3) / 1e12) if ms else None
        row[f"error_{name}"] = err

    # ---- cuflash: zero-copy CuPy views, torch's current stream --------------
    if "cuflash" in args.impls:
        if cuflash is None:
            record("cuflash", err=f"import failed: {CUFLASH_IMPORT_ERROR}")
        else:
            try:
                qc, kc, vc = to_cupy(q), to_cupy(k), to_cupy(v)
                stream = cupy_stream()

                def run_cuflash():
                    return cuflash.attention(qc, kc, vc, causal=causal, stream=stream)

                out_c = run_cuflash()  # the first call compiles
                torch.cuda.synchronize()
                record("cuflash", ms=time_ms(run_cuflash, args))
            except Exception as e:  # noqa: BLE001
                record("cuflash", err=short_error(e))
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
            else:
                try:
                    outs["cuflash"] = to_torch(out_c)
                except Exception as e:  # noqa: BLE001
                    row["check_error"] = f"cuflash output not readable by torch: {short_error(e)}"
                del out_c

    # ---- SDPA backends on (b, h, s, d) views of the same storage -------------
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run_sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    for name, backend in SDPA_BACKENDS.items():
        if name not in args.impls:
            continue
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    sdpa_kernel(getattr(SDPBackend, backend)):
                warnings.simplefilter("always")
                out = run_sdpa()
                torch.cuda.synchronize()
                if name in CHECK_REFS and not any(r in outs for r in CHECK_REFS):
                    outs[name] = out.transpose(1, 2)  # back to (b, s, h, d)
                del out
                record(name, ms=time_ms(run_sdpa, args))
        except Exception as e:  # noqa: BLE001
            record(name, err=short_error(e, caught))

    # ---- spot check: cuflash against the first SDPA backend that ran ---------
    ref = next((r for r in CHECK_REFS if r in outs), None)
    row["check_ref"] = ref
    row["max_abs_diff"] = None
    row["check_ok"] = False if row.get("check_error") else None
    if "cuflash" in outs and ref is not None:
        diff = max_abs_diff(outs["cuflash"], outs[ref])
        row["max_abs_diff"] = diff
        row["check_ok"] = bool(math.isfinite(diff) and diff <= args.tol)

    for name in ("flash", "cudnn"):
        a, p = row.get("tflops_cuflash"), row.get(f"tflops_{name}")
        row[f"ratio_{name}"] = (a / p) if (a and p) else None
    del q, k, v, qt, kt, vt, outs
    return row


# op name -> Op. To add the backward: write backward_cell (cuflash.attention_backward
# timed directly; SDPA as (fwd+bwd) - fwd; flops 2.5x forward) and register it here.
OPS = {
    "fwd": Op(title="Forward", unit="TFLOP/s", grid=training_grid, run_cell=forward_cell),
}


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #
def _fmt(x, spec="7.1f", width=7) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "n/a".rjust(width)


def format_row(row: dict, impls: list[str]) -> str:
    cells = [f"{row['d']:>4}", f"{str(row['causal']):>6}", f"{row['seqlen']:>6}",
             f"{row['batch']:>5}", f"{row['nheads']:>5}"]
    cells += [_fmt(row.get(f"tflops_{i}"), "9.1f", 9) for i in impls]
    cells += [_fmt(row.get("ratio_flash"), "8.3f", 8), _fmt(row.get("ratio_cudnn"), "8.3f", 8)]
    diff = row.get("max_abs_diff")
    check = "" if row.get("check_ok") is None else ("" if row["check_ok"] else "  <<< FAIL")
    cells.append((_fmt(diff, "9.2e", 9) if diff is not None else "      n/a") + check)
    return " ".join(cells)


def table_header(impls: list[str]) -> str:
    cols = ["   d", "causal", "seqlen", "batch", "heads"]
    cols += [i[:9].rjust(9) for i in impls]
    cols += ["cf/flash", "cf/cudnn", "  maxdiff"]
    return " ".join(cols)


def print_table(op: Op, rows: list[dict], args) -> None:
    print()
    print(f"=== cuflash {op.title} {op.unit} ({args.dtype}; ratios = cuflash / peer) ===")
    print(table_header(args.impls))
    for r in rows:
        print(format_row(r, args.impls))
    ratios = [(r["ratio_flash"], r) for r in rows if r.get("ratio_flash")]
    if ratios:
        worst, wr = min(ratios, key=lambda t: t[0])
        print(f"min cuflash/flash over {len(ratios)}/{len(rows)} cells: {worst:.3f} "
              f"(d={wr['d']} causal={wr['causal']} seqlen={wr['seqlen']})")
    else:
        print(f"min cuflash/flash over 0/{len(rows)} cells: n/a")
    errors = {(i, r.get(f"error_{i}")) for r in rows for i in args.impls if r.get(f"error_{i}")}
    for impl, err in sorted(errors, key=str):
        print(f"n/a {impl}: {err}")
    fails = [r for r in rows if r.get("check_ok") is False]
    if fails:
        print(f"FAIL: {len(fails)} cell(s) with max abs diff > {args.tol:g}")


def _json_safe(x):
    """nan/inf -> None so the file is strict JSON (check_ok keeps the verdict)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = [{k: _json_safe(v) for k, v in {**meta, **r}.items()} for r in rows]
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
    print(f"wrote {path}")


def write_png(path: str, op: Op, rows: list[dict], args, meta: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"no plot: matplotlib not importable ({e})")
        return
    panels = sorted({(r["d"], r["causal"]) for r in rows})
    if not panels:
        return
    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows), squeeze=False)
    for ax, (d, causal) in zip(axes.flat, panels):
        sub = sorted((r for r in rows if r["d"] == d and r["causal"] == causal),
                     key=lambda r: r["seqlen"])
        xs = [r["seqlen"] for r in sub]
        for impl in args.impls:
            ys = [r.get(f"tflops_{impl}") or float("nan") for r in sub]
            ax.plot(xs, ys, marker="o", label=impl, linewidth=2.5 if impl == "cuflash" else 1.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_title(f"{op.title}, d={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen (batch = 16384 / seqlen)")
        ax.set_ylabel(op.unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{meta['device']}, {args.dtype}, torch {meta['torch_version']}, "
                 f"{meta['timestamp']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def run_meta() -> dict:
    import triton
    return dict(
        device=torch.cuda.get_device_name(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        cudnn_version=torch.backends.cudnn.version(),
        triton_version=triton.__version__,
        cupy_version=cupy.__version__,
        cuflash_version=getattr(cuflash, "__version__", None),
        python_version=platform.python_version(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


# --------------------------------------------------------------------------- #
def main(argv=None) -> int:
    args = parse_args(argv)
    reason = _import_gpu_stack()
    if reason:
        print(f"bench_attention: skipped: {reason}", file=sys.stderr)
        return 2
    op = OPS[args.op]
    meta = run_meta()
    print(f"device {meta['device']}  torch {meta['torch_version']}  triton "
          f"{meta['triton_version']}  cupy {meta['cupy_version']}  cudnn {meta['cudnn_version']}")
    if CUFLASH_IMPORT_ERROR:
        print(f"cuflash: import failed: {CUFLASH_IMPORT_ERROR}  (peers still measured)")

    rows, broken = [], False
    cells = op.grid(args)
    for n, cell in enumerate(cells, 1):
        try:
            row = op.run_cell(cell, args)
        except Exception as e:  # noqa: BLE001  -- setup failure (e.g. out of memory)
            traceback.print_exc()
            row = dict(op=args.op, dtype=args.dtype, **cell, error_cell=short_error(e))
        rows.append(row)
        print(f"[{n}/{len(cells)}] " + format_row(row, args.impls), flush=True)
        if row.get("check_ok") is False and row.get("max_abs_diff") is not None:
            print(f"!!! FAIL: cuflash differs from SDPA {row['check_ref']} by "
                  f"{row['max_abs_diff']} > {args.tol:g} (d={row['d']} causal={row['causal']} "
                  f"seqlen={row['seqlen']}) !!!", flush=True)
        for key in ("error_cuflash", "check_error", "error_cell"):
            if row.get(key):
                print(f"    {key}: {row[key]}", flush=True)
        if not context_alive():
            print("CUDA context is broken (see the error above); stopping the run.")
            broken = True
            break
        free_memory()

    print_table(op, rows, args)
    if args.json:
        write_json(args.json, rows, meta)
    if args.png:
        write_png(args.png, op, rows, args, meta)

    cuflash_bad = "cuflash" in args.impls and any(
        r.get("tflops_cuflash") is None or r.get("check_ok") is False for r in rows)
    return 1 if (broken or cuflash_bad or len(rows) < len(cells)) else 0


if __name__ == "__main__":
    sys.exit(main())

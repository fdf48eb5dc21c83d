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

Operations (--op): fwd (cuflash.attention), bwd (cuflash.attention_backward, atomic
dQ as "cuflash" and deterministic=True as "cuflash_det"; the peers through autograd,
timed as (fwd+bwd) - fwd), all (fwd then bwd).

Timing: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``
(CUDA events, L2 flushed before every timed call). A cell's speed depends on where its
tensors lie in GPU memory, and the implementations do not move together, so each cell
runs on --placements (default 3) fresh allocations of its tensors: the first as they
come, each later one behind a pad of random size (seeded by the cell and the placement,
so a run is reproducible) that moves every tensor's address. The reported time of every
implementation is its median over the placements, and the ratios are those of the
medians; --placements 1 is one allocation per cell. TFLOP/s forward = 4*b*h*sq*sk*d,
halved when causal; backward = 2.5 x forward.

Usage (from the repository root, on a GPU machine):
    python3 benchmarks/bench_attention.py                    # the whole forward grid
    python3 benchmarks/bench_attention.py --op bwd           # the whole backward grid
    python3 benchmarks/bench_attention.py --op all --json out/bench.json --png out/bench.png
                                          # both; plots out/bench.png and out/bench_bwd.png
    python3 benchmarks/bench_attention.py --quick            # seqlens 1024 and 4096
    python3 benchmarks/bench_attention.py --placements 1     # one allocation per cell, a third of the time
    python3 benchmarks/bench_attention.py --dims 128 --seqlens 2048,8192 --causal true
    python3 benchmarks/bench_attention.py --op all --dropout 0.1   # every implementation with dropout

Exit status: 0 all good; 1 some cuflash cell failed to run or failed the spot
check; 2 nothing could run (no GPU, torch/triton missing). A cuflash without
attention_backward yet leaves the backward's cuflash columns n/a without failing.

Adding an operation (decode with the KV cache) means writing one cell function
like ``forward_cell`` and one entry in ``OPS``; the grid, the table, the JSON and
the plot are shared.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import importlib.util
import os
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("cuflash") is None:  # a checkout without pip install; a PYTHONPATH package (an A/B's
    sys.path.insert(0, REPO_ROOT)                # base, scripts/gpu_ab.sh) is the one measured

TOKENS_PER_BATCH = 16384
HIDDEN = 2048
DEFAULT_DIMS = (64, 128)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096)
CHECK_TOL = 2e-2  # max |cuflash - reference| in the output, bf16/fp16
# Backward spot check: gradients are larger than outputs and grow with causal masking
# (early keys collect whole rows of probability), so an absolute bound means little;
# the error is judged relative to the reference: max|cf - ref| / max|ref| and
# ||cf - ref||_2 / ||ref||_2, per gradient (dq, dk, dv). bf16 rounding gives ~0.5%.
BWD_CHECK_TOL = 5e-2
# Fresh allocations per cell; the reported time is the median over them. CUFLASH_BENCH_PLACEMENTS sets the default
# (scripts/gpu_ab.sh: 1, its rounds being separate processes).
PLACEMENTS = int(os.environ.get("CUFLASH_BENCH_PLACEMENTS", "3"))
PLACEMENT_SEED = 0
PAD_MAX_BYTES = 64 << 20  # a later placement's pad: 0 .. 64 MiB, as scripts/placement_probe.py

IMPLS = ("cuflash", "flash", "cudnn", "efficient")  # the forward's table and plot order
BWD_IMPLS = ("cuflash", "cuflash_det", "flash", "cudnn", "efficient")
ALL_IMPLS = ("cuflash", "cuflash_det", "flash", "cudnn", "efficient")  # what --impls knows
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
    p.add_argument("--op", choices=sorted(OPS) + ["all"], default="fwd",
                   help="which operation to benchmark (default fwd; all = "
                        + " then ".join(OPS) + ")")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlens {','.join(map(str, QUICK_SEQLENS))} only")
    p.add_argument("--dims", type=_int_list, default=None,
                   help="head dims, comma-separated (default 64,128)")
    p.add_argument("--seqlens", type=_int_list, default=None,
                   help="sequence lengths, comma-separated (default 512..16384)")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help=f"subset of {','.join(ALL_IMPLS)} (default all; cuflash_det is "
                        "the backward with deterministic=True)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--tol", type=float, default=CHECK_TOL,
                   help="forward spot-check tolerance on max abs diff (default 2e-2)")
    p.add_argument("--bwd-tol", type=float, default=BWD_CHECK_TOL,
                   help="backward spot-check tolerance on the relative errors "
                        f"max|cf-ref|/max|ref| and ||cf-ref||/||ref|| (default {BWD_CHECK_TOL:g})")
    p.add_argument("--placements", type=int, default=PLACEMENTS,
                   help=f"fresh allocations of each cell's tensors, each later one behind a pad of "
                        f"random size; times are medians over them (default {PLACEMENTS}; 1: one "
                        "allocation per cell)")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability for every implementation (cuflash's mask from a fixed seed, SDPA's "
                        "from torch's generator); the masks differ, so the spot checks are skipped")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    p.add_argument("--png", metavar="PATH", help="write a TFLOP/s-vs-seqlen plot")
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    if args.dims is None:
        args.dims = list(DEFAULT_DIMS)
    if args.placements < 1:
        p.error(f"--placements: {args.placements}, at least 1")
    args.impls = list(ALL_IMPLS) if args.impls is None else args.impls
    bad = [i for i in args.impls if i not in ALL_IMPLS]
    if bad:
        p.error(f"--impls: unknown {bad}, known {list(ALL_IMPLS)}")
    args.ops = list(OPS) if args.op == "all" else [args.op]
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


def import_stack_with_cuflash(script: str) -> bool:
    """_import_gpu_stack for a script that measures cuflash alone: False, with the reason on stderr, when it or
    cuflash is missing."""
    reason = _import_gpu_stack()
    if reason or cuflash is None:
        print(f"{script}: skipped: {reason or CUFLASH_IMPORT_ERROR}", file=sys.stderr)
        return False
    return True


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
    return cuflash.runtime.external_stream(torch.cuda.current_stream().cuda_stream)


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
    """The least of `args.repeats` do_bench medians (1 where the script's parser has no --repeats)."""
    return min(float(triton_testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))
               for _ in range(max(1, getattr(args, "repeats", 1))))


def warm_up_gpu(seconds: float = 0.3) -> None:
    """Keeps the GPU busy with bf16 matmuls for about `seconds`, so that the first timed cell of a fresh process
    does not run at idle clocks."""
    import torch
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def max_abs_diff(a, b) -> float:
    """max |a - b| in float32; nan if either holds a nan/inf."""
    return float((a.float() - b.float()).abs().max().item())


def worst_of(values):
    """The largest of values, None left out and nan winning (so a NaN is never hidden); None when none is left."""
    xs = [x for x in values if x is not None]
    return max(xs, key=lambda x: (math.isnan(x), x)) if xs else None


def derive_ratios(row: dict) -> dict:
    """cuflash's TFLOP/s over each peer's and, in the backward, deterministic time over atomic: from the row's
    times, so the same after a cell and after merging its placements."""
    for name in ("flash", "cudnn"):
        a, p = row.get("tflops_cuflash"), row.get(f"tflops_{name}")
        row[f"ratio_{name}"] = (a / p) if (a and p) else None
    if row["op"] == "bwd":
        atomic, det = row.get("ms_cuflash"), row.get("ms_cuflash_det")
        row["ratio_det_atomic"] = (det / atomic) if (atomic and det) else None
    return row


# --------------------------------------------------------------------------- #
# Operations
# --------------------------------------------------------------------------- #
@dataclass
class Column:
    """One column of the table after the per-implementation ones."""
    header: str
    key: str                       # row key
    spec: str                      # format spec, e.g. "8.3f"
    width: int


@dataclass
class Op:
    title: str                     # table heading
    unit: str                      # what the per-impl numbers are
    grid: Callable[[argparse.Namespace], list[dict]]
    run_cell: Callable[[dict, argparse.Namespace], dict]
    impls: tuple = IMPLS           # table and plot order
    columns: tuple = ()            # ratio and spot-check columns, after the impls
    fail_text: str = ""            # "FAIL: n cell(s) <fail_text>", formatted with vars(args)


def op_impls(op: Op, args) -> list[str]:
    """The op's implementations that --impls selected, in the op's order."""
    return [i for i in op.impls if i in args.impls]


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


def _dropout(args) -> dict:
    """cuflash's dropout arguments for --dropout (a fixed seed; one mask per cell, as a training step draws)."""
    return dict(dropout_p=args.dropout, dropout_seed=1, dropout_offset=0) if args.dropout else {}


def forward_cell(cell: dict, args) -> dict:
    b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    flops = forward_flops(b, h, s, s, d, causal)
    row = dict(op="fwd", dtype=args.dtype, d=d, causal=causal, seqlen=s, batch=b, nheads=h,
               flops=flops, dropout_p=args.dropout)
    drop = _dropout(args)

    # Inputs: created once per call (one placement of the cell), (b, s, h, d), random
    # (never zeros: zeros flatter the matmul units and hide masking bugs).
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
                    return cuflash.attention(qc, kc, vc, causal=causal, stream=stream, **drop)

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
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, dropout_p=args.dropout)

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
    if "cuflash" in outs and ref is not None and not args.dropout:
        diff = max_abs_diff(outs["cuflash"], outs[ref])
        row["max_abs_diff"] = diff
        row["check_ok"] = bool(math.isfinite(diff) and diff <= args.tol)

    derive_ratios(row)
    del q, k, v, outs  # (qt, kt, vt: run_sdpa's, they go with the frame)
    return row


def backward_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """2.5 x forward (five matmuls against two), as in ANCHORS.md."""
    return 2.5 * forward_flops(b, h, sq, sk, d, causal)


def _grad_errors(got, ref) -> dict:
    """Per gradient (dq, dk, dv): max abs diff, max abs diff / max|ref|, and the relative
    L2 error, all in float32; nan when anything is non-finite."""
    errs = {}
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        a, r = a.float(), r.float()
        diff = (a - r).abs()
        dmax = float(diff.max().item())
        rmax = float(r.abs().max().item())
        dl2 = float(torch.linalg.vector_norm(diff).item())
        rl2 = float(torch.linalg.vector_norm(r).item())
        finite = bool(torch.isfinite(a).all().item()) and math.isfinite(rmax) and math.isfinite(rl2)
        tiny = 1e-30
        errs[name] = dict(abs=dmax if finite else float("nan"),
                          rel_max=dmax / max(rmax, tiny) if finite else float("nan"),
                          rel_l2=dl2 / max(rl2, tiny) if finite else float("nan"))
        del a, r, diff
    return errs


def det_plan(qc, kc, vc, causal: bool, dropout: bool) -> str | None:
    """How the deterministic backward adds dQ in this cell, as backward.backward_call plans it: "ordered" (fp32, each
    query block's key blocks in turn), "fixed" (int32 fixed point) or "slices xN" (N fp32 slices per head); None
    where this package plans in another way."""
    try:
        from cuflash import build, checks, options
        from cuflash.ops import backward
        dev = cupy.cuda.Device().id
        problem = checks.check_attention(qc, kc, vc, causal=causal)
        left, right = options.normalize_window(*checks.window(causal, (-1, -1)), problem.seqlen_q, problem.seqlen_k)
        launch = backward.plan_backward(problem, left, right, False, True, build.device_arch(dev),
                                        build.sm_count(dev), dropout=dropout, memory=build.memory_system(dev))
    except Exception:  # noqa: BLE001 (an older package: no memory system, other names)
        return None
    if getattr(launch, "ordered", False):
        return "ordered"
    return "fixed" if launch.fixed_point else f"slices x{launch.slices}"


def backward_cell(cell: dict, args) -> dict:
    b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    flops = backward_flops(b, h, s, s, d, causal)
    row = dict(op="bwd", dtype=args.dtype, d=d, causal=causal, seqlen=s, batch=b, nheads=h,
               flops=flops, dropout_p=args.dropout)
    drop = _dropout(args)

    # Inputs and the incoming gradient: random, (b, s, h, d), created once per call (placement).
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    grads = {}  # impl -> (dq, dk, dv) as torch (b, s, h, d)

    def record(name, ms=None, err=None):
        row[f"ms_{name}"] = ms
        row[f"tflops_{name}"] = (flops / (ms * 1e-3) / 1e12) if ms else None
        row[f"error_{name}"] = err

    # ---- cuflash: out, lse from one forward; the backward timed on its own ------
    # "cuflash": atomic dQ accumulation (the default); "cuflash_det": deterministic=True.
    cf_impls = [i for i in ("cuflash", "cuflash_det") if i in args.impls]
    if cf_impls and cuflash is None:
        for name in cf_impls:
            record(name, err=f"import failed: {CUFLASH_IMPORT_ERROR}")
    elif cf_impls and not hasattr(cuflash, "attention_backward"):
        row["cuflash_missing"] = True  # not a failure of the run: the backward is not there yet
        for name in cf_impls:
            record(name, err="cuflash has no attention_backward (yet)")
    elif cf_impls:
        try:
            qc, kc, vc, doc = (to_cupy(x) for x in (q, k, v, dout))
            stream = cupy_stream()
            out_c, lse_c = cuflash.attention(qc, kc, vc, causal=causal, return_lse=True,
                                             stream=stream, **drop)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            for name in cf_impls:
                record(name, err=f"forward (out, lse): {short_error(e)}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        else:
            for name in cf_impls:
                det = name == "cuflash_det"
                kw = dict(causal=causal, stream=stream, **drop)
                if det:
                    kw["deterministic"] = True

                def run_backward(kw=kw):
                    return cuflash.attention_backward(doc, qc, kc, vc, out_c, lse_c, **kw)

                try:
                    first = run_backward()  # the first call compiles
                    torch.cuda.synchronize()
                    try:
                        grads[name] = tuple(to_torch(x) for x in first)
                    except Exception as e:  # noqa: BLE001
                        row["check_error"] = (f"{name} gradients not readable by torch: "
                                              f"{short_error(e)}")
                    del first
                    if det:
                        row["det_plan"] = det_plan(qc, kc, vc, causal, bool(drop))
                    if det and name in grads:  # the contract: bitwise identical across runs
                        again = run_backward()
                        torch.cuda.synchronize()
                        row["det_repeat_identical"] = all(
                            torch.equal(x.view(torch.int16), to_torch(y).view(torch.int16))
                            for x, y in zip(grads[name], again))
                        del again
                    record(name, ms=time_ms(run_backward, args))
                except Exception as e:  # noqa: BLE001
                    record(name, err=short_error(e))
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
            del out_c, lse_c
        cupy.get_default_memory_pool().free_all_blocks()  # room for the peers (grads stay alive)

    # ---- SDPA backends through autograd: (fwd + bwd) - fwd ---------------------
    # Leaves are (b, h, s, d) views of the same (b, s, h, d) storage, as in the forward.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    leaves = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    qt, kt, vt = leaves
    dout_t = dout.transpose(1, 2)

    def run_fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, dropout_p=args.dropout)

    def run_fwd_bwd():
        for x in leaves:
            x.grad = None
        run_fwd().backward(dout_t)

    def clear_grads():
        for x in leaves:
            x.grad = None

    ref, ref_grads = None, None
    for name, backend in SDPA_BACKENDS.items():
        if name not in args.impls:
            continue
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    sdpa_kernel(getattr(SDPBackend, backend)):
                warnings.simplefilter("always")
                run_fwd_bwd()  # untimed first call (plans, workspace) and the check's reference
                torch.cuda.synchronize()
                if name in CHECK_REFS and ref_grads is None:
                    ref, ref_grads = name, tuple(x.grad.transpose(1, 2) for x in leaves)
                clear_grads()
                ms_fwd = time_ms(run_fwd, args)
                ms_fwd_bwd = time_ms(run_fwd_bwd, args)
            row[f"ms_fwd_{name}"] = ms_fwd
            row[f"ms_fwdbwd_{name}"] = ms_fwd_bwd
            ms_bwd = ms_fwd_bwd - ms_fwd
            if ms_bwd > 0:
                record(name, ms=ms_bwd)
            else:
                record(name, err=f"(fwd+bwd) - fwd = {ms_bwd:.4f} ms, not positive")
        except Exception as e:  # noqa: BLE001
            record(name, err=short_error(e, caught))
        finally:
            clear_grads()

    # No SDPA backend ran: the math backend gives the check its reference where it fits.
    if ref_grads is None and grads and b * h * s * s * 4 <= (1 << 32):
        try:
            with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH):
                warnings.simplefilter("ignore")
                run_fwd_bwd()
                torch.cuda.synchronize()
                ref, ref_grads = "math", tuple(x.grad.transpose(1, 2) for x in leaves)
        except Exception as e:  # noqa: BLE001
            row["check_note"] = f"math reference failed: {short_error(e)}"
        finally:
            clear_grads()

    # ---- spot check: each cuflash mode's dq, dk, dv against the reference ---------
    row["check_ref"] = ref
    row["max_abs_diff"] = row["max_rel_err"] = row["max_rel_l2_err"] = None
    row["check_ok"] = False if row.get("check_error") else None
    failures = []
    if row.get("check_error"):
        failures.append(row["check_error"])
    if ref_grads is not None and not args.dropout:
        for name in ("cuflash", "cuflash_det"):
            if name not in grads:
                continue
            errs = _grad_errors(grads[name], ref_grads)
            for g, e in errs.items():
                for key, val in e.items():
                    row[f"{key}_{g}_{name}"] = val  # e.g. rel_max_dk_cuflash_det
                bad = (not all(math.isfinite(x) for x in e.values())
                       or e["rel_max"] > args.bwd_tol or e["rel_l2"] > args.bwd_tol)
                if bad:
                    failures.append(f"{name} {g} vs SDPA {ref}: max abs {e['abs']:.3g}, "
                                    f"max abs / max|ref| {e['rel_max']:.3g}, "
                                    f"rel L2 {e['rel_l2']:.3g} (tol {args.bwd_tol:g})")
            for key, field in (("abs", "max_abs_diff"), ("rel_max", "max_rel_err"),
                               ("rel_l2", "max_rel_l2_err")):
                row[field] = worst_of([row[field], *(x[key] for x in errs.values())])
        if any(n in grads for n in ("cuflash", "cuflash_det")) and row["check_ok"] is None:
            row["check_ok"] = True
    if row.get("det_repeat_identical") is False:
        failures.append("deterministic=True gave different bits on a repeated call")
    if failures:
        row["check_ok"] = False
        row["check_msg"] = "; ".join(failures)

    derive_ratios(row)
    del q, k, v, dout, grads, ref_grads  # (leaves, qt, kt, vt, dout_t: the closures', they go with the frame)
    return row


_RATIO_COLUMNS = (Column("cf/flash", "ratio_flash", "8.3f", 8),
                  Column("cf/cudnn", "ratio_cudnn", "8.3f", 8))

# op name -> Op, in the order --op all runs them.
OPS = {
    "fwd": Op(title="Forward", unit="TFLOP/s", grid=training_grid, run_cell=forward_cell,
              impls=IMPLS,
              columns=_RATIO_COLUMNS + (Column("  maxdiff", "max_abs_diff", "9.2e", 9),),
              fail_text="with max abs diff > {tol:g}"),
    "bwd": Op(title="Backward", unit="TFLOP/s", grid=training_grid, run_cell=backward_cell,
              impls=BWD_IMPLS,
              columns=_RATIO_COLUMNS + (Column("det/atom", "ratio_det_atomic", "8.3f", 8),
                                        Column("  maxdiff", "max_abs_diff", "9.2e", 9),
                                        Column("  relmax", "max_rel_err", "8.2e", 8)),
              fail_text="failing the gradient check (relative error > {bwd_tol:g}, "
                        "non-finite, or deterministic not repeatable)"),
}


# --------------------------------------------------------------------------- #
# Placements: one cell on several fresh allocations of its tensors
# --------------------------------------------------------------------------- #
def allocate_pad(nbytes: int):
    """nbytes of GPU memory, allocated before a placement's tensors so that their addresses move."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def pad_bytes(cell: dict, placement: int) -> int:
    """The pad's size before a cell's placement: random in 0 .. PAD_MAX_BYTES, the same in every run."""
    return random.Random(f"{PLACEMENT_SEED} {sorted(cell.items())} {placement}").randrange(0, PAD_MAX_BYTES)


def placed_cell(op: Op, cell: dict, args) -> dict:
    """op.run_cell on args.placements fresh allocations: the first as they come, each later one behind a pad that
    stays allocated while it runs. Their rows merged (merge_placements); placements 1 is one plain run_cell."""
    rows = []
    for i in range(args.placements):
        if i:
            if not context_alive():
                break  # the placement before broke the context: keep its row and its error
            free_memory()  # the last placement's tensors go back, so this one's are fresh
        pad = allocate_pad(pad_bytes(cell, i)) if i else None
        rows.append(op.run_cell(cell, args))
        del pad
    return merge_placements(rows, op.impls)


def merge_placements(rows: list[dict], impls) -> dict:
    """One row from a cell's placements: the first's, with each implementation's time the median over them (null
    with the error of a placement where it failed), TFLOP/s and ratios from the medians, the spot check failed when
    any placement failed it, the worst of each error over them. One placement: its row unchanged."""
    if len(rows) == 1:
        return rows[0]
    row = dict(rows[0])
    for impl in impls:
        if not any(f"ms_{impl}" in r for r in rows):
            continue  # not selected by --impls
        ms = [r.get(f"ms_{impl}") for r in rows]
        failed = next((r for r, t in zip(rows, ms) if not t), None)
        if failed:
            row.update({f"ms_{impl}": None, f"tflops_{impl}": None, f"error_{impl}": failed.get(f"error_{impl}")})
        else:
            row[f"ms_{impl}"] = statistics.median(ms)
            row[f"tflops_{impl}"] = row["flops"] / (row[f"ms_{impl}"] * 1e-3) / 1e12
            row[f"tflops_{impl}_placements"] = [r[f"tflops_{impl}"] for r in rows]
    failed = next((r for r in rows if r.get("check_ok") is False), None)
    if failed:
        row["check_ok"] = False
        row.update({k: failed[k] for k in ("check_msg", "check_error") if k in failed})
    for key in ("max_abs_diff", "max_rel_err", "max_rel_l2_err"):
        if key in row:
            row[key] = worst_of(r.get(key) for r in rows)
    if any(r.get("det_repeat_identical") is False for r in rows):
        row["det_repeat_identical"] = False
    return derive_ratios(row)


def placements_note(args) -> str:
    """The line that says what a reported time is."""
    if args.placements == 1:
        return "times: one placement (the tensors allocated once per cell)"
    return f"times: medians over {args.placements} placements (fresh tensors behind a pad of random size)"


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #
def _fmt(x, spec="7.1f", width=7) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "n/a".rjust(width)


def _impl_width(impl: str) -> int:
    return max(9, len(impl))


def format_row(row: dict, op: Op, impls: list[str]) -> str:
    cells = [f"{row['d']:>4}", f"{str(row['causal']):>6}", f"{row['seqlen']:>6}",
             f"{row['batch']:>5}", f"{row['nheads']:>5}"]
    cells += [_fmt(row.get(f"tflops_{i}"), f"{_impl_width(i)}.1f", _impl_width(i)) for i in impls]
    cells += [_fmt(row.get(c.key), c.spec, c.width) for c in op.columns]
    line = " ".join(cells)
    if row.get("check_ok") is False:
        line += "  <<< FAIL"
    return line


def table_header(op: Op, impls: list[str]) -> str:
    cols = ["   d", "causal", "seqlen", "batch", "heads"]
    cols += [i.rjust(_impl_width(i)) for i in impls]
    cols += [c.header.rjust(c.width) for c in op.columns]
    return " ".join(cols)


def print_table(op: Op, rows: list[dict], args) -> None:
    """The op's table: from a '=== ' line to the next blank line (gpu_check.sh cuts it there)."""
    impls = op_impls(op, args)
    print()
    print(f"=== cuflash {op.title} {op.unit} ({args.dtype}; ratios = cuflash / peer) ===")
    print(table_header(op, impls))
    for r in rows:
        print(format_row(r, op, impls))
    print(placements_note(args))
    ratios = [(r["ratio_flash"], r) for r in rows if r.get("ratio_flash")]
    if ratios:
        worst, wr = min(ratios, key=lambda t: t[0])
        print(f"min cuflash/flash over {len(ratios)}/{len(rows)} cells: {worst:.3f} "
              f"(d={wr['d']} causal={wr['causal']} seqlen={wr['seqlen']})")
    else:
        print(f"min cuflash/flash over 0/{len(rows)} cells: n/a")
    dets = sorted(r["ratio_det_atomic"] for r in rows if r.get("ratio_det_atomic"))
    if dets:
        print(f"deterministic/atomic time over {len(dets)} cells: min {dets[0]:.3f}, "
              f"median {dets[len(dets) // 2]:.3f}, max {dets[-1]:.3f}")
    plans = [r for r in rows if r.get("det_plan")]
    if plans:  # how each cell's deterministic mode added dQ: in turn, fixed point, or which cells' fp32 slices
        slices = [f"{r['d']}/{'causal' if r['causal'] else 'full'}/{r['seqlen']} {r['det_plan'][len('slices '):]}"
                  for r in plans if r["det_plan"].startswith("slices")]
        ordered = sum(r["det_plan"] == "ordered" for r in plans)
        print(f"deterministic mode over {len(plans)} cells: ordered in {ordered}, the fixed point in "
              f"{len(plans) - ordered - len(slices)}; slices in {', '.join(slices) if slices else 'none'}")
    errors = {(i, r.get(f"error_{i}")) for r in rows for i in impls if r.get(f"error_{i}")}
    for impl, err in sorted(errors, key=str):
        print(f"n/a {impl}: {err}")
    fails = [r for r in rows if r.get("check_ok") is False]
    if fails:
        print(f"FAIL: {len(fails)} cell(s) " + op.fail_text.format(**vars(args)))
    print()


def json_safe(x):
    """nan/inf -> None so the file is strict JSON (check_ok keeps the verdict)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def json_rows(rows: list[dict], meta: dict | None = None) -> list[dict]:
    """Each cell with the run's fields in front, nan/inf as null."""
    return [{k: json_safe(v) for k, v in {**(meta or {}), **r}.items()} for r in rows]


def dump_json(path: str, data) -> None:
    """`data` as strict JSON at `path`, its folder made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    dump_json(path, json_rows(rows, meta))
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
        for impl in op_impls(op, args):
            ys = [r.get(f"tflops_{impl}") or float("nan") for r in sub]
            ax.plot(xs, ys, marker="o", label=impl,
                    linestyle="--" if impl == "cuflash_det" else "-",
                    linewidth=2.5 if impl.startswith("cuflash") else 1.5)
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
def png_path(path: str, op_name: str, ops: list[str]) -> str:
    """The first op's plot goes to PATH; the others to PATH with _<op> before the extension."""
    if op_name == ops[0]:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_{op_name}{ext or '.png'}"


def run_op(op_name: str, args) -> tuple[list[dict], bool, int]:
    """Run one op's grid, printing each cell. Returns (rows, context broken, cells planned)."""
    op = OPS[op_name]
    impls = op_impls(op, args)
    rows, broken = [], False
    cells = op.grid(args)
    print(f"\n### {op.title} ({op_name}): {len(cells)} cells, impls {','.join(impls)}", flush=True)
    print(placements_note(args), flush=True)
    for n, cell in enumerate(cells, 1):
        try:
            row = placed_cell(op, cell, args)
        except Exception as e:  # noqa: BLE001  -- setup failure (e.g. out of memory)
            traceback.print_exc()
            row = dict(op=op_name, dtype=args.dtype, **cell, error_cell=short_error(e))
        rows.append(row)
        print(f"[{n}/{len(cells)}] " + format_row(row, op, impls), flush=True)
        if row.get("check_ok") is False:
            if row.get("check_msg"):
                print(f"!!! FAIL: {row['check_msg']} (d={row['d']} causal={row['causal']} "
                      f"seqlen={row['seqlen']}) !!!", flush=True)
            elif row.get("max_abs_diff") is not None:
                print(f"!!! FAIL: cuflash differs from SDPA {row['check_ref']} by "
                      f"{row['max_abs_diff']} > {args.tol:g} (d={row['d']} causal={row['causal']} "
                      f"seqlen={row['seqlen']}) !!!", flush=True)
        for key in ("error_cuflash", "error_cuflash_det", "check_error", "error_cell"):
            if row.get(key) and not (key.startswith("error_cuflash") and row.get("cuflash_missing")):
                print(f"    {key}: {row[key]}", flush=True)
        if not context_alive():
            print("CUDA context is broken (see the error above); stopping the run.")
            broken = True
            break
        free_memory()
    return rows, broken, len(cells)


def op_failed(op_name: str, rows: list[dict], args) -> bool:
    """A cuflash cell that did not run (other than a backward that does not exist yet) or
    that failed its spot check."""
    cf = [i for i in op_impls(OPS[op_name], args) if i.startswith("cuflash")]
    for r in rows:
        if r.get("check_ok") is False:
            return True
        if r.get("cuflash_missing"):
            continue
        if any(r.get(f"tflops_{i}") is None for i in cf):
            return True
    return False


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = _import_gpu_stack()
    if reason:
        print(f"bench_attention: skipped: {reason}", file=sys.stderr)
        return 2
    meta = dict(run_meta(), placements=args.placements)
    print(f"device {meta['device']}  torch {meta['torch_version']}  triton "
          f"{meta['triton_version']}  cupy {meta['cupy_version']}  cudnn {meta['cudnn_version']}"
          + (f"  cuflash {os.path.dirname(cuflash.__file__)}" if cuflash is not None else ""))
    if CUFLASH_IMPORT_ERROR:
        print(f"cuflash: import failed: {CUFLASH_IMPORT_ERROR}  (peers still measured)")
    if "bwd" in args.ops and cuflash is not None and not hasattr(cuflash, "attention_backward"):
        print("cuflash: no attention_backward yet; the backward's cuflash columns are n/a "
              "(peers still measured)")

    all_rows, bad = [], False
    for op_name in args.ops:
        rows, broken, planned = run_op(op_name, args)
        op = OPS[op_name]
        print_table(op, rows, args)
        all_rows += rows
        # Written after each op, so a later op that dies or times out loses nothing before it.
        if args.json:
            write_json(args.json, all_rows, meta)
        if args.png:
            write_png(png_path(args.png, op_name, args.ops), op, rows, args, meta)
        bad = bad or broken or len(rows) < planned or op_failed(op_name, rows, args)
        if broken:
            break
        free_memory()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

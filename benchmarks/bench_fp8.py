#!/usr/bin/env python3
"""The FP8 (e4m3) forward beside its ceiling and its peers, in one run, on the FA2-paper grid (16k tokens, hidden
2048; benchmarks/bench_attention.py's cells and timing).

    python3 benchmarks/bench_fp8.py [--dims 64,128,256] [--seqlens 512,...,16384] [--causal both|true|false]
                                    [--heads N] [--json out/fp8.json]

--heads replaces the grid's head count (2048 / d) in every cell, e.g. to see whether a cell loses to its last
partial wave of CTAs: at d 128 and 16k keys the kernel's 192-row tiles make 86 x 16 = 1376 CTAs, 10.4 waves of 132,
where 23 heads make 1978, 15.0 waves.

Per cell, TFLOP/s (the forward's 4 b h s^2 d, halved when causal):
  cuflash_fp8     cuflash.attention_fp8, per-tensor descales (from forward_fp8.VT_PASS_FROM keys the V^T pass included)
  cudnn_fp8       cuDNN's FP8 attention on the same e4m3 tensors (cudnn-frontend's sdpa_fp8 graph, descales of 1,
                  bf16 O where cuDNN takes it, else e4m3 O), where the cudnn-frontend package imports; with max
                  |O - cuflash's O| (err) as a check that both compute the same attention
  cuflash_bf16    cuflash.attention on the same shapes in bf16
  cudnn_bf16      torch's SDPA, cuDNN backend, bf16
then cuflash_fp8 over cudnn_fp8 and over cudnn_bf16; and once per run torch._scaled_mm's e4m3 GEMM (8192 x 8192 x
8192, bf16 out): the tensor cores' FP8 ceiling as torch reaches it; the fp8 column's fraction of it (of_mm) is printed
beside each cell.

--json writes the run (the device and versions, the ceiling, a row per cell with these TFLOP/s and err) for
benchmarks/report.py --fp8, which makes docs/benchmarks.md's FP8 table and plot of it.

The device image has no cudnn-frontend: its wheel travels beside the tree (docs/benchmarks.md, "FP8").
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (its GPU stack, timing and grid)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=ba._int_list, default=[64, 128, 256])
    p.add_argument("--seqlens", type=ba._int_list, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--fp8-only", action="store_true", help="the fp8 column alone (A/Bs): no ceiling, no peers")
    p.add_argument("--heads", type=int, default=None, help="query and KV heads of every cell (default 2048 / d)")
    p.add_argument("--json", help="write the run here (benchmarks/report.py --fp8 reads it)")
    args = p.parse_args(argv)
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


def scaled_mm(n: int = 8192):
    """(callable, FLOPs a call) of torch._scaled_mm's e4m3 GEMM, n^3, bf16 out: the tensor cores' FP8 ceiling."""
    torch = ba.torch
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    return (lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), 2.0 * n ** 3


def scaled_mm_tflops(args) -> float:
    fn, flops = scaled_mm()
    return flops / (ba.time_ms(fn, args) * 1e-3) / 1e12


def cudnn_fp8(x8, causal: bool):
    """(run, O) for cuDNN's FP8 attention on x8 = (q, k, v), float8_e4m3fn torch tensors (b, s, h, d) with descales
    of 1 (run() launches on torch's current stream into O), or (None, why not)."""
    try:
        import cudnn
    except ImportError as e:
        return None, f"no cudnn-frontend ({e})"
    torch = ba.torch
    b, s, h, d = x8[0].shape
    dims, stride, unit = [b, h, s, d], [s * h * d, d, h * d, 1], dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1])
    try:
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    except Exception as e:  # noqa: BLE001
        return None, f"no cuDNN handle ({ba.short_error(e)})"
    errors = []
    for out_type, out_dtype in ((cudnn.data_type.BFLOAT16, torch.bfloat16), (cudnn.data_type.FP8_E4M3,
                                                                             torch.float8_e4m3fn)):
        try:
            g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            q, k, v = (g.tensor(name=n, dim=dims, stride=stride, data_type=cudnn.data_type.FP8_E4M3) for n in "qkv")
            scalars = [g.tensor(name=n, data_type=cudnn.data_type.FLOAT, **unit)
                       for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
            o, _, amax_s, amax_o = g.sdpa_fp8(q, k, v, *scalars, is_inference=True, attn_scale=1 / math.sqrt(d),
                                              use_causal_mask=causal)
            o.set_output(True).set_dim(dims).set_stride(stride).set_data_type(out_type)
            for amax in (amax_s, amax_o):
                amax.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(unit["dim"]).set_stride(
                    unit["stride"])
            g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        except Exception as e:  # noqa: BLE001  -- cuDNN declines this graph: the next output type, or none
            errors.append(f"{out_type}: {ba.short_error(e)}")
            continue
        out = torch.empty(b, s, h, d, dtype=out_dtype, device="cuda")
        one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device="cuda")
        pack = {q: x8[0], k: x8[1], v: x8[2], o: out, amax_s: torch.empty_like(one), amax_o: torch.empty_like(one)}
        pack.update({t: one for t in scalars})
        workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
        return (lambda: g.execute(pack, workspace, handle=handle)), out
    return None, "; ".join(errors)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not ba.import_stack_with_cuflash("bench_fp8"):
        return 2
    torch, cupy, cuflash = ba.torch, ba.cupy, ba.cuflash
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ba.warm_up_gpu()
    ceiling = float("nan") if args.fp8_only else scaled_mm_tflops(args)
    print(f"torch._scaled_mm e4m3 8192^3: {ceiling:.1f} TFLOP/s")
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} {'cuflash_fp8':>11} {'of_mm':>6} {'cudnn_fp8':>9} {'err':>6} "
          f"{'cuflash_bf16':>12} {'cudnn_bf16':>10} {'/cudnn_fp8':>10} {'/cudnn_bf16':>11}")
    rows = []
    for cell in ba.training_grid(args):
        b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
        h = args.heads or h
        flops = ba.forward_flops(b, h, s, s, d, causal)
        x = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        x8 = [t.to(torch.float8_e4m3fn) for t in x]  # |x| < 448: descale 1
        one = cupy.ones((1,), dtype=cupy.float32)
        with ba.cupy_stream():
            q8, k8, v8 = (cupy.from_dlpack(t.view(torch.uint8)) for t in x8)
            qb, kb, vb = (ba.to_cupy(t) for t in x)
            row = {"bf16": float("nan"), "cudnn": float("nan"), "cudnn_fp8": float("nan")}
            row["fp8"] = ba.time_ms(lambda: cuflash.attention_fp8(q8, k8, v8, q_descale=one, k_descale=one,
                                                                  v_descale=one, causal=causal), args)
            if not args.fp8_only:
                row["bf16"] = ba.time_ms(lambda: cuflash.attention(qb, kb, vb, causal=causal), args)
                ours = ba.to_torch(cuflash.attention_fp8(q8, k8, v8, causal=causal)).float()
        err = float("nan")
        if not args.fp8_only:
            run, theirs = cudnn_fp8(x8, causal)
            if run is None:
                print(f"cudnn_fp8: {theirs}", file=sys.stderr)
            else:
                try:
                    run()
                    err = float((theirs.float() - ours).abs().max())
                    row["cudnn_fp8"] = ba.time_ms(run, args)
                except Exception as e:  # noqa: BLE001
                    print(f"cudnn_fp8: {ba.short_error(e)}", file=sys.stderr)
        xt = [t.transpose(1, 2) for t in x]
        try:
            if not args.fp8_only:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    row["cudnn"] = ba.time_ms(lambda: F.scaled_dot_product_attention(*xt, is_causal=causal), args)
        except Exception as e:  # noqa: BLE001
            print(f"cudnn: {ba.short_error(e)}", file=sys.stderr)
        tf = {k: flops / (ms * 1e-3) / 1e12 for k, ms in row.items()}
        print(f"{d:>4} {str(causal):>6} {s:>6} {tf['fp8']:>11.1f} {tf['fp8'] / ceiling:>6.2f} {tf['cudnn_fp8']:>9.1f} "
              f"{err:>6.3f} {tf['bf16']:>12.1f} {tf['cudnn']:>10.1f} {tf['fp8'] / tf['cudnn_fp8']:>10.2f} "
              f"{tf['fp8'] / tf['cudnn']:>11.2f}", flush=True)
        rows.append(dict(d=d, causal=causal, seqlen=s, batch=b, nheads=h, tflops_cuflash_fp8=tf["fp8"],
                         tflops_cudnn_fp8=tf["cudnn_fp8"], err=err, tflops_cuflash_bf16=tf["bf16"],
                         tflops_cudnn_bf16=tf["cudnn"]))
        ba.free_memory()
    if args.json:
        write_json(args.json, rows, ceiling)
    return 0


def write_json(path: str, rows: list, ceiling: float) -> None:
    """The run as one JSON object: the device and versions, the ceiling's TFLOP/s, the cells (nan -> null)."""
    meta = ba.run_meta()
    run = dict(gpu=meta["device"], date=meta["timestamp"], dtype="e4m3",
               versions=dict(torch=meta["torch_version"], cudnn=meta["cudnn_version"], cupy=meta["cupy_version"]),
               scaled_mm_tflops=ba.json_safe(ceiling), rows=ba.json_rows(rows))
    ba.dump_json(path, run)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""cuflash beside torch's FlexAttention on what SDPA lacks: softcap, ALiBi, a sliding window and grouped-query
attention, forward and backward in one run, on the FA2-paper grid (16k tokens, hidden 2048; bench_attention.py's
cells and timing).

    python3 benchmarks/bench_flex.py [--mod none|softcap|alibi|both] [--softcap 50] [--window LEFT,RIGHT]
                                     [--group G] [--dims 64,128,256] [--seqlens 1024,4096,16384]
                                     [--causal both|true|false] [--cuflash-only]

FlexAttention (`torch.nn.attention.flex_attention` under torch.compile, its shapes dynamic after the first) gets
the same work: a score_mod for softcap `c tanh(s / c)` on the scaled score s and ALiBi `- slope_h |i - j|` (slopes
2^(-8 (h + 1) / heads)), a block mask for the causal mask and the window (query i sees keys i - LEFT .. i + RIGHT,
-1 unbounded: cuflash's `window_size`; RIGHT is 0 in causal cells), and `enable_gqa` for G query heads per K/V head.
Per cell, TFLOP/s (the forward's 4 b h d FLOP per visible (query, key) pair: half the square when causal without a
window, as bench_attention.py; the backward 2.5x that):
  cuflash_fwd     cuflash.attention
  flex_fwd        FlexAttention
  cuflash_bwd     cuflash.attention_backward (atomic dQ)
  cuflash_det     the same, deterministic=True
  flex_bwd        FlexAttention through autograd, (forward + backward) - forward
  plain_bwd       cuflash.attention_backward without the score mod (n/a with --mod none): what the mod costs
then cuflash over FlexAttention in each direction, and as checks max |O - O_flex| (err) and the largest of
max |dX - dX_flex| / max |dX_flex| over dq, dk, dv (gerr), a row past bench_attention.py's tolerances marked FAIL
(exit status 1). --cuflash-only keeps cuflash_fwd, cuflash_bwd and cuflash_det (A/Bs: scripts/gpu_ab.sh, --column
cuflash_bwd).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (its GPU stack, timing and grid)

COLUMNS = ("cuflash_fwd", "flex_fwd", "cuflash_bwd", "cuflash_det", "flex_bwd", "plain_bwd")


def _window(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or any(int(x) < -1 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LEFT,RIGHT, each -1 (unbounded) or >= 0")
    return int(parts[0]), int(parts[1])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mod", choices=["none", "softcap", "alibi", "both"], default="softcap")
    p.add_argument("--softcap", type=float, default=50.0, help="the cap (Gemma 2's attention logits: 50)")
    p.add_argument("--window", type=_window, default=(-1, -1), metavar="LEFT,RIGHT",
                   help="sliding window (cuflash's window_size; Mistral's 4096 keys: 4095,0)")
    p.add_argument("--group", type=int, default=1, metavar="G", help="query heads per K/V head (GQA)")
    p.add_argument("--dims", type=ba._int_list, default=[64, 128, 256])
    p.add_argument("--seqlens", type=ba._int_list, default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--cuflash-only", action="store_true", help="cuflash's columns alone (A/Bs)")
    args = p.parse_args(argv)
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    if args.softcap <= 0:
        p.error(f"--softcap: {args.softcap}, expected > 0")
    heads = {d: ba.HIDDEN // d for d in args.dims}
    if args.group < 1 or any(h % args.group for h in heads.values()):
        p.error(f"--group: {args.group}, expected a divisor of every cell's query heads {sorted(set(heads.values()))}")
    return args


def alibi_slopes(nheads: int) -> list[float]:
    """ALiBi's geometric slopes, 2^(-8 (h + 1) / nheads)."""
    return [2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)]


def cell_window(window: tuple[int, int], causal: bool) -> tuple[int, int]:
    """The window a cell runs with: RIGHT is 0 when causal (cuflash forces it so)."""
    return (window[0], 0) if causal else window


def visible_pairs(seqlen: int, causal: bool, window: tuple[int, int]) -> float:
    """(query, key) pairs a square problem's mask leaves: seqlen^2, halved when causal without a window (as
    bench_attention.py counts), else exactly."""
    left, right = cell_window(window, causal)
    if left < 0 and (right < 0 or causal):  # (a causal cell's right is 0)
        return seqlen * seqlen / (2 if causal else 1)
    total = 0
    for i in range(seqlen):
        lo = 0 if left < 0 else max(0, i - left)
        hi = seqlen - 1 if right < 0 else min(seqlen - 1, i + right)
        total += max(0, hi - lo + 1)
    return float(total)


def flex_score_mod(softcap: float, slopes):
    """FlexAttention's score_mod for cuflash's mods on a square problem (seqlen_q = seqlen_k): softcap (0: none) on
    the scaled score, then ALiBi's bias from `slopes` (a float32 tensor (heads,), or None); None for neither."""
    if softcap <= 0 and slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * (score / softcap).tanh()
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score
    return score_mod


def flex_mask_mod(causal: bool, window: tuple[int, int]):
    """FlexAttention's mask_mod for cuflash's causal mask and window on a square problem; None for neither."""
    left, right = cell_window(window, causal)
    if not causal and left < 0 and right < 0:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx if causal else q_idx >= 0
        if left >= 0:
            keep = keep & (q_idx - kv_idx <= left)
        if right >= 0:
            keep = keep & (kv_idx - q_idx <= right)
        return keep
    return mask_mod


def flex_call(flex, q, k, v, mask_mod, score_mod):
    """A no-argument call of `flex` (flex_attention, compiled or not) on (b, h, s, d) tensors (k and v with
    h / G heads) with `score_mod` and a block mask from `mask_mod` (None: every pair)."""
    from torch.nn.attention.flex_attention import create_block_mask
    s = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, s, s, device=str(q.device)) if mask_mod else None
    gqa = q.shape[1] != k.shape[1]
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


# (softcap, heads, alibi) -> (score_mod, slopes): one function per head count, so that torch.compile recompiles for
# new shapes only, not for each cell's new closure
_MODS = {}


def cell_mod(softcap: float, nheads: int, alibi: bool):
    """The score_mod and the ALiBi slopes tensor (or None) of a cell with `nheads` query heads."""
    key = (softcap, nheads, alibi)
    if key not in _MODS:
        slopes = ba.torch.tensor(alibi_slopes(nheads), device="cuda", dtype=ba.torch.float32) if alibi else None
        _MODS[key] = (flex_score_mod(softcap, slopes), slopes)
    return _MODS[key]


def tflops(flops: float, ms) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms else float("nan")


def run_cell(cell: dict, args, flex) -> dict:
    """One cell's times (ms; None where a column did not run) and checks."""
    torch, cuflash = ba.torch, ba.cuflash
    b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
    hk = h // args.group
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    softcap = args.softcap if args.mod in ("softcap", "both") else 0.0
    score_mod, slopes = cell_mod(softcap, h, args.mod in ("alibi", "both"))
    window = cell_window(args.window, causal)
    x = [torch.randn(b, s, n, d, device="cuda", dtype=dtype) for n in (h, hk, hk, h)]  # q, k, v, dout
    ms, errs = {}, {"err": float("nan"), "gerr": float("nan")}
    stream = ba.cupy_stream()
    qc, kc, vc, doc = (ba.to_cupy(t) for t in x)
    mods = dict(softcap=softcap, alibi_slopes=ba.to_cupy(slopes) if slopes is not None else None)
    mask = dict(causal=causal, window_size=window)

    def fwd(**kw):
        return cuflash.attention(qc, kc, vc, return_lse=True, stream=stream, **mask, **kw)

    out, lse = fwd(**mods)
    ms["cuflash_fwd"] = ba.time_ms(lambda: fwd(**mods), args)
    with_plain = not args.cuflash_only and args.mod != "none"
    plain = fwd() if with_plain else None  # out and lse without the mod, for plain_bwd
    ours = {}
    for name, kw in (("cuflash_bwd", mods), ("cuflash_det", dict(mods, deterministic=True)), ("plain_bwd", {})):
        if name == "plain_bwd" and not with_plain:
            continue
        o, l = plain if name == "plain_bwd" else (out, lse)

        def bwd(o=o, l=l, kw=kw):
            return cuflash.attention_backward(doc, qc, kc, vc, o, l, stream=stream, **mask, **kw)

        grads = bwd()
        if name == "cuflash_bwd":
            ours = dict(out=ba.to_torch(out), grads=tuple(ba.to_torch(g) for g in grads))
        ms[name] = ba.time_ms(bwd, args)
    if not args.cuflash_only:
        leaves = [t.detach().transpose(1, 2).requires_grad_() for t in x[:3]]
        dout = x[3].transpose(1, 2)
        try:
            run = flex_call(flex, *leaves, flex_mask_mod(causal, args.window), score_mod)
            theirs = run()
            errs["err"] = float((theirs.transpose(1, 2).float() - ours["out"].float()).abs().max())
            with torch.no_grad():
                ms["flex_fwd"] = ba.time_ms(run, args)

            def fwd_bwd():
                for t in leaves:
                    t.grad = None
                run().backward(dout)

            fwd_bwd()
            e = ba._grad_errors(ours["grads"], tuple(t.grad.transpose(1, 2) for t in leaves))
            errs["gerr"] = max(v["rel_max"] for v in e.values())
            both = ba.time_ms(fwd_bwd, args)
            ms["flex_bwd"] = both - ba.time_ms(run, args)
        except Exception as e:  # noqa: BLE001
            print(f"flex d={d} causal={causal} seqlen={s}: {ba.short_error(e)}", file=sys.stderr)
    return dict(ms=ms, **errs)


def title(args) -> str:
    parts = {"none": [], "softcap": [f"softcap {args.softcap:g}"], "alibi": ["ALiBi"],
             "both": [f"softcap {args.softcap:g}", "ALiBi"]}[args.mod]
    if args.window != (-1, -1):
        parts.append(f"window {args.window[0]},{args.window[1]}")
    if args.group > 1:
        parts.append(f"GQA {args.group}")
    return ", ".join(parts) or "no mod"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not ba.import_stack_with_cuflash("bench_flex"):
        return 2
    flex = None
    if not args.cuflash_only:
        from torch.nn.attention.flex_attention import flex_attention
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = 64  # shapes x masks x grad modes: past the default 8 flex runs eager
        flex = ba.torch.compile(flex_attention)
    ba.warm_up_gpu()
    print(f"=== {title(args)} ({args.dtype}; TFLOP/s; ratios = cuflash / FlexAttention) ===")
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} " + " ".join(f"{c:>11}" for c in COLUMNS)
          + f" {'fwd/flex':>8} {'bwd/flex':>8} {'err':>8} {'gerr':>8}")
    failed = False
    for cell in ba.training_grid(args):
        b, s, h, d, causal = cell["batch"], cell["seqlen"], cell["nheads"], cell["d"], cell["causal"]
        fwd_flops = 4.0 * b * h * d * visible_pairs(s, causal, args.window)
        try:
            row = run_cell(cell, args, flex)
        except Exception as e:  # noqa: BLE001
            print(f"d={d} causal={causal} seqlen={s}: {ba.short_error(e)}", file=sys.stderr)
            failed = True
            ba.free_memory()
            continue
        tf = {c: tflops(fwd_flops * (1.0 if c.endswith("fwd") else 2.5), row["ms"].get(c)) for c in COLUMNS}
        cells = " ".join(f"{tf[c]:>11.1f}" if tf[c] == tf[c] else f"{'n/a':>11}" for c in COLUMNS)
        ratios = (tf["cuflash_fwd"] / tf["flex_fwd"], tf["cuflash_bwd"] / tf["flex_bwd"])
        bad = row["err"] > ba.CHECK_TOL or row["gerr"] > ba.BWD_CHECK_TOL  # (nan: FlexAttention did not run)
        failed = failed or bad
        print(f"{d:>4} {str(causal):>6} {s:>6} {cells} {ratios[0]:>8.3f} {ratios[1]:>8.3f} {row['err']:>8.2e} "
              f"{row['gerr']:>8.2e}{'  <<< FAIL' if bad else ''}", flush=True)
        ba.free_memory()
    print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

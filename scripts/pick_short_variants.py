#!/usr/bin/env python3
"""Picks the Hopper forward's short-sequence table (plan.SM90_SHORT_VARIANTS) from benchmark runs of candidate tables.

    python3 scripts/pick_short_variants.py LABEL=TEXT:RUN.json[+RUN2.json...] ... [--margin 0.02]

TEXT is a CUFLASH_SM90_SHORT_VARIANTS value ("-" for the variable unset: the planner's own table) and each RUN a
`benchmarks/bench_attention.py --op fwd --json` file made with it. Per (head dim, causal) the variant each table
implies (its entry, else the head dim's default variant) is scored by the geometric mean over the cells up to
plan.SM90_SHORT_SEQLEN of cuflash's TFLOP/s, the best of that table's runs per cell. A variant replaces the head
dim's default only when it beats it by more than --margin. Prints the scores, then on its last line the chosen table
as a CUFLASH_SM90_SHORT_VARIANTS value.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cuflash import plan  # noqa: E402


def table_of(text: str) -> dict:
    return plan._short_table_from_env(None if text == "-" else text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=TEXT:RUN.json[+RUN2.json]")
    ap.add_argument("--margin", type=float, default=0.02)
    args = ap.parse_args(argv)
    scores = {}  # (d, band) -> {variant: geometric mean}
    for spec in args.runs:
        label, _, rest = spec.partition("=")
        text, _, paths = rest.rpartition(":")
        best = {}  # (d, causal, seqlen) -> TFLOP/s, the best run
        for path in paths.split("+"):
            try:
                rows = json.load(open(path))
            except (OSError, ValueError) as err:
                print(f"{label}: {path} unreadable ({err}); skipped")
                continue
            for r in rows:
                t = r.get("tflops_cuflash")
                if r.get("op") == "fwd" and t and r["seqlen"] <= plan.SM90_SHORT_SEQLEN:
                    key = (r["d"], bool(r["causal"]), r["seqlen"])
                    best[key] = max(best.get(key, 0.0), t)
        table = table_of(text)
        for d in sorted({k[0] for k in best}):
            for band in (False, True):
                cells = [v for (dd, c, _), v in best.items() if dd == d and c == band]
                if not cells:
                    continue
                variant = table.get((d, band), plan.SM90_DEFAULT_VARIANTS.get(d))
                gmean = math.exp(sum(map(math.log, cells)) / len(cells))
                scores.setdefault((d, band), {})[variant] = max(scores.get((d, band), {}).get(variant, 0.0), gmean)
                print(f"{label:>10}  d {d:3d} {'causal' if band else 'full  '}  {variant:16s} {gmean:7.1f} TFLOP/s "
                      f"(geometric mean of {len(cells)} cells)")
    chosen = {}
    for (d, band), by_variant in sorted(scores.items()):
        default = plan.SM90_DEFAULT_VARIANTS.get(d)
        base = by_variant.get(default)
        variant, score = max(by_variant.items(), key=lambda kv: kv[1])
        if variant != default and (base is None or score > base * (1 + args.margin)):
            chosen[d, band] = variant
        print(f"pick  d {d:3d} {'causal' if band else 'full  '}  {chosen.get((d, band), default)}"
              + (f"  (fastest other: {variant}, {score / base:.3f}x {default})" if base and variant != default else ""))
    print(",".join(f"{d}{'c' if band else ''}:{v}" for (d, band), v in sorted(chosen.items())))


if __name__ == "__main__":
    main()

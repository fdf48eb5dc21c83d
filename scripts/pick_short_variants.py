#!/usr/bin/env python3
"""Picks the Hopper forward's short-sequence table (forward.SM90_SHORT_VARIANTS) from benchmark runs of candidate
tables.

    python3 scripts/pick_short_variants.py LABEL=TEXT:RUN.json[+RUN2.json...] ... [--margin 0.02]

TEXT is a CUFLASH_SM90_SHORT_VARIANTS value ("-" for the variable unset: the planner's own table) and each RUN a
`benchmarks/bench_attention.py --op fwd --json` file made with it. Each cell up to forward.SM90_SHORT_SEQLEN keys
(head dim, causal, seqlen) scores the variant each table gives it (its entry, else the head dim's default variant)
by cuflash's TFLOP/s, the best of the runs that measured that variant there. A variant replaces the head dim's
default in a cell only when it beats it by more than --margin. Prints the scores, then on its last line the chosen
table as a CUFLASH_SM90_SHORT_VARIANTS value (an entry per run of cells with the same pick, "@N" bounding it).
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cuflash import settings  # noqa: E402
from cuflash.ops import forward  # noqa: E402


def table_of(text: str) -> dict:
    """A CUFLASH_SM90_SHORT_VARIANTS text ("-": unset, the built-in table) as the table it sets."""
    if text == "-":
        return forward.SM90_SHORT_VARIANTS
    return forward.short_table(settings.Settings.from_env({"CUFLASH_SM90_SHORT_VARIANTS": text}).sm90_short_variants)


def entries(picks: dict, defaults: dict) -> list:
    """{(d, band, seqlen): variant} -> CUFLASH_SM90_SHORT_VARIANTS items: per (d, band) the cells in order of
    length up to the last that does not take the default, a run of equal picks as one entry bounded by its
    longest cell ("@N"; none where that is SM90_SHORT_SEQLEN)."""
    items = []
    for d, band in sorted({(d, band) for d, band, _ in picks}):
        cells = sorted((s, v) for (dd, b, s), v in picks.items() if (dd, b) == (d, band))
        while cells and cells[-1][1] == defaults.get(d):
            cells.pop()
        for i, (seqlen, variant) in enumerate(cells):
            if i + 1 < len(cells) and cells[i + 1][1] == variant:
                continue
            bound = "" if seqlen == forward.SM90_SHORT_SEQLEN else f"@{seqlen}"
            items.append(f"{d}{'c' if band else ''}{bound}:{variant}")
    return items


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=TEXT:RUN.json[+RUN2.json]")
    ap.add_argument("--margin", type=float, default=0.02)
    args = ap.parse_args(argv)
    scores = {}  # (d, band, seqlen) -> {variant: TFLOP/s}
    for spec in args.runs:
        label, _, rest = spec.partition("=")
        text, _, paths = rest.rpartition(":")
        table = table_of(text)
        for path in paths.split("+"):
            try:
                rows = json.load(open(path))
            except (OSError, ValueError) as err:
                print(f"{label}: {path} unreadable ({err}); skipped")
                continue
            for r in rows:
                t = r.get("tflops_cuflash")
                if r.get("op") == "fwd" and t and r["seqlen"] <= forward.SM90_SHORT_SEQLEN:
                    d, band, seqlen = r["d"], bool(r["causal"]), r["seqlen"]
                    variant = forward.short_variant(table, d, band, seqlen) or forward.SM90_DEFAULT_VARIANTS.get(d)
                    cell = scores.setdefault((d, band, seqlen), {})
                    cell[variant] = max(cell.get(variant, 0.0), t)
    picks = {}
    for (d, band, seqlen), by_variant in sorted(scores.items()):
        default = forward.SM90_DEFAULT_VARIANTS.get(d)
        base = by_variant.get(default)
        variant, score = max(by_variant.items(), key=lambda kv: kv[1])
        picks[d, band, seqlen] = (variant if variant != default and (base is None or score > base * (1 + args.margin))
                                  else default)
        print(f"d {d:3d} {'causal' if band else 'full  '} {seqlen:5d}  " +
              "  ".join(f"{v} {t:.1f}" for v, t in sorted(by_variant.items(), key=lambda kv: -kv[1])) +
              f"  -> {picks[d, band, seqlen]}")
    print(",".join(entries(picks, forward.SM90_DEFAULT_VARIANTS)))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Nsight Compute's source page (CSV of SASS lines, scripts/gpu_source_profile.sh) summarized: the instructions each
warp executed per unit of work, by opcode; the warp-state samples by reason; the lines with the most samples.

    python3 scripts/ncu_source_summary.py src_d64_512.csv --units 131072 [--top 20]

--units: what to divide the executed instructions by, e.g. key blocks x consumer warps (a d 64 forward at batch 32,
32 heads, 512 keys: 32 x 32 x 4 query blocks x 4 key blocks x 8 warps = 131072).
"""
import argparse
import collections
import csv
import re


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--units", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {h: i for i, h in enumerate(rows[header])}
    data = [r for r in rows[header + 1:] if len(r) == len(rows[header])]
    stalls = [h for h in rows[header] if h.startswith("stall_") and "Not Issued" not in h]
    count = lambda r, h: int(r[col[h]] or 0)  # noqa: E731
    by_op, by_stall = collections.Counter(), collections.Counter()
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[col["Source"]].strip()).split()
        by_op[op[0].split(".")[0] if op else "?"] += count(r, "Instructions Executed")
        for s in stalls:
            by_stall[s[len("stall_"):]] += count(r, s)
    samples = sum(count(r, "Warp Stall Sampling (All Samples)") for r in data)
    print(f"instructions per unit: {sum(by_op.values()) / args.units:.1f}")
    print("  " + ", ".join(f"{k} {v / args.units:.1f}" for k, v in by_op.most_common(24)))
    print("samples by reason: " + ", ".join(f"{k} {v / samples:.3f}" for k, v in by_stall.most_common(10)))
    top = sorted(data, key=lambda r: -count(r, "Warp Stall Sampling (All Samples)"))[:args.top]
    for r in sorted(top, key=data.index):
        reasons = sorted(((count(r, s), s[len("stall_"):]) for s in stalls), reverse=True)[:3]
        print(f"{data.index(r):6d} {100 * count(r, 'Warp Stall Sampling (All Samples)') / samples:5.2f}% "
              f"{r[col['Source']].strip()[:60]:60s} " + " ".join(f"{s}:{c}" for c, s in reasons if c))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction, from an Nsight Compute report's source page.

Nsight Compute samples each warp's program counter and the reason it is not issuing (SourceCounters section). This
script reads the source page exported as CSV and prints the samples by stall reason, by opcode, and the
instructions that hold the most samples with their leading reasons and the instructions around them. A stall is
charged to the instruction a warp waits to issue: a warp blocked at a barrier shows on the instruction after the
`BAR`, one waiting for a warpgroup's wgmma to start on the `HGMMA` itself.

On the device (the repository root; `ncu` comes with the CUDA toolkit there):

    ncu --clock-control none --kernel-name regex:bwd_sm90 --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -f -o bwd \\
        python3 benchmarks/bench_attention.py --op bwd --dims 128 --seqlens 4096 --causal false --impls cuflash
    ncu -i bwd.ncu-rep --page source --csv --print-source sass > bwd_sass.csv

then anywhere:

    python3 scripts/ncu_stalls.py bwd_sass.csv [--top 40] [--context 3]
"""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
PREFIX = "stall_"


@dataclass
class Instruction:
    index: int
    source: str
    samples: int
    reasons: dict = field(default_factory=dict)  # stall reason -> samples

    @property
    def opcode(self) -> str:
        """The opcode without its predicate and modifiers (`@P0 BRA.U.ANY` -> `BRA`)."""
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else "?"


def read(lines) -> list[Instruction]:
    """The instructions of a `--page source --csv --print-source sass` export: its first line names the kernel, the
    second holds the column names. Only the all-samples stall columns are kept (not the "(Not Issued)" ones)."""
    rows = list(csv.reader(lines))
    header = next((i for i, r in enumerate(rows) if SAMPLES in r), None)
    if header is None:
        raise ValueError(f"no {SAMPLES!r} column: not a source-page export with SourceCounters")
    names = rows[header]
    at = {name: i for i, name in enumerate(names)}
    reasons = [n for n in names if n.startswith(PREFIX) and "Not Issued" not in n]
    out = []
    for r in rows[header + 1:]:
        if len(r) != len(names) or not r[at[SAMPLES]].strip().isdigit():
            continue
        by_reason = {n[len(PREFIX):]: int(r[at[n]]) for n in reasons if r[at[n]].strip().isdigit() and int(r[at[n]])}
        out.append(Instruction(len(out), r[at["Source"]].strip(), int(r[at[SAMPLES]]), by_reason))
    return out


def totals(instructions: list[Instruction], key) -> list[tuple[str, int]]:
    """Samples summed by key(instruction) -> [(name, samples)], or by reason when key is None; largest first."""
    sums: dict = {}
    for ins in instructions:
        items = ins.reasons.items() if key is None else [(key(ins), ins.samples)]
        for name, n in items:
            sums[name] = sums.get(name, 0) + n
    return sorted(sums.items(), key=lambda x: -x[1])


def report(instructions: list[Instruction], top: int = 30, context: int = 0) -> str:
    total = sum(i.samples for i in instructions)
    if total == 0:
        return "no samples"
    pct = lambda n: f"{100 * n / total:5.1f}%"  # noqa: E731
    lines = [f"{total} samples over {len(instructions)} instructions", "", "by stall reason:"]
    by_reason = totals(instructions, None)
    lines += [f"  {name:22s} {n:9d} {pct(n)}" for name, n in by_reason]
    unexplained = total - sum(n for _, n in by_reason)
    if unexplained > 0:  # a reason the export has no column for (e.g. waits of a warpgroup's wgmma)
        lines.append(f"  {'(no column)':22s} {unexplained:9d} {pct(unexplained)}")
    lines += ["", "by opcode:"] + [f"  {name:22s} {n:9d} {pct(n)}"
                                   for name, n in totals(instructions, lambda i: i.opcode)[:20]]
    lines += ["", "top instructions (index, samples, share, leading reasons):"]
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        leading = sorted(ins.reasons.items(), key=lambda x: -x[1])[:3]
        lines.append(f"{ins.index:6d} {ins.samples:8d} {pct(ins.samples)}  {ins.source[:64]:64s} "
                     + " ".join(f"{k}={v}" for k, v in leading))
        for j in range(max(0, ins.index - context), min(len(instructions), ins.index + context + 1)):
            if j != ins.index:
                lines.append(f"{'':8s}{j:6d} {instructions[j].samples:8d}   {instructions[j].source[:64]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=30, help="instructions to list")
    p.add_argument("--context", type=int, default=0, help="instructions shown before and after each listed one")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        text = report(read(f), args.top, args.context)
    try:
        print(text)
    except BrokenPipeError:  # piped into head
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

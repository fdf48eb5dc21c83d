#!/usr/bin/env python3
"""The A/B logs of scripts/gpu_ab.sh side by side: per benchmark cell, each switch set's mean TFLOP/s over its rounds
(the spread between rounds in parentheses), the sets' switches listed first; last, each set against set 0: the
median of its per-cell ratios and their range, over the cells both measured (the number the 2% rule of
docs/perf-notes.md reads).

    python3 scripts/ab_table.py DIR [--tag _bwd] [--column cuflash]

DIR holds ab<TAG>_<set>_<round>.txt; --column picks the benchmark table's column (cuflash, cuflash_det, ...; of
bench_fp8.py's table, cuflash_fp8).
"""
import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# d, causal, seqlen, then batch and heads (bench_attention.py; bench_fp8.py has none), then the columns
ROW = re.compile(r"^\s+(\d+)\s+(True|False)\s+(\d+)\s+(?:\d+\s+\d+\s+)?(.*)$")


def read(path: Path, column: str) -> tuple:
    """(the set's switches, {(d, causal, seqlen): TFLOP/s}) of one log; the column by the table's header."""
    switches, rows, index = "", {}, None
    for line in path.read_text().splitlines():
        if line.startswith("### ") and not switches:  # gpu_ab.sh's first line: the switches, then the command
            switches = line[4:].split(": python3", 1)[0]
        elif line.strip().startswith("d causal seqlen"):
            names = [n for n in line.split()[3:] if n not in ("batch", "heads")]
            index = names.index(column) if column in names else None
        elif index is not None and (m := ROW.match(line)):
            values = m[4].split()
            if index < len(values) and values[index] != "n/a":
                rows[int(m[1]), m[2] == "True", int(m[3])] = float(values[index])
    return switches, rows


def table(directory: Path, tag: str = "", column: str = "cuflash") -> str:
    runs = defaultdict(list)  # set -> [(switches, rows)]
    for path in sorted(directory.glob(f"ab{tag}_*_*.txt")):
        parts = path.stem[len(f"ab{tag}_"):].split("_")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            runs[int(parts[0])].append(read(path, column))
    if not runs:
        return f"no ab{tag}_<set>_<round>.txt in {directory}"
    sets = sorted(runs)
    lines = [f"set {i}: {runs[i][0][0]}" for i in sets]
    cells = sorted({cell for i in sets for _, rows in runs[i] for cell in rows})
    lines.append("  d causal seqlen " + "".join(f"{'set ' + str(i):>15}" for i in sets))
    means = {}  # (set, cell) -> mean over the set's rounds
    for cell in cells:
        out = f"{cell[0]:3d} {str(cell[1]):>6} {cell[2]:6d} "
        for i in sets:
            values = [rows[cell] for _, rows in runs[i] if cell in rows]
            if values:
                means[i, cell] = sum(values) / len(values)
            out += f"{means[i, cell]:8.1f}({max(values) - min(values):5.1f})" if values else f"{'-':>15}"
        lines.append(out)
    for i in sets[1:]:
        ratios = [means[i, c] / means[sets[0], c] for c in cells if (i, c) in means and means.get((sets[0], c))]
        if ratios:
            lines.append(f"set {i} / set {sets[0]}: median {statistics.median(ratios):.3f} over {len(ratios)} "
                         f"cell{'s' if len(ratios) > 1 else ''} ({min(ratios):.3f}-{max(ratios):.3f})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--tag", default="")
    ap.add_argument("--column", default="cuflash")
    args = ap.parse_args(argv)
    print(table(args.directory, args.tag, args.column))


if __name__ == "__main__":
    sys.exit(main())

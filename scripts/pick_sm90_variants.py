"""The fastest Hopper forward variant per head dim, from benchmarks/bench_sm90.py's JSON files (one per variant):

    python3 scripts/pick_sm90_variants.py out/sm90_*.json      ->  64:lockstep,128:ws_n128,256:ws

Per head dim, the variant with the highest geometric mean of its TFLOP/s over the cells every variant ran; cells
whose check failed disqualify the variant. The line is what CUFLASH_SM90_VARIANTS takes (cuflash/plan.py); the
per-variant means go to stderr.
"""
import json
import math
import sys
from collections import defaultdict


def main(paths) -> int:
    tflops = defaultdict(dict)  # (d, variant) -> {(causal, seqlen): TFLOP/s}
    bad = set()
    for path in paths:
        for row in json.load(open(path)):
            key = (row["d"], row["variant"])
            if row.get("check_ok") is False:
                bad.add(key)
            if row.get("tflops_sm90"):
                tflops[key][(row["causal"], row["seqlen"])] = row["tflops_sm90"]
    picks = []
    for d in sorted({d for d, _ in tflops}):
        variants = {v: cells for (dd, v), cells in tflops.items() if dd == d and (dd, v) not in bad}
        if not variants:
            continue
        common = set.intersection(*(set(c) for c in variants.values()))
        means = {v: math.exp(sum(math.log(c[k]) for k in common) / len(common)) for v, c in variants.items()}
        for v, m in sorted(means.items(), key=lambda x: -x[1]):
            print(f"d {d}: {v:14s} geomean {m:6.1f} TFLOP/s over {len(common)} cells", file=sys.stderr)
        picks.append(f"{d}:{max(means, key=means.get)}")
    print(",".join(picks))
    return 0 if picks else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

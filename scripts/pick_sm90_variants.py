"""The fastest Hopper forward variant per head dim, from benchmarks/bench_sm90.py's JSON files (one per variant):

    python3 scripts/pick_sm90_variants.py out/sm90_*.json      ->  64:lockstep,128:ws_n128,256:ws

Per head dim, the variant with the highest geometric mean of its TFLOP/s over the cells every variant ran longer than
SHORT_SEQLEN (all cells if none is); cells whose check failed disqualify the variant. The line is what
CUFLASH_SM90_VARIANTS takes (cuflash/ops/forward.py); the per-variant means go to stderr, with the best variants per
(head dim, causal) over the short cells (forward.SM90_SHORT_VARIANTS' form).
"""
import json
import math
import sys
from collections import defaultdict


SHORT_SEQLEN = 2048  # the head dim's own variant: from cells past it (at most forward.SM90_SHORT_SEQLEN)


def geomeans(variants: dict, keep) -> tuple[dict, int]:
    """Geometric mean per variant over the cells every variant ran that `keep` accepts (and how many)."""
    common = [k for k in set.intersection(*(set(c) for c in variants.values())) if keep(k)]
    if not common:
        return {}, 0
    return {v: math.exp(sum(math.log(c[k]) for k in common) / len(common)) for v, c in variants.items()}, len(common)


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
    picks, short = [], []
    for d in sorted({d for d, _ in tflops}):
        variants = {v: cells for (dd, v), cells in tflops.items() if dd == d and (dd, v) not in bad}
        if not variants:
            continue
        # the head dim's variant: over the cells longer than SHORT_SEQLEN where the sweep has some, else all
        means, n = geomeans(variants, lambda k: k[1] > SHORT_SEQLEN)
        if not n:
            means, n = geomeans(variants, lambda k: True)
        for v, m in sorted(means.items(), key=lambda x: -x[1]):
            print(f"d {d}: {v:14s} geomean {m:6.1f} TFLOP/s over {n} cells", file=sys.stderr)
        picks.append(f"{d}:{max(means, key=means.get)}")
        for causal in (False, True):  # short sequences, per masking (cuflash.ops.forward.SM90_SHORT_VARIANTS)
            means, n = geomeans(variants, lambda k: k[0] == causal and k[1] <= SHORT_SEQLEN)
            if n:
                ranked = sorted(means.items(), key=lambda x: -x[1])
                print(f"d {d} causal {causal} seqlen <= {SHORT_SEQLEN}: " +
                      ", ".join(f"{v} {m:.1f}" for v, m in ranked[:4]) + f" (over {n} cells)", file=sys.stderr)
                short.append(f"({d}, {causal}): {ranked[0][0]!r}")
    if short:
        print("short-sequence picks (forward.SM90_SHORT_VARIANTS form): {" + ", ".join(short) + "}", file=sys.stderr)
    print(",".join(picks))
    return 0 if picks else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env bash
# Session 27's fourth call (about 6 minutes), from the repository root, on main's kernels (f042e47's, whose whole suite
# passed in call 1): the forward bench beside the peers with each cell's times the median over three placements
# (bench_attention.py --placements, its default now), then the backward's            -> bench_fwd.txt, bench_bwd.txt
source scripts/device_env.sh
for op in fwd bwd; do
    timeout -k 5 "${LANDING_BENCH_TIMEOUT:-300}" python3 benchmarks/bench_attention.py --op $op \
        --json "$OUT/bench_$op.json" >"$OUT/bench_$op.txt" 2>&1
    echo "bench $op: exit $? [$((SECONDS - t0))s]"
    awk '/^===/{p=1} p' "$OUT/bench_$op.txt"
done
cd "$OUT" && tar czf logs.tgz ./*.txt ./*.json 2>/dev/null; rm -f ./*.txt ./*.json

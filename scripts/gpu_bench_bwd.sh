#!/usr/bin/env bash
# The backward's benchmark alone beside the peers (about 2 minutes), from the repository root, for a planner change
# after a landing call on the same kernels: every kernel compiled ahead, then bench_attention.py --op bwd
#                                                                                  -> pre.log, bench_bwd.txt
source scripts/device_env.sh
precompile_hopper
timeout -k 5 200 python3 benchmarks/bench_attention.py --op bwd >"$OUT/bench_bwd.txt" 2>&1
echo "bench bwd: exit $? [$((SECONDS - t0))s]"
awk '/^===/{p=1} p' "$OUT/bench_bwd.txt"

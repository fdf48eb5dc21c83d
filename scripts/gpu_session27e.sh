#!/usr/bin/env bash
# Session 27's fifth call (about 3 minutes), from the repository root, on main's kernels (f042e47's): the forward bench
# beside the peers again (medians over three placements), to see whether call 4's table repeats, then the placement
# probe's eight trials of the closest cell, d 64 non-causal 512                    -> bench_fwd.txt, probe.txt
source scripts/device_env.sh
timeout -k 5 300 python3 benchmarks/bench_attention.py --op fwd >"$OUT/bench_fwd.txt" 2>&1
echo "bench fwd: exit $? [$((SECONDS - t0))s]"
awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
timeout -k 5 120 python3 scripts/placement_probe.py --cells 64:0:512:32:32 --trials 8 >"$OUT/probe.txt" 2>&1
echo "probe: exit $? [$((SECONDS - t0))s]"
cat "$OUT/probe.txt"
cd "$OUT" && tar czf logs.tgz ./*.txt 2>/dev/null; rm -f ./*.txt

#!/usr/bin/env bash
# Session 26's fourth call (about 3 minutes), from the repository root, on main's kernels (session 25's): does a
# cell's speed depend on where its tensors lie (scripts/placement_probe.py: fresh tensors behind a pad of random
# size, eight trials per cell, cuflash and SDPA's cuDNN), then the forward bench beside the peers  -> logs.tgz
source scripts/device_env.sh
timeout -k 5 200 python3 scripts/placement_probe.py --trials 8 >"$OUT/placement.txt" 2>&1
echo "placement: exit $? [$((SECONDS - t0))s]"
grep -v "Deprecat\|_warn_once\|UserWarning\|stream = " "$OUT/placement.txt"
timeout -k 5 200 python3 benchmarks/bench_attention.py --op fwd >"$OUT/bench_fwd.txt" 2>&1
echo "bench fwd: exit $? [$((SECONDS - t0))s]"
awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
cd "$OUT" && tar czf logs.tgz ./*.txt 2>/dev/null; rm -f ./*.txt

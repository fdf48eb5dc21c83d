#!/usr/bin/env bash
# Session 23's third call (about 5 minutes), from the repository root, after the first (scripts/gpu_bwd_landing_ab.sh:
# whole suite, sanitizers, bench on the tree's kernels) and plan.BWD_SM90_DET's per-head-dim threshold, with three
# timing-only copies of the tree's FIXED kernel as untracked files (values wrong; made by the sed lines in
# docs/bench/bwd_session23.txt): _nocvt (the int32 stores as fp32 bits: no cvt), _noscale (a constant scale: no
# per-row scale fetched or read), _bare (both)
#
#   1. tests/gpu/test_backward.py in 4 shards (the planner's new threshold)                      -> shard_*.log
#   2. bench_attention.py --op bwd beside SDPA's flash and cuDNN backends ("auto" with the new threshold) -> bench_bwd.txt
#   3. A/B, two rounds, d 64, fixed point forced: the tree's kernel file and the three copies -> ab_<set>_<round>.txt
source scripts/device_env.sh
source_switch bwd
precompile_hopper
run_gpu_tests_parallel 300 4 test_backward
timeout -k 5 200 python3 benchmarks/bench_attention.py --op bwd >"$OUT/bench_bwd.txt" 2>&1
echo "bench bwd: exit $? [$((SECONDS - t0))s]"
awk '/^===/{p=1} p' "$OUT/bench_bwd.txt"
fixed_variants_ab bwd_sm90.cu bwd_sm90_nocvt.cu bwd_sm90_noscale.cu bwd_sm90_bare.cu
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

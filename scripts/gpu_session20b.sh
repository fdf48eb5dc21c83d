#!/usr/bin/env bash
# Session 20's second call (about 8 minutes), from the repository root:
#
#     OUT=... bash scripts/gpu_session20b.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case
#   2. bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                            -> bench_fwd.txt
#   3. A/B at d 64, ROUNDS (3) rounds, cuflash only: the kernels before half diagonal blocks (a copy of them in
#      cuda_src/base/, untracked: set 0) against the tree's (set 1)                               -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu" ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --seqlens 512,1024,2048,4096" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 19's second kernel call (about 8 minutes), from the repository root, with main's HEAD kernels copied to
# cuda_src/base/ (untracked, so they travel):
#
#     mkdir -p cuda_src/base && for f in $(git ls-files cuda_src | grep -v /base/); do
#         git show HEAD:$f > cuda_src/base/${f#cuda_src/}; done
#     OUT=... bash scripts/gpu_session19b.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case
#   2. bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                            -> bench_fwd.txt
#   3. A/B, ROUNDS (3) rounds, d 64 and 128, cuflash only: HEAD's kernels (set 0), the tree's (set 1), the tree's with
#      d 64's short table on pingpong_n128_p (set 2)                                             -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
short128="128@512:pingpong_n128_p_s2,128@2048:pingpong_n128_s2,128c@1024:pingpong_n128_p_s2"
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu;\
CUFLASH_SM90_SHORT_VARIANTS=64:pingpong_n128_p,64c:pingpong_n128_p,$short128" ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

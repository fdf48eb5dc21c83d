#!/usr/bin/env bash
# Session 20's first call (about 8 minutes), from the repository root:
#
#     OUT=... bash scripts/gpu_session20.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case
#   2. bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                            -> bench_fwd.txt
#   3. A/B on the causal cells, ROUNDS (3) rounds, cuflash only: the kernels before the diagonal mask (a copy of
#      them in cuda_src/base/, untracked: set 0) against the tree's (set 1)                       -> ab_<set>_<round>.txt
#   4. d 128 at 4k keys: the table (set 0) against pingpong_n128_p_s2 up to 4k keys (set 1)      -> ab_4k_<set>_<round>
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu" ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --causal true --seqlens 512,1024,2048,4096" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
table="64@512:ws_n128_p,64:ws3_n128_p,64c@2048:ws_n128_p,64c:ws3_n128_p"
AB="CUFLASH_SM90_SHORT_VARIANTS=$table,128@2048:pingpong_n128_p_s2,128c@2048:pingpong_n128_p_s2;\
CUFLASH_SM90_SHORT_VARIANTS=$table,128:pingpong_n128_p_s2,128c:pingpong_n128_p_s2" AB_TAG=_4k ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 128 --seqlens 4096" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _4k
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 20's first call (about 6 minutes), from the repository root, with the parent's kernels in cuda_src/base/:
#
#     OUT=... bash scripts/gpu_session20.sh
#
#   1-3. scripts/gpu_landing_ab.sh: the whole suite, the sanitizers, the peers; A/B on the causal cells up to 4k keys,
#        the kernels before the diagonal mask (set 0) against the tree's (set 1)              -> ab_<set>_<round>.txt
#   4. d 128 at 4k keys: the table (set 0) against pingpong_n128_p_s2 up to 4k keys (set 1)      -> ab_4k_<set>_<round>
# Logs in $OUT/logs.tgz.
NO_TAR=1 AB_BENCH_ARGS="--causal true --seqlens 512,1024,2048,4096" bash scripts/gpu_landing_ab.sh
source scripts/device_env.sh
table="64@512:ws_n128_p,64:ws3_n128_p,64c@2048:ws_n128_p,64c:ws3_n128_p"
AB="CUFLASH_SM90_SHORT_VARIANTS=$table,128@2048:pingpong_n128_p_s2,128c@2048:pingpong_n128_p_s2;\
CUFLASH_SM90_SHORT_VARIANTS=$table,128:pingpong_n128_p_s2,128c:pingpong_n128_p_s2" AB_TAG=_4k ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 128 --seqlens 4096" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _4k
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

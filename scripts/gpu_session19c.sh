#!/usr/bin/env bash
# Session 19's third kernel call (about 6 minutes), from the repository root:
#
#     OUT=... bash scripts/gpu_session19c.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case
#   2. bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                            -> bench_fwd.txt
#   3. A/B on the causal cells, ROUNDS (3) rounds, cuflash only: the pair-by-pair walk (CUFLASH_SM90_WALK_CHUNK=1,
#      set 0), the chunked walk (set 1), the chunked walk with pingpong_n128_p for d 64 causal up to 1k keys (set 2)
#                                                                                                -> ab_<set>_<round>.txt
#   4. d 128 non-causal 512-2k: the table (set 0) against pingpong_n128_p_s2 up to 1k keys (set 1) -> ab_nc_*
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench fwd
table="64@512:ws_n128_p,64:ws3_n128_p,64c@1024:pingpong_n128_p,64c@2048:ws_n128_p,64c:ws3_n128_p"
table="$table,128@512:pingpong_n128_p_s2,128@2048:pingpong_n128_s2,128c@1024:pingpong_n128_p_s2"
AB="CUFLASH_SM90_WALK_CHUNK=1;CUFLASH_SM90_WALK_CHUNK=0;CUFLASH_SM90_SHORT_VARIANTS=$table" ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --causal true" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
# 4. d 128 non-causal 512-2k: the table against pingpong_n128_p_s2 up to 1k keys      -> ab_nc_<set>_<round>.txt
table="64@512:ws_n128_p,64:ws3_n128_p,64c@2048:ws_n128_p,64c:ws3_n128_p"
table="$table,128@1024:pingpong_n128_p_s2,128@2048:pingpong_n128_s2,128c@1024:pingpong_n128_p_s2"
AB="CUFLASH_SM90_WALK_CHUNK=0;CUFLASH_SM90_SHORT_VARIANTS=$table" AB_TAG=_nc ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --causal false --dims 128 --seqlens 512,1024,2048" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _nc
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

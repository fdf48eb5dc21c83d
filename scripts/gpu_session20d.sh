#!/usr/bin/env bash
# Session 20's fourth call (about 3 minutes), from the repository root:
#
#     OUT=... bash scripts/gpu_session20d.sh
#
#   1. Nsight Compute's source page on the main kernel of d 64 at 512 keys, causal and not (gpu_source_profile.sh)
#                                                                                   -> src_<name>.csv, ncu_<name>.txt
#   2. A/B on d 64 up to 2k keys, three rounds: the short table (set 0) against pingpong_n128_p for d 64 non-causal 512
#      and causal up to 2k (set 1)                                                           -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
table="64:ws3_n128_p,64c:ws3_n128_p,128@2048:pingpong_n128_p_s2,128c:pingpong_n128_p_s2"
PROFILE_CASES="d64_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512;\
d64c_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512 --causal" \
AB="CUFLASH_SM90_SHORT_VARIANTS=64@512:ws_n128_p,64c@2048:ws_n128_p,$table;\
CUFLASH_SM90_SHORT_VARIANTS=64@512:pingpong_n128_p,64c@2048:pingpong_n128_p,$table" \
AB_BENCH_ARGS="--dims 64 --seqlens 512,1024,2048 --impls cuflash" bash scripts/gpu_source_profile.sh

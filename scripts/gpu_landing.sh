#!/usr/bin/env bash
# The landing call of a kernel or planner change (about 7 minutes), from the repository root:
#
#     OUT=... bash scripts/gpu_landing.sh
#
#   1. every kernel compiled ahead (precompile.py --hopper)                                               -> pre.log
#   2. the whole GPU suite (FILES: test files of tests/gpu, default all) in 8 shards                  -> shard_I.log
#   3. if it passed: memcheck and racecheck over every case of scripts/sanitize_cases.py (SANITIZE_ONLY narrows them)
#                                                                                 -> all_memcheck.log, all_racecheck.log
#   4. bench_attention.py --op fwd, then --op bwd, beside SDPA's flash and cuDNN backends (SKIP_BWD_BENCH=1: forward
#      only)                                                                              -> bench_fwd.txt, bench_bwd.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench "fwd$([ "${SKIP_BWD_BENCH:-0}" = 1 ] || echo ' bwd')"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

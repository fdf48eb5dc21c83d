#!/usr/bin/env bash
# Session 19, first device call (about 5 minutes), from the repository root with drafts/session18-ws3-n64-overlap.patch
# applied:
#   1. test_sm90 in 8 shards (every variant, ws3_p among them)
#   2. memcheck and racecheck over the sm90_ws3_p sanitizer cases
#   3. A/B of d 64's table against ws3_p at every length (three rounds, forward, cuflash only) -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
precompile_hopper
run_gpu_suite test_sm90
sanitize_both sm90 100 -- --only sm90_ws3_p
AB="CUFLASH_SM90_VARIANTS=;CUFLASH_SM90_VARIANTS=64:ws3_p" ROUNDS=3 \
    BENCH="benchmarks/bench_attention.py --op fwd --dims 64 --impls cuflash" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

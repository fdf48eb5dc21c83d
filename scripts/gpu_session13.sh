#!/usr/bin/env bash
# Session 13's landing call, from the repository root (OUT=... bash scripts/gpu_session13.sh):
#   1. every kernel compiled ahead (precompile.py: portable and Hopper)
#   2. the GPU test files in FILES (default: test_sm90, test_forward, test_varlen, test_torch, test_jax) in SHARDS
#      (8) processes at once (run_gpu_tests_parallel)
#   3. the Hopper forward's sanitizer cases (sm90_: every variant), memcheck and racecheck
#   4. bench_attention.py --op fwd on the ANCHORS grid beside SDPA's flash and cuDNN backends    -> bench_fwd.txt
# Logs in $OUT/logs.tgz. SKIP_SANITIZE=1 and SKIP_BENCH=1 leave steps out.
source scripts/device_env.sh
timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/pre.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/pre.log")"
run_gpu_tests_parallel "${TESTS_TIMEOUT:-400}" "${SHARDS:-8}" ${FILES:-test_sm90 test_forward test_varlen test_torch test_jax}
[ "${SKIP_SANITIZE:-0}" = 1 ] || sanitize_both sm90 "${SANITIZE_TIMEOUT:-150}" -- --only sm90_
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    timeout -k 5 150 python3 benchmarks/bench_attention.py --op fwd ${BENCH_ARGS:-} >"$OUT/bench_fwd.txt" 2>&1
    echo "bench: exit $? [$((SECONDS - t0))s]"
    awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
fi
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

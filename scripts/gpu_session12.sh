#!/usr/bin/env bash
# Session 12's device calls, from the repository root (OUT=... bash scripts/gpu_session12.sh):
#   1. the Hopper forward compiled ahead, then tests/gpu/test_sm90.py filtered by TESTS_K (default: the epilogue
#      and persistent tests; "" runs the whole file) and the GPU test files in MORE_TESTS
#   2. an A/B of the forward on bench_attention.py --op fwd over AB's switch sets (gpu_ab.sh; BENCH_ARGS, default
#      the short cells 512-2k at d 64 and 128, cuflash alone)
#   3. the Hopper forward's sanitizer cases (sm90_: every variant), memcheck and racecheck
# Logs and A/B tables in $OUT/logs.tgz.
# SKIP_SANITIZE=1, SKIP_TESTS=1 and an empty AB leave steps out. FWD_SOURCE_AB=1 makes the forward's kernel file a
# switch, CUFLASH_FWD_SM90_SOURCE (patched into hopper.py on the device), so that a copy of main's fwd_sm90.cu
# (cuda_src/fwd_sm90_main.cu, untracked) can be a set of its own beside a draft applied to fwd_sm90.cu.
source scripts/device_env.sh
precompile_hopper  # (FWD_SOURCE_AB=1: the kernel file as a switch first)
[ "${SKIP_TESTS:-0}" = 1 ] || run_gpu_tests "${TESTS_TIMEOUT:-300}" "test_sm90:${TESTS_K-epilogue or persistent}"
run_gpu_tests "${TESTS_TIMEOUT:-300}" ${MORE_TESTS:-}
if [ -n "${AB:-}" ]; then
    AB="$AB" ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=${BENCH_TIMEOUT:-110} \
        BENCH="benchmarks/bench_attention.py --op fwd ${BENCH_ARGS:---seqlens 512,1024,2048 --impls cuflash}" \
        bash scripts/gpu_ab.sh
    for f in "$OUT"/ab_*; do head -1 "$f"; awk '/^=== cuflash/{p=1} p' "$f"; done
fi
[ "${SKIP_SANITIZE:-0}" = 1 ] || sanitize_both sm90 "${SANITIZE_TIMEOUT:-150}" -- --only sm90_
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./ab_*.txt

#!/usr/bin/env bash
# Session 11's device calls, from the repository root (OUT=... bash scripts/gpu_session11.sh):
#   1. the Hopper backward's tests (TESTS, default test_backward; then MORE_TESTS, e.g. "test_varlen test_kvcache
#      -k paged"), its sanitizer cases (bwd: atomic and deterministic)                          -> *.log in logs.tgz
#   2. an A/B of the backward on bench_attention.py --op bwd --impls cuflash,cuflash_det over AB's switch sets
#      (gpu_ab.sh; BWD_SOURCE_AB=1 adds main's copy of bwd_sm90.cu, cuda_src/bwd_sm90_main.cu, as a set of its own
#      through a CUFLASH_BWD_SM90_SOURCE switch patched into hopper.py on the device)
# Call 1 of the session ran test_kvcache and the kvcache sanitizers, test_backward, and the A/B of main's kernel
# against the snake slot order with deterministic mode's wait once per key block (docs/bench/bwd_det_session11.txt).
source scripts/device_env.sh
precompile_and_test bwd tests/gpu/test_backward.py "$OUT/bwd.log" "${TESTS_TIMEOUT:-240}"
run_gpu_tests "${TESTS_TIMEOUT:-240}" ${MORE_TESTS:-}
sanitize_both bwd "${SANITIZE_TIMEOUT:-90}" -- --only bwd
if [ "${BWD_SOURCE_AB:-0}" = 1 ]; then
    sed -i 's/    source = "bwd_sm90.cu"/    source = __import__("os").environ.get("CUFLASH_BWD_SM90_SOURCE", "bwd_sm90.cu")/' \
        cuflash/hopper.py
fi
AB="${AB:?AB: switch sets}" ROUNDS=${ROUNDS:-1} BENCH_TIMEOUT=${BENCH_TIMEOUT:-110} \
    BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash,cuflash_det ${BENCH_ARGS:---seqlens 1024,4096,16384}" \
    bash scripts/gpu_ab.sh
for f in "$OUT"/ab_*; do head -1 "$f"; awk '/^=== cuflash/{p=1} p' "$f"; done
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt && rm -f ./*.log ./ab_*.txt

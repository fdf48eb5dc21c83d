#!/usr/bin/env bash
# Second half of a full device check (the first is scripts/gpu_check.sh with SKIP_BENCH=1): the tests that a
# late Python-layer change touches, then every benchmark and the framework examples, each step with a timeout.
#     OUT=... bash scripts/gpu_bench_all.sh
# Files in $OUT: tests.log, decode.txt, decode.json, bench.txt, bench.json, frameworks_examples.log, overhead.json
source scripts/device_env.sh
quiet() { grep -v "driver.pyx\|NoneType\|Exception ignored\|^Traceback\|DeprecationWarning\|sys.exit(main())"; }
timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu} 2>&1 | quiet > "$OUT/tests.log"
echo "tests: $(tail -1 "$OUT/tests.log") [$((SECONDS - t0))s]"
timeout "${DECODE_TIMEOUT:-110}" python3 benchmarks/bench_decode.py --json "$OUT/decode.json" 2>&1 | quiet > "$OUT/decode.txt"
echo "decode bench [$((SECONDS - t0))s]"; cat "$OUT/decode.txt"
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_attention.py --op all ${BENCH_ARGS:---quick} \
    --json "$OUT/bench.json" 2>&1 | quiet > "$OUT/bench.txt"
echo "attention bench [$((SECONDS - t0))s]"; grep -A30 "^=== " "$OUT/bench.txt" | head -40
timeout "${VARLEN_TIMEOUT:-90}" python3 benchmarks/bench_varlen.py --bwd ${VARLEN_ARGS:---quick} \
    --json "$OUT/bench.json" --append 2>&1 | quiet | tee -a "$OUT/bench.txt" | tail -30
echo "varlen bench [$((SECONDS - t0))s]"
SKIP_TESTS=1 SKIP_PRECOMPILE=1 timeout "${FRAMEWORKS_TIMEOUT:-150}" bash scripts/gpu_frameworks.sh 2>&1 | quiet | tail -25
rm -f "$OUT/frameworks_tests.log"
echo "done [$((SECONDS - t0))s]"

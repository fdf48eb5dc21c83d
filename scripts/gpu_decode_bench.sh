#!/usr/bin/env bash
# The decode benchmark alone, then (if SM90_TESTS=1) tests/gpu/test_sm90.py, in one device call from the repository
# root:
#
#     OUT=... bash scripts/gpu_decode_bench.sh
#
#   1. decode kernels compiled ahead (scripts/precompile.py --pattern decode)                       -> decode.log
#   2. benchmarks/bench_decode.py (three measurements per cell and implementation, the least counts) -> decode.txt
#   3. if SM90_TESTS=1: every Hopper forward kernel compiled ahead, then tests/gpu/test_sm90.py under
#      SM90_TIMEOUT (200) seconds                                                                    -> sm90.log
source scripts/device_env.sh
timeout -k 5 120 python3 scripts/precompile.py --pattern decode --workers 16 >"$OUT/decode.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/decode.log")"
timeout -k 5 200 python3 benchmarks/bench_decode.py --json "$OUT/decode.json" >"$OUT/decode.txt" 2>&1
echo "decode bench: exit $? [$((SECONDS - t0))s]"
grep -v "Deprecat\|stream = \|sys.exit" "$OUT/decode.txt"
if [ "${SM90_TESTS:-0}" = 1 ]; then
    timeout -k 5 150 python3 scripts/precompile.py --hopper --pattern fwd_sm90 --workers 16 >"$OUT/sm90.log" 2>&1
    echo "precompile (Hopper forward): exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/sm90.log")"
    timeout -k 5 "${SM90_TIMEOUT:-200}" python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_sm90.py \
        >>"$OUT/sm90.log" 2>&1
    echo "test_sm90: exit $? [$((SECONDS - t0))s] $(grep -E 'passed|failed' "$OUT/sm90.log" | tail -1)"
    grep -E "^FAILED|^ERROR" "$OUT/sm90.log" | head -5
fi
echo "done [$((SECONDS - t0))s]"

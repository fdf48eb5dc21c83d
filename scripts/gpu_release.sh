#!/usr/bin/env bash
# The check that lands a change of the planner's defaults, in one device call from the repository root:
#
#     OUT=... bash scripts/gpu_release.sh
#
#   1. every portable and Hopper kernel compiled ahead, 16 processes (scripts/precompile.py --hopper) -> pre.log
#   2. scripts/sm90_sweep.sh: benchmarks/bench_sm90.py for each Hopper variant (cuflash.hopper.VARIANTS) at d 64,
#      128, 256; then scripts/pick_sm90_variants.py picks the fastest per head dim, exported as
#      CUFLASH_SM90_VARIANTS so that everything after runs with the planner choosing it          -> bench.txt
#   3. scripts/gpu_check.sh without its benchmark: the full GPU suite (one process per file; test_sm90 too unless
#      SKIP_SM90_TESTS=1, when an earlier call of the same kernels ran it), memcheck, racecheck
#                                                      -> env.txt, pytest_gpu.log, memcheck.log, racecheck.log
#      then memcheck and racecheck of the backward cases on the portable kernel (CUFLASH_BWD_SM90=0)
#                                                             -> portable_bwd_memcheck.log, portable_bwd_racecheck.log
#   4. bench_attention.py --op fwd on the ANCHORS grid (the planner's choice: the Hopper kernel on sm_90a), then
#      --op bwd --quick                                                                       -> bench.txt
#   5. benchmarks/bench_decode.py, the decode grid beside SDPA flash and cudnn (SKIP_DECODE_BENCH=1 skips it)
#                                                                                   -> decode.txt, decode.json
# Environment: OUT, SM90_VARIANTS (skip 2's benchmark and use these, e.g. "64:lockstep,128:ws,256:ws", at every
# length; "default": the planner's own tables, short sequences included),
# SM90_BENCH_DIMS (64,128,256; head dims left out keep plan.SM90_DEFAULT_VARIANTS), SKIP_SM90_TESTS=1,
# SKIP_BWD_BENCH=1, SKIP_DECODE_BENCH=1, BWD_BENCH_ARGS (--quick; '' benches the ANCHORS grid), BWD_BENCH_TIMEOUT (100),
# TESTS_TIMEOUT (300), SANITIZE_TIMEOUT (90).
source scripts/device_env.sh
timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/pre.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/pre.log")"
: >"$OUT/bench.txt"
if [ -z "${SM90_VARIANTS:-}" ]; then
    SM90_VARIANTS=$(bash scripts/sm90_sweep.sh "${SM90_BENCH_DIMS:-64,128,256}" "$OUT/bench.txt")
fi
if [ "$SM90_VARIANTS" = default ]; then  # the planner's own tables (plan.SM90_DEFAULT_VARIANTS, short sequences)
    echo "CUFLASH_SM90_VARIANTS unset: the planner's tables" | tee -a "$OUT/bench.txt"
else
    export CUFLASH_SM90_VARIANTS=$SM90_VARIANTS
    echo "CUFLASH_SM90_VARIANTS=$CUFLASH_SM90_VARIANTS" | tee -a "$OUT/bench.txt"
fi
ignore=""
[ "${SKIP_SM90_TESTS:-0}" = 1 ] && ignore="--ignore=tests/gpu/test_sm90.py"
SKIP_BENCH=1 PER_FILE=1 TESTS_TIMEOUT=${TESTS_TIMEOUT:-300} SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-90} \
    PYTEST_ARGS="$ignore" bash scripts/gpu_check.sh 2>&1 | sed -n '/gpu_check summary/,$p'
grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -20
echo "check [$((SECONDS - t0))s]"
# On sm_90a the planner sends d 64/128 backward to the Hopper kernel: the portable one's backward cases once more
sanitize_both portable_bwd "${SANITIZE_TIMEOUT:-90}" CUFLASH_BWD_SM90=0 -- --only bwd_
timeout -k 5 150 python3 benchmarks/bench_attention.py --op fwd >>"$OUT/bench.txt" 2>&1
echo "forward bench: exit $? [$((SECONDS - t0))s]"
if [ "${SKIP_BWD_BENCH:-0}" != 1 ]; then
    timeout -k 5 "${BWD_BENCH_TIMEOUT:-100}" python3 benchmarks/bench_attention.py --op bwd ${BWD_BENCH_ARGS---quick} \
        >>"$OUT/bench.txt" 2>&1
    echo "backward bench: exit $? [$((SECONDS - t0))s]"
fi
if [ "${SKIP_DECODE_BENCH:-0}" != 1 ]; then
    timeout -k 5 150 python3 benchmarks/bench_decode.py --json "$OUT/decode.json" >"$OUT/decode.txt" 2>&1
    echo "decode bench: exit $? [$((SECONDS - t0))s]"
    grep -v "Deprecat\|stream = \|sys.exit" "$OUT/decode.txt"
fi
awk '/^=== cuflash/{p=1} /^$/{if (p) print ""; p=0} p' "$OUT/bench.txt"
echo "done [$((SECONDS - t0))s]"

#!/usr/bin/env bash
# The ordered deterministic mode of the Hopper backward (CUFLASH_BWD_SM90_DET=ordered: one dQ buffer, each key
# block adding in its turn) checked and measured in one device call, from the repository root:
#
#     OUT=... bash scripts/gpu_bwd_ordered.sh
#
#   1. the backward compiled ahead, then tests/gpu/test_backward.py with
#      CUFLASH_BWD_SM90_DET=ordered: every deterministic test runs the new mode             -> bwd_ordered.log
#   2. memcheck and racecheck of the backward's sanitize cases in that mode    -> ordered_memcheck.log, ..._racecheck.log
#   3. bench_attention.py --op bwd, ordered mode (beside atomic and SDPA flash), then the slices mode's
#      deterministic column for the A/B                                      -> bench_ordered.txt, bench_slices.txt
# A wait that never ends (a turn never given) shows as a timeout. Environment: OUT, TESTS_TIMEOUT (200),
# SANITIZE_TIMEOUT (60), BENCH_TIMEOUT (150), BENCH_ARGS (the ANCHORS grid).
source scripts/device_env.sh
export CUFLASH_BWD_SM90_DET=ordered
precompile_and_test bwd tests/gpu/test_backward.py "$OUT/bwd_ordered.log" "${TESTS_TIMEOUT:-200}"
sanitize_both ordered "${SANITIZE_TIMEOUT:-60}" -- --only bwd
for mode in ordered slices; do
    impls=cuflash,cuflash_det,flash
    [ "$mode" = slices ] && impls=cuflash,cuflash_det
    CUFLASH_BWD_SM90_DET=$mode timeout -k 5 "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_attention.py --op bwd \
        --impls "$impls" ${BENCH_ARGS:-} >"$OUT/bench_$mode.txt" 2>&1
    echo "bench $mode: exit $? [$((SECONDS - t0))s]"
    awk '/^=== cuflash/{p=1} /^$/{if (p) print ""; p=0} p' "$OUT/bench_$mode.txt"
done
echo "done [$((SECONDS - t0))s]"

#!/usr/bin/env bash
# The kernels written without a GPU, checked in one device call from the repository root:
#
#     OUT=... bash scripts/gpu_drafts.sh
#
#   1. every portable and Hopper kernel compiled ahead, 16 processes (scripts/precompile.py --hopper) -> sm90.log
#   2. tests/gpu/test_sm90.py -k SM90_K (default: the selftests and the variants added in session 4) if
#      SKIP_SM90_TESTS=0                                                                              -> sm90.log
#   3. tests/gpu/test_backward.py -k sm90: the Hopper backward, with 64 and with 128 query rows per step at d = 64
#      (the sm90_backward fixture's two parameters)                                               -> bwd_sm90.log
#   4. memcheck and racecheck of scripts/sanitize_cases.py with every planner switch on, 128 query rows per step
#      in the Hopper backward at d = 64 (the Hopper variants' own cases run regardless on sm_90a)
#                                                                           -> optin_memcheck.log, optin_racecheck.log
#   5. if 3 passed, the backward bench (BWD_BENCH_ARGS, default --quick) under each of BWD_AB_SWITCHES (default:
#      the Hopper backward with 64, then 128 query rows per step at d = 64)                        -> bench.txt
#   6. if SWEEP_DIMS is set (e.g. 64,128): scripts/sm90_sweep.sh, every Hopper forward variant at those head dims,
#      and the fastest per head dim                                                               -> bench.txt
#   7. if PROFILE=1: benchmarks/profile_kernels.py, kernel time against launch gaps per call (torch.profiler): decode
#      at batch 1 x 8k and batch 8 x 1k (with SDPA cuDNN), the backward at batch 4 x 4k, 16 heads, d 128 -> profile.txt
# Each step has a timeout (a kernel that deadlocks on an mbarrier must not eat the call); -x stops a test file at its
# first failure. Environment: OUT, SKIP_SM90_TESTS (1), SM90_K, SWEEP_DIMS, BWD_AB_SWITCHES, BWD_BENCH_ARGS,
# PROFILE (0), SM90_TIMEOUT (300), BWD_TIMEOUT (150), SANITIZE_TIMEOUT (120), BWD_BENCH_TIMEOUT (120).
source scripts/device_env.sh
timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/sm90.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/sm90.log")"
if [ "${SKIP_SM90_TESTS:-1}" != 1 ]; then
    timeout -k 5 "${SM90_TIMEOUT:-300}" python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/gpu/test_sm90.py \
        -k "${SM90_K:-numpy or ws3_n128 or ws_n128_p or lockstep_n128 or persistent}" >>"$OUT/sm90.log" 2>&1
    echo "test_sm90: exit $? [$((SECONDS - t0))s] $(grep -E 'passed|failed' "$OUT/sm90.log" | tail -1)"
    grep -E "^FAILED|^ERROR" "$OUT/sm90.log" | head -5
fi
timeout -k 5 "${BWD_TIMEOUT:-150}" python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/gpu/test_backward.py \
    -k sm90 >"$OUT/bwd_sm90.log" 2>&1
bwd=$?
echo "test_backward -k sm90: exit $bwd [$((SECONDS - t0))s] $(grep -E 'passed|failed' "$OUT/bwd_sm90.log" | tail -1)"
grep -E "^FAILED|^E  " "$OUT/bwd_sm90.log" | head -8
sanitize_both optin "${SANITIZE_TIMEOUT:-120}" CUFLASH_SM90=1 CUFLASH_BWD_QBUF=1 CUFLASH_BWD_WIDE=1 \
    CUFLASH_BWD_SM90=1 CUFLASH_BWD_SM90_BLOCK_M=64:128
if [ "$bwd" = 0 ]; then
    : >"$OUT/bench.txt"
    for switch in ${BWD_AB_SWITCHES:-CUFLASH_BWD_SM90_BLOCK_M=64:64 CUFLASH_BWD_SM90_BLOCK_M=64:128}; do
        env "$switch" timeout -k 5 "${BWD_BENCH_TIMEOUT:-120}" python3 benchmarks/bench_attention.py --op bwd \
            ${BWD_BENCH_ARGS---quick} >>"$OUT/bench.txt" 2>&1
        echo "backward bench ($switch): exit $? [$((SECONDS - t0))s]"
    done
    grep -A30 "^=== cuflash Backward" "$OUT/bench.txt" | grep -v "^\[" 
fi
if [ -n "${SWEEP_DIMS:-}" ]; then
    echo "sweep pick: $(bash scripts/sm90_sweep.sh "$SWEEP_DIMS" "$OUT/bench.txt") [$((SECONDS - t0))s]"
fi
if [ "${PROFILE:-0}" = 1 ]; then
    : >"$OUT/profile.txt"
    for prof_args in "--op decode --batch 1 --seqlen 8192" "--op decode --batch 8 --seqlen 1024" \
                     "--op bwd --batch 4 --seqlen 4096 --heads 16 --headdim 128"; do
        timeout -k 5 120 python3 benchmarks/profile_kernels.py $prof_args >>"$OUT/profile.txt" 2>&1
        echo "profile_kernels $prof_args: exit $? [$((SECONDS - t0))s]"
    done
fi
echo "done [$((SECONDS - t0))s]"

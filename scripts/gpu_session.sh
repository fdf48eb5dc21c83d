#!/usr/bin/env bash
# One device call that checks everything a session touched, from the repository root:
#
#     OUT=... bash scripts/gpu_session.sh
#
#   1. tests/gpu/test_sm90.py (the Hopper path) in its own processes with timeouts: a kernel that deadlocks on
#      an mbarrier must not eat the call. Selftests first, then the forward (direct and as the planner's choice
#      inside cuflash.attention and attention_varlen, every variant), after compiling every Hopper and portable
#      kernel in 16 processes (scripts/precompile.py --hopper).                             -> sm90.log
#   2. scripts/gpu_check.sh without the benchmark: the full GPU suite (test_sm90 excluded, it ran in 1),
#      memcheck and racecheck.               -> env.txt, pytest_gpu.log, memcheck.log, racecheck.log
#   3. benchmarks/bench_varlen.py --bwd (--quick unless VARLEN_ARGS says otherwise)  -> varlen.txt
#   4. benchmarks/bench_overhead.py (torch per-call overhead beside SDPA)              -> overhead.txt
#   5. benchmarks/bench_sm90.py (each of SM90_VARIANTS, default: every cuflash.hopper.VARIANTS), then
#      bench_attention.py --op fwd --quick (SKIP_BENCH=1 skips)                            -> bench.txt
#   6. with BWD_AB=1: bench_attention.py --op bwd --quick with CUFLASH_BWD_SM90=0, then 1  -> bench.txt
#   7. with PROFILE=1: benchmarks/host_overhead.py --profile (cProfile of the CuPy API)  -> host_profile.txt
#   with OPTIN_SANITIZE=1, after 2: memcheck and racecheck of the sanitizer cases with CUFLASH_SM90=1,
#      CUFLASH_BWD_QBUF=1, CUFLASH_BWD_WIDE=1 and CUFLASH_BWD_SM90=1 (every planner switch on)  -> optin_memcheck.log, optin_racecheck.log
# Environment: OUT, SKIP_SM90=1, SKIP_CHECK=1, SKIP_VARLEN=1, SKIP_OVERHEAD=1, TESTS_TIMEOUT (300),
# SANITIZE_TIMEOUT (100), PYTEST_ARGS (passed on to gpu_check.sh). At most 8 files come back from the device:
# pick the steps of one call accordingly (e.g. SKIP_CHECK=1 for 1, 3-7; SKIP_SM90=1 SKIP_BENCH=1 ... for 2).
source scripts/device_env.sh
if [ "${SKIP_SM90:-0}" != 1 ]; then
    # every Hopper specialization (about 72) and the portable ones, in 16 processes: the tests then load them
    timeout -k 5 "${PRECOMPILE_TIMEOUT:-240}" python3 scripts/precompile.py --hopper --workers 16 >"$OUT/sm90.log" 2>&1
    echo "precompile: exit $? [$((SECONDS - t0))s]"
    timeout -k 5 "${SM90_SELFTEST_TIMEOUT:-60}" python3 -m pytest -v --tb=short -p no:cacheprovider \
        tests/gpu/test_sm90.py -k "numpy" >>"$OUT/sm90.log" 2>&1
    echo "sm90 selftests: exit $? [$((SECONDS - t0))s]"
    timeout -k 5 "${SM90_FWD_TIMEOUT:-300}" python3 -m pytest -v --tb=short -x -p no:cacheprovider \
        tests/gpu/test_sm90.py -k "not numpy" >>"$OUT/sm90.log" 2>&1
    echo "sm90 forward: exit $? [$((SECONDS - t0))s]"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/sm90.log" | grep -v "^tests.*PASSED" | tail -15
fi
if [ "${SKIP_CHECK:-0}" != 1 ]; then
    SKIP_BENCH=1 TESTS_TIMEOUT=${TESTS_TIMEOUT:-300} SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-100} \
        PER_FILE=1 PYTEST_ARGS="--ignore=tests/gpu/test_sm90.py ${PYTEST_ARGS:-}" \
        bash scripts/gpu_check.sh 2>&1 | sed -n '/gpu_check summary/,$p'
    grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -20
    echo "check [$((SECONDS - t0))s]"
fi
if [ "${OPTIN_SANITIZE:-0}" = 1 ]; then  # the sanitizer cases again with every opt-in planner entry switched on
    sanitize_both optin "${SANITIZE_TIMEOUT:-150}" \
        CUFLASH_SM90=1 CUFLASH_BWD_QBUF=1 CUFLASH_BWD_WIDE=1 CUFLASH_BWD_SM90=1
fi
if [ "${SKIP_VARLEN:-0}" != 1 ]; then
    timeout -k 5 "${VARLEN_TIMEOUT:-90}" python3 benchmarks/bench_varlen.py --bwd ${VARLEN_ARGS:---quick} \
        >"$OUT/varlen.txt" 2>&1
    echo "varlen bench: exit $? [$((SECONDS - t0))s]"
    grep -A14 "^=== " "$OUT/varlen.txt" | head -40
fi
if [ "${SKIP_OVERHEAD:-0}" != 1 ]; then
    timeout -k 5 "${OVERHEAD_TIMEOUT:-80}" python3 benchmarks/bench_overhead.py >"$OUT/overhead.txt" 2>&1
    echo "overhead bench: exit $? [$((SECONDS - t0))s]"
    tail -22 "$OUT/overhead.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then  # Hopper forward variants beside portable kernel and SDPA, then the forward grid
    : >"$OUT/bench.txt"
    for variant in ${SM90_VARIANTS:-$(python3 -c "from cuflash import hopper; print(*hopper.VARIANTS)")}; do
        timeout -k 5 "${SM90_BENCH_TIMEOUT:-150}" python3 benchmarks/bench_sm90.py --variant "$variant" \
            ${SM90_BENCH_ARGS:-} >>"$OUT/bench.txt" 2>&1
        echo "sm90 bench ($variant): exit $? [$((SECONDS - t0))s]"
    done
    timeout -k 5 "${FWD_BENCH_TIMEOUT:-150}" python3 benchmarks/bench_attention.py --op fwd ${FWD_BENCH_ARGS:---quick} \
        >>"$OUT/bench.txt" 2>&1
    echo "forward bench: exit $? [$((SECONDS - t0))s]"
    awk '/^=== /{p=1} /^$/{if (p) print ""; p=0} p' "$OUT/bench.txt"
fi
if [ "${BWD_AB:-0}" = 1 ]; then  # backward bench, CUFLASH_BWD_SM90=0 (portable) then =1 (Hopper kernel), same grid
    for switch in CUFLASH_BWD_SM90=0 CUFLASH_BWD_SM90=1; do
        env "$switch" timeout -k 5 "${BWD_BENCH_TIMEOUT:-200}" python3 benchmarks/bench_attention.py --op bwd \
            ${BWD_BENCH_ARGS:---quick} >>"$OUT/bench.txt" 2>&1
        echo "backward bench ($switch): exit $? [$((SECONDS - t0))s]"
    done
    grep -A12 "^=== cuflash Backward" "$OUT/bench.txt" | tail -26
fi
if [ "${PROFILE:-0}" = 1 ]; then
    timeout -k 5 60 python3 benchmarks/host_overhead.py --calls 1000 --profile >"$OUT/host_profile.txt" 2>&1
    echo "host profile: exit $? [$((SECONDS - t0))s]"
    grep "us per call" "$OUT/host_profile.txt"
fi
echo "done [$((SECONDS - t0))s]"

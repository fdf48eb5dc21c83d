#!/usr/bin/env bash
# The backward checked and measured in one device call, from the repository root:
#
#     OUT=... bash scripts/gpu_backward.sh
#
#   1. the backward kernels compiled ahead (scripts/precompile.py --pattern bwd)                         -> bwd.log
#   2. tests/gpu/test_backward.py, then each further file of MORE_TESTS (e.g. "test_varlen test_torch")
#                                                                                          -> bwd.log, <file>.log
#   3. memcheck and racecheck of scripts/sanitize_cases.py --only bwd (Hopper kernel where it applies), and of the
#      portable kernel's (CUFLASH_BWD_SM90=0)              -> bwd_memcheck.log, bwd_racecheck.log, portable_bwd_*.log
#   4. benchmarks/bench_attention.py --op bwd $BWD_BENCH_ARGS                                          -> bench.txt
#   5. benchmarks/profile_kernels.py per case of PROFILE_CASES (';'-separated argument lists): GPU time per kernel
#                                                                                                    -> profile.txt
# Environment: OUT, TESTS_TIMEOUT (240), MORE_TESTS, SANITIZE_TIMEOUT (90), BWD_BENCH_ARGS (--seqlens
# 512,1024,2048), BWD_BENCH_TIMEOUT (150), PROFILE_CASES ("none" skips step 5).
source scripts/device_env.sh
precompile_and_test bwd tests/gpu/test_backward.py "$OUT/bwd.log" "${TESTS_TIMEOUT:-240}"
run_gpu_tests "${TESTS_TIMEOUT:-240}" ${MORE_TESTS:-}
sanitize_both bwd "${SANITIZE_TIMEOUT:-90}" -- --only bwd
sanitize_both portable_bwd "${SANITIZE_TIMEOUT:-90}" CUFLASH_BWD_SM90=0 -- --only bwd_
timeout -k 5 "${BWD_BENCH_TIMEOUT:-150}" python3 benchmarks/bench_attention.py --op bwd \
    ${BWD_BENCH_ARGS:---seqlens 512,1024,2048} >"$OUT/bench.txt" 2>&1
echo "bench: exit $? [$((SECONDS - t0))s]"
awk '/^=== cuflash/{p=1} /^$/{if (p) print ""; p=0} p' "$OUT/bench.txt"
: >"$OUT/profile.txt"
[ "${PROFILE_CASES:-}" = none ] && { echo "done [$((SECONDS - t0))s]"; exit 0; }
IFS=';' read -r -a cases <<<"${PROFILE_CASES:-\
--op bwd --headdim 64 --heads 32 --batch 32 --seqlen 512;--op bwd --headdim 128 --heads 16 --batch 32 --seqlen 512}"
for args in "${cases[@]}"; do
    echo "### $args" >>"$OUT/profile.txt"
    timeout -k 5 90 python3 benchmarks/profile_kernels.py $args 2>&1 \
        | grep -v "Deprecat\|stream = \|_warn_once\|UserWarning" >>"$OUT/profile.txt"
    echo "profile $args: exit $? [$((SECONDS - t0))s]"
done
grep -E "^###|^=== |cuflash::|Memset|per call (span|busy)" "$OUT/profile.txt"
echo "done [$((SECONDS - t0))s]"

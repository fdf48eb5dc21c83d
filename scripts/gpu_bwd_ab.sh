#!/usr/bin/env bash
# A/B of a backward kernel change in one device call, from the repository root:
#
#     OUT=... PATCH=drafts/x.patch bash scripts/gpu_bwd_ab.sh
#
#   A: the working tree as sent: benchmarks/bench_attention.py --op bwd $BENCH_ARGS beside SDPA's backends -> bench_a.txt
#   B: PATCH applied (git apply): the backward compiled ahead and tests/gpu/test_backward.py             -> bwd_b.log
#      then the same benchmark, cuflash and SDPA flash only                                              -> bench_b.txt
# Environment: OUT, PATCH, BENCH_ARGS (--seqlens 512,1024,2048,16384), BENCH_TIMEOUT (150), TESTS_TIMEOUT (200).
source scripts/device_env.sh
bench() {
    timeout -k 5 "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_attention.py --op bwd \
        ${BENCH_ARGS:---seqlens 512,1024,2048,16384} "$@" >"$OUT/$name" 2>&1
    echo "$name: exit $? [$((SECONDS - t0))s]"
    awk '/^=== cuflash/{p=1} /^$/{if (p) print ""; p=0} p' "$OUT/$name"
}
name=bench_a.txt bench
git apply "$PATCH" || { echo "patch $PATCH does not apply"; exit 1; }
precompile_and_test bwd tests/gpu/test_backward.py "$OUT/bwd_b.log" "${TESTS_TIMEOUT:-200}"
name=bench_b.txt bench --impls cuflash,cuflash_det,flash
echo "done [$((SECONDS - t0))s]"

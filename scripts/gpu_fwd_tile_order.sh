#!/usr/bin/env bash
# The persistent Hopper forward against the grid kernels on the whole ANCHORS grid, in one device call from the
# repository root (session 9 ran it with drafts/session8-persistent-tile-order.patch applied first, now on main
# for the kernels without a band):
#
#     OUT=... bash scripts/gpu_fwd_tile_order.sh
#
#   1. the Hopper forward compiled ahead                                                              -> fwd_pre.log
#   2. bench_attention.py --op fwd on the ANCHORS grid, cuflash only, ROUNDS rounds interleaved of the planner's
#      variants (A) against the persistent ones everywhere (B: PERSISTENT, CUFLASH_SM90_VARIANTS format), then
#      once with cuDNN beside the planner's                          -> fwd_a_<round>.txt, fwd_b_<round>.txt, fwd_cudnn.txt
# Environment: OUT, ROUNDS (2), PERSISTENT (64:ws_n128_p,128:pingpong_n128_p), BENCH_TIMEOUT (90).
source scripts/device_env.sh
timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/fwd_pre.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/fwd_pre.log")"
bench() {  # bench NAME [VAR=value]: cuflash alone on the grid
    local name=$1
    shift
    env "$@" timeout -k 5 "${BENCH_TIMEOUT:-90}" python3 benchmarks/bench_attention.py --op fwd --impls cuflash \
        >"$OUT/fwd_$name.txt" 2>&1
    echo "bench $name: exit $? [$((SECONDS - t0))s]"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
    bench "a_$round" CUFLASH_UNUSED=1
    bench "b_$round" CUFLASH_SM90_VARIANTS="${PERSISTENT:-64:ws_n128_p,128:pingpong_n128_p}" CUFLASH_SM90_SHORT_VARIANTS=
done
timeout -k 5 "${BENCH_TIMEOUT:-90}" python3 benchmarks/bench_attention.py --op fwd --impls cuflash,cudnn \
    >"$OUT/fwd_cudnn.txt" 2>&1
echo "bench cudnn: exit $? [$((SECONDS - t0))s]"
grep -h "geometric\|^min\|^max" "$OUT"/fwd_*.txt | head -20
echo "done [$((SECONDS - t0))s]"

#!/usr/bin/env bash
# The decode path (attention_with_kvcache) checked and measured in one device call, from the repository root:
#
#     OUT=... bash scripts/gpu_decode.sh
#
#   1. decode kernels compiled ahead (scripts/precompile.py --pattern decode)                      -> decode.log
#   2. tests/gpu/test_kvcache.py                                                                   -> decode.log
#   3. memcheck and racecheck of scripts/sanitize_cases.py --only kvcache, on the cp.async kernel and with the TMA
#      kernel switched on (CUFLASH_DECODE_TMA=1)
#                  -> kvcache_memcheck.log, kvcache_racecheck.log, kvcache_tma_memcheck.log, kvcache_tma_racecheck.log
#   4. benchmarks/bench_decode.py, the issue's grid beside SDPA flash and cudnn, under each switch set of DECODE_AB
#      (default: cp.async; TMA with 6 slots; TMA with 3 slots)                                        -> bench.txt
#   5. if TUNE=1, benchmarks/tune_decode.py over TUNE_CELLS x TUNE_CONFIGS (cp.async kernel); if TUNE_SPLITS is
#      set (e.g. 0,16,32), those split counts at batch 1 x 8k, 1 x 1k, 8 x 1k                       -> bench.txt
#   6. benchmarks/profile_kernels.py at batch 1 x 8k and 8 x 1k (kernel times, launch gaps), with the TMA kernel
#      unless PROFILE_TMA=0                                                                          -> profile.txt
#   7. if NCU=1 and ncu exists: Nsight Compute's speed-of-light, memory and warp-state sections of the decode
#      kernel at batch 1 x 8k (TMA unless PROFILE_TMA=0)                                              -> ncu.txt
# Environment: OUT, DECODE_AB, DECODE_BENCH_ARGS, TUNE, TUNE_CELLS, TUNE_CONFIGS, TUNE_SPLITS, PROFILE_TMA (1),
# NCU (1), TESTS_TIMEOUT (300).
source scripts/device_env.sh
precompile_and_test decode tests/gpu/test_kvcache.py "$OUT/decode.log" "${TESTS_TIMEOUT:-300}"
sanitize_both kvcache 150 -- --only kvcache
sanitize_both kvcache_tma 150 CUFLASH_DECODE_TMA=1 -- --only kvcache
# The decode bench under each switch set of DECODE_AB (sets split by ';', variables inside a set by ','): by
# default the cp.async kernel, then the TMA kernel with a 6-slot ring (one CTA per SM), then with 3 slots.
: >"$OUT/bench.txt"
IFS=';' read -r -a ab_sets <<<"${DECODE_AB:-CUFLASH_DECODE_TMA=0;CUFLASH_DECODE_TMA=1,CUFLASH_DECODE_TMA_STAGES=6;\
CUFLASH_DECODE_TMA=1,CUFLASH_DECODE_TMA_STAGES=3}"
for set in "${ab_sets[@]}"; do
    IFS=',' read -r -a vars <<<"$set"
    echo "### bench_decode with ${vars[*]}" >>"$OUT/bench.txt"
    env "${vars[@]}" timeout -k 5 200 python3 benchmarks/bench_decode.py ${DECODE_BENCH_ARGS:-} \
        >>"$OUT/bench.txt" 2>&1
    echo "bench_decode (${vars[*]}): exit $? [$((SECONDS - t0))s]"
done
grep -v "Deprecat\|stream = \|cupy_stream\|sys.exit" "$OUT/bench.txt"
if [ "${TUNE:-0}" = 1 ]; then
    timeout -k 5 150 python3 benchmarks/tune_decode.py \
        --cells "${TUNE_CELLS:-1x8192,8x1024,1x1024,64x1024,1x65536,32x262144}" \
        --configs "${TUNE_CONFIGS:-64x3,64x2,64x4}" 2>&1 | grep -v "Deprecat\|stream = " | tee -a "$OUT/bench.txt"
fi
if [ -n "${TUNE_SPLITS:-}" ]; then
    timeout -k 5 90 python3 benchmarks/tune_decode.py --cells 1x8192,1x1024,8x1024 --configs 64x3,64x2 \
        --splits "$TUNE_SPLITS" 2>&1 | grep -v "Deprecat\|stream = " | tee -a "$OUT/bench.txt"
fi
echo "tune: [$((SECONDS - t0))s]"
: >"$OUT/profile.txt"
for prof_args in "--op decode --batch 1 --seqlen 8192" "--op decode --batch 8 --seqlen 1024"; do
    CUFLASH_DECODE_TMA=${PROFILE_TMA:-1} timeout -k 5 90 python3 benchmarks/profile_kernels.py $prof_args 2>&1 \
        | grep -v "Deprecat\|stream = \|_warn_once\|UserWarning" >>"$OUT/profile.txt"
    echo "profile_kernels $prof_args: exit $? [$((SECONDS - t0))s]"
done
grep -E "^===|decode_|cudnn|per call (span|busy)|median gap" "$OUT/profile.txt"
NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [ "${NCU:-1}" = 1 ] && [ -n "$NCU_BIN" ]; then
    CUFLASH_DECODE_TMA=${PROFILE_TMA:-1} timeout -k 5 120 "$NCU_BIN" -k regex:decode_ -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats \
        python3 benchmarks/profile_kernels.py --op decode --batch 1 --seqlen 8192 --warmup 1 --iters 1 \
        >"$OUT/ncu.txt" 2>&1
    echo "ncu: exit $? [$((SECONDS - t0))s]"
else
    echo "ncu: not run (NCU=${NCU:-1}, binary '${NCU_BIN}')"
fi
echo "done [$((SECONDS - t0))s]"

#!/usr/bin/env bash
# The landing call of a Hopper forward kernel change with an A/B against copies of the kernel file, from the
# repository root (about 7 minutes):
#
#     git show HEAD:cuda_src/fwd_sm90.cu > cuda_src/fwd_sm90_head.cu       # untracked copies travel with the tree
#     OUT=... SOURCES="fwd_sm90_head.cu fwd_sm90.cu" bash scripts/gpu_fwd_source_ab.sh
#
#   1. every kernel compiled ahead; the forward's kernel file a switch (FWD_SOURCE_AB, CUFLASH_FWD_SM90_SOURCE)
#   2. the GPU test files of FILES (default: all) in 8 shards on the working tree's kernels, or with TEST_SOURCE on
#      that kernel file (a variant of scripts/kernel_variant.sh, say); SKIP_TESTS=1 leaves it out
#   3. if it passed: the sm90_ sanitizer cases, memcheck and racecheck
#   4. bench_attention.py --op fwd, cuflash alone (AB_BENCH_ARGS), ROUNDS (3) rounds of one set per kernel file in
#      SOURCES (files of cuda_src/), interleaved                                               -> ab_<set>_<round>.txt
#   5. if the suite passed: bench_attention.py --op fwd beside SDPA's flash and cuDNN backends, on BENCH_SOURCE's kernel
#      file if set (the tested variant, say), else the working tree's                             -> bench_fwd.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
sets=""
for f in ${SOURCES:?SOURCES: kernel files of cuda_src/}; do
    [ -f "cuda_src/$f" ] || { echo "cuda_src/$f is missing (see the header)"; exit 2; }
    sets="${sets:+$sets;}CUFLASH_FWD_SM90_SOURCE=$f"
done
[ -n "${TEST_SOURCE:-}" ] && export CUFLASH_FWD_SM90_SOURCE=$TEST_SOURCE
FWD_SOURCE_AB=1 precompile_hopper
grep -q CUFLASH_FWD_SM90_SOURCE cuflash/hopper.py || { echo "the source switch did not patch in"; exit 2; }
suite_ok=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    run_gpu_suite ${FILES:-$GPU_TEST_FILES}
fi
[ $suite_ok = 1 ] && sanitize_both sm90 150 -- --only sm90_
unset CUFLASH_FWD_SM90_SOURCE  # (each A/B set names its own)
AB="$sets" ROUNDS=${ROUNDS:-3} BENCH_TIMEOUT=150 \
    BENCH="benchmarks/bench_attention.py --op fwd ${AB_BENCH_ARGS:---impls cuflash}" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
if [ $suite_ok = 1 ]; then
    [ -n "${BENCH_SOURCE:-}" ] && export CUFLASH_FWD_SM90_SOURCE=$BENCH_SOURCE
    timeout -k 5 150 python3 benchmarks/bench_attention.py --op fwd >"$OUT/bench_fwd.txt" 2>&1
    echo "bench: exit $? [$((SECONDS - t0))s]"
    awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
fi
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# A kernel change's landing call with an A/B against the parent's kernels (about 5 minutes), from the repository root,
# after copying the parent's kernels to cuda_src/base/ (untracked; remove it before committing):
#
#     mkdir -p cuda_src/base
#     for f in $(git ls-files cuda_src | xargs -n1 basename); do git show HEAD:cuda_src/$f >cuda_src/base/$f; done
#     OUT=... AB_BENCH_ARGS="--dims 64 --seqlens 512,1024" bash scripts/gpu_landing_ab.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case
#   2. bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                            -> bench_fwd.txt
#   3. A/B, ROUNDS (3) rounds, bench_attention.py --op fwd --impls cuflash AB_BENCH_ARGS: the parent's Hopper forward
#      (cuda_src/base/fwd_sm90.cu and its headers: set 0) against the tree's (set 1)          -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz; NO_TAR=1 leaves them in $OUT for a caller's further steps.
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu" ROUNDS=${ROUNDS:-3} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash ${AB_BENCH_ARGS:-}" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
[ "${NO_TAR:-0}" = 1 ] || { cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt; }

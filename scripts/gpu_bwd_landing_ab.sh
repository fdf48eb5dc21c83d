#!/usr/bin/env bash
# A Hopper backward kernel change's landing call with an A/B against the parent's kernel file (about 8 minutes), from
# the repository root, after copying the parent's bwd_sm90.cu and fixed_dq.cuh as untracked files (remove them before
# committing):
#
#     git show HEAD:cuda_src/bwd_sm90.cu | sed 's/"fixed_dq.cuh"/"fixed_dq_HEAD1.cuh"/' >cuda_src/bwd_sm90_HEAD1.cu
#     git show HEAD:cuda_src/fixed_dq.cuh >cuda_src/fixed_dq_HEAD1.cuh
#     OUT=... AB_ENV="CUFLASH_BWD_SM90_DET=fixed" AB_IMPLS=cuflash_det bash scripts/gpu_bwd_landing_ab.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case
#   2. bench_attention.py --op bwd beside SDPA's flash and cuDNN backends                            -> bench_bwd.txt
#   3. A/B, ROUNDS (2) rounds, bench_attention.py --op bwd --impls AB_IMPLS (cuflash; a table per impl) with AB_ENV
#      set: the parent's kernel file (set 0) against the tree's (set 1)                       -> ab_<set>_<round>.txt
source scripts/device_env.sh
source_switch bwd
precompile_hopper
suite_sanitize_bench bwd
src=CUFLASH_BWD_SM90_SOURCE
AB_IMPLS=${AB_IMPLS:-cuflash}
AB="$src=bwd_sm90_HEAD1.cu ${AB_ENV:-};$src=bwd_sm90.cu ${AB_ENV:-}" ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=300 \
    BENCH="benchmarks/bench_attention.py --op bwd --impls $AB_IMPLS" bash scripts/gpu_ab.sh
for impl in ${AB_IMPLS//,/ }; do python3 scripts/ab_table.py "$OUT" --column "$impl"; done
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# The Hopper backward's deterministic mode on main's kernels (about 3 minutes), from the repository root:
#
#     OUT=... bash scripts/gpu_det_threshold.sh
#
# Since db11638 (session 22) the slices run on the atomic mode's kernel, which lost the fixed point's code and got
# 2-8% faster, while the fixed point runs on its own `_fixed` kernels; session 16's threshold (plan.BWD_SM90_DET
# "fixed_min_blocks", 16 key blocks) was measured with both on one slower kernel. Here: ROUNDS (2) rounds of the whole
# grid, the slices forced (set 0) against the fixed point forced (set 1), with the atomic mode beside them in every
# run (det/atom per cell: issue 4's bound is 1.15)                                           -> ab_det_<set>_<round>.txt
source scripts/device_env.sh
# (no precompile step: each kernel compiles in the first set's warm-up call and comes from CuPy's disk cache after)
AB="CUFLASH_BWD_SM90_DET=slices;CUFLASH_BWD_SM90_DET=fixed" AB_TAG=_det ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=200 \
    BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash,cuflash_det" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _det --column cuflash_det
python3 scripts/ab_table.py "$OUT" --tag _det --column cuflash
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 16's follow-ups for the next device call (about 5 minutes), from the repository root:
#
#     git show a9f0c6a:cuda_src/bwd_sm90.cu > cuda_src/bwd_sm90_a9f0c6a.cu   # untracked: it travels with the tree
#     OUT=... bash scripts/gpu_session17.sh
#
#   1. the Hopper backward's atomic mode, main's kernel against the one before the fixed point (a9f0c6a's
#      bwd_sm90.cu, which compiles against today's params.cuh: its fields are read by name, and it knows modes 0 and 1
#      only, so that set runs with the slices), through a CUFLASH_BWD_SM90_SOURCE switch patched into hopper.py
#      here; ROUNDS (2) rounds of the whole grid, atomic only                                   -> ab_src_<set>_<round>.txt
#   2. deterministic mode, slices against the fixed point, ROUNDS rounds of the whole grid: the per-head-dim threshold
#      for plan.BWD_SM90_DET["fixed_min_blocks"] (session 16's one round had the slices ahead at d 64 2k)
#                                                                                                 -> ab_det_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
[ -f cuda_src/bwd_sm90_a9f0c6a.cu ] || { echo "cuda_src/bwd_sm90_a9f0c6a.cu is missing (see the header)"; exit 2; }
sed -i 's/    source = "bwd_sm90.cu"/    source = __import__("os").environ.get("CUFLASH_BWD_SM90_SOURCE", "bwd_sm90.cu")/' \
    cuflash/hopper.py
grep -q CUFLASH_BWD_SM90_SOURCE cuflash/hopper.py || { echo "the source switch did not patch in"; exit 2; }
precompile_hopper
AB="CUFLASH_BWD_SM90_SOURCE=bwd_sm90.cu;CUFLASH_BWD_SM90_SOURCE=bwd_sm90_a9f0c6a.cu CUFLASH_BWD_SM90_DET=slices" \
    AB_TAG=_src ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=200 \
    BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _src --column cuflash
AB="CUFLASH_BWD_SM90_DET=slices;CUFLASH_BWD_SM90_DET=fixed" AB_TAG=_det ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=200 \
    BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash,cuflash_det" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _det --column cuflash_det
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

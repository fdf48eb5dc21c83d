#!/usr/bin/env bash
# Session 27's first call (about 8 minutes), from the repository root: an A/B of the Hopper forward against a base
# commit's whole package (PYTHONPATH=ab_base: its cuflash/ and cuda_src/, since a change may touch both the kernel
# file and hopper.py), three rounds (ROUNDS; AB_BENCH_ARGS, the cells), then the whole suite, every sanitizer case and
# the forward bench beside the peers on this tree:
#
#     rm -rf ab_base && mkdir ab_base && git archive BASE cuflash cuda_src | tar -x -C ab_base
#     (BASE: the commit before the change; the untracked folder travels; delete it before committing)
#     OUT=... bash scripts/gpu_session27.sh                                                     -> logs.tgz
source scripts/device_env.sh
[ -d ab_base/cuflash ] || { echo "no ab_base/: see the header"; exit 2; }
precompile_hopper
AB="PYTHONPATH=$PWD/ab_base;PYTHONPATH=$PWD" ROUNDS=${ROUNDS:-3} BENCH_TIMEOUT=200 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash \
${AB_BENCH_ARGS:---dims 64,128 --seqlens 512,1024,4096}" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
suite_sanitize_bench fwd
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 26's third call (about 9 minutes), from the repository root: the softmax's row max by a tree
# (softmax.cuh tree_max) landed with the whole suite, every sanitizer case and the forward bench beside the peers, then
# an A/B of the Hopper forward against HEAD's kernel files, two rounds:
#
#     mkdir -p cuda_src/base && git archive BASE cuda_src | tar -x --strip-components=1 -C cuda_src/base
#     (BASE: the commit before the change, 6c2310b for this call; the untracked folder travels)
#     OUT=... bash scripts/gpu_session26c.sh                                                     -> logs.tgz
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu" ROUNDS=2 BENCH_TIMEOUT=150 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --seqlens 512,1024,2048,4096" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

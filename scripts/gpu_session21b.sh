#!/usr/bin/env bash
# Session 21's second call (idle warpgroups skipped, SKIP_IDLE: drafts/session21-skip-idle-warpgroups.patch applied),
# from the repository root, with the parent's kernels in cuda_src/base/:
#
#     OUT=... bash scripts/gpu_session21b.sh
#
# scripts/gpu_landing_ab.sh with the A/B at d 64 on 1k-4k keys (the three-warpgroup kernel's cells), then a second
# A/B on the tree (tag t, two rounds) of the table against ws3_n128_p and ws_n128_p for every d 64 call.
NO_TAR=1 AB_BENCH_ARGS="--dims 64 --seqlens 1024,2048,4096" bash scripts/gpu_landing_ab.sh
AB_TAG=t ROUNDS=2 AB="CUFLASH_AB=table;CUFLASH_SM90_VARIANTS=64:ws3_n128_p;CUFLASH_SM90_VARIANTS=64:ws_n128_p" \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --seqlens 512,1024,2048,4096" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag t
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null && rm -f ./*.log ./*.txt

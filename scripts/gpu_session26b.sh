#!/usr/bin/env bash
# Session 26's second call (about 6 minutes), from the repository root: the persistent consumers find the walk's
# next tile while a GEMM computes (fwd_sm90.cu next_tile), landed with the whole suite and the Hopper sanitizer
# cases, then an A/B against HEAD's kernel file, two rounds, and the forward bench beside the peers:
#
#     git show HEAD:cuda_src/fwd_sm90.cu > cuda_src/fwd_sm90_head.cu    # (untracked: travels with the tree)
#     OUT=... bash scripts/gpu_session26b.sh                                                     -> logs.tgz
SOURCES="fwd_sm90_head.cu fwd_sm90.cu" ROUNDS=2 AB_BENCH_ARGS="--seqlens 512,1024,2048,4096 --impls cuflash" \
    bash scripts/gpu_fwd_source_ab.sh

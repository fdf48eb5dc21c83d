#!/usr/bin/env bash
# Session 20's sixth call (the OVERLAP kernel's tile range and mask fields made warp-uniform once per tile),
# from the repository root, with the parent's kernels in cuda_src/base/:
#
#     OUT=... bash scripts/gpu_session20f.sh
#
# scripts/gpu_landing_ab.sh with the A/B on --dims 64 --seqlens 512,1024,2048,4096.
AB_BENCH_ARGS="--dims 64 --seqlens 512,1024,2048,4096" exec bash scripts/gpu_landing_ab.sh

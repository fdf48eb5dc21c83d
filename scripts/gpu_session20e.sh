#!/usr/bin/env bash
# Session 20's fifth call (the descriptors built once per wgmma group; main at e448dcd),
# from the repository root, with the parent's kernels in cuda_src/base/:
#
#     OUT=... bash scripts/gpu_session20e.sh
#
# scripts/gpu_landing_ab.sh with the A/B on --seqlens 512,1024,2048.
AB_BENCH_ARGS="--seqlens 512,1024,2048" exec bash scripts/gpu_landing_ab.sh

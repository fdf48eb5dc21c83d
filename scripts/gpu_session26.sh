#!/usr/bin/env bash
# Session 26's first call (about 6 minutes), from the repository root: Nsight Compute's source page of the d 64 causal
# 512 cell, ours (ws_n128_p) and cuDNN's kernel on the same tensors (where does each spend its instructions and warp
# samples per block), then the chunked walk at d 128 causal 4k / 8k (CUFLASH_SM90_WALK_CHUNK 12 and 6: what
# plan.sm90_walk_chunk would give there) against the default pair-by-pair walk, three rounds  -> logs.tgz
source scripts/device_env.sh
PROFILE_CASES="d64c_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512 --causal;\
cudnn_d64c_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512 --causal --peer|cudnn" \
AB="CUFLASH_SM90=1;CUFLASH_SM90_WALK_CHUNK=12;CUFLASH_SM90_WALK_CHUNK=6" ROUNDS=3 \
AB_BENCH_ARGS="--dims 128 --causal true --seqlens 4096,8192 --impls cuflash" \
    bash scripts/gpu_source_profile.sh

#!/usr/bin/env bash
# Session 27's second call (about 4 minutes), from the repository root: Nsight Compute's source page of the d 64
# non-causal 512 cell (the one closest to cuDNN), ours (ws_n128_p) and cuDNN's kernel on the same tensors, then the
# d 64 non-causal 512 / 1k cells over the persistent variants that can run them (CUFLASH_SM90_SHORT_VARIANTS), three
# rounds                                                                                                 -> logs.tgz
source scripts/device_env.sh
PROFILE_CASES="d64_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512;\
cudnn_d64_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512 --peer|cudnn" \
AB="CUFLASH_SM90=1;CUFLASH_SM90_SHORT_VARIANTS=64@1024:ws_n128_p;CUFLASH_SM90_SHORT_VARIANTS=64@1024:pingpong_n128_p;\
CUFLASH_SM90_SHORT_VARIANTS=64@1024:ws_n128_p_s2;CUFLASH_SM90_SHORT_VARIANTS=64@1024:pingpong_n128_p_s2" ROUNDS=3 \
AB_BENCH_ARGS="--dims 64 --causal false --seqlens 512,1024 --impls cuflash" \
    bash scripts/gpu_source_profile.sh

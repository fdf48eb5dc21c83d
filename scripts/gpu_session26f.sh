#!/usr/bin/env bash
# Session 26's sixth call (about 7 minutes), from the repository root, on dc7e327 (reverted: d 128 lost 1-3%; the
# change is drafts/session26-handed-tiles-all.patch): every persistent kernel with two consumer warpgroups takes
# its tiles from the producer (fwd_sm90.cu HANDED_TILES; d 128's pingpong_n128_p_s2 among them),
# landed with the whole suite, every sanitizer case and the forward bench beside the peers, then an A/B of the
# Hopper forward at d 128 against HEAD's kernel files, two rounds (last: the device time left is short):
#
#     mkdir -p cuda_src/base && git archive HEAD cuda_src | tar -x --strip-components=1 -C cuda_src/base
#     OUT=... bash scripts/gpu_session26f.sh                                                     -> logs.tgz
ROUNDS=2 AB_BENCH_ARGS="--dims 128 --seqlens 512,1024,2048" bash scripts/gpu_session26e.sh

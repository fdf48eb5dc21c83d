#!/usr/bin/env bash
# Session 26's sixth call (about 7 minutes), from the repository root: every persistent kernel with two consumer
# warpgroups takes its tiles from the producer (fwd_sm90.cu HANDED_TILES; d 128's pingpong_n128_p_s2 among them),
# landed with the whole suite, every sanitizer case and the forward bench beside the peers, then an A/B of the
# Hopper forward at d 128 against HEAD's kernel files, two rounds (last: the device time left is short):
#
#     mkdir -p cuda_src/base && git archive HEAD cuda_src | tar -x --strip-components=1 -C cuda_src/base
#     OUT=... bash scripts/gpu_session26f.sh                                                     -> logs.tgz
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu" ROUNDS=2 BENCH_TIMEOUT=100 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 128 --seqlens 512,1024,2048" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

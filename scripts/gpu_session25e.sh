#!/usr/bin/env bash
# Session 25's seventh call (about 7 minutes), from the repository root: ws_n128_p_tail with the tail in a kernel of
# its own (fwd_sm90.cu TAIL: the persistent walk stops before the tail, whose tiles a grid kernel works in parts,
# launched as a programmatic dependent) in the table at d 64 non-causal up to 512 keys: the whole suite, the
# sanitizers, the forward bench beside the peers; the entry against ws_n128_p (A/B, three rounds, d 64 non-causal
# 256 / 512 / 1k); GPU time per shape with the tail on and off (time_tail.py, twice)
#                                                              -> logs.tgz (suite logs, bench_fwd.txt, ab_*, tail.txt)
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_SM90=1;CUFLASH_SM90_SHORT_VARIANTS=64@512:ws_n128_p,64@1024:ws3_n128_p_split,64@4096:ws3_n128_p" \
    ROUNDS=3 BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --causal false \
    --seqlens 256,512,1024" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
for r in 1 2; do timeout -k 5 60 python3 scripts/time_tail.py 2>&1 | grep -v Warn; done | tee "$OUT/tail.txt"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

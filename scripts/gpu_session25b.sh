#!/usr/bin/env bash
# Session 25's second call (about 7 minutes), from the repository root: ws_n128_p_tail (fwd_sm90.cu TAIL: the walk's
# last round split by key blocks over the idle CTAs) in the table at d 64 non-causal up to 512 keys, landed with the
# whole suite, the sanitizers and the forward bench beside the peers; the entry against ws_n128_p (A/B, three
# rounds, d 64 non-causal 256 / 512 / 1k); then the small decode cells beside a plain read of the same K/V bytes
# after each flush (decode_flush.py)                    -> logs.tgz (suite logs, bench_fwd.txt, ab_*, flush.txt)
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_SM90=1;CUFLASH_SM90_SHORT_VARIANTS=64@512:ws_n128_p,64@1024:ws3_n128_p_split,64@4096:ws3_n128_p" \
    ROUNDS=3 BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --causal false \
    --seqlens 256,512,1024" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
timeout -k 5 90 python3 benchmarks/decode_flush.py --cells 1x8192,1x1024,8x1024 >"$OUT/flush.txt" 2>&1
echo "flush: exit $? [$((SECONDS - t0))s]"; grep -v Warning "$OUT/flush.txt"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

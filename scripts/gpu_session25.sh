#!/usr/bin/env bash
# Session 25's first call (about 8 minutes), from the repository root: the d 128 causal 8k table entry
# (pingpong_n128_p_s2 up to 8192 keys) landed with the whole suite, the sanitizers and the forward bench beside the
# peers; the entry against the grid kernel at causal 4k/8k/16k (A/B, three rounds); then the decode host path
# (host_overhead.py --profile) and the small decode cells after each flush, the host kept ahead by a spin kernel
# (decode_flush.py's memset+sleep)                     -> logs.tgz (suite logs, bench_fwd.txt, ab_*, host.txt, flush.txt)
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_SM90=1;CUFLASH_SM90_VARIANTS=128:pingpong_n128" ROUNDS=3 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 128 --causal true --seqlens 4096,8192,16384" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
timeout -k 5 60 python3 benchmarks/host_overhead.py --profile >"$OUT/host.txt" 2>&1
echo "host: exit $? [$((SECONDS - t0))s]"; grep "per call" "$OUT/host.txt"
timeout -k 5 90 python3 benchmarks/decode_flush.py --cells 1x8192,1x1024,8x1024 >"$OUT/flush.txt" 2>&1
echo "flush: exit $? [$((SECONDS - t0))s]"; cat "$OUT/flush.txt"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

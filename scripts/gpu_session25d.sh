#!/usr/bin/env bash
# Session 25's fourth call (about 5 minutes), from the repository root, on main's kernels (those of call 1): the
# decode benchmark on issue 5's grid beside SDPA's flash and cuDNN backends (gpu_decode_bench.sh), the small decode
# cells beside a plain read of their K/V bytes after each flush (decode_flush.py), and the forward benchmark beside
# the peers once more                                   -> logs.tgz (decode.txt, decode.json, flush.txt, bench_fwd.txt)
source scripts/device_env.sh
bash scripts/gpu_decode_bench.sh
timeout -k 5 90 python3 benchmarks/decode_flush.py --cells 1x8192,1x1024,8x1024 >"$OUT/flush.txt" 2>&1
echo "flush: exit $? [$((SECONDS - t0))s]"; grep -v "Warning\|main()" "$OUT/flush.txt"
timeout -k 5 150 python3 benchmarks/bench_attention.py --op fwd >"$OUT/bench_fwd.txt" 2>&1
echo "bench fwd: exit $? [$((SECONDS - t0))s]"; awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt ./*.json 2>/dev/null; rm -f ./*.log ./*.txt ./*.json

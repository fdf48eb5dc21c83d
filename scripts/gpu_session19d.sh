#!/usr/bin/env bash
# Session 19's landing call (about 5 minutes; the kernels of call 5, whose sanitizer runs were clean, with the table
# changes after it), from the repository root:
#
#     OUT=... bash scripts/gpu_session19d.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards
#   2. bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                            -> bench_fwd.txt
#   3. A/B on d 64's causal cells, two rounds: the walk's chunk by the L2 rule (set 0), forced to 132 (set 1) and 66
#      (set 2) pairs                                                                             -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
precompile_hopper
run_gpu_suite ${FILES:-$GPU_TEST_FILES}
timeout -k 5 200 python3 benchmarks/bench_attention.py --op fwd >"$OUT/bench_fwd.txt" 2>&1
echo "bench fwd: exit $? [$((SECONDS - t0))s]"
awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
AB="CUFLASH_SM90_WALK_CHUNK=0;CUFLASH_SM90_WALK_CHUNK=132;CUFLASH_SM90_WALK_CHUNK=66" ROUNDS=${ROUNDS:-2} \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --causal true --dims 64 --seqlens 512,1024,2048,4096"\
        bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 22's landing call for the FIXED backward kernels (deterministic mode 2 as a template parameter, so that the
# atomic kernels carry none of its code; about 6 minutes), from the repository root, with two earlier kernel files
# as untracked copies whose kernel template takes (and ignores) the new flag:
#
#     for rev in a9f0c6a:a9f0c6a 2495792:HEAD1; do git show ${rev%:*}:cuda_src/bwd_sm90.cu | python3 -c "import sys; \
#         print(sys.stdin.read().replace('bool SCORE_MOD>\n__global__', 'bool SCORE_MOD, bool UNUSED>\n__global__'), \
#         end='')" >cuda_src/bwd_sm90_${rev#*:}.cu; done
#     OUT=... bash scripts/gpu_session22e.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case;
#      bench_attention.py --op bwd beside SDPA's flash and cuDNN backends                          -> bench_bwd.txt
#   2. A/B, two rounds of the whole grid, atomic mode: the tree's kernel (set 0), the parent's (set 1: mode 2 a run-time
#      test), a9f0c6a's (set 2: before the fixed point)                                        -> ab_<set>_<round>.txt
source scripts/device_env.sh
source_switch bwd
precompile_hopper
suite_sanitize_bench bwd
src=CUFLASH_BWD_SM90_SOURCE
AB="$src=bwd_sm90.cu;$src=bwd_sm90_HEAD1.cu;$src=bwd_sm90_a9f0c6a.cu" \
    ROUNDS=2 BENCH_TIMEOUT=200 BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --column cuflash
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

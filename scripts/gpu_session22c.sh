#!/usr/bin/env bash
# Session 22's landing call for left_half (about 6 minutes), from the repository root, with the parent's kernels
# copied to cuda_src/base/ (untracked; remove it before committing):
#
#     mkdir -p cuda_src/base
#     for f in $(git ls-files cuda_src | xargs -n1 basename); do git show HEAD~1:cuda_src/$f >cuda_src/base/$f; done
#     OUT=... bash scripts/gpu_session22c.sh
#
#   1. every kernel compiled ahead; the whole GPU suite in 8 shards; memcheck and racecheck over every sanitizer case;
#      bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                          -> bench_fwd.txt
#   2. A/B, three rounds up to 4k keys: the parent's kernels (set 0), the tree's (set 1), and the tree with d 64 causal
#      on ws3_n128_p at every length of the table (set 2: left_half runs in that kernel, not in ws_n128_p)
#                                                                                             -> ab_<set>_<round>.txt
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
table="64@512:ws_n128_p,64:ws3_n128_p,64c:ws3_n128_p,128@2048:pingpong_n128_p_s2,128c:pingpong_n128_p_s2"
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu;CUFLASH_SM90_SHORT_VARIANTS=$table" \
    ROUNDS=3 BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --seqlens 512,1024,2048,4096" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null && rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 18's last device call (about 5 minutes; call 5, with drafts/session18-idle-warpgroups.patch applied), from
# the repository root:
#
#     git show HEAD:cuda_src/fwd_sm90.cu > cuda_src/fwd_sm90_head.cu   # untracked: travels with the tree
#     OUT=... bash scripts/gpu_session18b.sh
#
#   1. every kernel compiled ahead; the Hopper forward's kernel file a switch (CUFLASH_FWD_SM90_SOURCE)
#   2. the whole GPU suite in 8 shards on the working tree's kernels; if it passed, the sm90_ sanitizer cases
#   3. d 64 up to 4k keys, 2 rounds: main's kernel file (fwd_sm90_head.cu) and the working tree's, with the planner's
#      table, then the working tree's with ws3_n128_p at every length                      -> ab_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
[ -f cuda_src/fwd_sm90_head.cu ] || { echo "cuda_src/fwd_sm90_head.cu is missing (see the header)"; exit 2; }
FWD_SOURCE_AB=1 precompile_hopper
run_gpu_suite ${FILES:-$GPU_TEST_FILES}
[ $suite_ok = 1 ] && sanitize_both sm90 100 -- --only sm90_
AB="CUFLASH_FWD_SM90_SOURCE=fwd_sm90_head.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu;CUFLASH_SM90_VARIANTS=64:ws3_n128_p" \
    ROUNDS=2 BENCH_TIMEOUT=100 \
    BENCH="benchmarks/bench_attention.py --op fwd --dims 64 --seqlens 512,1024,2048,4096 --impls cuflash" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 18's second device call (about 6 minutes), from the repository root, as run on 0c6d764's tree with
# ws3_n128_p added (the backward patch landed in 9beaf74 and left drafts/; step 4 runs only where cuda_src/v_bwd is):
#
#     bash scripts/kernel_variant.sh v_bwd drafts/session17-bwd-desc-uniform.patch   # untracked: travels with the tree
#     OUT=... bash scripts/gpu_session18.sh
#
#   1. every kernel compiled ahead; the Hopper backward's kernel file a switch (CUFLASH_BWD_SM90_SOURCE)
#   2. test_sm90 in 8 shards (FILES: other test files), which runs the new variant ws3_n128_p; the sm90_ sanitizer
#      cases (every variant), memcheck and racecheck, if it passed
#   3. the d 64 forward, the planner's variants against ws3_n128_p and ws3_n128_p_s2 at every length (ROUNDS, 3)
#                                                                                            -> ab_fwd_<set>_<round>.txt
#   4. the Hopper backward, main's kernel file against v_bwd/bwd_sm90.cu (2 rounds, atomic, the whole grid)
#                                                                                            -> ab_bwd_<set>_<round>.txt
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
sed -i 's/    source = "bwd_sm90.cu"/    source = __import__("os").environ.get("CUFLASH_BWD_SM90_SOURCE", "bwd_sm90.cu")/' \
    cuflash/hopper.py
grep -q CUFLASH_BWD_SM90_SOURCE cuflash/hopper.py || { echo "the source switch did not patch in"; exit 2; }
precompile_hopper
run_gpu_suite ${FILES:-test_sm90}
[ $suite_ok = 1 ] && sanitize_both sm90 150 -- --only sm90_
AB="CUFLASH_SM90_VARIANTS=;CUFLASH_SM90_VARIANTS=64:ws3_n128_p;CUFLASH_SM90_VARIANTS=64:ws3_n128_p_s2" AB_TAG=_fwd \
    ROUNDS=${ROUNDS:-3} BENCH_TIMEOUT=150 \
    BENCH="benchmarks/bench_attention.py --op fwd --dims 64 --impls cuflash" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag _fwd --column cuflash
if [ -d cuda_src/v_bwd ]; then
    AB="CUFLASH_BWD_SM90_SOURCE=bwd_sm90.cu;CUFLASH_BWD_SM90_SOURCE=v_bwd/bwd_sm90.cu" AB_TAG=_bwd ROUNDS=2 \
        BENCH_TIMEOUT=200 BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash" bash scripts/gpu_ab.sh
    python3 scripts/ab_table.py "$OUT" --tag _bwd --column cuflash
fi
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

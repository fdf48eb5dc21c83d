#!/usr/bin/env bash
# Session 27's third call (about 4 minutes), from the repository root: a share of the d 64 softmax's exponentials on
# the FMA pipe (softmax.cuh exp2_fma; CUFLASH_EXP2_FMA_EVERY=N: every N-th column tile, an experiment's switch read
# by build.nvrtc_options), A/B of 0 / 8 / 4 / 2 over the d 64 forward grid, three rounds, then test_sm90's d 64 cases
# with N=4 against the reference                                                                        -> logs.tgz
source scripts/device_env.sh
AB="CUFLASH_EXP2_FMA_EVERY=0;CUFLASH_EXP2_FMA_EVERY=8;CUFLASH_EXP2_FMA_EVERY=4;CUFLASH_EXP2_FMA_EVERY=2" \
    ROUNDS=${ROUNDS:-3} BENCH_TIMEOUT=150 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash,cudnn --dims 64" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
python3 scripts/ab_table.py "$OUT" --column cudnn
CUFLASH_EXP2_FMA_EVERY=4 timeout -k 5 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_sm90.py \
    -k "64" >"$OUT/sm90_fma4.log" 2>&1
echo "test_sm90 d 64 with N=4: exit $? $(tail -1 "$OUT/sm90_fma4.log")"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 25's ninth call (about 5 minutes), from the repository root: d 64's O by TMA stores (plan.SM90_O_TMA_DEFAULT;
# the split variant keeps registers) landed with the whole suite, the sanitizers and the forward bench beside the
# peers; then the default against O from registers at d 64 (CUFLASH_SM90_O_TMA=0 turns d 128 and 256 to registers
# too: only d 64 measured), two rounds                          -> logs.tgz (suite logs, bench_fwd.txt, ab_*)
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_SM90=1;CUFLASH_SM90_O_TMA=0" ROUNDS=2 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

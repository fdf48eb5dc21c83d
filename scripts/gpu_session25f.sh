#!/usr/bin/env bash
# Session 25's eighth call (about 1.5 minutes), from the repository root, on main's kernels: d 64's epilogue, O from
# registers (main, plan.SM90_O_TMA_DEFAULT) against O by TMA stores (CUFLASH_SM90_O_TMA=1; d 128 and 256 already), on
# the forward bench's d 64 cells, cuflash only, two rounds                                    -> logs.tgz (ab_*)
source scripts/device_env.sh
AB="CUFLASH_SM90=1;CUFLASH_SM90_O_TMA=1" ROUNDS=2 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.txt 2>/dev/null; rm -f ./*.txt

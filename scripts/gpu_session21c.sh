#!/usr/bin/env bash
# Session 21's third call (the split last round of the persistent walk without a band; the split half of
# drafts/session21-split-dynamic-walk.patch in an earlier form), from the repository root:
#
#     OUT=... bash scripts/gpu_session21c.sh
#
#   1. every kernel compiled ahead; the whole GPU suite; memcheck and racecheck over every sanitizer case;
#      bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                          -> bench_fwd.txt
#   2. A/B, three rounds: CUFLASH_SM90_SPLIT=0 against 1 at d 64 without a band (every length: 4096 tiles, 4 of them
#      in the last round on 132 SMs)                                                            -> ab_<set>_<round>.txt
#   3. A/B (tag t), two rounds: d 64 non-causal 1k on the table's ws3_n128_p against ws_n128_p
#                                                                                             -> abt_<set>_<round>.txt
source scripts/device_env.sh
precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_SM90_SPLIT=0;CUFLASH_SM90_SPLIT=1" ROUNDS=3 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --causal false" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
AB_TAG=t AB="CUFLASH_AB=table;CUFLASH_SM90_VARIANTS=64:ws_n128_p" ROUNDS=2 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --causal false --seqlens 1024,2048" \
    bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT" --tag t
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null && rm -f ./*.log ./*.txt

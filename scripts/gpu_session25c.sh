#!/usr/bin/env bash
# Session 25's third call (about 2 minutes), from the repository root: ws_n128_p_tail with its merge off acc_o (no
# wgmma serialization; call 2's build had ptxas serialize every wgmma, C7520) against ws_n128_p at d 64 non-causal
# 256 / 512 / 1k keys, three rounds                                                    -> logs.tgz (ab_*)
source scripts/device_env.sh
AB="CUFLASH_SM90=1;CUFLASH_SM90_SHORT_VARIANTS=64@512:ws_n128_p,64@1024:ws3_n128_p_split,64@4096:ws3_n128_p" \
    ROUNDS=3 BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --dims 64 --causal false \
    --seqlens 256,512,1024" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

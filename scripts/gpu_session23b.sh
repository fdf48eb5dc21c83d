#!/usr/bin/env bash
# Session 23's fourth call (about 2 minutes), from the repository root: where the d 64 fixed point's row scale
# costs, timing only (values wrong), with untracked copies of bwd_sm90.cu (docs/bench/bwd_session23.txt says how they
# were made): _wg1pre (threads BM..2 BM - 1 load one value per row and store it, no arithmetic: the cost of a scale
# precomputed by an earlier pass), _wg0 (threads < BM load lse, D and that value; the second warpgroup fetches
# nothing), _noscale (no scale fetched or read). A/B, two rounds, d 64, fixed point forced   -> ab_<set>_<round>.txt
source scripts/device_env.sh
source_switch bwd
fixed_variants_ab bwd_sm90.cu bwd_sm90_wg1pre.cu bwd_sm90_wg0.cu bwd_sm90_noscale.cu
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

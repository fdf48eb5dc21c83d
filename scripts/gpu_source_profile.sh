#!/usr/bin/env bash
# Where the Hopper forward's short cells wait, per SASS instruction (issue 8), then an A/B of the forward's short
# cells, in one device call from the repository root:
#
#     OUT=... bash scripts/gpu_source_profile.sh
#
#   1. Nsight Compute's warp-state sampling per instruction (SourceCounters) on the main kernel of each case of
#      PROFILE_CASES ("name|profile_kernels.py arguments[|kernel regex, default fwd_sm90];..."; a peer's kernel with
#      profile_kernels.py --peer and its regex), exported as the source page's CSV (SASS)
#                                                                            -> src_<name>.csv, ncu_<name>.txt
#   2. if AB is set: gpu_ab.sh over AB's sets, ROUNDS (3) rounds, bench_attention.py --op fwd AB_BENCH_ARGS (the
#      short cells, cuflash alone); FWD_SOURCE_AB=1 makes the kernel file a switch (CUFLASH_FWD_SM90_SOURCE)
# Logs in $OUT/logs.tgz.
source scripts/device_env.sh
if [ "${FWD_SOURCE_AB:-0}" = 1 ]; then source_switch fwd; fi
NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
IFS=';' read -r -a cases <<<"${PROFILE_CASES:-\
d64_512|--op fwd --headdim 64 --heads 32 --batch 32 --seqlen 512;\
d128_512|--op fwd --headdim 128 --heads 16 --batch 32 --seqlen 512}"
for case in "${cases[@]}"; do
    IFS='|' read -r name args regex <<<"$case"
    [ -n "$NCU_BIN" ] || { echo "no ncu"; break; }
    timeout -k 5 "${NCU_TIMEOUT:-120}" "$NCU_BIN" -k "regex:${regex:-fwd_sm90}" --launch-skip 2 -c 1 \
        --section SourceCounters --section WarpStateStats --section SpeedOfLight -f -o "$OUT/rep_$name" \
        python3 benchmarks/profile_kernels.py $args --warmup 3 --iters 1 >"$OUT/ncu_$name.txt" 2>&1
    echo "ncu $name: exit $? [$((SECONDS - t0))s]"
    "$NCU_BIN" -i "$OUT/rep_$name.ncu-rep" --page source --csv --print-source sass >"$OUT/src_$name.csv" 2>&1
    echo "source page $name: exit $? $(wc -l <"$OUT/src_$name.csv") lines"
    "$NCU_BIN" -i "$OUT/rep_$name.ncu-rep" --page details >>"$OUT/ncu_$name.txt" 2>&1
    head -3 "$OUT/src_$name.csv" | cut -c1-400
done
if [ -n "${AB:-}" ]; then
    AB="$AB" ROUNDS=${ROUNDS:-3} BENCH_TIMEOUT=${BENCH_TIMEOUT:-120} \
        BENCH="benchmarks/bench_attention.py --op fwd ${AB_BENCH_ARGS:---seqlens 512,1024,2048,4096 --impls cuflash}" \
        bash scripts/gpu_ab.sh
    python3 scripts/ab_table.py "$OUT"
fi
cd "$OUT" && tar czf logs.tgz ./*.txt ./*.csv 2>/dev/null; rm -f ./*.txt ./*.csv ./*.ncu-rep

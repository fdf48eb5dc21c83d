#!/usr/bin/env bash
# The sweep behind the Hopper forward's variant tables (cuflash/plan.py), in one device run from the repository root:
#
#     OUT=out bash scripts/sm90_sweep.sh [DIMS]                       # DIMS: head dims, default 64,128,256
#
#   1. every portable and Hopper kernel compiled ahead (scripts/precompile.py --hopper)
#   2. the long table: benchmarks/bench_sm90.py for each Hopper variant at DIMS and SWEEP_SEQLENS
#      (512,1024,2048,4096,16384), then scripts/pick_sm90_variants.py: per head dim the variant with the best
#      geometric mean over the cells past 2048 keys, as a CUFLASH_SM90_VARIANTS value
#   3. the short table (when SHORT_SETS is given): benchmarks/bench_attention.py --op fwd at 512-2k keys, cuflash
#      alone, under each candidate CUFLASH_SM90_SHORT_VARIANTS value of SHORT_SETS (';'-separated, "-" = the
#      planner's own table), ROUNDS (2) rounds interleaved; then scripts/pick_short_variants.py: per cell the
#      fastest variant when it beats the head dim's default by more than 2%
#                                                      -> $OUT/sweep.txt (every table), $OUT/picks.txt (the picks)
# The picks' last lines are the two switches; check them with the whole GPU check before writing them into the
# planner's tables:
#
#     CUFLASH_SM90_VARIANTS=... CUFLASH_SM90_SHORT_VARIANTS=... bash scripts/gpu_check.sh
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
tmp=${TMPDIR:-/tmp}/sm90_sweep
mkdir -p "$tmp"
dims=${1:-64,128,256}
t0=$SECONDS
: >"$OUT/sweep.txt"
: >"$OUT/picks.txt"

timeout -k 5 300 python3 scripts/precompile.py --hopper --workers 16 >"$tmp/precompile.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$tmp/precompile.log")"

jsons=()
for v in $(python3 -c "from cuflash.ops import forward_sm90; print(*forward_sm90.VARIANTS)"); do
    timeout -k 5 120 python3 benchmarks/bench_sm90.py --variant "$v" --dims "$dims" \
        --seqlens "${SWEEP_SEQLENS:-512,1024,2048,4096,16384}" --json "$tmp/sm90_$v.json" >>"$OUT/sweep.txt" 2>&1
    echo "bench_sm90 $v: exit $? [$((SECONDS - t0))s]"
    jsons+=("$tmp/sm90_$v.json")
done
python3 scripts/pick_sm90_variants.py "${jsons[@]}" >"$tmp/long.txt" 2>>"$OUT/sweep.txt"
echo "CUFLASH_SM90_VARIANTS=$(tail -1 "$tmp/long.txt")" | tee -a "$OUT/picks.txt"
grep -E "geomean|seqlen <=|short-sequence" "$OUT/sweep.txt" | tee -a "$OUT/picks.txt"

if [ -n "${SHORT_SETS:-}" ]; then
    IFS=';' read -r -a sets <<<"$SHORT_SETS"
    picks=()
    for i in "${!sets[@]}"; do picks+=("set$i=${sets[$i]}:"); done
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for i in "${!sets[@]}"; do
            json="$tmp/short_${i}_${round}.json"
            if [ "${sets[$i]}" = "-" ]; then switch=(-u CUFLASH_SM90_SHORT_VARIANTS)
            else switch=("CUFLASH_SM90_SHORT_VARIANTS=${sets[$i]}"); fi
            env "${switch[@]}" timeout -k 5 90 python3 benchmarks/bench_attention.py --op fwd --placements 1 \
                --seqlens 512,1024,2048 --impls cuflash --json "$json" >>"$OUT/sweep.txt" 2>&1
            echo "short set $i (${sets[$i]}) round $round: exit $? [$((SECONDS - t0))s]"
            picks[$i]="${picks[$i]}$json+"
        done
    done
    python3 scripts/pick_short_variants.py "${picks[@]%+}" >"$tmp/short.txt" 2>&1
    cat "$tmp/short.txt" >>"$OUT/sweep.txt"
    echo "CUFLASH_SM90_SHORT_VARIANTS=$(tail -1 "$tmp/short.txt")" | tee -a "$OUT/picks.txt"
fi
echo "done [$((SECONDS - t0))s]"

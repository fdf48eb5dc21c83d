#!/usr/bin/env bash
# Benchmark every Hopper forward variant (cuflash.hopper.VARIANTS) with benchmarks/bench_sm90.py at the head dims
# given, appending the tables to BENCH, and print the fastest per head dim (scripts/pick_sm90_variants.py) on
# stdout in CUFLASH_SM90_VARIANTS' form (over the cells past 2048 keys; the short cells' picks per causal go to
# BENCH). Seqlens: SWEEP_SEQLENS (512,1024,2048,4096,16384). Used by gpu_release.sh and gpu_drafts.sh.
#
#     bash scripts/sm90_sweep.sh 64,128 "$OUT/bench.txt"
set -u
dims=$1 bench=$2
t0=$SECONDS
jsons=()
for v in $(python3 -c "from cuflash import hopper; print(*hopper.VARIANTS)"); do
    timeout -k 5 120 python3 benchmarks/bench_sm90.py --variant "$v" --dims "$dims" \
        --seqlens "${SWEEP_SEQLENS:-512,1024,2048,4096,16384}" \
        --json "${TMPDIR:-/tmp}/sm90_$v.json" >>"$bench" 2>&1
    echo "sm90 bench ($v): exit $? [$((SECONDS - t0))s]" >&2
    jsons+=("${TMPDIR:-/tmp}/sm90_$v.json")
done
python3 scripts/pick_sm90_variants.py "${jsons[@]}" 2>>"$bench"
grep -E "geomean|seqlen <=|short-sequence" "$bench" >&2

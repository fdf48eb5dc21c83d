#!/usr/bin/env bash
# An A/B of two or more switch sets (environment variables, or whole packages through PYTHONPATH) on one benchmark,
# rounds interleaved, in one device run from the repository root:
#
#     OUT=out AB="CUFLASH_X=0;CUFLASH_X=1" BENCH="benchmarks/bench_attention.py --op fwd" bash scripts/gpu_ab.sh
#     OUT=out AB="PYTHONPATH=$PWD/base;PYTHONPATH=$PWD" BENCH="benchmarks/bench_attention.py --op bwd --dims 64" \
#         bash scripts/gpu_ab.sh
#     python3 scripts/ab_table.py out [--column cuflash_det]   # the sets side by side, and their median ratios
#
# AB: switch sets split by ';', variables inside a set by spaces (a value may hold commas). Each set runs BENCH once
# per round (ROUNDS, 2) in the order A B A B ..., so that a drift of the GPU's clocks or of the host shows as a
# difference between rounds, not between the sets                                   -> $OUT/ab<AB_TAG>_<set>_<round>.txt
# A second package (a checkout of the base commit, e.g. `git worktree add base <rev>` made before the run) is one set
# with PYTHONPATH pointing at it. AB_OWN_BENCH=1: such a set runs its own tree's copy of BENCH's script, where this
# tree's benchmark calls what the other package lacks (the measurement is then each tree's own).
# Environment: OUT (./out), AB, BENCH, ROUNDS (2), BENCH_TIMEOUT (120), AB_TAG ("": a second A/B in the same $OUT),
# AB_COLUMNS ("cuflash": the columns scripts/ab_table.py prints at the end, e.g. "cuflash cuflash_det", or
# "cuflash_fp8" for bench_fp8.py).
# bench_attention.py measures each cell on one allocation here (CUFLASH_BENCH_PLACEMENTS, default 1 in an A/B: every
# round is a fresh process, whose tensors lie elsewhere anyway).
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export CUFLASH_BENCH_PLACEMENTS=${CUFLASH_BENCH_PLACEMENTS:-1}
t0=$SECONDS
IFS=';' read -r -a ab_sets <<<"${AB:?AB: switch sets, e.g. CUFLASH_X=0;CUFLASH_X=1}"
for round in $(seq 1 "${ROUNDS:-2}"); do
    for i in "${!ab_sets[@]}"; do
        read -r -a vars <<<"${ab_sets[$i]}"
        log="$OUT/ab${AB_TAG:-}_${i}_$round.txt"
        bench=${BENCH:?BENCH: a benchmark script and its arguments}
        if [ "${AB_OWN_BENCH:-0}" = 1 ]; then  # the set's PYTHONPATH's first folder holding BENCH's script
            script=${BENCH%% *}
            for v in "${vars[@]}"; do
                root=${v#PYTHONPATH=}
                root=${root%%:*}
                if [ "$v" != "$root" ] && [ -f "$root/$script" ]; then bench="$root/$script${BENCH#"$script"}"; fi
            done
        fi
        echo "### ${vars[*]}: python3 $bench" >"$log"
        env "${vars[@]}" timeout -k 5 "${BENCH_TIMEOUT:-120}" python3 $bench >>"$log" 2>&1
        echo "set $i (${vars[*]}) round $round: exit $? [$((SECONDS - t0))s]"
    done
done
echo "done [$((SECONDS - t0))s]"
# the sets side by side, in the run's own output (AB_COLUMNS: the table's columns, "cuflash" by default)
for column in ${AB_COLUMNS:-cuflash}; do
    python3 scripts/ab_table.py "$OUT" ${AB_TAG:+--tag "$AB_TAG"} --column "$column"
done

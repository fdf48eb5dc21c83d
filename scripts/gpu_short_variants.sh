#!/usr/bin/env bash
# The Hopper forward's short-sequence table chosen and checked in one device call, from the repository root:
#
#     OUT=... bash scripts/gpu_short_variants.sh
#
#   1. the Hopper kernels compiled ahead (scripts/precompile.py --hopper)                                -> pre.log
#   2. benchmarks/bench_attention.py --op fwd at 512-2k keys, cuflash only, under each candidate table of
#      SHORT_SETS (';'-separated CUFLASH_SM90_SHORT_VARIANTS values, "-" = unset), ROUNDS rounds interleaved
#                                                                                              -> short_<set>_<round>.json
#   3. scripts/pick_short_variants.py: per (head dim, causal) the fastest variant by more than 2%, exported as
#      CUFLASH_SM90_SHORT_VARIANTS for everything after                                                -> pick.txt
#   4. tests/gpu/test_sm90.py -k NEW_VARIANTS (the variants not yet checked by an earlier call)      -> sm90_new.log
#   5. scripts/gpu_release.sh with the picked table: the full GPU suite (test_sm90 skipped), the sanitizers, the
#      forward benchmark on the ANCHORS grid (backward and decode benchmarks skipped)                 -> release/
# Environment: OUT, SHORT_SETS, ROUNDS (2), NEW_VARIANTS (pingpong_n128_p), TESTS_TIMEOUT (300).
source scripts/device_env.sh
timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/pre.log" 2>&1
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/pre.log")"
IFS=';' read -r -a sets <<<"${SHORT_SETS:--;64:ws_n128_p,128:pingpong_n128_p,128c:pingpong_n128_p}"
picks=()
for i in "${!sets[@]}"; do picks+=("set$i=${sets[$i]}:"); done
for round in $(seq 1 "${ROUNDS:-2}"); do
    for i in "${!sets[@]}"; do
        json="$OUT/short_${i}_${round}.json"
        if [ "${sets[$i]}" = "-" ]; then
            env -u CUFLASH_SM90_SHORT_VARIANTS timeout -k 5 60 python3 benchmarks/bench_attention.py --op fwd \
                --seqlens 512,1024,2048 --impls cuflash --json "$json" >/dev/null 2>&1
        else
            CUFLASH_SM90_SHORT_VARIANTS=${sets[$i]} timeout -k 5 60 python3 benchmarks/bench_attention.py --op fwd \
                --seqlens 512,1024,2048 --impls cuflash --json "$json" >/dev/null 2>&1
        fi
        echo "bench set $i (${sets[$i]}) round $round: exit $? [$((SECONDS - t0))s]"
        picks[$i]="${picks[$i]}$json+"
    done
done
python3 scripts/pick_short_variants.py "${picks[@]%+}" >"$OUT/pick.txt" 2>&1
cat "$OUT/pick.txt"
export CUFLASH_SM90_SHORT_VARIANTS=$(tail -1 "$OUT/pick.txt")
echo "CUFLASH_SM90_SHORT_VARIANTS=$CUFLASH_SM90_SHORT_VARIANTS [$((SECONDS - t0))s]"
timeout -k 5 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_sm90.py \
    -k "${NEW_VARIANTS:-pingpong_n128_p}" >"$OUT/sm90_new.log" 2>&1
echo "test_sm90 -k ${NEW_VARIANTS:-pingpong_n128_p}: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/sm90_new.log")"
grep -E "^FAILED|^E  " "$OUT/sm90_new.log" | head -8
mkdir -p "$OUT/release"
OUT="$OUT/release" SM90_VARIANTS=default SKIP_SM90_TESTS=1 SKIP_BWD_BENCH=1 SKIP_DECODE_BENCH=1 \
    TESTS_TIMEOUT=${TESTS_TIMEOUT:-300} SANITIZE_TIMEOUT=80 bash scripts/gpu_release.sh
echo "done [$((SECONDS - t0))s]"

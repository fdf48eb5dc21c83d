#!/usr/bin/env bash
# Deterministic mode's fixed point (session 16), one device call from the repository root (OUT=... bash
# scripts/gpu_fixed_dq.sh): scripts/smoke_fixed_dq.py under a timeout, then, if it passed, session 13's landing call
# (scripts/gpu_session13.sh, the same variables: the GPU suite, the sm90_ sanitizer cases, BWD_AB), then, unless
# SKIP_BWD_BENCH=1, bench_attention.py --op bwd on the ANCHORS grid beside the peers          -> bench_bwd.txt
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
timeout -k 5 "${SMOKE_TIMEOUT:-150}" python3 scripts/smoke_fixed_dq.py >"$OUT/smoke_fixed.txt" 2>&1
rc=$?
tail -20 "$OUT/smoke_fixed.txt"
echo "smoke: exit $rc"
if [ $rc -ne 0 ]; then
    cd "$OUT" && tar czf logs.tgz ./*.txt && rm -f ./*.txt
    exit $rc
fi
SKIP_BENCH=${SKIP_BENCH:-1} bash scripts/gpu_session13.sh
if [ "${SKIP_BWD_BENCH:-0}" != 1 ]; then
    mkdir -p "$OUT/bwd" && t1=$SECONDS
    timeout -k 5 "${BWD_BENCH_TIMEOUT:-240}" python3 benchmarks/bench_attention.py --op bwd ${BWD_BENCH_ARGS:-} \
        >"$OUT/bwd/bench_bwd.txt" 2>&1
    echo "bwd bench: exit $? [$((SECONDS - t1))s]"
    awk '/^===/{p=1} p' "$OUT/bwd/bench_bwd.txt"
fi

#!/usr/bin/env bash
# The whole GPU check, in one command on the device machine, from the repository root:
#
#     bash scripts/gpu_check.sh
#
# Steps (each timed; each can be skipped):
#   env        nvidia-smi and versions                                      -> $OUT/env.txt
#   tests      the GPU suite (SKIP_TESTS=1): every kernel compiled ahead (scripts/precompile.py --hopper), then
#              tests/gpu dealt round-robin to SHARDS pytest processes at once (default 8; the CPU reference is
#              what takes the time); SHARDS=1 runs one `pytest -m gpu`, PER_FILE=1 one process per test file
#              (scripts/pytest_per_file.sh)                                  -> $OUT/pytest_gpu.log
#   sanitize   compute-sanitizer memcheck, racecheck over scripts/sanitize_cases.py
#                                                        (SKIP_SANITIZE=1)   -> $OUT/memcheck.log, racecheck.log
#   bench      benchmarks/bench_attention.py --op all: forward then backward (SKIP_BENCH=1), then
#              benchmarks/bench_varlen.py --bwd --paged 16,256 --fp8 (SKIP_VARLEN=1, rows appended with op
#              "varlen"), then
#              bench_attention.py at head dims 59, 111, 200, 256 (SKIP_DIMS=1, rows appended), then
#              benchmarks/bench_overhead.py (SKIP_OVERHEAD=1), then benchmarks/bench_decode.py (SKIP_DECODE=1)
#                                         -> $OUT/bench.txt (every table), bench.json, overhead.json, decode.json
# then a short summary on stdout with the tables benchmarks/report.py makes of the two JSON files. Exit status 1
# if any step that ran failed. The plots and the docs' tables come from those files, on any machine:
#
#     python3 benchmarks/report.py --bench out/bench.json --decode out/decode.json \
#         --save docs/bench/results.json --plots docs/bench --readme README.md --docs docs/benchmarks.md
#
# Environment:
#   OUT            output folder (default ./out); the device returns at most 8 files, this script writes 8.
#   SHARDS, PER_FILE   how the suite runs (above)
#   PYTEST_ARGS    appended to the pytest call(s), e.g. PYTEST_ARGS='-k forward --hypothesis-seed=0'
#   SANITIZE_ARGS  appended to sanitize_cases.py, e.g. SANITIZE_ARGS='--only fwd_'
#   BENCH_ARGS     appended to bench_attention.py, e.g. BENCH_ARGS='--quick', or '--op fwd' for the
#                  forward alone (the last --op wins)
#   TESTS_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT   seconds per step (default: none; a shard gets TESTS_TIMEOUT);
#                  the device kills a whole command after 600 s, so budget the steps.
# The repository is not pip-installed there: it is imported through PYTHONPATH.

set -u

OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX shares the GPU with torch and CuPy

# Extra arguments, split like a shell line (quotes honoured): PYTEST_ARGS="-k 'fwd and not d256'".
eval "PYTEST_EXTRA=(${PYTEST_ARGS:-})"
eval "SANITIZE_EXTRA=(${SANITIZE_ARGS:-})"
eval "BENCH_EXTRA=(${BENCH_ARGS:-})"

FAILED=0
SUMMARY=()   # one line per step: name, status, seconds

# run_step NAME TIMEOUT_SECONDS LOGFILE CMD...  -- output to the log and to stdout,
# so the output_tail sees progress. Returns the command's exit status.
run_step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local t0=$SECONDS rc
    echo
    echo "### $name: $*"
    if [ -n "$limit" ]; then
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    else
        "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    local dt=$((SECONDS - t0))
    [ "$rc" = 124 ] && echo "### $name: timed out after ${limit}s" | tee -a "$log"
    echo "### $name: exit $rc after ${dt}s"
    LAST_DT=$dt
    return "$rc"
}

# run_sharded N: every kernel compiled ahead (16 processes), then every GPU test dealt round-robin to N pytest
# processes that run at once, each under TESTS_TIMEOUT and compiling with one worker (a worker is a CUDA context;
# 8 processes of 16 workers ran out of memory). Prints each shard's log, then one summary line of the counts summed.
run_sharded() {
    local n=$1 i ids=() tmp=${TMPDIR:-/tmp}/gpu_check_shards rc=0
    mkdir -p "$tmp"
    timeout -k 5 300 python3 scripts/precompile.py --hopper --workers 16 2>&1 | tail -1
    python3 -m pytest tests -m gpu -q --collect-only -p no:cacheprovider 2>/dev/null | grep '::' >"$tmp/ids.txt"
    echo "collected $(wc -l <"$tmp/ids.txt") GPU tests"
    for i in $(seq 0 $((n - 1))); do
        mapfile -t ids < <(awk -v n="$n" -v i="$i" '(NR - 1) % n == i' "$tmp/ids.txt")
        CUFLASH_TEST_COMPILE_WORKERS=1 OMP_NUM_THREADS=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 )) \
            ${TESTS_TIMEOUT:+timeout -k 5 "$TESTS_TIMEOUT"} python3 -m pytest -q --tb=short -p no:cacheprovider \
            ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"} "${ids[@]}" >"$tmp/shard_$i.log" 2>&1 &
    done
    wait
    for i in $(seq 0 $((n - 1))); do
        echo "### shard $i"
        cat "$tmp/shard_$i.log"
        grep -qE "[0-9]+ passed" "$tmp/shard_$i.log" || rc=1
        grep -qE "[0-9]+ (failed|errors?)\b" "$tmp/shard_$i.log" && rc=1
    done
    python3 - "$tmp"/shard_*.log <<'PY'
import re, sys
total = {}
for path in sys.argv[1:]:
    lines = [l for l in open(path) if re.search(r"\d+ (passed|failed|errors?|skipped)", l)]
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", lines[-1] if lines else ""):
        word = "errors" if word == "error" else word
        total[word] = total.get(word, 0) + int(n)
print("all shards: " + ", ".join(f"{v} {k}" for k, v in total.items()) + f" ({len(sys.argv) - 1} shards)")
PY
    return "$rc"
}

record() {  # record NAME STATUS SECONDS
    SUMMARY+=("$(printf '%-10s %-28s %5ss' "$1" "$2" "$3")")
}

# --------------------------------------------------------------------------- env
t0=$SECONDS
{
    echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
    echo "host: $(uname -a)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo
    nvidia-smi || echo "nvidia-smi failed"
    echo
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
        --format=csv 2>/dev/null
    echo
    python3 --version
    python3 - <<'EOF'
import importlib
for name in ("numpy", "cupy", "ml_dtypes", "torch", "triton", "jax", "pytest", "hypothesis", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{name} not importable: {e}")
try:
    import torch
    print("torch cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
          "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
except Exception as e:
    print("torch device query failed:", e)
try:
    import cupy
    print("cupy runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion(),
          "nvrtc", cupy.cuda.nvrtc.getVersion())
except Exception as e:
    print("cupy device query failed:", e)
EOF
    echo
    (nvcc --version 2>/dev/null | tail -2) || echo "nvcc not on PATH"
    (compute-sanitizer --version 2>/dev/null | head -3) || echo "compute-sanitizer not on PATH"
} >"$OUT/env.txt" 2>&1
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
record env "ok (${GPU_NAME:-no GPU})" $((SECONDS - t0))

# ------------------------------------------------------------------------- tests
PYTEST_SUMMARY="(skipped)"
if [ "${SKIP_TESTS:-0}" = 1 ]; then
    record tests skipped 0
else
    if [ "${PER_FILE:-0}" = 1 ]; then
        # one process per test file: an illegal address kills the CUDA context of its process only
        run_step tests "${TESTS_TIMEOUT:-}" "$OUT/pytest_gpu.log" bash scripts/pytest_per_file.sh \
            ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"}
    elif [ "${SHARDS:-8}" -gt 1 ]; then
        run_step tests "" "$OUT/pytest_gpu.log" run_sharded "${SHARDS:-8}"
    else
        run_step tests "${TESTS_TIMEOUT:-}" "$OUT/pytest_gpu.log" \
            python3 -m pytest tests -m gpu -q -x -p no:cacheprovider ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"}
    fi
    rc=$?
    PYTEST_SUMMARY=$(grep -E '^all (shards|files):|([0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed))|no tests ran' \
        "$OUT/pytest_gpu.log" | tail -1)
    if [ "$rc" = 0 ]; then
        record tests ok "$LAST_DT"
    elif [ "$rc" = 5 ]; then  # pytest: no test selected; not a failure of the code
        record tests "no gpu tests collected" "$LAST_DT"
    else
        record tests "FAILED (exit $rc)" "$LAST_DT"
        FAILED=1
    fi
fi

# ---------------------------------------------------------------------- sanitize
find_sanitizer() {
    command -v compute-sanitizer && return 0
    local p
    for p in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
             /opt/nvidia/compute-sanitizer/compute-sanitizer; do
        [ -x "$p" ] && { echo "$p"; return 0; }
    done
    return 1
}

if [ "${SKIP_SANITIZE:-0}" = 1 ]; then
    record memcheck skipped 0
    record racecheck skipped 0
elif ! SAN=$(find_sanitizer); then
    echo "compute-sanitizer not found" | tee "$OUT/memcheck.log"
    record memcheck "FAILED (no compute-sanitizer)" 0
    FAILED=1
else
    run_step memcheck "${SANITIZE_TIMEOUT:-}" "$OUT/memcheck.log" \
        "$SAN" --tool memcheck --error-exitcode 9 --print-limit 200 \
        python3 scripts/sanitize_cases.py ${SANITIZE_EXTRA[@]+"${SANITIZE_EXTRA[@]}"}
    rc=$?
    if [ "$rc" = 0 ]; then record memcheck ok "$LAST_DT"
    else record memcheck "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi

    run_step racecheck "${SANITIZE_TIMEOUT:-}" "$OUT/racecheck.log" \
        "$SAN" --tool racecheck --racecheck-report all --error-exitcode 9 --print-limit 200 \
        python3 scripts/sanitize_cases.py ${SANITIZE_EXTRA[@]+"${SANITIZE_EXTRA[@]}"}
    rc=$?
    if [ "$rc" = 0 ]; then record racecheck ok "$LAST_DT"
    else record racecheck "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi
fi

# ------------------------------------------------------------------------- bench
if [ "${SKIP_BENCH:-0}" = 1 ]; then
    record bench skipped 0
else
    # One process, forward then backward: one bench.txt, one bench.json (rows with field "op").
    run_step bench "${BENCH_TIMEOUT:-}" "$OUT/bench.txt" \
        python3 benchmarks/bench_attention.py --op all --json "$OUT/bench.json" \
        ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"}
    rc=$?
    if [ "$rc" = 0 ]; then record bench ok "$LAST_DT"
    else record bench "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi

    # Packed variable-length sequences: its log goes to the end of bench.txt and its rows into bench.json.
    if [ "${SKIP_VARLEN:-0}" != 1 ]; then
        run_step varlen "${BENCH_TIMEOUT:-}" "${TMPDIR:-/tmp}/bench_varlen.txt" \
            python3 benchmarks/bench_varlen.py --bwd --paged 16,256 --fp8 --json "$OUT/bench.json" --append
        rc=$?
        cat "${TMPDIR:-/tmp}/bench_varlen.txt" >>"$OUT/bench.txt"
        if [ "$rc" = 0 ]; then record varlen ok "$LAST_DT"
        else record varlen "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi
    fi

    # Head dims beyond 64 and 128 (not multiples of 8: padded copies; 256), forward and backward beside the peers:
    # its log to bench.txt, its rows into bench.json.
    if [ "${SKIP_DIMS:-0}" != 1 ]; then
        run_step dims "${BENCH_TIMEOUT:-}" "${TMPDIR:-/tmp}/bench_dims.txt" \
            python3 benchmarks/bench_attention.py --op all --dims 59,111,200,256 --seqlens 2048,8192 \
            --json "${TMPDIR:-/tmp}/bench_dims.json"
        rc=$?
        cat "${TMPDIR:-/tmp}/bench_dims.txt" >>"$OUT/bench.txt"
        python3 -c 'import json, sys; rows = json.load(open(sys.argv[1])) + json.load(open(sys.argv[2]));
json.dump(rows, open(sys.argv[1], "w"), indent=1)' "$OUT/bench.json" "${TMPDIR:-/tmp}/bench_dims.json" || rc=1
        if [ "$rc" = 0 ]; then record dims ok "$LAST_DT"
        else record dims "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi
    fi

    # Per-call cost of every entry point beside its peer (host and GPU together): overhead.json.
    if [ "${SKIP_OVERHEAD:-0}" != 1 ]; then
        run_step overhead "${BENCH_TIMEOUT:-}" "${TMPDIR:-/tmp}/bench_overhead.txt" \
            python3 benchmarks/bench_overhead.py --json "$OUT/overhead.json"
        rc=$?
        cat "${TMPDIR:-/tmp}/bench_overhead.txt" >>"$OUT/bench.txt"
        if [ "$rc" = 0 ]; then record overhead ok "$LAST_DT"
        else record overhead "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi
    fi

    # Decode (attention_with_kvcache) beside SDPA flash and cuDNN: its log to bench.txt, its rows to decode.json.
    if [ "${SKIP_DECODE:-0}" != 1 ]; then
        run_step decode "${BENCH_TIMEOUT:-}" "${TMPDIR:-/tmp}/bench_decode.txt" \
            python3 -W ignore::DeprecationWarning benchmarks/bench_decode.py --json "$OUT/decode.json"
        rc=$?
        { echo; echo "=== cuflash Decode (bf16, one new row, 32 query heads, 8 KV heads, d 128; us per call) ==="
          cat "${TMPDIR:-/tmp}/bench_decode.txt"; } >>"$OUT/bench.txt"
        if [ "$rc" = 0 ]; then record decode ok "$LAST_DT"
        else record decode "FAILED (exit $rc)" "$LAST_DT"; FAILED=1; fi
    fi
fi

# ----------------------------------------------------------------------- summary
echo
echo "================================ gpu_check summary ================================"
for line in "${SUMMARY[@]}"; do echo "$line"; done
echo
echo "pytest:    ${PYTEST_SUMMARY:-(no summary line)}"
for tool in memcheck racecheck; do
    log="$OUT/$tool.log"
    [ -f "$log" ] || continue
    echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sed 's/^=* *//' | tr '\n' ' ')"
    echo "           $(grep -E 'sanitize cases (ok|FAILED)|^skipped [0-9]+ case' "$log" | tr '\n' ' ')"
done
if [ -f "$OUT/bench.json" ] || [ -f "$OUT/decode.json" ]; then
    echo
    # the tables the docs carry, from the JSON files (benchmarks/report.py prints them without --readme/--docs)
    python3 benchmarks/report.py --bench "$OUT/bench.json" --decode "$OUT/decode.json" 2>&1 | head -120
    grep -E '^!!! FAIL|^CUDA context is broken|^cuflash: (import failed|no attention_backward)' \
        "$OUT/bench.txt" 2>/dev/null | head -20
elif [ -f "$OUT/bench.txt" ]; then
    echo "bench (no JSON; last lines):"
    tail -5 "$OUT/bench.txt"
fi
echo
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ "$FAILED" = 0 ]; then echo "gpu_check: ALL OK"; else echo "gpu_check: FAILED"; fi
exit "$FAILED"

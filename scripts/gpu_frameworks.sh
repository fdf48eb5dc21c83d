#!/usr/bin/env bash
# The framework wrappers on the device, in one command from the repository root:
#
#     bash scripts/gpu_frameworks.sh
#
# Steps (each timed, output also on stdout):
#   precompile  the fp16/bf16 d64/d128 forward and backward kernels, 16 processes (SKIP_PRECOMPILE=1)
#   tests       pytest tests/gpu/test_torch.py tests/gpu/test_jax.py        -> $OUT/frameworks_tests.log
#   examples    examples/cupy_example.py, torch_gpt.py, jax_example.py      -> $OUT/frameworks_examples.log
#   overhead    benchmarks/bench_overhead.py (table appended to the examples log) -> $OUT/overhead.json
# Three files in $OUT (default ./out). Exit status 1 if any step failed.
#
# Environment: OUT, PYTEST_ARGS (appended to pytest), SKIP_TESTS=1, SKIP_EXAMPLES=1, SKIP_BENCH=1.
# The repository is used through PYTHONPATH, not installed. JAX is told not to preallocate GPU memory
# (it shares the GPU with torch and CuPy in one process).

source scripts/device_env.sh
eval "PYTEST_EXTRA=(${PYTEST_ARGS:-})"

TESTS_LOG="$OUT/frameworks_tests.log"
EXAMPLES_LOG="$OUT/frameworks_examples.log"
: >"$EXAMPLES_LOG"
FAILED=0
SUMMARY=()

step() {  # step NAME LOG CMD...  (appends to LOG)
    local name=$1 log=$2 t0=$SECONDS rc
    shift 2
    echo "### $name: $*" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "### $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
    SUMMARY+=("$(printf '%-16s %-10s %4ss' "$name" "$([ "$rc" = 0 ] && echo ok || echo "FAILED($rc)")" $((SECONDS - t0)))")
    [ "$rc" = 0 ] || FAILED=1
    return "$rc"
}

{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
    python3 - <<'PY'
import importlib
for name in ("torch", "jax", "jaxlib", "cupy", "ml_dtypes"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "not importable:", e)
try:
    import jax
    print("jax devices:", jax.devices())
except Exception as e:
    print("jax devices failed:", e)
PY
} 2>&1 | tee "$TESTS_LOG"

if [ "${SKIP_PRECOMPILE:-0}" != 1 ]; then
    step precompile "$TESTS_LOG" python3 scripts/precompile.py --pattern '(fwd|bwd)_' --headdims 64,128 --workers 16
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    step tests "$TESTS_LOG" python3 -m pytest -q -p no:cacheprovider -rs \
        tests/gpu/test_torch.py tests/gpu/test_jax.py ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"}
fi

if [ "${SKIP_EXAMPLES:-0}" != 1 ]; then
    step cupy_example "$EXAMPLES_LOG" timeout 120 python3 examples/cupy_example.py
    step torch_gpt "$EXAMPLES_LOG" timeout 180 python3 examples/torch_gpt.py
    step jax_example "$EXAMPLES_LOG" timeout 120 python3 examples/jax_example.py
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
    step overhead "$EXAMPLES_LOG" timeout 180 python3 benchmarks/bench_overhead.py --json "$OUT/overhead.json"
fi

echo
echo "============================ gpu_frameworks summary ============================"
for line in "${SUMMARY[@]}"; do echo "$line"; done
echo "pytest: $(grep -E '[0-9]+ (passed|failed)' "$TESTS_LOG" | tail -1)"
grep -E '^(=== per-call|cuflash.torch / sdpa|sdpa forward|cuflash.torch forward)' "$EXAMPLES_LOG"
grep -E 'losses track|max rel. diff|max \|' "$EXAMPLES_LOG"
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ "$FAILED" = 0 ]; then echo "gpu_frameworks: ALL OK"; else echo "gpu_frameworks: FAILED"; fi
exit "$FAILED"

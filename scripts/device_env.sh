# Sourced by the device scripts (gpu_*.sh) from the repository root: strict mode, $OUT, the repository on
# PYTHONPATH (used in place, not installed), JAX told not to preallocate GPU memory (it shares the GPU with torch
# and CuPy), t0 for the elapsed times the steps print, precompile_and_test, run_gpu_tests, run_gpu_tests_parallel,
# run_gpu_suite, sanitize_both and precompile_hopper.
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
t0=$SECONDS

# precompile_and_test PATTERN TEST_FILE LOG SECONDS: the kernels whose names match PATTERN compiled ahead
# (scripts/precompile.py), then the GPU test file under a timeout, both logged to LOG; prints each step's status.
precompile_and_test() {
    local pattern=$1 file=$2 log=$3 limit=$4
    timeout -k 5 200 python3 scripts/precompile.py --pattern "$pattern" --workers 16 >"$log" 2>&1
    echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$log")"
    timeout -k 5 "$limit" python3 -m pytest -q --tb=short -p no:cacheprovider "$file" >>"$log" 2>&1
    echo "$(basename "$file" .py): exit $? [$((SECONDS - t0))s] $(grep -E 'passed|failed' "$log" | tail -1)"
    grep -E "^FAILED|^E  " "$log" | head -8
}

# run_gpu_tests SECONDS FILE[:FILTER]...: each tests/gpu/FILE.py (with pytest -k FILTER if given) under a timeout
#                                                                      -> $OUT/FILE.log; prints each one's status.
run_gpu_tests() {
    local limit=$1 f file filter
    shift
    for f in "$@"; do
        IFS=: read -r file filter <<<"$f"
        timeout -k 5 "$limit" python3 -m pytest -q --tb=short -p no:cacheprovider "tests/gpu/$file.py" \
            ${filter:+-k "$filter"} >"$OUT/$file.log" 2>&1
        echo "$file ${filter:-}: exit $? [$((SECONDS - t0))s] $(grep -E 'passed|failed' "$OUT/$file.log" | tail -1)"
        grep -E "^FAILED|^E  " "$OUT/$file.log" | head -6
    done
}

# sanitize_both NAME SECONDS [VAR=value ...] [-- sanitize_cases.py arguments]: compute-sanitizer memcheck, then
# racecheck, over scripts/sanitize_cases.py with those variables set, each under a timeout
#                                                                  -> $OUT/NAME_memcheck.log, $OUT/NAME_racecheck.log
sanitize_both() {
    local name=$1 limit=$2 vars=() tool san
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for tool in memcheck racecheck; do
        env ${vars[@]+"${vars[@]}"} timeout -k 5 "$limit" "$san" --tool "$tool" --error-exitcode 9 --print-limit 50 \
            python3 scripts/sanitize_cases.py "$@" >"$OUT/${name}_$tool.log" 2>&1
        echo "$name $tool: exit $? [$((SECONDS - t0))s] $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
            "$OUT/${name}_$tool.log")"
    done
}

# run_gpu_tests_parallel SECONDS SHARDS FILE...: every test of tests/gpu/FILE.py, dealt round-robin to SHARDS pytest
# processes that run at once, each under the timeout (the CPU reference is what takes the time, and the device has 16
# cores). Compile the kernels ahead: each process compiles with one worker (a worker is a CUDA context; 8 processes
# of 16 ran out of memory)                                        -> $OUT/shard_I.log; prints each shard's status.
run_gpu_tests_parallel() {
    local limit=$1 shards=$2 i f files=() ids=()
    shift 2
    for f in "$@"; do files+=("tests/gpu/$f.py"); done
    python3 -m pytest -q --collect-only -p no:cacheprovider "${files[@]}" 2>/dev/null | grep '::' >"$OUT/ids.txt"
    echo "collected $(wc -l <"$OUT/ids.txt") tests from $* [$((SECONDS - t0))s]"
    for i in $(seq 0 $((shards - 1))); do
        mapfile -t ids < <(awk -v n="$shards" -v i="$i" '(NR - 1) % n == i' "$OUT/ids.txt")
        CUFLASH_TEST_COMPILE_WORKERS=1 OMP_NUM_THREADS=$((16 / shards)) timeout -k 5 "$limit" \
            python3 -m pytest -q --tb=short -p no:cacheprovider "${ids[@]}" >"$OUT/shard_$i.log" 2>&1 &
    done
    wait
    for i in $(seq 0 $((shards - 1))); do
        echo "shard $i: [$((SECONDS - t0))s] $(grep -E 'passed|failed|error' "$OUT/shard_$i.log" | tail -1)"
        grep -E "^FAILED|^ERROR|^E  " "$OUT/shard_$i.log" | head -6
    done
}

# source_switch fwd|bwd: the Hopper forward's (backward's) kernel file becomes CUFLASH_FWD_SM90_SOURCE
# (CUFLASH_BWD_SM90_SOURCE), default fwd_sm90.cu (bwd_sm90.cu), patched into cuflash/hopper.py here, so that copies of
# that file (untracked files of cuda_src/) can be A/B sets.
source_switch() {
    local file="$1_sm90.cu" var="CUFLASH_${1^^}_SM90_SOURCE"
    sed -i "s/    source = \"$file\"/    source = __import__(\"os\").environ.get(\"$var\", \"$file\")/" cuflash/hopper.py
    grep -q "$var" cuflash/hopper.py || { echo "the source switch $var did not patch in"; exit 2; }
}

# fixed_variants_ab FILE...: A/B, two rounds, d 64, the backward's fixed point forced, over these kernel files of
# cuda_src/ (the first usually bwd_sm90.cu; needs source_switch bwd)                            -> ab_<set>_<round>.txt
fixed_variants_ab() {
    local f sets=()
    for f in "$@"; do sets+=("CUFLASH_BWD_SM90_SOURCE=$f CUFLASH_BWD_SM90_DET=fixed"); done
    AB=$(IFS=';'; echo "${sets[*]}") ROUNDS=2 BENCH_TIMEOUT=200 \
        BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash_det --dims 64" bash scripts/gpu_ab.sh
    python3 scripts/ab_table.py "$OUT" --column cuflash_det
}

# run_gpu_suite FILE...: run_gpu_tests_parallel in 8 shards (TESTS_TIMEOUT, 300 s) over those test files of tests/gpu
# (GPU_TEST_FILES: all of them); sets suite_ok to 1 when every shard passed, else 0, and prints it.
GPU_TEST_FILES="test_sm90 test_forward test_varlen test_backward test_kvcache test_torch test_jax"
run_gpu_suite() {
    local i
    run_gpu_tests_parallel "${TESTS_TIMEOUT:-300}" 8 "$@"
    suite_ok=1
    grep -qE "[0-9]+ (failed|error)" "$OUT"/shard_*.log && suite_ok=0
    for i in $(seq 0 7); do grep -qE "[0-9]+ passed" "$OUT/shard_$i.log" || suite_ok=0; done
    echo "suite_ok=$suite_ok"
}

# suite_sanitize_bench "OPS": the whole GPU suite (run_gpu_suite over FILES, default GPU_TEST_FILES), then if it passed
# memcheck and racecheck over every case of scripts/sanitize_cases.py (SANITIZE_ONLY narrows them) and
# bench_attention.py --op OP beside the peers for each OP (fwd, bwd)         -> all_memcheck.log, all_racecheck.log,
#                                                                                                      bench_<op>.txt
suite_sanitize_bench() {
    local op
    run_gpu_suite ${FILES:-$GPU_TEST_FILES}
    [ $suite_ok = 1 ] || return 0
    sanitize_both all "${SANITIZE_TIMEOUT:-200}" -- --only "${SANITIZE_ONLY:-}"
    for op in $1; do
        timeout -k 5 "${LANDING_BENCH_TIMEOUT:-450}" python3 benchmarks/bench_attention.py --op "$op" \
            >"$OUT/bench_$op.txt" 2>&1
        echo "bench $op: exit $? [$((SECONDS - t0))s]"
        awk '/^===/{p=1} p' "$OUT/bench_$op.txt"
    done
}

# precompile_hopper: every kernel compiled ahead (precompile.py --hopper: portable and Hopper)  -> $OUT/pre.log. With
# FWD_SOURCE_AB=1 first makes the Hopper forward's kernel file a switch, CUFLASH_FWD_SM90_SOURCE (patched into
# hopper.py here), so that a copy of main's fwd_sm90.cu (cuda_src/fwd_sm90_main.cu, untracked) can be an A/B set.
precompile_hopper() {
    if [ "${FWD_SOURCE_AB:-0}" = 1 ]; then source_switch fwd; fi
    timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/pre.log" 2>&1
    echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/pre.log")"
}

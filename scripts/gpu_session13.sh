#!/usr/bin/env bash
# Session 13's device calls, from the repository root (OUT=... bash scripts/gpu_session13.sh):
#   1. every kernel compiled ahead (precompile.py: portable and Hopper)
#   2. the GPU test files in FILES (default: all of tests/gpu) in SHARDS (8) processes at once
#      (run_gpu_tests_parallel)
#   3. the Hopper forward's sanitizer cases (sm90_: every variant), memcheck and racecheck
#   4. an A/B of the forward over AB's switch sets (gpu_ab.sh, AB_BENCH_ARGS: default the short cells 512-2k, cuflash
#      alone), if AB is set. FWD_SOURCE_AB=1 makes the forward's kernel file a switch, CUFLASH_FWD_SM90_SOURCE
#      (patched into hopper.py here), so that a copy of main's fwd_sm90.cu (cuda_src/fwd_sm90_main.cu, untracked)
#      can be a set of its own; scripts/ab_table.py prints the sets side by side
#   5. an A/B of the backward over BWD_AB's switch sets (gpu_ab.sh, one round, BWD_AB_BENCH_ARGS: default the grid,
#      atomic and deterministic), if BWD_AB is set                                        -> ab_bwd_<set>_1.txt
#   6. bench_attention.py --op fwd on the ANCHORS grid beside SDPA's flash and cuDNN backends    -> bench_fwd.txt
# Logs in $OUT/logs.tgz. SKIP_TESTS=1, SKIP_SANITIZE=1 and SKIP_BENCH=1 leave steps out.
source scripts/device_env.sh
precompile_hopper  # (FWD_SOURCE_AB=1: the kernel file as a switch first)
[ "${SKIP_TESTS:-0}" = 1 ] || run_gpu_tests_parallel "${TESTS_TIMEOUT:-400}" "${SHARDS:-8}" \
    ${FILES:-test_sm90 test_forward test_varlen test_backward test_kvcache test_torch test_jax}
[ "${SKIP_SANITIZE:-0}" = 1 ] || sanitize_both sm90 "${SANITIZE_TIMEOUT:-150}" -- --only sm90_
if [ -n "${AB:-}" ]; then
    AB="$AB" ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=${BENCH_TIMEOUT:-110} \
        BENCH="benchmarks/bench_attention.py --op fwd ${AB_BENCH_ARGS:---seqlens 512,1024,2048 --impls cuflash}" \
        bash scripts/gpu_ab.sh
    python3 scripts/ab_table.py "$OUT"
fi
if [ -n "${BWD_AB:-}" ]; then
    AB="$BWD_AB" AB_TAG=_bwd ROUNDS=${BWD_ROUNDS:-1} BENCH_TIMEOUT=${BWD_BENCH_TIMEOUT:-200} \
        BENCH="benchmarks/bench_attention.py --op bwd ${BWD_AB_BENCH_ARGS:---impls cuflash,cuflash_det}" \
        bash scripts/gpu_ab.sh
    for column in cuflash cuflash_det; do python3 scripts/ab_table.py "$OUT" --tag _bwd --column $column; done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    timeout -k 5 150 python3 benchmarks/bench_attention.py --op fwd ${BENCH_ARGS:-} >"$OUT/bench_fwd.txt" 2>&1
    echo "bench: exit $? [$((SECONDS - t0))s]"
    awk '/^===/{p=1} p' "$OUT/bench_fwd.txt"
fi
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

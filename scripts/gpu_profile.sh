#!/usr/bin/env bash
# Where the short cells lose, in one device call from the repository root (issues 4 and 8: the backward at d 64
# and the forward at 512-2k keys are below their peers, and nobody has looked inside yet):
#
#     OUT=... bash scripts/gpu_profile.sh
#
#   1. the Hopper kernels compiled ahead (scripts/precompile.py --hopper)                               -> pre.log
#   2. benchmarks/profile_kernels.py per case of PROFILE_CASES: GPU time per kernel of one call and the launch
#      gaps (the backward's preprocess, dQ zeroing and conversion against its main kernel)          -> profile.txt
#   3. Nsight Compute on each case's main kernel (its name matched by the case's regex): speed of light, occupancy,
#      scheduler and warp-state sections, and every stall reason per issued instruction          -> ncu_<n>.txt
# A case is "name|kernel regex|profile_kernels.py arguments"; the defaults are the worst cells of session 6's
# release run (docs/bench/release_session6.txt). Environment: OUT, PROFILE_CASES, PRECOMPILE (1: step 1; 0: each
# kernel is compiled when first used), NCU (1), NCU_TIMEOUT (150).
source scripts/device_env.sh
if [ "${PRECOMPILE:-1}" = 1 ]; then
    timeout -k 5 200 python3 scripts/precompile.py --hopper --workers 16 >"$OUT/pre.log" 2>&1
    echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/pre.log")"
fi
IFS=';' read -r -a cases <<<"${PROFILE_CASES:-\
bwd_d64_causal_512|bwd_sm90|--op bwd --headdim 64 --heads 32 --batch 32 --seqlen 512 --causal;\
bwd_d64_512|bwd_sm90|--op bwd --headdim 64 --heads 32 --batch 32 --seqlen 512;\
fwd_d128_512|fwd_sm90|--op fwd --headdim 128 --heads 16 --batch 32 --seqlen 512;\
fwd_d64_causal_1k|fwd_sm90|--op fwd --headdim 64 --heads 32 --batch 16 --seqlen 1024 --causal}"
: >"$OUT/profile.txt"
NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
n=0
for case in "${cases[@]}"; do
    IFS='|' read -r name regex args <<<"$case"
    n=$((n + 1))
    echo "### $name: $args" >>"$OUT/profile.txt"
    timeout -k 5 120 python3 benchmarks/profile_kernels.py $args 2>&1 \
        | grep -v "Deprecat\|stream = \|_warn_once\|UserWarning" >>"$OUT/profile.txt"
    echo "profile $name: exit $? [$((SECONDS - t0))s]"
    if [ "${NCU:-1}" = 1 ] && [ -n "$NCU_BIN" ]; then
        timeout -k 5 "${NCU_TIMEOUT:-150}" "$NCU_BIN" -k "regex:$regex" --launch-skip 1 -c 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
            --section WarpStateStats --section MemoryWorkloadAnalysis \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            python3 benchmarks/profile_kernels.py $args --warmup 2 --iters 1 >"$OUT/ncu_$n.txt" 2>&1
        echo "ncu $name: exit $? [$((SECONDS - t0))s]"
        grep -E "Duration|Compute \(SM\) Throughput|DRAM Throughput|Issued Warp Per Scheduler" "$OUT/ncu_$n.txt"
        grep -E "stalled_.*ratio" "$OUT/ncu_$n.txt" | sort -k3 -g -r | head -8  # the largest stall reasons
    fi
done
grep -E "^###|^=== |us/it|per call (span|busy)|median gap" "$OUT/profile.txt"
echo "done [$((SECONDS - t0))s]"

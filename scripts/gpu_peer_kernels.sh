#!/usr/bin/env bash
# cuDNN's forward kernels beside ours on the cells below it (issue 8), in one device call from the repository root:
#
#     OUT=... bash scripts/gpu_peer_kernels.sh
#
#   1. benchmarks/peer_kernels.py: each kernel's name, grid, block, registers, shared memory, GPU time -> peers.txt
#   2. Nsight Compute on both main kernels per NCU_CELLS cell (head dim:causal:seqlen): speed of light, compute
#      workload (pipes), instruction statistics, scheduler, warp states, launch and occupancy  -> ncu_<impl>_<cell>.txt
# Environment: OUT, NCU_CELLS ("64:0:512 64:1:512"), NCU_TIMEOUT (120), PEER_ARGS (peer_kernels.py's), PRECOMPILE (1:
# every kernel compiled ahead; 0: each one when first used).
source scripts/device_env.sh
[ "${PRECOMPILE:-1}" = 1 ] && precompile_hopper
timeout -k 5 200 python3 benchmarks/peer_kernels.py ${PEER_ARGS:-} 2>&1 | grep -v "Warning\|warn" >"$OUT/peers.txt"
echo "peers: exit $? [$((SECONDS - t0))s]"
cat "$OUT/peers.txt"
NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
for cell in ${NCU_CELLS:-64:0:512 64:1:512}; do
    for impl in cuflash cudnn; do
        regex=$([ "$impl" = cuflash ] && echo fwd_sm90 || echo "cudnn|sdpa|fmha|flash")
        log="$OUT/ncu_${impl}_${cell//:/_}.txt"
        timeout -k 5 "${NCU_TIMEOUT:-120}" "$NCU_BIN" -k "regex:$regex" --launch-skip 2 -c 1 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
            --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            python3 benchmarks/peer_kernels.py --cells "$cell" --impls "$impl" --plain --warmup 2 --iters 2 \
            >"$log" 2>&1
        echo "ncu $impl $cell: exit $? [$((SECONDS - t0))s]"
        grep -E "^  [a-z_]|Duration|Executed Instructions |Issue Slots Busy|Issued Warp Per Scheduler" "$log"
        grep -E "Registers Per|Block Size|Grid Size|Shared Memory Config|Dynamic Shared" "$log"
    done
done
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Where deterministic mode's fixed point spends its time (session 16), from the repository root (OUT=... bash
# scripts/gpu_fixed_profile.sh): benchmarks/profile_kernels.py per kernel, atomic / slices / fixed, on the cells
# where the fixed point measured slowest against the atomic mode; then Nsight Compute on the main kernel, atomic
# against fixed, at d 64 non-causal 16k (NCU=0 leaves it out)                 -> profile.txt, ncu_<name>.txt
source scripts/device_env.sh
: >"$OUT/profile.txt"
for shape in "--headdim 64 --heads 32 --batch 1 --seqlen 16384" "--headdim 128 --heads 16 --batch 4 --seqlen 4096 --causal"; do
    for mode in atomic slices fixed; do
        det=--deterministic; [ $mode = atomic ] && det=
        echo "### $mode: $shape" >>"$OUT/profile.txt"
        CUFLASH_BWD_SM90_DET=${mode/atomic/auto} timeout -k 5 90 python3 benchmarks/profile_kernels.py --op bwd $shape $det \
            2>&1 | grep -v "Deprecat\|stream = \|_warn_once\|UserWarning" >>"$OUT/profile.txt"
        echo "profile $mode $shape: exit $? [$((SECONDS - t0))s]"
    done
done
grep -E "^###|us/it|per call (span|busy)|bwd_|convert|preprocess|kv_bound" "$OUT/profile.txt" | cut -c1-150
if [ "${NCU:-1}" = 1 ]; then
    NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
    for mode in atomic fixed; do
        det=--deterministic; [ $mode = atomic ] && det=
        CUFLASH_BWD_SM90_DET=fixed timeout -k 5 80 "$NCU_BIN" -k "regex:bwd_sm90" --launch-skip 1 -c 1 \
            --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum" \
            python3 benchmarks/profile_kernels.py --op bwd --headdim 64 --heads 32 --batch 1 --seqlen 16384 $det \
            --warmup 2 --iters 1 >"$OUT/ncu_$mode.txt" 2>&1
        echo "ncu $mode: exit $? [$((SECONDS - t0))s]"
        grep -E "Duration|DRAM Throughput|L2 Hit|Issued Warp Per Scheduler|inst_executed.sum" "$OUT/ncu_$mode.txt"
        grep -E "stalled_.*ratio" "$OUT/ncu_$mode.txt" | sort -k3 -g -r | head -6
    done
fi
echo "done [$((SECONDS - t0))s]"

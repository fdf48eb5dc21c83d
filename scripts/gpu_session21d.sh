#!/usr/bin/env bash
# Session 21's fourth call (the persistent two-warpgroup kernels' dynamic walk, on top of the split last round),
# from the repository root, with drafts/session21-split-dynamic-walk.patch applied and cuda_src/fwd_sm90_static.cu
# (untracked: fwd_sm90.cu with DYNAMIC false):
#
#     git apply drafts/session21-split-dynamic-walk.patch
#     sed 's/static constexpr bool DYNAMIC = PERSISTENT .*;/static constexpr bool DYNAMIC = false;/' \
#         cuda_src/fwd_sm90.cu >cuda_src/fwd_sm90_static.cu
#     OUT=... bash scripts/gpu_session21d.sh
#
# (In session 21 the dynamic kernels hung, 48 / 232 registers; the patch now has 48 / 224, not yet run.)
#
#   0. scripts/smoke_persistent.py under a 120 s timeout: stop there if it hangs
#   1. every kernel compiled ahead; the whole GPU suite; memcheck and racecheck over every sanitizer case;
#      bench_attention.py --op fwd beside SDPA's flash and cuDNN backends                          -> bench_fwd.txt
#   2. A/B, three rounds, up to 4k keys (the persistent kernels' cells): the static walk with the split, the dynamic
#      walk without the split, and the tree                                                    -> ab_<set>_<round>.txt
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
# a hang shows in a minute here (scripts/smoke_persistent.py), not in the suite's timeouts
timeout -k 5 120 python3 scripts/smoke_persistent.py >"$OUT/smoke.log" 2>&1
rc=$?
echo "smoke: exit $rc [$((SECONDS - t0))s] $(tail -1 "$OUT/smoke.log")"
if [ $rc = 124 ] || [ $rc = 137 ]; then cd "$OUT" && tar czf logs.tgz ./*.log 2>/dev/null; exit 1; fi  # hung
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=fwd_sm90_static.cu;CUFLASH_SM90_SPLIT=0;CUFLASH_AB=tree" ROUNDS=3 \
    BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash --seqlens 512,1024,2048,4096" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null && rm -f ./*.log ./*.txt

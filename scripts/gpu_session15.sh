#!/usr/bin/env bash
# Session 15's fourth device call, from the repository root (OUT=... bash scripts/gpu_session15.sh):
#   1. the landing run of this tree (scripts/gpu_session13.sh without A/Bs or bench: precompile, the whole GPU suite in
#      shards, the Hopper sanitizer cases)
#   2. then drafts/session15-bwd-pairs.patch applied here, and its probes of the deterministic pairs' cost (one CTA
#      per slot in clusters of two: the cost of the cluster launch alone; pairs without reading the partner's tile)
#      on the backward's non-causal cells at 512, 4k and 16k keys                           -> ab_bwd_<set>_<round>.txt
# Logs in $OUT/logs_landing.tgz (step 1) and $OUT/logs.tgz (step 2).
source scripts/device_env.sh
SKIP_BENCH=1 bash scripts/gpu_session13.sh
mv "$OUT/logs.tgz" "$OUT/logs_landing.tgz"
git apply drafts/session15-bwd-pairs.patch && echo "draft applied [$((SECONDS - t0))s]"
timeout -k 5 200 python3 - <<'PY' >"$OUT/pre_pairs.log" 2>&1  # the pair kernels and the probes (in no table)
import cuflash
from cuflash import hopper
specs = [s for s in hopper.all_backward_specs() if s.pair and s.dtype == "bf16" and not s.band]
specs += [hopper.BwdSm90Spec("bf16", d, False, False, m, False, True) for d, m in ((64, 128), (128, 64))]
print(len(cuflash.precompile(specs, workers=4, progress=False)), "pair and probe kernels")
PY
echo "precompile: exit $? [$((SECONDS - t0))s] $(tail -1 "$OUT/pre_pairs.log")"
P="CUFLASH_BWD_SM90_DET_PAIR_MIN_BLOCKS"
AB="$P=0;$P=0 CUFLASH_BWD_SM90_CLUSTER_PROBE=1;$P=2;$P=2 CUFLASH_BWD_SM90_PAIR_NOSUM=1" AB_TAG=_bwd \
    ROUNDS=${BWD_ROUNDS:-2} BENCH_TIMEOUT=120 \
    BENCH="benchmarks/bench_attention.py --op bwd --impls cuflash,cuflash_det --causal false --seqlens 512,4096,16384" \
    bash scripts/gpu_ab.sh
for column in cuflash cuflash_det; do python3 scripts/ab_table.py "$OUT" --tag _bwd --column $column; done
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

#!/usr/bin/env bash
# Session 26's fifth call (about 6 minutes), from the repository root: the OVERLAP kernels take their tiles from the
# producer (fwd_sm90.cu HANDED_TILES), landed with the whole suite, every sanitizer case and the forward bench beside
# the peers, then an A/B of the Hopper forward against HEAD's kernel files, three rounds (ROUNDS; AB_BENCH_ARGS, the
# A/B's cells: d 64 up to 2k keys):
#
#     mkdir -p cuda_src/base && git archive BASE cuda_src | tar -x --strip-components=1 -C cuda_src/base
#     (BASE: the commit before the change, 34e94fa for this call; the untracked folder travels)
#     OUT=... bash scripts/gpu_session26e.sh                                                     -> logs.tgz
source scripts/device_env.sh
FWD_SOURCE_AB=1 precompile_hopper
suite_sanitize_bench fwd
AB="CUFLASH_FWD_SM90_SOURCE=base/fwd_sm90.cu;CUFLASH_FWD_SM90_SOURCE=fwd_sm90.cu" ROUNDS=${ROUNDS:-3} \
    BENCH_TIMEOUT=150 BENCH="benchmarks/bench_attention.py --op fwd --impls cuflash \
${AB_BENCH_ARGS:---dims 64 --seqlens 512,1024,2048}" bash scripts/gpu_ab.sh
python3 scripts/ab_table.py "$OUT"
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt 2>/dev/null; rm -f ./*.log ./*.txt

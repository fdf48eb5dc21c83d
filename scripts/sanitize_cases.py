#!/usr/bin/env python3
"""Small launches of every cuflash kernel, to run under compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 9 python3 scripts/sanitize_cases.py
    compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 \
        python3 scripts/sanitize_cases.py
    python3 scripts/sanitize_cases.py --list          # the case table
    python3 scripts/sanitize_cases.py --only causal   # cases whose name contains 'causal'
    python3 scripts/sanitize_cases.py --only fp8_,softcap   # ... 'fp8_' or 'softcap'

CuPy's memory pool is switched off before anything is allocated: a pooled block is
larger than the array in it, so an out-of-bounds write lands inside the block and
memcheck never sees it. With the pool off every array is its own cudaMalloc.

Each case names a cuflash function; a case whose function does not exist yet is
skipped (listed as such), so backward and KV-cache cases can sit in the table before
their kernels land. Shapes are deliberately off every tile size (17, 33, 70, 113, 129, ...).

Varlen cases (``--only varlen``) call ``cuflash.attention_varlen`` and its backward on packed
sequences with lengths 0 (on either side), 1 and off-tile sizes.

Hopper cases (``--only sm90_``) call ``cuflash.ops.forward_sm90.attention_sm90`` in each variant (skipped off sm_90a);
FP8 cases (``--only fp8_``) call ``cuflash.attention_fp8`` and ``cuflash.attention_varlen_fp8`` on e4m3 inputs
(sm_90a too). Quantization cases (``--only quantize_``) call ``cuflash.quantize_e4m3``.

Backward cases (``--only bwd_``) call ``cuflash.attention_backward(dout, q, k, v, out, lse,
causal=..., window_size=..., softcap=..., alibi_slopes=..., deterministic=False|True,
stream=...)`` with out, lse from ``cuflash.attention(..., return_lse=True)`` under the
same options, head dims <= 128, GQA 2:1; names end in _atomic or _det.

Prints "sanitize cases ok" last when every case that ran finished; exit 1 otherwise
(the sanitizer's own findings come out through its --error-exitcode).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import cupy

cupy.cuda.set_allocator(None)  # before any allocation: the pool hides OOB writes

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import cuflash  # noqa: E402
from cuflash import settings  # noqa: E402

DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
NONFINITE_MASK = {"fp16": 0x7C00, "bf16": 0x7F80}  # exponent bits all ones = inf/nan


# --------------------------------------------------------------------------- #
# The case table. One row per launch:
#   name   unique, printed
#   fn     the cuflash function called (case skipped while cuflash lacks it)
#   dtype  "fp16" | "bf16"
#   shape  b, sq, sk, h, hk, d  (q (b, sq, h, d), k/v (b, sk, hk, d))
#   opts   keyword options passed through (causal, window_size, softcap, ...);
#          "alibi": True makes float32 (h,) slopes, "packed": True makes q/k/v
#          strided views of one (b, s, 3, h, d) tensor, "side_stream": True runs
#          on a non-default CuPy stream.
# --------------------------------------------------------------------------- #
SMALL = dict(b=1, sq=17, sk=33, h=2, hk=1, d=64)      # inside one tile, GQA 2:1
SMALL40 = dict(SMALL, d=40)                           # head dim padded inside the kernel
MULTI = dict(b=2, sq=200, sk=333, h=4, hk=2, d=128)   # several Q and KV blocks, ragged ends
SQ_GT_SK = dict(b=1, sq=33, sk=17, h=2, hk=1, d=64)   # causal: leading rows see no key
PACKED = dict(b=1, sq=113, sk=113, h=2, hk=2, d=64)

FWD_VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(8, 4)),
    "softcap_alibi": dict(softcap=5.0, alibi=True),
    "lse": dict(return_lse=True),
}


def _fwd_cases() -> list[dict]:
    cases = []
    for dtype in DTYPES:
        for sname, shape in (("d64", SMALL), ("d40", SMALL40)):
            for vname, opts in FWD_VARIANTS.items():
                cases.append(dict(name=f"fwd_{dtype}_{sname}_{vname}", fn="attention",
                                  dtype=dtype, shape=shape, opts=opts))
        cases += [
            dict(name=f"fwd_{dtype}_multi", fn="attention", dtype=dtype, shape=MULTI, opts={}),
            dict(name=f"fwd_{dtype}_multi_causal_lse", fn="attention", dtype=dtype, shape=MULTI,
                 opts=dict(causal=True, return_lse=True)),
            dict(name=f"fwd_{dtype}_sq_gt_sk_causal", fn="attention", dtype=dtype,
                 shape=SQ_GT_SK, opts=dict(causal=True, return_lse=True)),
        ]
    cases += [
        dict(name="fwd_fp16_packed_qkv", fn="attention", dtype="fp16", shape=PACKED,
             opts=dict(packed=True, causal=True)),
        dict(name="fwd_bf16_side_stream", fn="attention", dtype="bf16", shape=SMALL,
             opts=dict(side_stream=True)),
    ]
    return cases


# Backward shapes (head dims <= 128, what the backward supports), GQA 2:1 in each:
BWD_S17 = dict(b=1, sq=17, sk=33, h=2, hk=1, d=64)     # one query block, one KV block, ragged
BWD_S70 = dict(b=2, sq=70, sk=129, h=4, hk=2, d=128)   # 2 query blocks x 3 KV blocks, ragged ends
BWD_D40 = dict(BWD_S17, d=40)                          # head dim padded inside the kernel
BWD_SQ_GT_SK = dict(b=1, sq=33, sk=17, h=2, hk=1, d=64)  # causal: leading rows see no key, grads 0

BWD_VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(8, 4)),
    "softcap_alibi": dict(softcap=5.0, alibi=True),
}


def _bwd_cases() -> list[dict]:
    """cuflash.attention_backward(dout, q, k, v, out, lse, ..., deterministic=False|True):
    every variant on both main shapes in both dQ modes for bf16; fp16 (same kernels but for
    the conversions) on the larger shape only, plus the edge shapes."""
    cases = []

    def add(dtype, sname, shape, vname, opts):
        for det in (False, True):
            cases.append(dict(name=f"bwd_{dtype}_{sname}_{vname}_{'det' if det else 'atomic'}",
                              fn="attention_backward", dtype=dtype, shape=shape,
                              opts=dict(opts, deterministic=det)))

    for dtype in DTYPES:
        shapes = (("s17", BWD_S17), ("s70", BWD_S70)) if dtype == "bf16" else (("s70", BWD_S70),)
        for vname, opts in BWD_VARIANTS.items():
            for sname, shape in shapes:
                add(dtype, sname, shape, vname, opts)
        add(dtype, "d40", BWD_D40, "plain", {})
        add(dtype, "sq_gt_sk", BWD_SQ_GT_SK, "causal", dict(causal=True))
    # all three backward launches (preprocess, main, dQ convert) on the caller's stream
    cases.append(dict(name="bwd_bf16_s70_causal_side_stream_atomic", fn="attention_backward",
                      dtype="bf16", shape=BWD_S70, opts=dict(causal=True, deterministic=False,
                                                             side_stream=True)))
    return cases


def _kvcache_cases() -> list[dict]:
    decode = dict(b=2, sq=1, sk=300, h=8, hk=2, d=128)
    return [
        dict(name="kvcache_bf16_decode", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(300, 17))),
        dict(name="kvcache_bf16_decode_split", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(300, 17), num_splits=3)),
        dict(name="kvcache_fp16_prefill_causal", fn="attention_with_kvcache", dtype="fp16",
             shape=dict(decode, sq=5), opts=dict(cache_seqlens=(300, 17), causal=True)),
        dict(name="kvcache_bf16_paged48_append_split", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(250, 0), page_size=48, new_k=3, num_splits=4,
                                     alibi=True, softcap=10.0)),
        dict(name="kvcache_fp16_speculative_paged16", fn="attention_with_kvcache", dtype="fp16",
             shape=dict(decode, sq=20), opts=dict(cache_seqlens=(200, 33), page_size=16, new_k=20,
                                                  causal=True, num_splits=2)),
        dict(name="kvcache_bf16_d256_window", fn="attention_with_kvcache", dtype="bf16",
             shape=dict(decode, d=256, sq=3), opts=dict(cache_seqlens=(297, 5), window_size=(40, 0))),
        # rotary embedding of the new keys and the queries, cache_leftpad
        dict(name="kvcache_bf16_rotary_interleaved_leftpad", fn="attention_with_kvcache", dtype="bf16",
             shape=dict(decode, sq=2), opts=dict(cache_seqlens=(280, 9), new_k=2, causal=True, rotary=64,
                                                 rotary_interleaved=True, leftpad=(100, 9), num_splits=3)),
        dict(name="kvcache_fp16_rotary_half_paged16", fn="attention_with_kvcache", dtype="fp16",
             shape=decode, opts=dict(cache_seqlens=(120, 0), page_size=16, new_k=1, rotary=128,
                                     rotary_interleaved=False)),
        # values in device memory outside the cache: the kernels bound them (nothing read or written outside)
        dict(name="kvcache_bf16_seqlens_past_capacity_append", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(400, -3), new_k=2, num_splits=2)),
        dict(name="kvcache_fp16_paged_bad_pages_append", fn="attention_with_kvcache", dtype="fp16",
             shape=decode, opts=dict(cache_seqlens=(290, 40), page_size=32, new_k=3, bad_pages=True)),
        dict(name="kvcache_bf16_paged16_bad_pages_split", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(290, 40), page_size=16, new_k=2, num_splits=3, bad_pages=True)),
        dict(name="kvcache_bf16_batch_idx_outside", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(100, 50), new_k=1, batch_idx=(5, -1))),
        dict(name="kvcache_bf16_leftpad_past_seqlens", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(100, 50), new_k=1, leftpad=(150, -2))),
        # e4m3 caches (uint8, with descales per tensor or per (batch, KV head))
        dict(name="kvcache_e4m3_bf16_decode_head_split", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(300, 0), num_splits=3, e4m3="head")),
        dict(name="kvcache_e4m3_fp16_speculative_paged16_append", fn="attention_with_kvcache", dtype="fp16",
             shape=dict(decode, sq=20), opts=dict(cache_seqlens=(200, 33), page_size=16, new_k=20, causal=True,
                                                  num_splits=2, e4m3="tensor")),
        dict(name="kvcache_e4m3_bf16_d256_window_softcap", fn="attention_with_kvcache", dtype="bf16",
             shape=dict(decode, d=256, sq=3), opts=dict(cache_seqlens=(297, 5), window_size=(40, 0), softcap=10.0,
                                                        e4m3="head")),
        dict(name="kvcache_e4m3_bf16_seqlens_past_capacity_append", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(400, -3), new_k=2, num_splits=2, e4m3="tensor")),
        dict(name="kvcache_e4m3_fp16_paged_bad_pages_append", fn="attention_with_kvcache", dtype="fp16",
             shape=dict(decode, d=64), opts=dict(cache_seqlens=(290, 40), page_size=32, new_k=3, bad_pages=True,
                                                 e4m3="head")),
        dict(name="kvcache_e4m3_bf16_batch_idx_outside", fn="attention_with_kvcache", dtype="bf16",
             shape=decode, opts=dict(cache_seqlens=(100, 50), new_k=1, batch_idx=(5, -1), e4m3="head")),
        dict(name="kvcache_e4m3_fp16_paged64_split", fn="attention_with_kvcache", dtype="fp16",
             shape=decode, opts=dict(cache_seqlens=(290, 40), page_size=64, new_k=2, num_splits=3, bad_pages=True,
                                     e4m3="head")),
        dict(name="kvcache_e4m3_bf16_d64_paged32_bad_pages_split", fn="attention_with_kvcache", dtype="bf16",
             shape=dict(decode, d=64), opts=dict(cache_seqlens=(290, 40), page_size=32, new_k=1, num_splits=2,
                                                 bad_pages=True, e4m3="tensor")),
        dict(name="kvcache_e4m3_bf16_d64_paged256_bad_pages_append", fn="attention_with_kvcache", dtype="bf16",
             shape=dict(decode, d=64), opts=dict(cache_seqlens=(290, 40), page_size=256, new_k=3, bad_pages=True,
                                                 e4m3="tensor")),
    ]


# Packed variable-length sequences: lengths 0 on either side, 1, and off-tile ones; GQA 2:1.
VARLEN = dict(lens_q=(17, 0, 33, 1, 70), lens_k=(33, 12, 0, 1, 129), h=2, hk=1, d=64)


def _varlen_cases() -> list[dict]:
    return [
        dict(name="varlen_fwd_bf16_causal_lse", fn="attention_varlen", dtype="bf16", shape=VARLEN,
             opts=dict(causal=True, return_lse=True)),
        dict(name="varlen_fwd_fp16_d40_window_softcap_alibi", fn="attention_varlen", dtype="fp16",
             shape=dict(VARLEN, d=40), opts=dict(window_size=(8, 4), softcap=5.0, alibi=True)),
        dict(name="varlen_bwd_bf16_causal_atomic", fn="attention_varlen_backward", dtype="bf16", shape=VARLEN,
             opts=dict(causal=True, deterministic=False)),
        dict(name="varlen_bwd_fp16_softcap_alibi_det", fn="attention_varlen_backward", dtype="fp16", shape=VARLEN,
             opts=dict(softcap=5.0, alibi=True, deterministic=True)),
        # paged keys (block_table) and seqused_k, with counts and pages outside what the call holds
        dict(name="varlen_fwd_bf16_paged16_causal", fn="attention_varlen", dtype="bf16", shape=VARLEN,
             opts=dict(causal=True, page_size=16)),
        dict(name="varlen_fwd_fp16_paged64_seqused_bad_pages", fn="attention_varlen", dtype="fp16", shape=VARLEN,
             opts=dict(page_size=64, seqused=(1000, -1, 0, 1, 129), bad_pages=True)),
        dict(name="varlen_fwd_bf16_seqused_past_rows", fn="attention_varlen", dtype="bf16", shape=VARLEN,
             opts=dict(seqused=(40, 12, 5, 1, 500))),
        # (on sm_90a the Hopper kernel's PAGED variant: boxes of 16 rows for pages of 48, d 256's 64-key blocks)
        dict(name="varlen_fwd_fp16_d128_paged48_seqused_bad_pages", fn="attention_varlen", dtype="fp16",
             shape=dict(VARLEN, d=128), opts=dict(page_size=48, seqused=(1000, -1, 0, 1, 129), bad_pages=True)),
        dict(name="varlen_fwd_bf16_d256_paged32_causal", fn="attention_varlen", dtype="bf16",
             shape=dict(VARLEN, d=256), opts=dict(causal=True, page_size=32)),
    ]


def _sm90_cases() -> list[dict]:
    """Each Hopper forward variant (cuflash.ops.forward_sm90.attention_sm90, sm_90a only) at d 64, 128, 256 on a ragged
    shape with causal and lse, one score-mod case each, and a shape with more tiles than SMs (the persistent walk)."""
    from cuflash.ops import forward_sm90
    cases = []
    for variant in forward_sm90.VARIANTS:
        for d in forward_sm90.HEADDIMS:
            cases.append(dict(name=f"sm90_{variant}_bf16_d{d}_causal_lse", fn="attention_sm90", dtype="bf16",
                              shape=dict(MULTI, d=d), opts=dict(variant=variant, causal=True, return_lse=True)))
        cases.append(dict(name=f"sm90_{variant}_fp16_d64_window_softcap_alibi", fn="attention_sm90", dtype="fp16",
                          shape=dict(MULTI, d=64), opts=dict(variant=variant, window_size=(40, 8), softcap=5.0,
                                                             alibi=True)))
        cases.append(dict(name=f"sm90_{variant}_bf16_d128_many_tiles", fn="attention_sm90", dtype="bf16",
                          shape=dict(b=2, sq=1100, sk=700, h=70, hk=14, d=128), opts=dict(variant=variant)))
        if forward_sm90.variant_spec(variant, "bf16", 64, True, False).persistent:
            # a persistent walk of 9-10 tiles a CTA (the tile ring, where the kernel has one, wraps); bottom-right
            # causal leaves the first 400 rows without keys
            cases.append(dict(name=f"sm90_{variant}_bf16_d64_causal_many_tiles", fn="attention_sm90", dtype="bf16",
                              shape=dict(b=2, sq=1100, sk=700, h=70, hk=14, d=64),
                              opts=dict(variant=variant, causal=True)))
        if forward_sm90.variant_spec(variant, "bf16", 64, False, False).split:  # split tail tiles (1000 = 5 x 192
            cases.append(dict(name=f"sm90_{variant}_bf16_d64_split_tiles", fn="attention_sm90",  # + 40), several a CTA
                              dtype="bf16", shape=dict(b=2, sq=1000, sk=700, h=24, hk=6, d=64),
                              opts=dict(variant=variant)))
    # the Hopper backward's deterministic fixed point (the bwd_sm90_det setting "fixed": bwd_kv_bound, the int32 dQ
    # reductions, the scaled convert), d 64 (128 query rows), 128 and 256, causal
    for d in (64, 128, 256):
        cases.append(dict(name=f"sm90_bwd_fixed_bf16_d{d}_causal", fn="attention_backward", dtype="bf16",
                          shape=dict(BWD_S70, d=d), det_mode="fixed", opts=dict(causal=True, deterministic=True)))
    # the Hopper backward's ordered dQ additions (the bwd_sm90_det setting "ordered": each query block's counter
    # passed from key block to key block), d 64 (128 query rows), 128 and 256, causal and without a mask (the walks
    # started apart)
    for d in (64, 128, 256):
        for causal in (True, False):
            cases.append(dict(name=f"sm90_bwd_ordered_bf16_d{d}_{'causal' if causal else 'full'}",
                              fn="attention_backward", dtype="bf16", shape=dict(BWD_S70, d=d), det_mode="ordered",
                              opts=dict(causal=causal, deterministic=True)))
    # the Hopper backward at d = 256 (64-key blocks, the warpgroups splitting the head dim): atomic and slices
    for det in (False, True):
        cases.append(dict(name=f"sm90_bwd_bf16_d256_window_{'det' if det else 'atomic'}", fn="attention_backward",
                          dtype="bf16", shape=dict(BWD_S70, d=256),
                          opts=dict(window_size=(50, 10), deterministic=det)))
    # the Hopper backward's score-mod kernel at d 64 (128 query rows, dQ by TMA; softcap and ALiBi under a window):
    # atomic and the slices; its fixed point below
    for det in (False, True):
        cases.append(dict(name=f"sm90_bwd_fp16_d64_window_softcap_alibi_{'slices' if det else 'atomic'}",
                          fn="attention_backward", dtype="fp16", shape=dict(BWD_S70, d=64),
                          opts=dict(window_size=(50, 10), softcap=5.0, alibi=True, deterministic=det),
                          **(dict(det_mode="slices") if det else {})))
    # the Hopper backward's score-mod kernels at d 128 and 256 (softcap and ALiBi under a window): atomic and the
    # fixed point; at d 64 the fixed point (its atomic case above)
    for d in (64, 128, 256):
        for det in ((True,) if d == 64 else (False, True)):
            cases.append(dict(name=f"sm90_bwd_fp16_d{d}_window_softcap_alibi_{'fixed' if det else 'atomic'}",
                              fn="attention_backward", dtype="fp16", shape=dict(BWD_S70, d=d),
                              opts=dict(window_size=(50, 10), softcap=5.0, alibi=True, deterministic=det),
                              **(dict(det_mode="fixed") if det else {})))
    # head dims between the Hopper kernels' compiled ones: TMA zero-fills the columns past the head dim, the stores
    # leave them out
    for d in (48, 96, 200):
        cases.append(dict(name=f"sm90_between_fwd_bf16_d{d}_causal", fn="attention", dtype="bf16",
                          shape=dict(BWD_S70, d=d), opts=dict(causal=True)))
        cases.append(dict(name=f"sm90_between_bwd_fp16_d{d}_window_det", fn="attention_backward", dtype="fp16",
                          shape=dict(BWD_S70, d=d), opts=dict(window_size=(50, 10), deterministic=True)))
    # d 48 on the d 64 score-mod kernel (its dQ TMA additions clipped at the head dim) and fixed point
    cases.append(dict(name="sm90_between_bwd_fp16_d48_causal_softcap_alibi_det", fn="attention_backward",
                      dtype="fp16", shape=dict(BWD_S70, d=48),
                      opts=dict(causal=True, softcap=5.0, alibi=True, deterministic=True)))
    cases.append(dict(name="sm90_between_bwd_bf16_d48_window_fixed", fn="attention_backward", dtype="bf16",
                      shape=dict(BWD_S70, d=48), det_mode="fixed", opts=dict(window_size=(50, 10), deterministic=True)))
    return cases


def _dropout_cases() -> list[dict]:
    """Dropout: forward (on sm_90a the Hopper kernel at d 64, 128, 256, with a score mod too), backward in both dQ
    modes (on sm_90a the Hopper kernel's dropout variant at d 40 to 256, with a score mod too), varlen."""
    drop = dict(dropout_p=0.2, dropout_seed=2 ** 40 + 5, dropout_offset=3)
    return [
        dict(name="dropout_fwd_bf16_d64_causal_lse", fn="attention", dtype="bf16", shape=SMALL,
             opts=dict(drop, causal=True, return_lse=True)),
        dict(name="dropout_fwd_fp16_d40_window", fn="attention", dtype="fp16", shape=SMALL40,
             opts=dict(drop, window_size=(8, 4))),
        # the Hopper forward's dropout kernels on sm_90a (d 64 under a band above; without one, three consumer
        # warpgroups, 200 rows: a second, partial 192-row tile; d 128 and 256)
        dict(name="dropout_fwd_bf16_d64_lse", fn="attention", dtype="bf16", shape=dict(BWD_S70, sq=200, d=64),
             opts=dict(drop, return_lse=True)),
        dict(name="dropout_fwd_bf16_d128_causal_lse", fn="attention", dtype="bf16", shape=BWD_S70,
             opts=dict(drop, causal=True, return_lse=True)),
        dict(name="dropout_fwd_fp16_d256", fn="attention", dtype="fp16", shape=dict(BWD_S17, d=256), opts=drop),
        dict(name="dropout_bwd_bf16_s70_causal_atomic", fn="attention_backward", dtype="bf16", shape=BWD_S70,
             opts=dict(drop, causal=True, deterministic=False)),
        dict(name="dropout_bwd_bf16_s70_softcap_alibi_det", fn="attention_backward", dtype="bf16", shape=BWD_S70,
             opts=dict(drop, softcap=5.0, alibi=True, deterministic=True)),
        dict(name="dropout_bwd_fp16_s17_window_atomic", fn="attention_backward", dtype="fp16", shape=BWD_S17,
             opts=dict(drop, window_size=(8, 4), deterministic=False)),
        dict(name="dropout_bwd_fp16_s70_window_det", fn="attention_backward", dtype="fp16", shape=BWD_S70,
             opts=dict(drop, window_size=(30, 5), deterministic=True)),
        dict(name="dropout_bwd_fp16_d64_softcap_alibi_causal_atomic", fn="attention_backward", dtype="fp16",
             shape=dict(BWD_S70, d=64), opts=dict(drop, softcap=5.0, alibi=True, causal=True, deterministic=False)),
        dict(name="dropout_bwd_bf16_d64_causal_atomic", fn="attention_backward", dtype="bf16",
             shape=dict(BWD_S70, d=64), opts=dict(drop, causal=True, deterministic=False)),
        dict(name="dropout_bwd_fp16_d64_window_det", fn="attention_backward", dtype="fp16",
             shape=dict(BWD_S70, d=64), opts=dict(drop, window_size=(30, 5), deterministic=True)),
        dict(name="dropout_bwd_bf16_d256_causal_det", fn="attention_backward", dtype="bf16",
             shape=dict(BWD_S70, d=256), opts=dict(drop, causal=True, deterministic=True)),
        dict(name="dropout_bwd_fp16_d256_softcap_alibi_window_atomic", fn="attention_backward", dtype="fp16",
             shape=dict(BWD_S70, d=256), opts=dict(drop, softcap=5.0, alibi=True, window_size=(50, 10))),
        dict(name="dropout_bwd_bf16_d128_softcap_causal_det", fn="attention_backward", dtype="bf16",
             shape=dict(BWD_S70, d=128), opts=dict(drop, softcap=5.0, causal=True, deterministic=True)),
        dict(name="dropout_bwd_fp16_d48_softcap_alibi_atomic", fn="attention_backward", dtype="fp16",
             shape=dict(BWD_S70, d=48), opts=dict(drop, softcap=5.0, alibi=True)),
        dict(name="dropout_bwd_bf16_d40_window_det", fn="attention_backward", dtype="bf16",
             shape=dict(BWD_S70, d=40), opts=dict(drop, window_size=(50, 10), deterministic=True)),
        dict(name="dropout_varlen_fwd_bf16_causal_lse", fn="attention_varlen", dtype="bf16", shape=VARLEN,
             opts=dict(drop, causal=True, return_lse=True)),
        dict(name="dropout_varlen_bwd_bf16_causal_det", fn="attention_varlen_backward", dtype="bf16", shape=VARLEN,
             opts=dict(drop, causal=True, deterministic=True)),
    ]


def _fp8_cases() -> list[dict]:
    """The FP8 forward (sm_90a), V transposed in shared memory: off-tile lengths, GQA, masks, per-head descales, rows
    without keys, the ring refilled (several key blocks), d 64 (V^T's row of ones in shared memory), 128 (at 80),
    256, packed sequences (a sequence's last V block zeroed past its keys); and with V^T from the pass (vt_pass:
    forward_fp8.vt_pass forced)."""
    return [
        dict(name="fp8_fwd_d128_gqa_head", fn="attention_fp8", dtype="bf16", shape=dict(MULTI, sk=600),
             opts=dict(descale="head", return_lse=True)),
        # the ring refilled, the last key block partial
        dict(name="fp8_fwd_d128_ring", fn="attention_fp8", dtype="bf16", shape=dict(MULTI, sk=1800),
             opts=dict(descale="tensor", return_lse=True)),
        dict(name="fp8_fwd_d64_ring", fn="attention_fp8", dtype="bf16", shape=dict(MULTI, d=64, sk=1800),
             opts=dict(descale="tensor", return_lse=True)),
        dict(name="fp8_fwd_d80_causal", fn="attention_fp8", dtype="bf16", shape=dict(SQ_GT_SK, d=80),
             opts=dict(causal=True, descale="tensor", return_lse=True)),
        dict(name="fp8_fwd_d64_window", fn="attention_fp8", dtype="bf16", shape=dict(MULTI, d=64),
             opts=dict(window_size=(40, 7), descale="tensor")),
        dict(name="fp8_fwd_d256", fn="attention_fp8", dtype="bf16", shape=dict(BWD_S70, d=256),
             opts=dict(causal=True)),
        # packed sequences (empty ones among them), and cu_seqlens that end past q's and k's rows
        dict(name="fp8_varlen_d128_causal_head", fn="attention_varlen_fp8", dtype="bf16", shape=dict(VARLEN, d=128),
             opts=dict(causal=True, descale="head", return_lse=True)),
        dict(name="fp8_varlen_d128", fn="attention_varlen_fp8", dtype="bf16", shape=dict(VARLEN, d=128),
             opts=dict(return_lse=True)),
        dict(name="fp8_varlen_d64_cu_past_rows", fn="attention_varlen_fp8", dtype="bf16", shape=VARLEN,
             opts=dict(short_rows=(7, 9), return_lse=True)),
        dict(name="fp8_fwd_d128_ring_vt_pass", fn="attention_fp8", dtype="bf16", shape=dict(MULTI, sk=1800),
             opts=dict(descale="head", return_lse=True, vt_pass=1)),
        dict(name="fp8_fwd_d64_causal_vt_pass", fn="attention_fp8", dtype="bf16", shape=dict(SQ_GT_SK, d=64),
             opts=dict(causal=True, vt_pass=1)),
        dict(name="fp8_fwd_d256_vt_pass", fn="attention_fp8", dtype="bf16", shape=dict(BWD_S70, d=256),
             opts=dict(vt_pass=1)),
        dict(name="fp8_varlen_d128_cu_past_rows_vt_pass", fn="attention_varlen_fp8", dtype="bf16",
             shape=dict(VARLEN, d=128), opts=dict(short_rows=(7, 9), causal=True, vt_pass=1)),
    ]


def _quantize_cases() -> list[dict]:
    """e4m3 quantization (any architecture): per tensor over several row blocks, per (sequence, KV head) on a strided
    view (a head dim of 48: 6 chunks of 8 a row, so that a thread's chunks cross rows)."""
    return [
        dict(name="quantize_fp16_tensor_d256", fn="quantize_e4m3", dtype="fp16", shape=dict(b=2, s=130, h=3, d=256),
             opts=dict(per="tensor")),
        dict(name="quantize_bf16_head_strided_d48", fn="quantize_e4m3", dtype="bf16", shape=dict(b=2, s=70, h=4, d=48),
             opts=dict(per="head", nheads_k=2, pow2=True)),
    ]


CASES = (_fwd_cases() + _bwd_cases() + _kvcache_cases() + _varlen_cases() + _sm90_cases() + _dropout_cases()
         + _fp8_cases() + _quantize_cases())


# --------------------------------------------------------------------------- #
# Inputs and calls
# --------------------------------------------------------------------------- #
def _rand(rng, shape, dtype):
    """Random normal values made on the host (no CuPy kernel), copied as raw 16-bit words."""
    host = rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype])
    return cupy.asarray(host.view(np.uint16)).view(DTYPES[dtype])


def _ready():
    """Inputs were copied on the default stream; a side stream must not run ahead of them."""
    cupy.cuda.Device().synchronize()


def _qkv(rng, case):
    s, dt, o = case["shape"], case["dtype"], case["opts"]
    if o.get("packed"):
        qkv = _rand(rng, (s["b"], s["sq"], 3, s["h"], s["d"]), dt)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # strided views, no copy
    return (_rand(rng, (s["b"], s["sq"], s["h"], s["d"]), dt),
            _rand(rng, (s["b"], s["sk"], s["hk"], s["d"]), dt),
            _rand(rng, (s["b"], s["sk"], s["hk"], s["d"]), dt))


def _kwargs(rng, case, stream) -> dict:
    """The case's options as cuflash keyword arguments."""
    kw = {k: v for k, v in case["opts"].items() if k not in ("alibi", "packed", "side_stream")}
    if case["opts"].get("alibi"):
        h = case["shape"]["h"]
        kw["alibi_slopes"] = cupy.asarray(
            np.float32(2.0) ** (-8.0 * np.arange(1, h + 1, dtype=np.float32) / h))
    kw["stream"] = stream
    return kw


def run_attention(rng, case, stream):
    q, k, v = _qkv(rng, case)
    kw = _kwargs(rng, case, stream)
    _ready()
    return cuflash.attention(q, k, v, **kw)


def run_attention_backward(rng, case, stream):
    """The public signature: dout, q, k, v, out, lse from a forward with return_lse=True
    and the same options; deterministic only to the backward."""
    q, k, v = _qkv(rng, case)
    kw = _kwargs(rng, case, stream)  # causal, window_size, softcap, alibi_slopes, stream
    deterministic = bool(kw.pop("deterministic", False))
    _ready()
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    dout = _rand(rng, out.shape, case["dtype"])
    _ready()  # out, lse from the forward's stream; dout from the default stream's copy
    with settings.override(bwd_sm90_det=case.get("det_mode", settings.current().bwd_sm90_det)):
        return cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)


def run_attention_with_kvcache(rng, case, stream):
    """e4m3="tensor" or "head": e4m3 caches and new keys (uint8) with k/v descales of that form."""
    s, dt = case["shape"], case["dtype"]
    e4m3 = case["opts"].get("e4m3")
    kv = (lambda shape: _e4m3(rng, shape)) if e4m3 else (lambda shape: _rand(rng, shape, dt))  # noqa: E731
    q = _rand(rng, (s["b"], s["sq"], s["h"], s["d"]), dt)
    k_cache = kv((s["b"], s["sk"], s["hk"], s["d"]))
    v_cache = kv((s["b"], s["sk"], s["hk"], s["d"]))
    kw = _kwargs(rng, case, stream)
    kw.pop("e4m3", None)
    if e4m3:
        descales = _fp8_descales(rng, e4m3, s["b"], s["hk"])
        kw.update(k_descale=descales["k_descale"], v_descale=descales["v_descale"])
    kw["cache_seqlens"] = cupy.asarray(np.array(kw["cache_seqlens"], dtype=np.int32))
    page_size, new_k = kw.pop("page_size", None), kw.pop("new_k", 0)
    rotary, leftpad, bad_pages, batch_idx = (kw.pop(n, None) for n in ("rotary", "leftpad", "bad_pages", "batch_idx"))
    if rotary:  # tables for positions up to the capacity plus the new rows
        kw["rotary_cos"] = _rand(rng, (s["sk"] + s["sq"], rotary // 2), dt)
        kw["rotary_sin"] = _rand(rng, (s["sk"] + s["sq"], rotary // 2), dt)
    if leftpad is not None:
        kw["cache_leftpad"] = cupy.asarray(np.array(leftpad, dtype=np.int32))
    if batch_idx is not None:
        kw["cache_batch_idx"] = cupy.asarray(np.array(batch_idx, dtype=np.int32))
    if page_size:  # the same capacity as pages, shuffled, plus two spare pages
        pages = -(-s["sk"] // page_size)
        k_cache = kv((s["b"] * pages + 2, page_size, s["hk"], s["d"]))
        v_cache = kv((s["b"] * pages + 2, page_size, s["hk"], s["d"]))
        table = rng.permutation(s["b"] * pages + 2)[:s["b"] * pages].reshape(s["b"], pages).astype(np.int32)
        if bad_pages:  # entries that name no page of the pool
            table[0, -1], table[1, 0] = 10 ** 6, -1
        kw["block_table"] = cupy.asarray(table)
    if new_k:
        kw["k"] = kv((s["b"], new_k, s["hk"], s["d"]))
        kw["v"] = kv((s["b"], new_k, s["hk"], s["d"]))
    _ready()
    return cuflash.attention_with_kvcache(q, k_cache, v_cache, **kw)


def _varlen_inputs(rng, case):
    """Packed q (total_q, h, d), k, v (total_k, hk, d), their cu_seqlens and the maximum lengths."""
    s, dt = case["shape"], case["dtype"]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(s[n])]).astype(np.int32) for n in ("lens_q", "lens_k"))
    q = _rand(rng, (int(cu_q[-1]), s["h"], s["d"]), dt)
    k = _rand(rng, (int(cu_k[-1]), s["hk"], s["d"]), dt)
    v = _rand(rng, (int(cu_k[-1]), s["hk"], s["d"]), dt)
    return q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max(s["lens_q"]), max(s["lens_k"])


def run_attention_varlen(rng, case, stream):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(rng, case)
    kw = _kwargs(rng, case, stream)
    page_size, seqused, bad_pages = (kw.pop(n, None) for n in ("page_size", "seqused", "bad_pages"))
    if seqused is not None:
        kw["seqused_k"] = cupy.asarray(np.array(seqused, dtype=np.int32))
    if page_size:  # each sequence's keys in pages of a shuffled pool, with its own block-table row
        s = case["shape"]
        pages = [max(1, -(-n // page_size)) for n in s["lens_k"]]
        k = _rand(rng, (sum(pages), page_size, s["hk"], s["d"]), case["dtype"])
        v = _rand(rng, (sum(pages), page_size, s["hk"], s["d"]), case["dtype"])
        order = rng.permutation(sum(pages)).astype(np.int32)
        table = np.zeros((len(pages), max(pages)), np.int32)
        for b, n in enumerate(pages):
            table[b, :n] = order[sum(pages[:b]):sum(pages[:b]) + n]
        if bad_pages:
            table[0, 0], table[-1, -1] = -5, 10 ** 6
        kw["block_table"] = cupy.asarray(table)
    _ready()
    return cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def run_attention_varlen_backward(rng, case, stream):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(rng, case)
    kw = _kwargs(rng, case, stream)
    deterministic = bool(kw.pop("deterministic", False))
    _ready()
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    dout = _rand(rng, out.shape, case["dtype"])
    _ready()
    return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                             deterministic=deterministic, **kw)


def run_attention_sm90(rng, case, stream):
    from cuflash.ops import forward_sm90
    q, k, v = _qkv(rng, case)
    kw = _kwargs(rng, case, stream)
    stream = kw.pop("stream")
    o_tma = kw.pop("o_tma", None)  # the sm90_o_tma setting for every head dim, for this case
    _ready()
    with settings.override(sm90_o_tma=o_tma), (stream or cupy.cuda.get_current_stream()):
        return forward_sm90.attention_sm90(q, k, v, **kw)


def _e4m3(rng, shape):
    """e4m3 bits made on the host: finite values of a standard normal, rounded."""
    return cupy.asarray(rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _fp8_descales(rng, per, batch: int, hk: int) -> dict:
    """q/k/v descales per tensor ("tensor"), per (batch, KV head) ("head"), or none (None)."""
    if not per:
        return {}
    shape = (batch, hk) if per == "head" else (1,)
    return {n: cupy.asarray(rng.uniform(0.5, 2.0, shape).astype(np.float32))
            for n in ("q_descale", "k_descale", "v_descale")}


def run_attention_fp8(rng, case, stream):
    """e4m3 inputs (_e4m3), descales per tensor or per (batch, KV head) as the case says."""
    s, o = case["shape"], dict(case["opts"])
    per, vt_pass = o.pop("descale", None), o.pop("vt_pass", None)
    q = _e4m3(rng, (s["b"], s["sq"], s["h"], s["d"]))
    k, v = (_e4m3(rng, (s["b"], s["sk"], s["hk"], s["d"])) for _ in range(2))
    o.update(_fp8_descales(rng, per, s["b"], s["hk"]))
    _ready()
    with settings.override(fp8_vt_pass=vt_pass), (stream or cupy.cuda.get_current_stream()):
        return cuflash.attention_fp8(q, k, v, **o)


def run_attention_varlen_fp8(rng, case, stream):
    """Packed e4m3 sequences (VARLEN's lengths); short_rows=(a, b): q and k hold a and b rows fewer than the
    cu_seqlens say, which the kernels must bound."""
    s, o = case["shape"], dict(case["opts"])
    per, short, vt_pass = o.pop("descale", None), o.pop("short_rows", (0, 0)), o.pop("vt_pass", None)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(s[n])]).astype(np.int32) for n in ("lens_q", "lens_k"))
    q = _e4m3(rng, (int(cu_q[-1]) - short[0], s["h"], s["d"]))
    k, v = (_e4m3(rng, (int(cu_k[-1]) - short[1], s["hk"], s["d"])) for _ in range(2))
    o.update(_fp8_descales(rng, per, len(s["lens_q"]), s["hk"]))
    _ready()
    with settings.override(fp8_vt_pass=vt_pass), (stream or cupy.cuda.get_current_stream()):
        return cuflash.attention_varlen_fp8(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max(s["lens_q"]),
                                            max(s["lens_k"]), **o)


def run_quantize_e4m3(rng, case, stream):
    """x from _rand; with per="head" a strided view (every other row of a wider array)."""
    s, o = case["shape"], case["opts"]
    x = _rand(rng, (s["b"], 2 * s["s"], s["h"], s["d"]), case["dtype"])
    x = x[:, ::2] if o["per"] == "head" else x[:, :s["s"]]
    _ready()
    with stream or cupy.cuda.get_current_stream():
        return cuflash.quantize_e4m3(x, **o)


def _available(fn: str) -> bool:
    """The case's function exists (and, for the Hopper kernels, the device is sm_90a)."""
    if fn in ("attention_sm90", "attention_fp8", "attention_varlen_fp8"):
        try:
            return cupy.cuda.Device().compute_capability == "90"
        except cupy.cuda.runtime.CUDARuntimeError:  # no GPU (--list on a CPU machine)
            return False
    return hasattr(cuflash, fn)


RUNNERS = {
    "attention_sm90": run_attention_sm90,
    "attention_fp8": run_attention_fp8,
    "attention_varlen_fp8": run_attention_varlen_fp8,
    "attention_varlen": run_attention_varlen,
    "attention_varlen_backward": run_attention_varlen_backward,
    "attention": run_attention,
    "attention_backward": run_attention_backward,
    "attention_with_kvcache": run_attention_with_kvcache,
    "quantize_e4m3": run_quantize_e4m3,
}


def _nonfinite_count(outputs, dtype: str) -> int:
    """inf/nan among the 16-bit outputs, read from the exponent bits on the host, so that
    no CuPy kernel of ours runs under the sanitizer (only cuflash's should be judged)."""
    n = 0
    mask = NONFINITE_MASK[dtype]
    for a in outputs:
        if isinstance(a, cupy.ndarray) and a.dtype.itemsize == 2:
            bits = cupy.asnumpy(a).view(np.uint16)
            n += int(((bits & mask) == mask).sum())
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="cuflash launches for compute-sanitizer")
    p.add_argument("--list", action="store_true", help="print the case table and exit")
    p.add_argument("--only", default="", help="run cases whose name contains this (or, comma-separated, any of these)")
    args = p.parse_args(argv)

    cases = [c for c in CASES if any(part in c["name"] for part in args.only.split(","))]
    if args.list:
        for c in cases:
            state = "" if _available(c["fn"]) else "   (skipped: cuflash lacks it, or not sm_90a)"
            print(f"{c['name']:<36} {c['fn']:<24} {c['shape']} {c['opts']}{state}")
        return 0

    ran, skipped, failed = 0, [], []
    for case in cases:
        if not _available(case["fn"]):
            skipped.append(case["name"])
            continue
        rng = np.random.default_rng(0)
        side = case["opts"].get("side_stream")
        stream = cupy.cuda.Stream(non_blocking=True) if side else None
        try:
            result = RUNNERS[case["fn"]](rng, case, stream)
            (stream or cupy.cuda.get_current_stream()).synchronize()
            cupy.cuda.Device().synchronize()
            outs = result if isinstance(result, tuple) else (result,)
            bad = _nonfinite_count(outs, case["dtype"])
            if bad:
                raise AssertionError(f"{bad} non-finite values in the 16-bit outputs")
            ran += 1
            print(f"ok    {case['name']}", flush=True)
        except Exception as e:  # noqa: BLE001  -- keep going, report all
            failed.append(case["name"])
            print(f"FAIL  {case['name']}: {type(e).__name__}: {e}", flush=True)
            if len(failed) == 1:  # the first traceback is the useful one
                traceback.print_exc()

    missing = sorted({c["fn"] for c in cases if c["name"] in skipped})
    if skipped:
        print(f"skipped {len(skipped)} case(s): cuflash has no {', '.join(missing)} yet")
    if failed or not ran:
        print(f"sanitize cases FAILED: {len(failed)} of {ran + len(failed)} failed"
              + ("" if ran or failed else " (no case ran)") + f": {failed}")
        return 1
    print(f"sanitize cases ok ({ran} ran, {len(skipped)} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode benchmark: cuflash.attention_with_kvcache beside PyTorch SDPA (flash, cudnn backends), same run.

One new query row per sequence, 32 query heads, 8 KV heads, d = 128 (--headdim), bf16, on the grid
batch {1, 8, 32, 64} x KV length {1k, 8k, 64k, 256k} (cells whose K/V exceed --max-gb are skipped).
Reports microseconds per call and TB/s of K/V read (2 * batch * len * nheads_k * d * 2 bytes over the
time). cuflash and the peers read the same K/V storage: it is allocated once as (batch, nheads_k, len, d),
SDPA's layout, and cuflash takes the (batch, len, nheads_k, d) view of it (strides, no copy). The paged
column (page size 64, pages shuffled) uses its own pool and runs where K/V fit under --paged-max-gb. The e4m3
column reads the same keys and values quantized to an e4m3 cache (per-tensor descales; its own contiguous
(batch, len, nheads_k, d) arrays, half the bytes): its TB/s counts the bytes it reads, and x bf16 is cuflash bf16's
time over its time. The e4m3 paged column is the e4m3 cache in the paged column's shuffled pages.

Timing: triton.testing.do_bench (CUDA events, L2 flushed before every call), median; the least of --repeats such
medians per implementation and cell.

    python benchmarks/bench_decode.py [--json out.json] [--quick]
    python benchmarks/bench_decode.py --page-sizes 16,32,64,256 [--headdim 64]   # page sizes against contiguous

--page-sizes times the same keys, bf16 and e4m3, contiguous and in shuffled pools of each page size, at batch 1 x 64k,
32 x 8k and 32 x 64k keys (cuflash alone: SDPA has no paged cache).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCHES = (1, 8, 32, 64)
LENGTHS = (1024, 8192, 65536, 262144)
H, HK = 32, 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--quick", action="store_true", help="batch {1, 32} x len {8k, 64k} only")
    p.add_argument("--headdim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--max-gb", type=float, default=72.0, help="skip cells whose K/V exceed this")
    p.add_argument("--paged-max-gb", type=float, default=8.0, help="paged column only up to this K/V size")
    p.add_argument("--rep", type=int, default=100, help="ms of timed calls per measurement (do_bench)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per implementation and cell; the least "
                   "median counts (single measurements of the 1k-8k cells at batch 1-8 swung 2-3x for "
                   "every implementation in one run of four)")
    p.add_argument("--page-sizes", type=lambda x: [int(n) for n in x.split(",") if n],
                   help="page sizes to time against the contiguous cache (see above) instead of the grid")
    return p.parse_args(argv)


PAGE_CELLS = ((1, 65536), (32, 8192), (32, 65536))


def page_sweep(args, time_us) -> list:
    """Microseconds per call of the contiguous cache and of each page size, bf16 and e4m3, per cell of PAGE_CELLS;
    `same`: the paged bf16 output bitwise equal to the contiguous one."""
    import cupy
    import torch

    import cuflash
    D, rows = args.headdim, []
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = args.page_sizes
    print(f"{'dtype':>5} {'batch':>5} {'len':>7} | {'contig':>8} " + " ".join(f"{'pg ' + str(ps):>8}" for ps in sizes)
          + "  (us per call; * paged output not bitwise the contiguous one)")
    for b, n in PAGE_CELLS:
        q = cupy.from_dlpack(torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen))
        for dtype in ("bf16", "e4m3"):
            if dtype == "bf16":
                k = torch.randn(b, n, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                v = torch.randn(b, n, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                extra = {}
            else:  # random e4m3 bytes of normal magnitude (no NaN: 0x7f / 0xff excluded)
                k = torch.randint(0, 120, (b, n, HK, D), device="cuda", dtype=torch.uint8, generator=gen)
                v = torch.randint(0, 120, (b, n, HK, D), device="cuda", dtype=torch.uint8, generator=gen)
                descale = cupy.asarray([0.01], dtype=cupy.float32)
                extra = dict(k_descale=descale, v_descale=descale)
            kc, vc = cupy.from_dlpack(k), cupy.from_dlpack(v)
            ref = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=n, **extra)
            row = dict(dtype=dtype, batch=b, len=n, d=D,
                       contiguous_us=time_us(lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=n,
                                                                                    **extra)))
            for ps in sizes:
                pages = b * (n // ps)
                perm = torch.randperm(pages, device="cuda", generator=gen)
                pk = torch.empty((pages, ps, HK, D), device="cuda", dtype=k.dtype)
                pv = torch.empty_like(pk)
                pk[perm] = k.reshape(pages, ps, HK, D)
                pv[perm] = v.reshape(pages, ps, HK, D)
                table = cupy.from_dlpack(perm.to(torch.int32).reshape(b, n // ps).contiguous())
                pkc, pvc = cupy.from_dlpack(pk), cupy.from_dlpack(pv)

                def call():
                    return cuflash.attention_with_kvcache(q, pkc, pvc, cache_seqlens=n, block_table=table, **extra)

                row[f"same_{ps}"] = bool((call() == ref).all())
                row[f"paged{ps}_us"] = time_us(call)
                del pk, pv, pkc, pvc, table
            rows.append(row)
            print(f"{dtype:>5} {b:>5} {n:>7} | {row['contiguous_us']:>8.1f} " + " ".join(
                f"{row[f'paged{ps}_us']:>7.1f}{' ' if row[f'same_{ps}'] else '*'}" for ps in sizes), flush=True)
            del k, v, kc, vc, ref
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import cuflash

    def time_us(fn):  # the least of --repeats medians: a transient stall of the host or GPU does not decide a cell
        return min(1e3 * float(do_bench(fn, warmup=10, rep=args.rep, return_mode="median"))
                   for _ in range(args.repeats))

    if args.page_sizes:
        rows = page_sweep(args, time_us)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(h=H, hk=HK, d=args.headdim, rows=rows), indent=1))
        return 0
    batches, lengths = ((1, 32), (8192, 65536)) if args.quick else (BATCHES, LENGTHS)
    D = args.headdim
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    header = (f"{'batch':>5} {'len':>7} {'KV MB':>8} | {'cuflash':>8} {'TB/s':>5} {'paged':>8} {'e4m3':>8} "
              f"{'TB/s':>5} {'x bf16':>6} {'e4m3 pg':>8} {'flash':>8} {'cudnn':>8} | {'cf/flash':>8} {'cf/cudnn':>8}"
              f"  (us per call)")
    print(header)
    print("-" * len(header))
    for b in batches:
        for n in lengths:
            kv_bytes = 2 * b * n * HK * D * 2
            if kv_bytes > args.max_gb * 2**30:
                print(f"{b:>5} {n:>7} {kv_bytes / 2**20:>8.0f} | skipped (K/V over --max-gb)")
                continue
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()
            k = torch.randn(b, HK, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(b, HK, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            # cuflash's view of the same storage: (batch, len, nheads_k, d) and q (batch, 1, nheads, d)
            kc, vc = cupy.from_dlpack(k.transpose(1, 2)), cupy.from_dlpack(v.transpose(1, 2))
            qc = cupy.from_dlpack(q.transpose(1, 2))
            stream = cuflash.runtime.external_stream(torch.cuda.current_stream().cuda_stream)
            row = dict(batch=b, len=n, kv_mb=kv_bytes / 2**20)

            def cf():
                with stream:
                    return cuflash.attention_with_kvcache(qc, kc, vc, cache_seqlens=n)

            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True) \
                if kv_bytes <= 2**31 else None
            out = torch.from_dlpack(cf()).transpose(1, 2)
            if ref is not None:
                row["cuflash_err"] = float((out.float() - ref).abs().max())
            row["cuflash_us"] = time_us(cf)
            row["cuflash_tbs"] = kv_bytes / row["cuflash_us"] / 1e6

            if kv_bytes <= args.paged_max_gb * 2**30:  # same keys in shuffled 64-row pages
                ps = 64
                pages = b * (n // ps)
                perm = torch.randperm(pages, device="cuda", generator=gen)
                pool_k = torch.empty(pages, ps, HK, D, device="cuda", dtype=torch.bfloat16)
                pool_v = torch.empty_like(pool_k)
                pool_k[perm] = k.transpose(1, 2).reshape(pages, ps, HK, D)
                pool_v[perm] = v.transpose(1, 2).reshape(pages, ps, HK, D)
                table = cupy.from_dlpack(perm.to(torch.int32).reshape(b, n // ps).contiguous())
                pk, pv = cupy.from_dlpack(pool_k), cupy.from_dlpack(pool_v)

                def cf_paged():
                    with stream:
                        return cuflash.attention_with_kvcache(qc, pk, pv, cache_seqlens=n, block_table=table)

                paged_out = torch.from_dlpack(cf_paged()).transpose(1, 2)
                row["paged_matches"] = bool(torch.equal(paged_out, out))
                row["paged_us"] = time_us(cf_paged)
                del pool_k, pool_v, pk, pv

            scale = float(torch.maximum(k.abs().max(), v.abs().max())) / 448.0
            descale = cupy.asarray([scale], dtype=cupy.float32)
            k8, v8 = (cupy.from_dlpack((x.transpose(1, 2) / scale).to(torch.float8_e4m3fn).contiguous()
                                       .view(torch.uint8)) for x in (k, v))

            def cf_e4m3():
                with stream:
                    return cuflash.attention_with_kvcache(qc, k8, v8, cache_seqlens=n, k_descale=descale,
                                                          v_descale=descale)

            e4m3_out = torch.from_dlpack(cf_e4m3()).transpose(1, 2)
            if ref is not None:
                row["e4m3_err"] = float((e4m3_out.float() - ref).abs().max())
            row["e4m3_us"] = time_us(cf_e4m3)
            row["e4m3_tbs"] = kv_bytes / 2 / row["e4m3_us"] / 1e6
            if "paged_us" in row:  # the e4m3 cache in the same shuffled 64-row pages
                pool_k8 = torch.empty(pages, ps, HK, D, device="cuda", dtype=torch.uint8)
                pool_v8 = torch.empty_like(pool_k8)
                pool_k8[perm] = torch.from_dlpack(k8).reshape(pages, ps, HK, D)
                pool_v8[perm] = torch.from_dlpack(v8).reshape(pages, ps, HK, D)
                pk8, pv8 = cupy.from_dlpack(pool_k8), cupy.from_dlpack(pool_v8)

                def cf_e4m3_paged():
                    with stream:
                        return cuflash.attention_with_kvcache(qc, pk8, pv8, cache_seqlens=n, block_table=table,
                                                              k_descale=descale, v_descale=descale)

                cf_e4m3_paged()
                row["e4m3_paged_us"] = time_us(cf_e4m3_paged)
                del pool_k8, pool_v8, pk8, pv8, table
            del k8, v8, e4m3_out

            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def peer(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                try:
                    peer_out = peer()
                    if ref is not None:
                        row[f"{name}_err"] = float((peer_out.float() - ref).abs().max())
                    row[f"{name}_us"] = time_us(peer)
                except Exception as e:  # a backend that refuses the shape is reported, not fatal
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)

            def us(key):
                return f"{row[key]:>8.1f}" if key in row else f"{'n/a':>8}"

            def ratio(peer):
                return f"{row[peer + '_us'] / row['cuflash_us']:>8.2f}" if peer + "_us" in row else f"{'n/a':>8}"
            print(f"{b:>5} {n:>7} {row['kv_mb']:>8.0f} | {us('cuflash_us')} {row['cuflash_tbs']:>5.2f} "
                  f"{us('paged_us')} {us('e4m3_us')} {row['e4m3_tbs']:>5.2f} "
                  f"{row['cuflash_us'] / row['e4m3_us']:>6.2f} {us('e4m3_paged_us')} {us('flash_us')} "
                  f"{us('cudnn_us')} | "
                  f"{ratio('flash')} {ratio('cudnn')}", flush=True)
            del k, v, q, kc, vc, qc, ref, out
    for row in rows:
        for key in ("flash_error", "cudnn_error"):
            if key in row:
                print(f"note: batch {row['batch']} len {row['len']}: {key[:-6]} failed: {row[key]}")
        errs = {k: v for k, v in row.items() if k.endswith("_err") and k != "e4m3_err"}  # e4m3: quantized
        if errs and max(errs.values()) > 0.05:
            print(f"warning: batch {row['batch']} len {row['len']}: max errors vs fp32 {errs}")
        if row.get("paged_matches") is False:
            print(f"warning: batch {row['batch']} len {row['len']}: paged output differs from contiguous")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(h=H, hk=HK, d=D, dtype="bf16", rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode tile/ring/split tuning: times attention_with_kvcache (bf16, d 128, 32 query heads, 8 KV heads, one new
row) for several (block_n, stages) configs and split counts on a few cells, same run, SDPA cuDNN beside it. The
winner goes into decode.DECODE_TABLE (and the split heuristic) with this output as its record (docs/bench/).

    python benchmarks/tune_decode.py                                   # the table's cells, heuristic splits
    python benchmarks/tune_decode.py --cells 1x8192,8x1024 --configs 64x3,64x2 --splits 0,16,32,64

Cache layout as bench_decode.py: SDPA's (batch, nheads_k, len, d) storage, cuflash's (batch, len, nheads_k, d)
view of it. Timing: triton.testing.do_bench (L2 flushed before every call), median, microseconds.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = "64x2,64x3,64x4,64x6,128x2,128x3"
CELLS = "1x8192,1x262144,8x65536,32x8192,32x65536,64x262144"
H, HK, D = 32, 8, 128


def _pairs(text):
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=CELLS, help="batch x KV length, comma separated")
    ap.add_argument("--configs", default=CONFIGS, help="block_n x stages, comma separated")
    ap.add_argument("--splits", default="0", help="num_splits values (0: the planner's heuristic)")
    ap.add_argument("--rep", type=int, default=60)
    args = ap.parse_args(argv)

    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    import cuflash
    from cuflash.ops import decode

    original = decode.decode_config
    splits = [int(s) for s in args.splits.split(",")]
    configs = _pairs(args.configs)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    cols = [f"n{bn}s{st}/{s or 'h'}" for bn, st in configs for s in splits]
    print(f"{'batch':>5} {'len':>7} | {'cudnn':>8} | " + " ".join(c.rjust(11) for c in cols) + "   (us per call)")
    for b, n in _pairs(args.cells):
        k = torch.randn(b, HK, n, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, HK, n, D, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16)
        kc, vc, qc = (cupy.from_dlpack(x.transpose(1, 2)) for x in (k, v, q))

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ref = cudnn()
        row = [1e3 * do_bench(cudnn, warmup=10, rep=args.rep, return_mode="median")]
        for bn, st in configs:
            decode.decode_config = lambda d, rows, c=(bn, st): decode.DecodeConfig(1 if rows <= 16 else 4, *c)
            for s in splits:
                decode.plan_decode.cache_clear()
                decode._calls.clear()

                def fn(s=s):
                    with stream:
                        return cuflash.attention_with_kvcache(qc, kc, vc, cache_seqlens=n, num_splits=s)
                out = torch.from_dlpack(fn()).transpose(1, 2)
                err = float((out.float() - ref.float()).abs().max())
                assert err < 2e-2, (b, n, bn, st, s, err)
                row.append(1e3 * do_bench(fn, warmup=10, rep=args.rep, return_mode="median"))
        best = min(range(1, len(row)), key=lambda i: row[i])
        print(f"{b:>5} {n:>7} | {row[0]:8.1f} | " + " ".join(f"{x:11.1f}" for x in row[1:])
              + f"   best {cols[best - 1]} {row[0] / row[best]:.2f}x cudnn", flush=True)
        del k, v, q, kc, vc, ref
        torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
    decode.decode_config = original


if __name__ == "__main__":
    main()

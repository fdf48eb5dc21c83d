"""Where the host time of an eager ``cuflash.torch.attention`` forward + backward goes, piece by piece.

    python benchmarks/profile_host.py [--shape 1,128,16,64] [--causal] [--varlen] [--profile]

Each line is the wall time per call of a loop of calls with one synchronize at the end (median of 5 loops):
on a small shape the GPU finishes each call before the host issues the next, so it is the host's cost. The
pieces: the forward without and with a gradient to track, ``out.backward(dout)`` on a retained graph, the
backward's Python layer called directly on the main thread, its planned launch alone, the same for SDPA (the
backend ``--backend``), an autograd.Function that does nothing (autograd's cost for a Python function) and a
C++ node (``torch.cat`` of q, k, v: the engine's cost for any node). ``--profile`` adds cProfile's top functions
of the forward with grad and of the direct backward.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call_us(torch, fn, calls: int = 400, loops: int = 5) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,128,16,64", help="b,s,h,d")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--varlen", action="store_true", help="attention_varlen on the batch packed")
    parser.add_argument("--backend", default="cudnn", choices=("cudnn", "flash", "efficient"))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash.torch as cft

    b, s, h, d = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    if args.varlen:
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        q, k, v, dout = (x.view(b * s, h, d) for x in (q, k, v, dout))

        def cf(q_, k_, v_):
            return cft.attention_varlen(q_, k_, v_, cu, cu, s, s, causal=args.causal)
    else:
        def cf(q_, k_, v_):
            return cft.attention(q_, k_, v_, causal=args.causal)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    rows = []

    def row(name, fn):
        us = per_call_us(torch, fn)
        rows.append((name, us))
        print(f"{name:<48} {us:8.1f} us", flush=True)

    with torch.no_grad():
        row("cuflash forward, no grad", lambda: cf(q, k, v))
    row("cuflash forward with grad (Function.apply)", lambda: cf(qg, kg, vg))
    out = cf(qg, kg, vg)
    row("cuflash out.backward(dout), retained graph", lambda: out.backward(dout, retain_graph=True))
    inside = []  # the backward's own time when the autograd engine calls it (on its device thread)
    direct_backward = cft._saved_backward

    def timed_backward(ctx, grad):
        t0 = time.perf_counter()
        try:
            return direct_backward(ctx, grad)
        finally:
            inside.append(time.perf_counter() - t0)

    cft._saved_backward = timed_backward
    try:
        per_call_us(torch, lambda: out.backward(dout, retain_graph=True))
    finally:
        cft._saved_backward = direct_backward
    rows.append(("  of which inside cuflash's backward", statistics.median(inside) * 1e6))
    print(f"{rows[-1][0]:<48} {rows[-1][1]:8.1f} us", flush=True)

    # the backward's Python layer and its launch, on the main thread, from what the forward saved
    node = out.grad_fn
    saved = node.saved_tensors
    ctx = types.SimpleNamespace(saved_tensors=saved, args=node.args, plan=node.plan)
    row("cuflash backward called directly", lambda: cft._saved_backward(ctx, dout))
    qs, ks, vs, outs, lse = saved
    bplan = cft._plans[(node.plan, dout.shape, dout.stride(), dout.dtype, False)]  # deterministic=False
    cu_q, cu_k, alibi = node.args[0], node.args[1], node.args[2]
    row("cuflash backward: allocations + launch", lambda: cft._run_backward(bplan, dout, qs, ks, vs, outs, lse, cu_q,
                                                                             cu_k, alibi))
    grads = [torch.empty_like(x) for x in (qs, ks, vs)]
    ws = torch.empty(bplan.workspace, dtype=torch.uint8, device="cuda")
    row("cuflash backward: launch alone", lambda: bplan.launch(dout, qs, ks, vs, outs, lse, *grads, alibi, cu_q, cu_k,
                                                                ws))

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            ctx.save_for_backward(x, y, z)
            return torch.empty_like(x)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            x, y, z = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(y), torch.empty_like(z)

    row("empty autograd.Function forward", lambda: Nothing.apply(qg, kg, vg))
    nothing = Nothing.apply(qg, kg, vg)
    row("empty autograd.Function backward", lambda: nothing.backward(dout, retain_graph=True))
    cat = torch.cat([qg, kg, vg])  # one C++ node with three inputs: the engine's own cost per backward
    dcat = torch.cat([dout] * 3)
    row("C++ node (torch.cat) backward", lambda: cat.backward(dcat, retain_graph=True))

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.backend]
    if not args.varlen:
        qt, kt, vt, dt = (x.detach().clone().transpose(1, 2).detach().requires_grad_() for x in (q, k, v, dout))
        with sdpa_kernel([backend]):
            with torch.no_grad():
                row(f"SDPA {args.backend} forward, no grad",
                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal))
            row(f"SDPA {args.backend} forward with grad",
                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal))
            sout = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
            dtt = dt.detach()
            row(f"SDPA {args.backend} out.backward(dout), retained graph",
                lambda: sout.backward(dtt, retain_graph=True))

    if args.profile:
        for name, fn in (("forward with grad", lambda: cf(qg, kg, vg)),
                         ("backward called directly", lambda: cft._saved_backward(ctx, dout))):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\n--- cProfile: {name}, 2000 calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())

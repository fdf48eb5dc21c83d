"""Per-call cost, host and GPU together, of every cuflash entry point beside its peer, in one run.

    python benchmarks/bench_overhead.py [--json out/overhead.json] [--quick] [--dtype float16] [--no-jax]

Eager calls, no CUDA graphs, as a user of the library makes them. Each row times one entry point and its peer on
the same data:

- torch (peer: ``torch.nn.functional.scaled_dot_product_attention``): forward without grad, forward with grad
  (``requires_grad`` inputs, forward only), forward + backward (``out.backward(dout)`` with a preallocated
  ``dout``, the leaves' ``.grad`` reset to None each call, as ``zero_grad`` does), ``attention_varlen`` forward
  and forward + backward on equal-length sequences packed along the token axis (peer: SDPA on the same tokens
  as the dense batch), and ``attention_with_kvcache`` without append, with a one-token append, and paged
  (``block_table``, page 256, with append). The kvcache peer is SDPA of q ``(b, h, 1, d)`` on the cache's keys
  ``(b, hk, L, d)`` with ``enable_gqa=True``; with an append, the peer first writes the new row into its cache
  (two slice assignments), as a decode step with SDPA must.
- the CuPy API (``cuflash.attention`` and friends on ``cupy.from_dlpack`` views of the same memory) beside the
  torch entry point in the same row; forward with grad is ``return_lse=True``, forward + backward adds
  ``attention_backward``.
- JAX (optional): ``jax.jit`` of ``cuflash.jax.attention`` forward and of ``jax.grad`` beside
  ``jax.nn.dot_product_attention(implementation="cudnn")`` jitted, same shapes.

Shapes, (batch, seqlen, nheads, headdim), causal: "small" (1, 128, 16, 64), "typical" (4, 1024, 16, 128);
kvcache, 32 query heads / 8 KV heads, d 128: "b1 8k" (batch 1, 8192 keys) and "b8 4k" (batch 8, 4096 keys).

Method. The SDPA backend is chosen once per row, before any timing: cuDNN if it runs the row's call, else
flash, else efficient; ``sdpa_kernel([backend])`` is entered around the whole row. Wall: the time of a loop of
calls with one synchronize at the end (``block_until_ready`` for JAX), divided by the calls; the loop is sized
to about --loop-ms, the implementations of a row alternate loop by loop, and each figure is the median of
--repeats loops. GPU: CUDA events around --gpu-calls calls queued behind a spin kernel (``torch.cuda._sleep``)
long enough for the host to enqueue them all, so the GPU runs them back to back: the device time of a call,
launch gaps included, without the host's. A GPU figure marked ``~`` is an upper bound (the host did not finish
enqueuing before the spin ended). JAX rows have no GPU figure. Ratios are cuflash's wall time over the peer's
(lower is better). Each row spot-checks cuflash's output against the peer's first.

Exit status: 0; 1 when a row failed to run or its spot check (max |cuflash - peer| above 2e-2, relative for JAX's
gradients); 2 without torch, CuPy or a CUDA GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported: share the GPU with torch
if importlib.util.find_spec("cuflash") is None:  # a checkout without pip install; a PYTHONPATH package (an A/B's
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # base) is the one measured

DENSE_SHAPES = {"small": (1, 128, 16, 64), "typical": (4, 1024, 16, 128)}  # (b, s, h, d), causal
KV_SHAPES = {"b1 8k": (1, 8192), "b8 4k": (8, 4096)}                      # (batch, keys in the cache)
KV_HEADS, KV_KV_HEADS, KV_D, PAGE = 32, 8, 128, 256
SPOT_TOL = 2e-2  # max |cuflash - peer| on the outputs; above it the row is flagged (the benchmark guards itself)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--loop-ms", type=float, default=40.0, help="length of one timed loop of calls")
    p.add_argument("--repeats", type=int, default=7, help="timed loops per implementation; the median counts")
    p.add_argument("--gpu-calls", type=int, default=48, help="calls queued behind the spin kernel per GPU loop")
    p.add_argument("--quick", action="store_true", help="smoke run: --loop-ms 8 --repeats 3 --gpu-calls 16")
    p.add_argument("--no-jax", action="store_true", help="skip the JAX rows")
    p.add_argument("--json", help="write the run (versions, GPU, date, rows) here")
    args = p.parse_args(argv)
    if args.quick:
        args.loop_ms, args.repeats, args.gpu_calls = 8.0, 3, 16
    return args


# --------------------------------------------------------------------------- timing
class Timer:
    """Wall and GPU time per call; see the module docstring."""

    def __init__(self, torch, args):
        self.torch, self.loop_ms, self.repeats, self.gpu_calls = torch, args.loop_ms, args.repeats, args.gpu_calls
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        self.cycles_per_ms = 20_000_000 / start.elapsed_time(end)

    @staticmethod
    def wall_us(fn, calls: int, sync) -> float:
        """(wall time of `calls` calls + one sync) / calls, in microseconds."""
        out = None
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        return (time.perf_counter() - t0) / calls * 1e6

    def gpu_us(self, fn, calls: int, host_us: float) -> tuple[float, bool]:
        """GPU time per call of `calls` calls queued behind a spin kernel; False when the host fell behind it."""
        torch = self.torch
        sleep_ms = 1.5 * host_us * calls / 1e3 + 2.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        torch.cuda._sleep(int(sleep_ms * self.cycles_per_ms))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        queued_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls * 1e3, queued_ms < sleep_ms

    def calls_for(self, us: float) -> int:
        return int(min(5000, max(20, self.loop_ms * 1e3 / max(us, 1e-3))))

    def measure(self, fns: dict, sync, gpu: bool = True) -> dict:
        """{name: {"wall", "gpu", "gpu_exact", "calls"}} for the callables of one row, timed alternately."""
        for fn in fns.values():  # first calls: NVRTC compiles, cuDNN plans, allocator growth
            for _ in range(3):
                out = fn()
            sync(out)
        calls = self.calls_for(max(self.wall_us(fn, 5, sync) for fn in fns.values()))
        walls = {name: [] for name in fns}
        for _ in range(self.repeats):
            for name, fn in fns.items():
                walls[name].append(self.wall_us(fn, calls, sync))
        out = {name: dict(wall=statistics.median(w), gpu=None, gpu_exact=None, calls=calls)
               for name, w in walls.items()}
        if gpu:
            gpus = {name: [] for name in fns}
            for _ in range(self.repeats):
                for name, fn in fns.items():
                    gpus[name].append(self.gpu_us(fn, self.gpu_calls, out[name]["wall"]))
            for name, g in gpus.items():
                out[name].update(gpu=statistics.median(us for us, _ in g), gpu_exact=all(ok for _, ok in g))
        return out


# --------------------------------------------------------------------------- rows
def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def run_row(timer, torch, group: str, call: str, shape: str, dims: str, cf, peer, cupy_fn=None, spot=None,
            backends=None, sync=None, gpu=True) -> dict:
    """One line of the table: times `cf` (and `cupy_fn`, the CuPy API's call) beside `peer`. For torch rows
    `backends` lists (label, SDPBackend) in order of preference: the first that runs `peer` is entered around the
    whole row. `spot` returns {"max_diff": ...} of cuflash's output against the peer's."""
    row = dict(group=group, call=call, shape=shape, dims=dims)
    sync = sync or (lambda _: torch.cuda.synchronize())
    context, peer_label = _pick_backend(torch, peer, backends, row) if backends else (None, "peer")
    row["peer"] = peer_label
    fns = {"cuflash": cf}
    if context is not None or not backends:
        fns["peer"] = peer
    if cupy_fn is not None:
        fns["cupy"] = cupy_fn
    try:
        with context if context is not None else contextlib.nullcontext():
            if spot is not None and "peer" in fns:
                row.update(spot())
            times = timer.measure(fns, sync, gpu=gpu)
    except Exception as e:  # a failing call is reported in its row; the run goes on
        row["error"] = _first_line(e)
        return row
    for name, t in times.items():
        row[f"{name}_us"] = t["wall"]
        row[f"{name}_gpu_us"] = t["gpu"]
        row[f"{name}_gpu_exact"] = t["gpu_exact"]
    row["calls"] = times["cuflash"]["calls"]
    row["ratio"] = row["cuflash_us"] / row["peer_us"] if row.get("peer_us") else None
    return row


def _pick_backend(torch, peer, backends, row):
    """(sdpa_kernel context, label) of the first backend that runs `peer`; (None, "SDPA none") when none does. The
    backends that refused are noted in row["peer_error"]."""
    from torch.nn.attention import sdpa_kernel
    refused = []
    for label, backend in backends:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([backend]):
                    peer()
                torch.cuda.synchronize()
            if refused:
                row["peer_error"] = "; ".join(refused)
            return sdpa_kernel([backend]), f"SDPA {label}"
        except Exception as e:  # "No available kernel": this backend refuses the shape or dtype
            refused.append(f"{label}: {_first_line(e)}")
    row["peer_error"] = "; ".join(refused)
    return None, "SDPA none"


def torch_rows(timer, args) -> list[dict]:
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    import cuflash
    import cuflash.torch as cft

    dtype = getattr(torch, args.dtype)
    if cupy.cuda.get_current_stream().ptr != torch.cuda.current_stream().cuda_stream:
        cuflash.runtime.external_stream(torch.cuda.current_stream().cuda_stream).use()  # the CuPy API on torch's stream
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    def leaves(*xs):
        return tuple(x.detach().clone().requires_grad_() for x in xs)

    def leaves_t(*xs):  # (b, h, s, d) leaves over fresh (b, s, h, d) memory, as SDPA sees a model's projections
        return tuple(x.detach().clone().transpose(1, 2).detach().requires_grad_() for x in xs)

    def fwd_bwd(attn, xs, dout):
        def run():
            for x in xs:
                x.grad = None
            attn(*xs).backward(dout)
        return run

    def diff(a, b):
        return dict(max_diff=float((a.float() - b.float()).abs().max()))

    rows = []

    def add(row):
        rows.append(row)
        print_row(row)

    for shape, (b, s, h, d) in DENSE_SHAPES.items():
        dims = f"({b}, {s}, {h}, {d}) causal"
        q, k, v, dout = (randn(b, s, h, d) for _ in range(4))
        qt, kt, vt, doutt = (x.transpose(1, 2) for x in (q, k, v, dout))  # SDPA's (b, h, s, d) views
        cq, ck, cv, cdout = (cupy.from_dlpack(x) for x in (q, k, v, dout))

        def sdpa(q_, k_, v_):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

        def cf(q_, k_, v_):
            return cft.attention(q_, k_, v_, causal=True)

        def spot():
            return diff(cf(q, k, v), sdpa(qt, kt, vt).transpose(1, 2))

        with torch.no_grad():
            add(run_row(timer, torch, "torch", "forward", shape, dims, lambda: cf(q, k, v), lambda: sdpa(qt, kt, vt),
                        lambda: cuflash.attention(cq, ck, cv, causal=True), spot, backends))
        qg, kg, vg = leaves(q, k, v)
        qgt, kgt, vgt = leaves_t(q, k, v)
        add(run_row(timer, torch, "torch", "forward with grad", shape, dims, lambda: cf(qg, kg, vg),
                    lambda: sdpa(qgt, kgt, vgt),
                    lambda: cuflash.attention(cq, ck, cv, causal=True, return_lse=True), spot, backends))

        def cupy_fwd_bwd():
            out, lse = cuflash.attention(cq, ck, cv, causal=True, return_lse=True)
            return cuflash.attention_backward(cdout, cq, ck, cv, out, lse, causal=True)

        add(run_row(timer, torch, "torch", "forward + backward", shape, dims, fwd_bwd(cf, (qg, kg, vg), dout),
                    fwd_bwd(sdpa, (qgt, kgt, vgt), doutt), cupy_fwd_bwd, spot, backends))

        # varlen: the b sequences of length s packed along the token axis, the same memory as the dense batch
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        ccu = cupy.from_dlpack(cu)
        pq, pk, pv, pdout = (x.view(b * s, h, d) for x in (q, k, v, dout))
        cpq, cpk, cpv, cpdout = (cupy.from_dlpack(x) for x in (pq, pk, pv, pdout))

        def cf_varlen(q_, k_, v_):
            return cft.attention_varlen(q_, k_, v_, cu, cu, s, s, causal=True)

        def spot_varlen():
            return diff(cf_varlen(pq, pk, pv), sdpa(qt, kt, vt).transpose(1, 2).reshape(b * s, h, d))

        with torch.no_grad():
            add(run_row(timer, torch, "torch", "varlen forward", shape, dims, lambda: cf_varlen(pq, pk, pv),
                        lambda: sdpa(qt, kt, vt),
                        lambda: cuflash.attention_varlen(cpq, cpk, cpv, ccu, ccu, s, s, causal=True),
                        spot_varlen, backends))

        def cupy_varlen_fwd_bwd():
            out, lse = cuflash.attention_varlen(cpq, cpk, cpv, ccu, ccu, s, s, causal=True, return_lse=True)
            return cuflash.attention_varlen_backward(cpdout, cpq, cpk, cpv, out, lse, ccu, ccu, s, s, causal=True)

        pqg, pkg, pvg = leaves(pq, pk, pv)
        add(run_row(timer, torch, "torch", "varlen forward + backward", shape, dims,
                    fwd_bwd(cf_varlen, (pqg, pkg, pvg), pdout), fwd_bwd(sdpa, (qgt, kgt, vgt), doutt),
                    cupy_varlen_fwd_bwd, spot_varlen, backends))

    h, hk, d = KV_HEADS, KV_KV_HEADS, KV_D
    for shape, (b, n) in KV_SHAPES.items():
        dims = f"batch {b}, {n // 1024}k keys, {h}/{hk} heads, d {d}"
        # each implementation's cache in its own layout, same keys: cuflash (b, L, hk, d), SDPA (b, hk, L, d)
        k_cache, v_cache = randn(b, n, hk, d), randn(b, n, hk, d)
        k_sdpa, v_sdpa = (x.transpose(1, 2).contiguous() for x in (k_cache, v_cache))
        q = randn(b, 1, h, d)
        qt = q.transpose(1, 2)
        # the appended key is the one already at position L - 1: every call writes the same values, so the
        # attention stays equal to the peer's, which does not append
        k_new, v_new = (x[:, n - 1:n].clone() for x in (k_cache, v_cache))
        full = torch.full((b,), n, dtype=torch.int32, device="cuda")
        before = torch.full((b,), n - 1, dtype=torch.int32, device="cuda")
        pages = b * (n // PAGE)
        perm = torch.randperm(pages, device="cuda", generator=gen)
        pool_k, pool_v = (torch.empty(pages, PAGE, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        pool_k[perm], pool_v[perm] = (x.reshape(pages, PAGE, hk, d) for x in (k_cache, v_cache))
        table = perm.to(torch.int32).reshape(b, n // PAGE).contiguous()
        cq, ckc, cvc, ck_new, cv_new, cfull, cbefore, cpool_k, cpool_v, ctable = (
            cupy.from_dlpack(x) for x in (q, k_cache, v_cache, k_new, v_new, full, before, pool_k, pool_v, table))

        def sdpa_kv():
            return F.scaled_dot_product_attention(qt, k_sdpa, v_sdpa, enable_gqa=True)

        k_new_t, v_new_t = k_new.transpose(1, 2), v_new.transpose(1, 2)

        def sdpa_kv_append():  # what a decode step costs with SDPA: write the new row into the cache, then attend
            k_sdpa[:, :, n - 1:n] = k_new_t
            v_sdpa[:, :, n - 1:n] = v_new_t
            return sdpa_kv()

        # one query row: causal or not is the same mask, and the peer's is_causal (top-left) would not be
        variants = [
            ("kvcache", lambda: cft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=full),
             lambda: cuflash.attention_with_kvcache(cq, ckc, cvc, cache_seqlens=cfull), sdpa_kv),
            ("kvcache, append", lambda: cft.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                                                   cache_seqlens=before),
             lambda: cuflash.attention_with_kvcache(cq, ckc, cvc, k=ck_new, v=cv_new, cache_seqlens=cbefore),
             sdpa_kv_append),
            (f"kvcache, paged {PAGE}, append",
             lambda: cft.attention_with_kvcache(q, pool_k, pool_v, k=k_new, v=v_new, cache_seqlens=before,
                                                block_table=table),
             lambda: cuflash.attention_with_kvcache(cq, cpool_k, cpool_v, k=ck_new, v=cv_new, cache_seqlens=cbefore,
                                                    block_table=ctable), sdpa_kv_append),
        ]
        with torch.no_grad():
            for call, cf, cp, peer in variants:
                add(run_row(timer, torch, "torch", call, shape, dims, cf, peer, cp,
                            lambda cf=cf: diff(cf(), sdpa_kv().transpose(1, 2)), backends))
    return rows


def jax_rows(timer, args) -> tuple[list[dict], str | None]:
    """The JAX rows, or none and the reason."""
    try:
        import jax
        import jax.numpy as jnp
        if not jax.devices("gpu"):
            return [], "JAX sees no GPU"
    except Exception as e:
        return [], f"JAX unavailable ({_first_line(e)})"
    try:
        import cuflash.jax as cfj
    except Exception as e:
        return [], f"cuflash.jax unavailable ({_first_line(e)})"
    import torch

    dtype = getattr(jnp, args.dtype)
    rows = []

    def cudnn_or_xla(fn_of_impl, *xs):
        """(jitted peer, label, why not cuDNN): cuDNN if it compiles and runs for these inputs, else XLA's own
        attention."""
        refused = []
        for impl in ("cudnn", "xla"):
            fn = fn_of_impl(impl)
            try:
                jax.block_until_ready(fn(*xs))
                return fn, f"jax.nn {impl}", "; ".join(refused) or None
            except Exception as e:  # cuDNN refuses the shape or dtype on this GPU
                refused.append(f"{impl}: {_first_line(e)}")
        raise RuntimeError("jax.nn.dot_product_attention runs with neither implementation: " + "; ".join(refused))

    def sync(out):
        jax.block_until_ready(out)

    for shape, (b, s, h, d) in DENSE_SHAPES.items():
        dims = f"({b}, {s}, {h}, {d}) causal"
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, dout = (jax.random.normal(key, (b, s, h, d), dtype=dtype) for key in keys)

        def cf_attn(q_, k_, v_):
            return cfj.attention(q_, k_, v_, causal=True)

        def peer_attn(impl):
            return lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_, is_causal=True, implementation=impl)

        def grad_of(attn):
            def loss(q_, k_, v_, do):
                return jnp.sum(attn(q_, k_, v_).astype(jnp.float32) * do.astype(jnp.float32))
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

        torch.cuda.synchronize()
        for call, cf, peer_of in (
                ("jit forward", jax.jit(cf_attn), lambda impl: jax.jit(peer_attn(impl))),
                ("jit grad (forward + backward)", grad_of(cf_attn), lambda impl: grad_of(peer_attn(impl)))):
            xs = (q, k, v) if call == "jit forward" else (q, k, v, dout)
            try:
                peer, label, refused = cudnn_or_xla(peer_of, *xs)
            except Exception as e:
                row = dict(group="jax", call=call, shape=shape, dims=dims, peer="jax.nn none", error=_first_line(e))
                rows.append(row)
                print_row(row)
                continue

            def spot(cf=cf, peer=peer, xs=xs):
                a, p = jax.tree_util.tree_leaves(cf(*xs)), jax.tree_util.tree_leaves(peer(*xs))
                scale = 1.0 if call == "jit forward" else max(float(jnp.abs(x.astype(jnp.float32)).max()) for x in p)
                return dict(max_diff=max(float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
                                         for x, y in zip(a, p)) / max(scale, 1e-6))

            row = run_row(timer, torch, "jax", call, shape, dims, lambda cf=cf, xs=xs: cf(*xs),
                          lambda peer=peer, xs=xs: peer(*xs), spot=spot, sync=sync, gpu=False)
            row["peer"] = label
            if refused:
                row["peer_error"] = refused
            rows.append(row)
            print_row(row)
    return rows, None


# --------------------------------------------------------------------------- output
HEADER = (f"{'call':34} {'shape':8} {'peer':14} {'cuflash':>8} {'peer':>8} {'ratio':>6} | {'cf GPU':>8} "
          f"{'peer GPU':>8} | {'CuPy API':>8} {'CuPy GPU':>8}")


def _us(row, key):
    x = row.get(f"{key}_us")
    if x is None:
        return f"{'n/a':>8}"
    return f"{x:>8.1f}"


def _gpu(row, key):
    x = row.get(f"{key}_gpu_us")
    if x is None:
        return f"{'n/a':>8}"
    return f"{'' if row.get(f'{key}_gpu_exact') else '~'}{x:.1f}".rjust(8)


def print_row(row) -> None:
    name = f"{row['group']} {row['call']}"
    ratio = f"{row['ratio']:>5.2f}x" if row.get("ratio") else f"{'n/a':>6}"
    line = (f"{name:34} {row['shape']:8} {row.get('peer', ''):14} {_us(row, 'cuflash')} {_us(row, 'peer')} {ratio} | "
            f"{_gpu(row, 'cuflash')} {_gpu(row, 'peer')} | {_us(row, 'cupy')} {_gpu(row, 'cupy')}")
    if row.get("max_diff") is not None and not row["max_diff"] <= SPOT_TOL:
        line += f"  <<< max diff {row['max_diff']:.3g}"
    print(line, flush=True)
    for key in ("error", "peer_error"):
        if row.get(key):
            print(f"    {key.replace('_', ' ')}: {row[key]}", flush=True)


def verdict(rows: list[dict]) -> dict:
    """Whether every torch row ran and is at most 1.0x its peer's wall time, and the worst row."""
    torch_rows_ = [r for r in rows if r["group"] == "torch"]
    timed = [r for r in torch_rows_ if r.get("ratio") is not None]
    worst = max(timed, key=lambda r: r["ratio"], default=None)
    return dict(torch_within_peer=bool(timed) and len(timed) == len(torch_rows_) and worst["ratio"] <= 1.0,
                torch_rows=len(torch_rows_), torch_rows_timed=len(timed),
                torch_rows_within=sum(r["ratio"] <= 1.0 for r in timed),
                worst=dict(call=worst["call"], shape=worst["shape"], ratio=worst["ratio"]) if worst else None)


def versions(torch, cupy) -> dict:
    import cuflash
    out = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
               cupy=cupy.__version__, cuflash=getattr(cuflash, "__version__", None), python=platform.python_version(),
               jax=None, jaxlib=None)
    if "jax" in sys.modules:
        import jax
        out["jax"] = jax.__version__
        try:
            import jaxlib
            out["jaxlib"] = jaxlib.__version__
        except ImportError:
            pass
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import cupy
        import torch
    except ImportError as e:
        print(f"bench_overhead: needs torch and cupy ({e})")
        return 2
    if not torch.cuda.is_available():
        print("bench_overhead: no CUDA GPU")
        return 2
    timer = Timer(torch, args)
    gpu_name = torch.cuda.get_device_name()
    print(f"=== per-call cost, eager, no CUDA graphs: {args.dtype}, {gpu_name}; torch {torch.__version__} "
          f"(cuDNN {torch.backends.cudnn.version()}), CuPy {cupy.__version__}")
    print(f"wall: us per call over loops of ~{args.loop_ms:g} ms, median of {args.repeats}; GPU: us per call of "
          f"{args.gpu_calls} calls queued behind a spin kernel (~ = upper bound); ratio = cuflash / peer wall")
    print(HEADER)
    print("-" * len(HEADER))
    t0 = time.perf_counter()
    rows = torch_rows(timer, args)
    jax_skipped = "--no-jax" if args.no_jax else None
    if not args.no_jax:
        more, jax_skipped = jax_rows(timer, args)
        rows += more
    if jax_skipped:
        print(f"JAX rows skipped: {jax_skipped}")
    v = verdict(rows)
    worst = v["worst"]
    print(f"torch rows at most 1.0x their SDPA peer's wall time: {v['torch_rows_within']}/{v['torch_rows']} -> "
          f"{'YES' if v['torch_within_peer'] else 'NO'}"
          + (f" (worst: {worst['call']}, {worst['shape']}, {worst['ratio']:.2f}x)" if worst else "")
          + f"; {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(
            gpu=gpu_name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            dtype=args.dtype, versions=versions(torch, cupy), loop_ms=args.loop_ms, repeats=args.repeats,
            gpu_calls=args.gpu_calls, quick=args.quick, jax_skipped=jax_skipped, rows=rows, **v), indent=1) + "\n")
    bad = [r for r in rows if r.get("error") or (r.get("max_diff") is not None and not r["max_diff"] <= SPOT_TOL)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

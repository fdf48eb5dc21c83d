"""Experimental launcher of the Hopper forward (``cuda_src/fwd_sm90.cu``): TMA tensor maps and the kernel's
parameters. Not chosen by the planner yet and not public: ``tests/gpu/test_sm90.py`` compares each variant with
the reference (issue 8). Head dims 64 and 128, fp16/bf16, causal and local windows, GQA, lse; no softcap or
ALiBi.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import build, checks, plan, tma

HEADDIMS = (64, 128)
BLOCK_M, BLOCK_N = 128, 64


@dataclass(frozen=True)
class FwdSm90Spec:
    dtype: str     # "fp16" | "bf16"
    headdim: int   # 64 | 128
    band: bool
    warp_specialized: bool = False  # a producer warpgroup and "empty" mbarriers (fwd_sm90.cu, WS)
    stages: int = 2                 # K/V ring slots (2 without warp specialization)

    source = "fwd_sm90.cu"

    @property
    def threads(self) -> int:
        return 384 if self.warp_specialized else 256

    @property
    def name(self) -> str:
        ws = f"_ws{self.stages}" if self.warp_specialized else ""
        return f"fwd_sm90_{self.dtype}_d{self.headdim}{ws}{'_band' if self.band else ''}"

    @property
    def template(self) -> str:
        return plan._template("fwd_sm90_kernel", self.dtype, (self.headdim, self.stages),
                              (self.band, self.warp_specialized))

    @property
    def smem_bytes(self) -> int:  # FwdSm90::SMEM_BYTES: Q, K and V slots, mbarriers, alignment
        return (BLOCK_M + 2 * self.stages * BLOCK_N) * self.headdim * 2 + (1 + 2 * self.stages) * 8 + 1024


# The variants: the lockstep first version, and the warp-specialized one with a deeper ring.
VARIANTS = {"lockstep": dict(warp_specialized=False, stages=2), "ws": dict(warp_specialized=True, stages=4)}


# FwdSm90Params (fwd_sm90.cu): three 64-byte-aligned tensor maps, then pointers, strides, ints, a float; 512 bytes.
_INTS = ("seqlen_q", "seqlen_k", "nheads", "heads_per_kv", "window_left", "window_right")
PARAMS_DTYPE = np.dtype({
    "names": ["q", "k", "v", "o", "lse", "o_batch_stride", "o_row_stride", "o_head_stride", *_INTS, "scale_log2"],
    "formats": ["V128"] * 3 + [np.uint64] * 2 + [np.int64] * 3 + [np.int32] * 6 + [np.float32],
    "offsets": [0, 128, 256, 384, 392, 400, 408, 416] + [424 + 4 * i for i in range(6)] + [448],
    "itemsize": 512})


def _map(x, rows_box: int) -> bytes:
    """(batch, seqlen, heads, d) with any 16-byte-aligned strides as a 4-D map (d, heads, seqlen, batch), box
    (64, 1, rows_box, 1): one 64-column panel of rows_box rows, 128-byte swizzle."""
    b, s, h, d = x.shape
    sb, ss, sh, _ = x.strides
    return tma.encode_tiled(x.data.ptr, x.dtype, (d, h, s, b), (sh, ss, sb), (64, 1, rows_box, 1), swizzle=128)


def attention_sm90(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), return_lse=False,
                   variant="lockstep"):
    """Like :func:`cuflash.attention` (without softcap/ALiBi), on the Hopper kernel; `variant` one of VARIANTS."""
    import cupy
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if problem.headdim not in HEADDIMS:
        raise NotImplementedError(f"the Hopper forward covers head dims {HEADDIMS}, not {problem.headdim}")
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    band = left >= 0 or right >= 0
    spec = FwdSm90Spec(plan.DTYPES[np.dtype(problem.dtype).name][0], problem.headdim, band, **VARIANTS[variant])
    b, sq, h, d = q.shape
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((b, h, sq), dtype=np.float32) if return_lse else None
        p = np.zeros((), dtype=PARAMS_DTYPE)
        p["q"], p["k"], p["v"] = _map(q, BLOCK_M), _map(k, BLOCK_N), _map(v, BLOCK_N)
        p["o"], p["lse"] = out.data.ptr, 0 if lse is None else lse.data.ptr
        p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"] = sq * h * d, h * d, d
        p["seqlen_q"], p["seqlen_k"], p["nheads"] = sq, problem.seqlen_k, h
        p["heads_per_kv"], p["window_left"], p["window_right"] = h // problem.nheads_k, left, right
        p["scale_log2"] = scale * plan.LOG2E
        grid = plan.check_grid((math.ceil(sq / BLOCK_M), h, b))
        build.get_kernel(spec, q.device.id)(grid, (spec.threads,), (p[()],), shared_mem=spec.smem_bytes)
    return (out, lse) if return_lse else out

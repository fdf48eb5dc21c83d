#!/usr/bin/env python3
"""What the tail split costs and gains (fwd_sm90.cu TAIL): the Hopper forward at d 64, non-causal, on shapes whose
walk ends in a mostly idle round (or has fewer tiles than SMs), as ws_n128_p, ws_n128_p_tail with the split off
(plan.SM90_TAIL: its persistent kernel alone walks every tile) and ws_n128_p_tail. Each launch object is built
once and launched 20 times between two CUDA events (the GPU's time, not the host's); the median of 15 such.

    python3 scripts/time_tail.py       # with the tail-kernel patch of drafts/ applied (plan.SM90_TAIL, the variant)
"""
import cupy
import numpy as np

from cuflash import checks, options, plan
from cuflash.ops import forward_sm90


def gpu_us(fn, calls: int = 20, reps: int = 15) -> float:
    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    return float(np.median(times))


def main():
    rng = np.random.default_rng(0)
    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    stream = cupy.cuda.get_current_stream().ptr
    # (batch, seqlen, heads): the benchmark's 256 / 512 cells, a last round of 32 tiles, fewer tiles than SMs
    for b, s, h in ((64, 256, 32), (32, 512, 32), (8, 512, 34), (1, 1024, 4), (1, 512, 16), (1, 2048, 4),
                    (2, 4096, 4)):
        q, k, v = (cupy.asarray(rng.standard_normal((b, s, h, 64), dtype=np.float32)).astype(cupy.float16)
                   for _ in range(3))
        out = cupy.empty_like(q)
        problem = checks.check_attention(q, k, v)
        tiles = -(-s // 128) * h * b
        split = plan.sm90_tail_split(tiles, sms, -(-s // 128))
        flops = 4 * b * h * s * s * 64
        for name, variant, on in (("base", "ws_n128_p", True), ("tail off", "ws_n128_p_tail", False),
                                  ("tail", "ws_n128_p_tail", True)):
            plan.SM90_TAIL["enabled"] = on
            opts = options.AttentionOptions(0.125, -1, -1, 0.0, False, False)
            call = forward_sm90.forward_call(problem, q, k, v, out, None, opts, device_id=dev.id, variant=variant)
            us = gpu_us(lambda: call(stream, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0))
            print(f"b={b:3d} s={s:5d} h={h:3d} tiles={tiles:5d} split={split} {name:9s} {us:9.1f} us "
                  f"{flops / us / 1e6:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Whether the tensor cores' wgmma, MUFU's exponentials and the FMA pipe run at the same time on a Hopper SM.

    python3 scripts/sm90_pipe_overlap.py [--dtype fp8|bf16] [--ms 2]      # on the GPU
    python3 scripts/sm90_pipe_overlap.py --compile-only                   # here: NVRTC and ptxas, no GPU

One CTA per SM, three warpgroups (each has a warp on every SM sub-partition, as a forward's consumers do), each
given a role for a run: `T`, back-to-back wgmma m64n128 (k 32 e4m3 or k 16 bf16, both operands from a zeroed
128-byte-swizzled tile, 16 a commit group, each group waited for, as a forward's S is); `R`, the same with A from
registers (as P in O += P V); `M`, `ex2.approx` of 32 independent values a thread, each after an FFMA (a softmax's
exponential pass); `F`, one FFMA a value alone. The iteration counts are set so that each role alone takes about --ms
milliseconds, then the roles run together.
Printed per set of roles: the kernel's time (CUDA events, median of 5), each role's rate (TFLOP/s; exponentials or
FFMAs per clock and SM from the role's own clock64 span), and for two roles together their time over the longer one
alone (1.0: they overlap fully) and over the sum of both (1.0: they take turns).

The FP8 forward's softmax and GEMMs appear to take turns (docs/perf-notes.md, "fp8-fwd: the d 128 kernel's
instructions per 224-key block"; its period is close to the sum of MUFU's and the tensor cores' times for a block);
this measures the pipes without a kernel's dependences between them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCE = r"""
#include "sm90.cuh"
using namespace cuflash;

// roles: 4 bits per warpgroup (bits 4 wg ..): 0 idle, 1 wgmma (ss), 2 MUFU (FFMA + ex2), 3 FFMA alone, 4 wgmma (rs).
// spans[3 blockIdx.x + wg]: the warpgroup's clock64 cycles (thread 0 of each), 0 when idle.
template <bool FP8, bool RS>
__device__ __forceinline__ void wgmma_loop(u32 base, int iters, float* sink) {
    const u32 a_regs[4] = {0u, 0u, 0u, 0u};  // RS: A from registers (zeros), as P in O += P V
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    for (int it = 0; it < iters; ++it) {
        sm90::wgmma_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) {  // four passes over the 128-byte panel, 32 bytes of K a step
            const auto a = sm90::smem_desc(base + (k % 4) * 32);
            const auto b = sm90::smem_desc(base + 64 * 128 + (k % 4) * 32);
            if constexpr (FP8 && RS) sm90::wgmma_m64n128k32_e4m3_rs(acc, a_regs, b, true);
            else if constexpr (FP8) sm90::wgmma_m64n128k32_e4m3_ss(acc, a, b, true);
            else if constexpr (RS) sm90::wgmma_m64n128k16_rs<bf16_t>(acc, a_regs, b, true);
            else sm90::wgmma_m64n128k16_ss<bf16_t>(acc, a, b, true);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) s += acc[i];
    if (s != 0.f) sink[threadIdx.x] = s;  // zeros in, zeros out: never stored, but not dead either
}

template <bool EXP>
__device__ __forceinline__ void alu_loop(int iters, float* sink) {
    float x[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) x[i] = 0.5f + 1e-3f * i + 1e-7f * threadIdx.x;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int i = 0; i < 32; ++i)  // 2^y, y in [-1.5, -0.5]: in [0.35, 0.71]; or one FFMA
                x[i] = EXP ? exp2f(fmaf(x[i], -1.f, -0.5f)) : fmaf(x[i], -0.75f, 0.1f);
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) s += x[i];
    if (s == 12345.f) sink[threadIdx.x] = s;
}

template <bool FP8>
__device__ void pipe_overlap(unsigned roles, int wgmma_iters, int alu_iters, long long* spans, float* sink) {
    extern __shared__ __align__(1024) char smem[];
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;
    for (int i = threadIdx.x; i < 192 * 128 / 16; i += blockDim.x) st_shared_zero16(base + 16 * i);
    sm90::fence_proxy_async();  // generic-proxy zeros, read by wgmma
    __syncthreads();
    const int wg = threadIdx.x / 128;
    const unsigned role = (roles >> (4 * wg)) & 15u;
    const long long t0 = clock64();
    if (role == 1) wgmma_loop<FP8, false>(base, wgmma_iters, sink);
    else if (role == 4) wgmma_loop<FP8, true>(base, wgmma_iters, sink);
    else if (role == 2) alu_loop<true>(alu_iters, sink);
    else if (role == 3) alu_loop<false>(alu_iters, sink);
    const long long t1 = clock64();
    if (threadIdx.x % 128 == 0) spans[3 * blockIdx.x + wg] = role ? t1 - t0 : 0;
}

extern "C" __global__ void __launch_bounds__(384, 1)
pipe_overlap_fp8(unsigned roles, int wgmma_iters, int alu_iters, long long* spans, float* sink) {
    pipe_overlap<true>(roles, wgmma_iters, alu_iters, spans, sink);
}
extern "C" __global__ void __launch_bounds__(384, 1)
pipe_overlap_bf16(unsigned roles, int wgmma_iters, int alu_iters, long long* spans, float* sink) {
    pipe_overlap<false>(roles, wgmma_iters, alu_iters, spans, sink);
}
"""

SMEM = 192 * 128 + 1024  # A (64 rows) and B (128 rows) of 128 bytes, and the alignment
THREADS = 384
# work per iteration: a warpgroup's 16 wgmma; a thread's 128 exponentials (M) or FFMAs (F)
FLOP_PER_ITER = {"fp8": 16 * 64 * 128 * 32 * 2, "bf16": 16 * 64 * 128 * 16 * 2}
ALU_PER_ITER = 128
# sets of roles (warpgroups 0, 1, 2): T wgmma (ss), R wgmma (rs), M FFMA + ex2, F FFMA, - idle
SETS = ("T--", "TT-", "R--", "RR-", "--M", "--F", "T-M", "TTM", "R-M", "RRM", "T-F", "TTF")
CODE = {"-": 0, "T": 1, "M": 2, "F": 3, "R": 4}


def compile_only(arch: str) -> None:
    """NVRTC to a cubin for `arch` with cuflash's options and ptxas's resource report (no GPU)."""
    from cuflash import build
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "pipe_overlap.cu"
        src.write_text(SOURCE)
        for name in ("pipe_overlap_fp8", "pipe_overlap_bf16"):
            spec = types.SimpleNamespace(source=str(src), name=name, template=name)
            _, log = build.compile_cubin(spec, arch)
            report = [line.strip() for line in log.splitlines() if name in line or "registers" in line
                      or "spill" in line]
            print(f"{name}: compiled for {arch}")
            print("\n".join(f"  {line}" for line in report))


def run(dtype: str, ms: float) -> None:
    import cupy
    from cuflash import build
    dev = cupy.cuda.Device().id
    module = cupy.RawModule(code=SOURCE, options=build.nvrtc_options(build.device_arch(dev)))
    kernel = module.get_function(f"pipe_overlap_{dtype}")
    kernel.max_dynamic_shared_size_bytes = SMEM
    sms = build.sm_count(dev)
    spans = cupy.zeros(3 * sms, dtype=cupy.int64)
    sink = cupy.zeros(THREADS, dtype=cupy.float32)

    def launch(roles: str, wgmma_iters: int, alu_iters: int) -> tuple[float, list]:
        code = sum(CODE[r] << (4 * i) for i, r in enumerate(roles))
        args = (cupy.uint32(code), cupy.int32(wgmma_iters), cupy.int32(alu_iters), spans, sink)
        kernel((sms,), (THREADS,), args, shared_mem=SMEM)  # warm-up
        times = []
        for _ in range(5):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            kernel((sms,), (THREADS,), args, shared_mem=SMEM)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        cycles = spans.get().reshape(sms, 3)
        return statistics.median(times), [float(statistics.median(cycles[:, wg])) for wg in range(3)]

    # iteration counts for about `ms` of each role alone (from a short run's rate)
    t, _ = launch("T--", 64, 0)
    wgmma_iters = max(1, int(64 * ms / t))
    a, _ = launch("--M", 0, 64)
    alu_iters = max(1, int(64 * ms / a))
    print(f"{cupy.cuda.runtime.getDeviceProperties(dev)['name'].decode()}, {sms} SMs, {dtype}: "
          f"{wgmma_iters} wgmma iterations, {alu_iters} ALU iterations")
    print(f"{'roles':>6} {'ms':>8} {'TFLOP/s':>9} {'ALU/clk/SM':>11}   together / longer alone, / sum of both")
    alone = {}
    for roles in SETS:
        ms_, cycles = launch(roles, wgmma_iters, alu_iters)
        n_t = roles.count("T") + roles.count("R")
        tflops = n_t * sms * FLOP_PER_ITER[dtype] * wgmma_iters / (ms_ * 1e-3) / 1e12 if n_t else 0.0
        alu = 128 * ALU_PER_ITER * alu_iters / cycles[2] if roles[2] != "-" else 0.0
        line = f"{roles:>6} {ms_:8.3f} {tflops:9.1f} {alu:11.2f}"
        tensor, other = roles[:2], roles[2]
        if tensor != "--" and other != "-":
            longer = max(alone[tensor + "-"], alone["--" + other])
            both = alone[tensor + "-"] + alone["--" + other]
            line += f"   {ms_ / longer:.3f}, {ms_ / both:.3f}"
        else:
            alone[roles] = ms_
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("fp8", "bf16", "both"), default="both")
    p.add_argument("--ms", type=float, default=2.0, help="each role alone, about (default 2)")
    p.add_argument("--compile-only", action="store_true", help="NVRTC and ptxas only (no GPU)")
    p.add_argument("--arch", default="sm_90a", help="with --compile-only")
    args = p.parse_args()
    if args.compile_only:
        compile_only(args.arch)
        return
    for dtype in (("fp8", "bf16") if args.dtype == "both" else (args.dtype,)):
        run(dtype, args.ms)


if __name__ == "__main__":
    main()

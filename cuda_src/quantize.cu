// e4m3 quantization with amax scaling (cuflash.quantize_e4m3; cuflash.reference.quantize_e4m3 is its float64
// model): x (batch, seqlen, nheads, d) fp16 or bf16, any strides with d contiguous, d a multiple of 16 up to 256,
// to x8 (batch, seqlen, nheads, d) e4m3 bytes, contiguous, and one float32 descale per group of rows, x ~ x8 descale.
//
// A group is the whole tensor (group_batch_stride 0, heads_per_group nheads) or one (sequence, KV head): rows of
// sequence b and head h belong to group b group_batch_stride + h / heads_per_group. Two kernels on one grid
// (blocks of QUANTIZE_ROWS rows, nheads, batch):
//   e4m3_amax      the largest |x| of each group, as float bits (order-preserving for non-negative floats) by
//                  atomicMax into `amax`, which the caller zeroes; NaN bits exceed Inf's, which exceed every finite
//                  value's, so a non-finite x gives a non-finite descale;
//   e4m3_quantize  descale = amax / 448 (1 where amax is 0; with pow2 the power of two at or above it), written
//                  once per group, then x8 = e4m3(x / descale), rounded to nearest even, saturating at +-448.
// With `given` the caller's descales are read instead (a KV cache's, for the rows appended to it), and only
// e4m3_quantize runs.
#include "e4m3_encode.cuh"
#include "types.cuh"

namespace cuflash {

struct QuantizeParams {
    const u16* x;
    u8* x8;
    u32* amax;                                         // one per group, float bits, zeroed by the caller
    float* descale;                                    // one per group
    i64 x_batch_stride, x_row_stride, x_head_stride;   // elements
    int seqlen, nheads, headdim, heads_per_group, group_batch_stride, pow2;
    int given;                                         // 1: descale is the caller's (no e4m3_amax launch)
};

constexpr int QUANTIZE_THREADS = 256, QUANTIZE_ROWS = 128;  // a block: rows of one head
constexpr int QUANTIZE_UNROLL = 4;  // chunks of 8 elements a thread loads before it uses any of them
constexpr float E4M3_MAX = 448.f;

// Eight elements of x's row (b, row, h) from column c (a multiple of 8) on, as they are stored: one 16-byte load where
// they are 16-byte aligned, else eight 2-byte ones.
__device__ __forceinline__ uint4 load8(const QuantizeParams& p, int b, int row, int h, int c) {
    const u16* x = p.x + b * p.x_batch_stride + row * p.x_row_stride + h * p.x_head_stride + c;
    if (reinterpret_cast<size_t>(x) % 16 == 0) return *reinterpret_cast<const uint4*>(x);
    u32 w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = x[2 * t] | u32(x[2 * t + 1]) << 16;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

template <class T>
__device__ __forceinline__ void to_floats(uint4 chunk, float (&v)[8]) {
    const u32 words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) v[2 * t] = to_float<T>(u16(words[t])), v[2 * t + 1] = to_float<T>(u16(words[t] >> 16));
}

__device__ __forceinline__ int quantize_group(const QuantizeParams& p, int b, int h) {
    return b * p.group_batch_stride + h / p.heads_per_group;
}

// The block's rows as chunks of 8 elements, chunk i at row first_row + i / (d / 8), column 8 (i % (d / 8)): every
// thread busy at any head dim, consecutive threads on consecutive bytes of a row. Each thread loads QUANTIZE_UNROLL
// chunks, QUANTIZE_THREADS apart, before it hands them to f(row, column, chunk) in turn: 64 bytes in flight a
// thread, since the loads' latency, not the issue rate, bounds these kernels.
template <class F>
__device__ __forceinline__ void for_each_chunk(const QuantizeParams& p, F&& f) {
    const int first_row = blockIdx.x * QUANTIZE_ROWS, per_row = p.headdim / 8;
    const int n = (min(p.seqlen, first_row + QUANTIZE_ROWS) - first_row) * per_row;
    const int h = blockIdx.y, b = blockIdx.z;
    for (int i0 = threadIdx.x; i0 < n; i0 += QUANTIZE_UNROLL * QUANTIZE_THREADS) {
        uint4 chunk[QUANTIZE_UNROLL];
#pragma unroll
        for (int u = 0; u < QUANTIZE_UNROLL; ++u) {
            const int i = i0 + u * QUANTIZE_THREADS;
            if (i < n) chunk[u] = load8(p, b, first_row + i / per_row, h, 8 * (i % per_row));
        }
#pragma unroll
        for (int u = 0; u < QUANTIZE_UNROLL; ++u) {
            const int i = i0 + u * QUANTIZE_THREADS;
            if (i < n) f(first_row + i / per_row, 8 * (i % per_row), chunk[u]);
        }
    }
}

template <class T>
__global__ void __launch_bounds__(QUANTIZE_THREADS) e4m3_amax(const __grid_constant__ QuantizeParams p) {
    __shared__ u32 warp_max[QUANTIZE_THREADS / 32];
    u32 m = 0;  // |x| as float bits
    for_each_chunk(p, [&](int, int, uint4 chunk) {
        float v[8];
        to_floats<T>(chunk, v);
#pragma unroll
        for (int t = 0; t < 8; ++t) m = max(m, __float_as_uint(fabsf(v[t])));
    });
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < QUANTIZE_THREADS / 32; ++w) m = max(m, warp_max[w]);
        atomicMax(p.amax + quantize_group(p, blockIdx.z, blockIdx.y), m);
    }
}

// amax / 448; with pow2 the power of two at or above it, found in double so that it is the reference's exactly
// (amax / 448 in float64, not rounded to float32 first). 1 where amax is 0, or below float32's normal range (bf16
// values there are zeros to the kernels' flushing arithmetic); amax itself where it is not finite.
__device__ __forceinline__ float e4m3_descale(u32 amax_bits, int pow2) {
    const float amax = __uint_as_float(amax_bits);
    if (amax_bits < 0x00800000u) return 1.f;
    if (amax_bits >= 0x7f800000u) return amax;
    if (!pow2) return __fdiv_rn(amax, E4M3_MAX);
    int e;
    const double m = frexp((double)amax / 448.0, &e);  // amax / 448 = m 2^e, m in [0.5, 1)
    return (float)ldexp(1.0, m == 0.5 ? e - 1 : e);
}

// Four floats as e4m3 bytes, the first in the lowest: the hardware conversion from sm_89 on, which rounds and saturates
// as e4m3_from_float (e4m3_encode.cuh) does, that function before.
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 890
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));  // (the first operand: high byte)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return u32(lo) | u32(hi) << 16;
#else
    return e4m3_from_float(a) | e4m3_from_float(b) << 8 | e4m3_from_float(c) << 16 | e4m3_from_float(d) << 24;
#endif
}

template <class T>
__global__ void __launch_bounds__(QUANTIZE_THREADS) e4m3_quantize(const __grid_constant__ QuantizeParams p) {
    const int h = blockIdx.y, b = blockIdx.z;
    const int group = quantize_group(p, b, h);
    const float descale = p.given ? p.descale[group] : e4m3_descale(p.amax[group], p.pow2);
    if (!p.given && threadIdx.x == 0 && blockIdx.x == 0 && h % p.heads_per_group == 0 &&
        (p.group_batch_stride || b == 0))
        p.descale[group] = descale;
    for_each_chunk(p, [&](int row, int c, uint4 chunk) {
        float v[8];
        to_floats<T>(chunk, v);
#pragma unroll
        for (int t = 0; t < 8; ++t) v[t] = __fdiv_rn(v[t], descale);
        *reinterpret_cast<uint2*>(p.x8 + (((i64)b * p.seqlen + row) * p.nheads + h) * p.headdim + c) =
            make_uint2(e4m3x4(v[0], v[1], v[2], v[3]), e4m3x4(v[4], v[5], v[6], v[7]));
    });
}

}  // namespace cuflash

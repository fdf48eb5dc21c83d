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

constexpr int QUANTIZE_THREADS = 256, QUANTIZE_ROWS = 64;  // a block: rows of one head, 8 elements a thread a turn
constexpr float E4M3_MAX = 448.f;

// Eight elements of row (b, row, h) of x from column c (a multiple of 8) on, as floats: one 16-byte load where they
// are 16-byte aligned, else eight 2-byte ones.
template <class T>
__device__ __forceinline__ void load8(const QuantizeParams& p, int b, int row, int h, int c, float (&v)[8]) {
    const u16* x = p.x + b * p.x_batch_stride + row * p.x_row_stride + h * p.x_head_stride + c;
    u16 e[8];
    if (reinterpret_cast<size_t>(x) % 16 == 0) {
        const uint4 w = *reinterpret_cast<const uint4*>(x);
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) e[2 * t] = words[t] & 0xffffu, e[2 * t + 1] = words[t] >> 16;
    } else {
#pragma unroll
        for (int t = 0; t < 8; ++t) e[t] = x[t];
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = to_float<T>(e[t]);
}

__device__ __forceinline__ int quantize_group(const QuantizeParams& p, int b, int h) {
    return b * p.group_batch_stride + h / p.heads_per_group;
}

// A block's rows as chunks of 8 elements, chunk i at row first_row + i / (d / 8), column 8 (i % (d / 8)): every
// thread busy at any head dim, consecutive threads on consecutive bytes of a row.
__device__ __forceinline__ int block_chunks(const QuantizeParams& p) {
    const int first_row = blockIdx.x * QUANTIZE_ROWS;
    return (min(p.seqlen, first_row + QUANTIZE_ROWS) - first_row) * (p.headdim / 8);
}

template <class T>
__global__ void __launch_bounds__(QUANTIZE_THREADS) e4m3_amax(const __grid_constant__ QuantizeParams p) {
    __shared__ u32 warp_max[QUANTIZE_THREADS / 32];
    const int h = blockIdx.y, b = blockIdx.z;
    u32 m = 0;  // |x| as float bits
    for (int i = threadIdx.x, n = block_chunks(p); i < n; i += QUANTIZE_THREADS) {
        const int row = blockIdx.x * QUANTIZE_ROWS + i / (p.headdim / 8), c = 8 * (i % (p.headdim / 8));
        float v[8];
        load8<T>(p, b, row, h, c, v);
#pragma unroll
        for (int t = 0; t < 8; ++t) m = max(m, __float_as_uint(fabsf(v[t])));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < QUANTIZE_THREADS / 32; ++w) m = max(m, warp_max[w]);
        atomicMax(p.amax + quantize_group(p, b, h), m);
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

template <class T>
__global__ void __launch_bounds__(QUANTIZE_THREADS) e4m3_quantize(const __grid_constant__ QuantizeParams p) {
    const int h = blockIdx.y, b = blockIdx.z;
    const int group = quantize_group(p, b, h);
    const float descale = p.given ? p.descale[group] : e4m3_descale(p.amax[group], p.pow2);
    if (!p.given && threadIdx.x == 0 && blockIdx.x == 0 && h % p.heads_per_group == 0 &&
        (p.group_batch_stride || b == 0))
        p.descale[group] = descale;
    for (int i = threadIdx.x, n = block_chunks(p); i < n; i += QUANTIZE_THREADS) {
        const int row = blockIdx.x * QUANTIZE_ROWS + i / (p.headdim / 8), c = 8 * (i % (p.headdim / 8));
        float v[8];
        load8<T>(p, b, row, h, c, v);
        u32 words[2] = {0, 0};
#pragma unroll
        for (int t = 0; t < 8; ++t) words[t / 4] |= e4m3_from_float(__fdiv_rn(v[t], descale)) << (8 * (t % 4));
        *reinterpret_cast<uint2*>(p.x8 + (((i64)b * p.seqlen + row) * p.nheads + h) * p.headdim + c) =
            make_uint2(words[0], words[1]);
    }
}

}  // namespace cuflash

// Backward helpers: D = rowsum(dO * O) with lse moved to the log2 domain before the main kernel, and the
// fp32 dQ accumulator summed over its slices (in a fixed order) and cast after it.
#include "params.cuh"

namespace cuflash {

template <class T>
__global__ void bwd_preprocess(const BwdPreParams p) {
    const int lane = threadIdx.x % 32;
    const i64 rows = (i64)p.batch * p.nheads * p.seqlen_q;
    for (i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows;
         r += (i64)gridDim.x * (blockDim.x / 32)) {
        const int row = (int)(r % p.seqlen_q), h = (int)((r / p.seqlen_q) % p.nheads),
                  b = (int)(r / ((i64)p.seqlen_q * p.nheads));
        const u16* o = p.out + b * p.o_batch_stride + row * p.o_row_stride + h * p.o_head_stride;
        const u16* d = p.dout + b * p.do_batch_stride + row * p.do_row_stride + h * p.do_head_stride;
        float acc = 0.f;
        for (int c = lane * 8; c < p.headdim; c += 32 * 8) {  // 16-byte pieces
            uint4 ov = *reinterpret_cast<const uint4*>(o + c), dv = *reinterpret_cast<const uint4*>(d + c);
            const u16* oe = reinterpret_cast<const u16*>(&ov);
            const u16* de = reinterpret_cast<const u16*>(&dv);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc += to_float<T>(oe[e]) * to_float<T>(de[e]);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
        if (lane == 0) {
            const i64 i = ((i64)b * p.nheads + h) * p.seqlen_q + row;  // r in (b, h, row) order
            const float lse = p.lse[i];
            p.dsum[i] = acc;
            p.lse_log2[i] = lse == -__int_as_float(0x7f800000) ? __int_as_float(0x7f800000) : lse * LOG2E;
        }
    }
}

template <class T>
__global__ void bwd_convert_dq(const BwdConvertParams p) {
    for (i64 i = 2 * ((i64)blockIdx.x * blockDim.x + threadIdx.x); i < p.slice_stride;
         i += 2 * (i64)gridDim.x * blockDim.x) {
        float2 acc = *reinterpret_cast<const float2*>(p.dq_accum + i);
        for (int s = 1; s < p.slices; ++s) {  // fixed order: deterministic
            float2 x = *reinterpret_cast<const float2*>(p.dq_accum + s * p.slice_stride + i);
            acc.x += x.x;
            acc.y += x.y;
        }
        *reinterpret_cast<u32*>(p.dq + i) = pack2<T>(acc.x, acc.y);
    }
}

}  // namespace cuflash

// Backward helpers: D = rowsum(dO * O) with lse moved to the log2 domain and the fp32 dQ accumulator zeroed before
// the main kernel, and that accumulator summed over its slices (in a fixed order) and cast after it.
#include "params.cuh"

namespace cuflash {

// Grid (row blocks, heads, sequences); a row is read by p.lanes adjacent threads (a power of two, 16 bytes of O and
// of dO each per pass), so a warp covers several rows with every lane loading: no index division anywhere. The same
// threads zero the row's dQ accumulator in every slice (one pass over memory instead of a memset launch).
template <class T>
__global__ void bwd_preprocess(const BwdPreParams p) {
    const int sub = threadIdx.x % p.lanes, row = blockIdx.x * (blockDim.x / p.lanes) + threadIdx.x / p.lanes;
    const int h = blockIdx.y, b = blockIdx.z;
    float acc = 0.f;
    if (row < p.seqlen_q) {
        const u16* o = p.out + b * p.o_batch_stride + row * p.o_row_stride + h * p.o_head_stride;
        const u16* d = p.dout + b * p.do_batch_stride + row * p.do_row_stride + h * p.do_head_stride;
        for (int c = sub * 8; c < p.headdim; c += p.lanes * 8) {  // 16-byte pieces
            uint4 ov = *reinterpret_cast<const uint4*>(o + c), dv = *reinterpret_cast<const uint4*>(d + c);
            const u16* oe = reinterpret_cast<const u16*>(&ov);
            const u16* de = reinterpret_cast<const u16*>(&dv);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc += to_float<T>(oe[e]) * to_float<T>(de[e]);
        }
        float* dq = p.dq_accum + (((i64)b * p.seqlen_q + row) * p.nheads + h) * p.headdim;
        for (int s = 0; s < p.slices; ++s)
            for (int c = sub * 4; c < p.headdim; c += p.lanes * 4)
                *reinterpret_cast<float4*>(dq + s * p.dq_slice_stride + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int off = p.lanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);  // within a row
    if (sub == 0 && row < p.seqlen_q) {
        const i64 i = ((i64)b * p.nheads + h) * p.seqlen_q + row;
        const float lse = p.lse[i];
        p.dsum[i] = acc;
        p.lse_log2[i] = lse == -__int_as_float(0x7f800000) ? __int_as_float(0x7f800000) : lse * LOG2E;
    }
}

// Four elements per thread and pass (slice_stride is a multiple of 8: head dims are).
template <class T>
__global__ void bwd_convert_dq(const BwdConvertParams p) {
    for (i64 i = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x); i < p.slice_stride;
         i += 4 * (i64)gridDim.x * blockDim.x) {
        float4 acc = *reinterpret_cast<const float4*>(p.dq_accum + i);
        for (int s = 1; s < p.slices; ++s) {  // fixed order: deterministic
            const float4 x = *reinterpret_cast<const float4*>(p.dq_accum + s * p.slice_stride + i);
            acc.x += x.x;
            acc.y += x.y;
            acc.z += x.z;
            acc.w += x.w;
        }
        *reinterpret_cast<uint2*>(p.dq + i) = make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
    }
}

}  // namespace cuflash

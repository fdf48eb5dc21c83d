// Backward helpers: D = rowsum(dO * O) with lse moved to the log2 domain and the fp32 dQ accumulator zeroed before
// the main kernel, and that accumulator summed over its slices (in a fixed order) and cast after it. Deterministic
// mode 2 (fixed_dq.cuh) adds the bounds its scales come from: |dO| per row here, max |K| and max |V_j| per KV head
// in bwd_kv_bound, then each row's scale in bwd_fixed_scale; the convert scales its int32 accumulator back.
#include "fixed_dq.cuh"
#include "params.cuh"

namespace cuflash {

// Rows of a packed tensor of `rows` that belong to a sequence: those before cu[sequences] (a caller's q, k or v may
// have more); all of them without packed sequences (cu == nullptr). The rows past it are read as zeros, so that
// their dQ is 0 in every mode, and the fixed point's bounds and scales come from rows that attention reads.
__device__ __forceinline__ int used_rows(const int* cu, int sequences, int rows) {
    return cu != nullptr ? max(0, min(rows, cu[sequences])) : rows;
}

// Grid (row blocks, heads, sequences); a row is read by p.lanes adjacent threads (a power of two, 16 bytes of O and
// of dO each per pass), so a warp covers several rows with every lane loading: no index division anywhere. The same
// threads zero the row's dQ accumulator in every slice (one pass over memory instead of a memset launch).
template <class T>
__global__ void bwd_preprocess(const BwdPreParams p) {
    const int sub = threadIdx.x % p.lanes, row = blockIdx.x * (blockDim.x / p.lanes) + threadIdx.x / p.lanes;
    const int h = blockIdx.y, b = blockIdx.z;
    if (p.fixed_point && (blockIdx.x | blockIdx.y | blockIdx.z) == 0)
        for (int i = threadIdx.x; i < 2 * p.nheads_k; i += blockDim.x) p.kv_bound[i] = 0u;  // before bwd_kv_bound
    float acc = 0.f, sq = 0.f;
    if (row < used_rows(p.cu_seqlens_q, p.sequences, p.seqlen_q)) {
        const u16* o = p.out + b * p.o_batch_stride + row * p.o_row_stride + h * p.o_head_stride;
        const u16* d = p.dout + b * p.do_batch_stride + row * p.do_row_stride + h * p.do_head_stride;
        for (int c = sub * 8; c < p.headdim; c += p.lanes * 8) {  // 16-byte pieces
            uint4 ov = *reinterpret_cast<const uint4*>(o + c), dv = *reinterpret_cast<const uint4*>(d + c);
            const u16* oe = reinterpret_cast<const u16*>(&ov);
            const u16* de = reinterpret_cast<const u16*>(&dv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc += to_float<T>(oe[e]) * to_float<T>(de[e]);
                sq += to_float<T>(de[e]) * to_float<T>(de[e]);
            }
        }
    }
    const int whole_rows = p.first_store_rows > 0 ? p.seqlen_q / p.first_store_rows * p.first_store_rows : 0;
    // each block's ticket and ready flag (partial blocks' too: ordered mode counts their turns)
    if (p.first_store_rows > 0 && row < p.seqlen_q && row % p.first_store_rows == 0 && sub == 0) {
        const int blocks = ceil_div(p.seqlen_q, p.first_store_rows);
        const DqStoreCounters counters(p.dq_accum, p.dq_slice_stride, p.batch, p.nheads, blocks);
        const i64 block = ((i64)b * p.nheads + h) * blocks + row / p.first_store_rows;
        *counters.ticket(block) = 0;
        *counters.ready(block) = 0;
    }
    // rows of whole blocks get their first addition stored, unless they see no key (then no CTA adds to them)
    const bool zero_row =
        row >= whole_rows || p.lse[((i64)b * p.nheads + h) * p.seqlen_q + row] == -__int_as_float(0x7f800000);
    if (row < p.seqlen_q && zero_row) {
        float* dq = p.dq_accum + (((i64)b * p.seqlen_q + row) * p.nheads + h) * p.headdim;
        for (int s = 0; s < p.slices; ++s)
            for (int c = sub * 4; c < p.headdim; c += p.lanes * 4)
                *reinterpret_cast<float4*>(dq + s * p.dq_slice_stride + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int off = p.lanes / 2; off > 0; off /= 2) {  // within a row
        acc += __shfl_xor_sync(0xffffffff, acc, off);
        sq += __shfl_xor_sync(0xffffffff, sq, off);
    }
    if (sub == 0 && row < p.seqlen_q) {
        const i64 i = ((i64)b * p.nheads + h) * p.seqlen_q + row;
        const float lse = p.lse[i];
        p.dsum[i] = acc;
        if (p.fixed_point) p.dq_scale[i] = sqrtf(sq);
        p.lse_log2[i] = lse == -__int_as_float(0x7f800000) ? __int_as_float(0x7f800000) : lse * LOG2E;
    }
}

// Fixed point (after bwd_preprocess, which zeroed kv_bound): max |K| and max |V_j| per KV head. Grid (row blocks,
// KV heads, sequences), p.lanes threads per row as there, each block striding over rows (the grid's x is capped), then
// one atomicMax per block and value (float bits: the values are >= 0, so their bits order as they do; one per warp
// serialized at the L2 and took 210 us for 16k rows x 32 heads).
template <class T>
__global__ void bwd_kv_bound(const BwdPreParams p) {
    __shared__ float warp_max[2][32];
    const int sub = threadIdx.x % p.lanes, per_block = blockDim.x / p.lanes;
    const int h = blockIdx.y, b = blockIdx.z;
    float kmax = 0.f, vmax = 0.f;  // vmax: of |V_j|^2
    const int rows = used_rows(p.cu_seqlens_k, p.sequences, p.seqlen_k);
    for (int first = blockIdx.x * per_block; first < rows; first += gridDim.x * per_block) {  // block-uniform
        const int row = first + threadIdx.x / p.lanes;
        float vsq = 0.f;
        if (row < rows) {
            const u16* k = p.k + b * p.k_batch_stride + row * p.k_row_stride + h * p.k_head_stride;
            const u16* v = p.v + b * p.v_batch_stride + row * p.v_row_stride + h * p.v_head_stride;
            for (int c = sub * 8; c < p.headdim; c += p.lanes * 8) {
                uint4 kv = *reinterpret_cast<const uint4*>(k + c), vv = *reinterpret_cast<const uint4*>(v + c);
                const u16* ke = reinterpret_cast<const u16*>(&kv);
                const u16* ve = reinterpret_cast<const u16*>(&vv);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    kmax = fmaxf(kmax, fabsf(to_float<T>(ke[e])));
                    vsq += to_float<T>(ve[e]) * to_float<T>(ve[e]);
                }
            }
        }
        for (int off = p.lanes / 2; off > 0; off /= 2) vsq += __shfl_xor_sync(0xffffffff, vsq, off);  // the row's
        vmax = fmaxf(vmax, vsq);
    }
    for (int off = 16; off > 0; off /= 2) {  // the warp's rows
        kmax = fmaxf(kmax, __shfl_xor_sync(0xffffffff, kmax, off));
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffff, vmax, off));
    }
    if (threadIdx.x % 32 == 0) {
        warp_max[0][threadIdx.x / 32] = kmax;
        warp_max[1][threadIdx.x / 32] = vmax;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / 32; ++w) {
            kmax = fmaxf(kmax, warp_max[0][w]);
            vmax = fmaxf(vmax, warp_max[1][w]);
        }
        atomicMax(p.kv_bound + 2 * h, __float_as_uint(kmax));
        atomicMax(p.kv_bound + 2 * h + 1, __float_as_uint(sqrtf(vmax)));
    }
}

// Fixed point (after bwd_kv_bound): each row's dQ scale in place of its |dO|, read by the main kernel and the
// convert. Grid (row blocks, heads, sequences), one row per thread.
template <class T>
__global__ void bwd_fixed_scale(const BwdPreParams p) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
    if (row >= p.seqlen_q) return;
    const i64 i = ((i64)b * p.nheads + h) * p.seqlen_q + row;
    const unsigned* kv_bound = p.kv_bound + 2 * (h / (p.nheads / p.nheads_k));
    p.dq_scale[i] = dq_fixed_scale(dq_row_bound(p.softmax_scale, kv_bound, p.dq_scale[i], p.dsum[i]));
}

// The fixed-point accumulator (one int32 slice) times each row's unit. Grid (chunks of 8 elements of a token, tokens):
// rows of dq are tokens (sequence, row) of (head, column) elements, 8 | headdim, so a chunk lies in one head; the
// per-row arrays are (sequence, head, row), as bwd_preprocess wrote them. A thread's head is the same for every token
// it visits and a token costs one 32-bit division, so that the kernel is bound by memory, not by index arithmetic.
template <class T>
__device__ __forceinline__ void convert_fixed(const BwdConvertParams& p) {
    const int row_elems = p.nheads * p.headdim, e = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (e >= row_elems) return;
    const int h = e / p.headdim;
    for (int token = blockIdx.y; (i64)token * row_elems < p.slice_stride; token += gridDim.y) {
        const int b = token / p.seqlen_q, row = token - b * p.seqlen_q;
        const float unit = dq_fixed_unit(p.dq_scale[((i64)b * p.nheads + h) * p.seqlen_q + row]);
        const i64 i = (i64)token * row_elems + e;
        const int4 x = *reinterpret_cast<const int4*>(p.dq_accum + i);
        const int4 y = *reinterpret_cast<const int4*>(p.dq_accum + i + 4);
        *reinterpret_cast<uint4*>(p.dq + i) =
            make_uint4(pack2<T>((float)x.x * unit, (float)x.y * unit), pack2<T>((float)x.z * unit, (float)x.w * unit),
                       pack2<T>((float)y.x * unit, (float)y.y * unit), pack2<T>((float)y.z * unit, (float)y.w * unit));
    }
}

// Four elements per thread and pass (slice_stride is a multiple of 8: head dims are).
template <class T>
__global__ void bwd_convert_dq(const BwdConvertParams p) {
    if (p.fixed_point) {
        convert_fixed<T>(p);
        return;
    }
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

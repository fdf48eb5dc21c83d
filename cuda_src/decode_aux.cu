// The two small kernels around decode_kernel (decode.cu):
//   decode_append  writes the new keys/values into the cache (contiguous or paged) before attention runs;
//   decode_combine merges the fp32 partial results of the KV splits (exactly cuflash.reference.combine).
#include "params.cuh"
#include "kvcache.cuh"
#include "softmax.cuh"

namespace cuflash {

// One 16-byte chunk per thread and step: (batch, new position, KV head, chunk).
template <class T>
__global__ void __launch_bounds__(256) decode_append(const __grid_constant__ DecodeParams p) {
    const int chunks = p.headdim / 8, nheads_k = p.nheads / p.heads_per_kv;
    const i64 total = (i64)p.batch * p.seqlen_new_k * nheads_k * chunks;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const int c = idx % chunks;
        i64 rest = idx / chunks;
        const int h_kv = rest % nheads_k;
        rest /= nheads_k;
        const int i = rest % p.seqlen_new_k, b = rest / p.seqlen_new_k;
        const CacheView cache(p, b, h_kv);
        i64 k_off, v_off;
        cache.locate(cache_length(p, b) - p.seqlen_new_k + i, k_off, v_off);
        const uint4 kx = *reinterpret_cast<const uint4*>(p.k_new + b * p.kn_batch_stride + i * p.kn_row_stride +
                                                         h_kv * p.kn_head_stride + c * 8);
        const uint4 vx = *reinterpret_cast<const uint4*>(p.v_new + b * p.vn_batch_stride + i * p.vn_row_stride +
                                                         h_kv * p.vn_head_stride + c * 8);
        *reinterpret_cast<uint4*>(const_cast<u16*>(cache.k) + k_off + c * 8) = kx;
        *reinterpret_cast<uint4*>(const_cast<u16*>(cache.v) + v_off + c * 8) = vx;
    }
}

constexpr int MAX_SPLITS = 128;

// One warp per output row (batch, head, query): weights exp(lse_s - max) of the splits, then O = sum w_s O_s / sum w_s.
// A split with lse = -inf (it saw no key) adds nothing; a row no split saw gets O = 0, lse = -inf. Every split's
// CTA writes its partial O (0 when empty), so all inputs are finite.
template <class T>
__global__ void __launch_bounds__(256) decode_combine(const __grid_constant__ DecodeParams p) {
    __shared__ float weights[8][MAX_SPLITS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 rows_total = (i64)p.batch * p.nheads * p.seqlen_q;
    const i64 row = (i64)blockIdx.x * 8 + warp;  // = (b * nheads + head) * seqlen_q + i, the lse index
    if (row >= rows_total) return;
    const int i = row % p.seqlen_q, head = (row / p.seqlen_q) % p.nheads, b = row / ((i64)p.seqlen_q * p.nheads);

    float m = NEG_INF;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.lse_partial[s * rows_total + row]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) {
        const float l = p.lse_partial[s * rows_total + row];
        const float w = l == NEG_INF ? 0.f : exp2f((l - m) * LOG2E);
        weights[warp][s] = w;
        sum += w;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    __syncwarp();
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : __frcp_rn(sum);  // inline; 1.f / sum calls a slow-path routine that spills

    u16* dst = p.o + (i64)b * p.o_batch_stride + (i64)i * p.o_row_stride + (i64)head * p.o_head_stride;
    for (int c = lane * 4; c < p.headdim; c += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        const float* src = p.o_partial + row * p.headdim + c;
        const i64 split_stride = rows_total * p.headdim;
        // Unrolled so that eight loads are in flight at once (the loop is latency-bound otherwise). An empty
        // split has weight 0 and wrote O = 0, so no branch is needed.
#pragma unroll 8
        for (int s = 0; s < p.num_splits; ++s) {
            const float w = weights[warp][s];
            const float4 x = *reinterpret_cast<const float4*>(src + s * split_stride);
            acc.x += w * x.x;
            acc.y += w * x.y;
            acc.z += w * x.z;
            acc.w += w * x.w;
        }
        *reinterpret_cast<uint2*>(dst + c) =
            make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
    }
    if (lane == 0 && p.lse != nullptr) p.lse[row] = empty ? NEG_INF : m + __logf(sum);
}

}  // namespace cuflash

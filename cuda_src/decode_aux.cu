// The two small kernels around decode_kernel (decode.cu):
//   decode_append  writes the new keys/values into the cache (contiguous or paged) before attention runs, and
//                  applies the rotary embedding to them and to the queries;
//   decode_combine merges the fp32 partial results of the KV splits (exactly cuflash.reference.combine).
#include "params.cuh"
#include "kvcache.cuh"
#include "rotary.cuh"
#include "softmax.cuh"

namespace cuflash {

// One 16-byte chunk of new key i and its value (KV head h_kv, batch row b) into the cache, of elements E (u16, or
// u8 for an e4m3 cache, which takes no rotary embedding: the checks refuse it).
template <class T, class E>
__device__ __forceinline__ void append_chunk(const DecodeParams& p, int b, int i, int h_kv, int c) {
    constexpr int PER_CHUNK = 16 / sizeof(E);
    const CacheView<E> cache(p, b, h_kv);
    const int pos = cache.cached + i;
    i64 k_off, v_off;
    if (pos >= cache.length(p.seqlen_new_k) || !cache.locate(pos, k_off, v_off)) return;
    const E* k_src = reinterpret_cast<const E*>(p.k_new) + b * p.kn_batch_stride + i * p.kn_row_stride +
                     h_kv * p.kn_head_stride;
    E* k_dst = const_cast<E*>(cache.k) + k_off;
    bool rotated = false;
    if constexpr (sizeof(E) == 2) {
        rotated = p.rotary_dim > 0;
        if (rotated) rotary_chunk<T>(p, k_src, k_dst, c, cache.start + pos);
    }
    if (!rotated)
        *reinterpret_cast<uint4*>(k_dst + c * PER_CHUNK) = *reinterpret_cast<const uint4*>(k_src + c * PER_CHUNK);
    const E* v_src = reinterpret_cast<const E*>(p.v_new) + b * p.vn_batch_stride + i * p.vn_row_stride +
                     h_kv * p.vn_head_stride;
    *reinterpret_cast<uint4*>(const_cast<E*>(cache.v) + v_off + c * PER_CHUNK) =
        *reinterpret_cast<const uint4*>(v_src + c * PER_CHUNK);
}

// Before a call's attention: the new keys and values into the cache, and with rotary embedding the rotated keys
// and queries (rotary.cuh; the queries to q_rot, which the decode kernels read). One 16-byte chunk per thread and
// step: first (batch, new position, KV head, chunk) of the keys and values, then (batch, query, head, chunk) of the
// queries. A key goes to the row's position cached + i only where that is inside the row's cache (CacheView::length):
// past the capacity, in a page the pool does not have, or for a row with no place in the cache, it is dropped. Its
// rotary position is its cache position, cache_seqlens[b] + i; a query's is cache_seqlens[b] (+ i, one position per
// query, with rotary_q_per_row).
template <class T>
__global__ void __launch_bounds__(256) decode_append(const __grid_constant__ DecodeParams p) {
    const int chunks = p.headdim / 8, nheads_k = p.nheads / p.heads_per_kv;
    const int kv_chunks = p.cache_fp8 ? p.headdim / 16 : chunks;  // an e4m3 row holds 16 elements per chunk
    const i64 kv_units = (i64)p.batch * p.seqlen_new_k * nheads_k * kv_chunks;
    const i64 q_units = p.q_rot != nullptr ? (i64)p.batch * p.seqlen_q * p.nheads * chunks : 0;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < kv_units + q_units;
         idx += (i64)gridDim.x * blockDim.x) {
        if (idx >= kv_units) {  // a query chunk
            i64 rest = idx - kv_units;
            const int c = rest % chunks;
            rest /= chunks;
            const int head = rest % p.nheads;
            rest /= p.nheads;
            const int i = rest % p.seqlen_q, b = rest / p.seqlen_q;
            const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_len;
            const int pos = cached + (p.rotary_q_per_row ? i : 0);
            rotary_chunk<T>(p, p.q + b * p.q_batch_stride + i * p.q_row_stride + head * p.q_head_stride,
                            p.q_rot + (((i64)b * p.seqlen_q + i) * p.nheads + head) * p.headdim, c, pos);
            continue;
        }
        const int c = idx % kv_chunks;
        i64 rest = idx / kv_chunks;
        const int h_kv = rest % nheads_k;
        rest /= nheads_k;
        const int i = rest % p.seqlen_new_k, b = rest / p.seqlen_new_k;
        if (p.cache_fp8)
            append_chunk<T, u8>(p, b, i, h_kv, c);
        else
            append_chunk<T, u16>(p, b, i, h_kv, c);
    }
}

constexpr int MAX_SPLITS = 128;
constexpr int COMBINE_THREADS = 256;
constexpr int COMBINE_AHEAD = 8;  // partial O loads each thread issues before the weights are known

// One CTA per output row (batch, head, query). Its threads are G groups of `lanes` threads (lanes: 4 columns each,
// the power of two that covers the head dim); group g takes splits g, g + G, ... Every thread first issues up to
// COMBINE_AHEAD loads of its splits' partial O, so they are in flight while warp 0 turns the splits' lse into
// weights exp(lse_s - max); then the groups' weighted sums meet in shared memory. A split with lse = -inf (it saw no
// key) weighs 0; a row no split saw gets O = 0, lse = -inf. Every split's CTA writes its partial O (0 when empty),
// so all inputs are finite. (One warp per row with a serial loop over the splits took 6 us for 32 splits: each
// split's load waited for the last.)
template <class T>
__global__ void __launch_bounds__(COMBINE_THREADS) decode_combine(const __grid_constant__ DecodeParams p) {
    __shared__ float weights[MAX_SPLITS];
    __shared__ float4 sums[COMBINE_THREADS];
    __shared__ float stats[2];  // max (natural log units), sum of weights
    const int tid = threadIdx.x, splits = p.num_splits;
    const i64 rows_total = (i64)p.batch * p.nheads * p.seqlen_q;
    const i64 row = blockIdx.x;  // = (b * nheads + head) * seqlen_q + i, the lse index
    int lanes = 8;
    while (lanes * 4 < p.headdim) lanes *= 2;
    const int groups = COMBINE_THREADS / lanes, g = tid / lanes, c = tid % lanes * 4;
    const bool active = c < p.headdim;
    const i64 split_stride = rows_total * p.headdim;
    const float* src = p.o_partial + row * p.headdim + c;
    pdl_wait();  // launched to overlap the decode kernel's end: its partial results are complete from here

    float4 ahead[COMBINE_AHEAD];
#pragma unroll
    for (int k = 0; k < COMBINE_AHEAD; ++k) {
        const int s = g + k * groups;
        ahead[k] = active && s < splits ? *reinterpret_cast<const float4*>(src + s * split_stride)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (tid < 32) {
        float m = NEG_INF;
        for (int s = tid; s < splits; s += 32) m = fmaxf(m, p.lse_partial[s * rows_total + row]);
#pragma unroll
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        float sum = 0.f;
        for (int s = tid; s < splits; s += 32) {
            const float l = p.lse_partial[s * rows_total + row];
            const float w = l == NEG_INF ? 0.f : exp2f((l - m) * LOG2E);
            weights[s] = w;
            sum += w;
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
        if (tid == 0) {
            stats[0] = m;
            stats[1] = sum;
        }
    }
    __syncthreads();

    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](int s, const float4& x) {
        const float w = weights[s];
        acc.x += w * x.x;
        acc.y += w * x.y;
        acc.z += w * x.z;
        acc.w += w * x.w;
    };
#pragma unroll
    for (int k = 0; k < COMBINE_AHEAD; ++k)
        if (g + k * groups < splits) add(g + k * groups, ahead[k]);
#pragma unroll 4
    for (int s = g + COMBINE_AHEAD * groups; s < splits; s += groups)
        if (active) add(s, *reinterpret_cast<const float4*>(src + s * split_stride));
    sums[tid] = acc;
    __syncthreads();

    const float sum = stats[1];
    const bool empty = !(sum > 0.f);
    if (g == 0 && active) {
        for (int j = 1; j < groups; ++j) {
            const float4 x = sums[j * lanes + tid];
            acc.x += x.x;
            acc.y += x.y;
            acc.z += x.z;
            acc.w += x.w;
        }
        const float inv = empty ? 0.f : __frcp_rn(sum);  // inline; 1.f / sum calls a slow-path routine
        const int i = row % p.seqlen_q, head = (row / p.seqlen_q) % p.nheads;
        const i64 b = row / ((i64)p.seqlen_q * p.nheads);
        u16* dst = p.o + b * p.o_batch_stride + (i64)i * p.o_row_stride + (i64)head * p.o_head_stride + c;
        *reinterpret_cast<uint2*>(dst) =
            make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
    }
    if (tid == 0 && p.lse != nullptr) p.lse[row] = empty ? NEG_INF : stats[0] + __logf(sum);
}

}  // namespace cuflash

// Where sequence b starts and how long it is, for the forward and the backward alike.
//
// Padded batch (cu_seqlens_q == nullptr): every sequence has the lengths of the params and starts at b batch strides.
// Packed sequences (cu_seqlens_q, cu_seqlens_k set): sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]) of q (and
// of k, v), and the host passes each packed tensor's row stride as its batch stride. So one formula serves both:
//     offset(row) = begin * batch_stride + row * row_stride,   begin = b (padded) or cu_seqlens[b] (packed),
// and outside this header the kernels never branch on the layout. (Per-row arrays, lse: batch stride
// seqlen_q * nheads padded, 1 packed; the head stride moves between heads.) Masks (causal bottom-right alignment,
// window, ALiBi distance) use this sequence's own lengths.
#pragma once
#include "types.cuh"

namespace cuflash {

struct SeqInfo {
    int q_begin, k_begin;    // start of the sequence in batch strides: b, or cu_seqlens_q[b] / cu_seqlens_k[b]
    int seqlen_q, seqlen_k;  // this sequence's lengths

    template <class Params>
    __device__ __forceinline__ SeqInfo(const Params& p, int b) {
        if (p.cu_seqlens_q != nullptr) {  // a kernel argument: the same branch for the whole grid
            q_begin = p.cu_seqlens_q[b];
            k_begin = p.cu_seqlens_k[b];
            seqlen_q = p.cu_seqlens_q[b + 1] - q_begin;
            seqlen_k = p.cu_seqlens_k[b + 1] - k_begin;
        } else {
            q_begin = k_begin = b;
            seqlen_q = p.seqlen_q;
            seqlen_k = p.seqlen_k;
        }
    }

    // The starts alone, for kernels that read them where they are needed rather than hold them in registers
    // through their loops (the lengths live on in Mask).
    template <class Params>
    static __device__ __forceinline__ int q_begin_of(const Params& p, int b) {
        return p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b] : b;
    }
    template <class Params>
    static __device__ __forceinline__ int k_begin_of(const Params& p, int b) {
        return p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b] : b;
    }

    // Offset of query row `row` of this sequence (q, o, dout, dq_accum, and lse-like arrays with row stride 1).
    __device__ __forceinline__ i64 q_offset(i64 batch_stride, i64 row_stride, int row = 0) const {
        return offset(q_begin, batch_stride, row_stride, row);
    }
    // Offset of key row `row` of this sequence (k, v, dk, dv).
    __device__ __forceinline__ i64 k_offset(i64 batch_stride, i64 row_stride, int row = 0) const {
        return offset(k_begin, batch_stride, row_stride, row);
    }
    static __device__ __forceinline__ i64 offset(int begin, i64 batch_stride, i64 row_stride, int row) {
        return (i64)begin * batch_stride + (i64)row * row_stride;
    }

    // Keys of packed sequence b where a call may give paged keys (block_table) or key counts (seqused_k): seqused_k[b]
    // or cu_seqlens_k's difference (`seqlen_k`), at most what the sequence's rows or pages hold. Both come from
    // device memory, so they are bounded here.
    template <class Params>
    static __device__ __forceinline__ int bounded_seqlen_k(const Params& p, int seqlen_k, int b) {
        if (p.block_table != nullptr) {
            const int used = p.seqused_k != nullptr ? p.seqused_k[b] : seqlen_k;
            return max(0, min(used, p.max_pages * p.page_size));
        }
        return p.seqused_k != nullptr ? max(0, min(p.seqused_k[b], seqlen_k)) : seqlen_k;
    }
};

}  // namespace cuflash

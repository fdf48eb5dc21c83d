// Kernel parameter structs. Python builds the same layout as a NumPy structured scalar (cuflash/plan.py,
// FWD_PARAMS_DTYPE); the field order here and there must match: 8-byte fields first, then 4-byte ones.
#pragma once
#include "types.cuh"

namespace cuflash {

struct FwdParams {
    const u16* q;          // (batch, seqlen_q, nheads, headdim), any strides, last dim contiguous
    const u16* k;          // (batch, seqlen_k, nheads_k, headdim)
    const u16* v;          // (batch, seqlen_k, nheads_k, headdim)
    u16* o;                // (batch, seqlen_q, nheads, headdim)
    float* lse;            // (batch, nheads, seqlen_q) contiguous, natural log; nullptr: not written
    const float* alibi;    // slopes, (nheads,) or (batch, nheads); nullptr: no ALiBi
    i64 q_batch_stride, q_row_stride, q_head_stride;  // strides in elements
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 alibi_batch_stride;  // 0 when the slopes are shared by the batch
    int seqlen_q, seqlen_k;
    int nheads, heads_per_kv;  // query heads; query heads per KV head (GQA group size)
    int headdim;               // real head dim (<= the compiled one; the rest is zero padding)
    int window_left, window_right;  // -1: unbounded; causal is (-1, 0)
    float scale_log2;  // multiplies raw scores inside exp2: softmax_scale*log2(e), or log2(e) if scores are pre-modded
    float mod_scale;   // score-mod kernels: s = q.k * mod_scale (softmax_scale, or softmax_scale / softcap)
    float softcap;     // score-mod kernels: s = softcap * tanh(s) when > 0
};

}  // namespace cuflash

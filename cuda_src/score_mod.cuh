// Score modifiers applied before masking: softcap (s -> softcap * tanh(s / softcap)) and ALiBi
// (s -> s - slope * |i + diag - j|). Scores leave in natural-log units, so softmax then uses scale_log2 = log2(e).
#pragma once
#include "types.cuh"

namespace cuflash {

struct ScoreMod {
    float scale;    // softmax_scale, or softmax_scale / softcap when capping
    float softcap;  // 0: no cap
    float slope;    // ALiBi slope of this (batch, head); 0: none
    int diag;       // seqlen_k - seqlen_q

    // Fragment rows are queries and columns keys (forward), or the other way round when KEYS_BY_QUERIES
    // (backward, which computes S^T). If `dtanh` is given, it receives d(score)/d(q.k) / scale = 1 - tanh^2
    // (1 without a cap) for the backward's dS, as packed fp16 pairs (elements 2h, 2h + 1): half the registers.
    // One score: s (raw q.k) -> modded score; *d receives d(score)/d(q.k) / scale.
    __device__ __forceinline__ float modify(float s, int query, int key, float row_slope, float* d) const {
        float x = s * scale;
        *d = 1.f;
        if (softcap > 0.f) {
            x = tanhf(x);
            *d = 1.f - x * x;
            x *= softcap;
        }
        return x - row_slope * fabsf((float)(query + diag - key));
    }

    template <bool KEYS_BY_QUERIES = false, int MT, int NT>
    __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int row0, int col0, int lane,
                                          u32 (*dtanh)[NT][2] = nullptr) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float d[2];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        int row = row0 + mt * 16 + lane / 4 + 8 * h;
                        int col = col0 + nt * 8 + 2 * (lane % 4) + i;
                        int query = KEYS_BY_QUERIES ? col : row, key = KEYS_BY_QUERIES ? row : col;
                        s[mt][nt][2 * h + i] = modify(s[mt][nt][2 * h + i], query, key, slope, &d[i]);
                    }
                    if (dtanh != nullptr) dtanh[mt][nt][h] = pack2<half_t>(d[0], d[1]);
                }
    }

    // Forward fragment tile whose two rows per thread (h = 0, 1) hold queries query[h] with ALiBi slopes
    // slope[h] (decode packs the heads of a GQA group into one tile); col_lane: the thread's first column.
    template <int NT>
    __device__ __forceinline__ void apply_rows(float (&s)[NT][4], const int (&query)[2], const float (&row_slope)[2],
                                               int col_lane) const {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float unused;
                s[nt][e] = modify(s[nt][e], query[e / 2], col_lane + nt * 8 + e % 2, row_slope[e / 2], &unused);
            }
    }
};

}  // namespace cuflash

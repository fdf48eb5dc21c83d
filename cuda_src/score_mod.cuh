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
                        const int e = 2 * h + i;
                        float x = s[mt][nt][e] * scale;
                        d[i] = 1.f;
                        if (softcap > 0.f) {
                            x = tanhf(x);
                            d[i] = 1.f - x * x;
                            x *= softcap;
                        }
                        int row = row0 + mt * 16 + lane / 4 + 8 * h;
                        int col = col0 + nt * 8 + 2 * (lane % 4) + i;
                        int query = KEYS_BY_QUERIES ? col : row, key = KEYS_BY_QUERIES ? row : col;
                        s[mt][nt][e] = x - slope * fabsf((float)(query + diag - key));
                    }
                    if (dtanh != nullptr) dtanh[mt][nt][h] = pack2<half_t>(d[0], d[1]);
                }
    }
};

}  // namespace cuflash

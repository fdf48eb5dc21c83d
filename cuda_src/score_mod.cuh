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

    template <int MT, int NT>
    __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int row0, int col0, int lane) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[mt][nt][e] * scale;
                    if (softcap > 0.f) x = softcap * tanhf(x);
                    int row = row0 + mt * 16 + lane / 4 + 8 * (e / 2);
                    int col = col0 + nt * 8 + 2 * (lane % 4) + (e % 2);
                    s[mt][nt][e] = x - slope * fabsf((float)(row + diag - col));
                }
    }
};

}  // namespace cuflash

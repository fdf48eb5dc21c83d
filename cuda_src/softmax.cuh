// Online softmax over a thread's rows of an mma.sync accumulator tile, in the exp2 domain.
//
// Fragment convention (m16n8k16 C layout): s[mt][nt][e] is row  mt*16 + lane/4 + 8*(e/2),
// column nt*8 + 2*(lane%4) + e%2. A thread owns 2 rows per 16-row tile; the 4 lanes of a quad share a row.
#pragma once
#include "types.cuh"

namespace cuflash {

#define NEG_INF (-__int_as_float(0x7f800000))  // no constexpr route to -inf without headers

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

template <int MT>
struct OnlineSoftmax {
    float row_max[MT][2];  // running max of the scores, in the units that scale_log2 converts to log2
    float row_sum[MT][2];  // this thread's share of the row sum; the quad reduction waits for finalize()

    // Empty state: what finalize() sees for a block whose rows see no key at all (out 0, lse -inf).
    __device__ __forceinline__ void reset() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                row_max[mt][h] = NEG_INF;
                row_sum[mt][h] = 0.f;
            }
    }

    // Turns scores into probabilities (in place) and updates the running max and sum; alpha = exp2(m_old - m_new)
    // is the factor the output accumulator must then be scaled by (see rescale; 1 when FIRST: nothing accumulated
    // yet). CHECK_INF: rows may be fully masked (max = -inf). CHAINS > 1 splits each row's max and sum into that many
    // independent chains (shorter dependency chains where the softmax is exposed rather than hidden under GEMMs).
    // SUMS = false leaves row_sum to the caller (the FP8 forward adds P's rows up on the tensor cores).
    template <bool FIRST, bool CHECK_INF, int CHAINS = 1, int LOG2_P = 0, bool SUMS = true, int NT>
    __device__ __forceinline__ void update_scores(float (&s)[MT][NT][4], float scale_log2, float (&alpha)[MT][2]) {
        static_assert(NT % CHAINS == 0, "column tiles split evenly over the chains");
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mc[CHAINS];
#pragma unroll
                for (int c = 0; c < CHAINS; ++c) mc[c] = fmaxf(s[mt][c][2 * h], s[mt][c][2 * h + 1]);
                if (!FIRST) mc[0] = fmaxf(row_max[mt][h], mc[0]);
#pragma unroll
                for (int nt = CHAINS; nt < NT; ++nt)
                    mc[nt % CHAINS] = fmaxf(mc[nt % CHAINS], fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
                float m = mc[0];
#pragma unroll
                for (int c = 1; c < CHAINS; ++c) m = fmaxf(m, mc[c]);
                m = quad_max(m);
                // A fully masked row keeps max -inf; exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
                float m_safe = (CHECK_INF && m == NEG_INF) ? 0.f : m;
                float neg_m_scaled = -m_safe * scale_log2;
                alpha[mt][h] = FIRST ? 1.f : exp2f(fmaf(row_max[mt][h], scale_log2, neg_m_scaled));
                if constexpr (LOG2_P != 0) neg_m_scaled += (float)LOG2_P;  // probabilities times 2^LOG2_P
                row_max[mt][h] = m;
                float sc[CHAINS];
#pragma unroll
                for (int c = 0; c < CHAINS; ++c) sc[c] = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        s[mt][nt][e] = exp2f(fmaf(s[mt][nt][e], scale_log2, neg_m_scaled));
                        if constexpr (SUMS) sc[nt % CHAINS] += s[mt][nt][e];
                    }
                }
                float sum = sc[0];
#pragma unroll
                for (int c = 1; c < CHAINS; ++c) sum += sc[c];
                if constexpr (SUMS) row_sum[mt][h] = FIRST ? sum : row_sum[mt][h] * alpha[mt][h] + sum;
            }
        }
    }

    // acc_o *= alpha, row by row.
    template <int DT>
    __device__ __forceinline__ static void rescale(float (&acc_o)[MT][DT][4], const float (&alpha)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= alpha[mt][e / 2];
    }

    // update_scores, then the rescale of the output accumulator (none when FIRST).
    template <bool FIRST, bool CHECK_INF, int NT, int DT>
    __device__ __forceinline__ void update(float (&s)[MT][NT][4], float (&acc_o)[MT][DT][4], float scale_log2) {
        float alpha[MT][2];
        update_scores<FIRST, CHECK_INF>(s, scale_log2, alpha);
        if (!FIRST) rescale(acc_o, alpha);
    }

    // Deferred normalization: acc_o /= l once, and lse = ln(sum) + max (-inf for an empty row, whose output is 0).
    template <int LOG2_P = 0, int DT>
    __device__ __forceinline__ void finalize(float (&acc_o)[MT][DT][4], float scale_log2, float (&lse)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float sum = quad_sum(row_sum[mt][h]);
                bool empty = !(sum > 0.f);
                float inv = empty ? 0.f : 1.f / sum;
                lse[mt][h] = empty ? NEG_INF : (row_max[mt][h] * scale_log2 + __log2f(sum) - LOG2_P) * LN2;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    acc_o[mt][dt][2 * h] *= inv;
                    acc_o[mt][dt][2 * h + 1] *= inv;
                }
            }
        }
    }
};

}  // namespace cuflash

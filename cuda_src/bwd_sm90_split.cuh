// The Hopper backward's step at d = 256 (BwdSm90::step_split and the products it issues; the class in
// bwd_sm90_block.cuh).
#pragma once
#include "bwd_sm90_block.cuh"

namespace cuflash {

// DSPLIT: S^T or dP^T of all 64 keys against this warpgroup's 32 of the step's queries (A = the keys tile, B =
// rows 32 wg .. of the queries tile, both K-major).
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::issue_keys_by_query_half(
    float (&acc)[NT][4], u32 keys, u32 queries) const {
    const auto desc0 = sm90::smem_desc(base);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const u32 a_at = keys + (ks / 4) * K_PANEL + (ks % 4) * 32;
        const u32 q_at = queries + (ks / 4) * Q_PANEL + wg * 32 * 128 + (ks % 4) * 32;
        sm90::wgmma_m64n32k16_ss<T>(*reinterpret_cast<float(*)[16]>(&acc[0][0]),
                                    sm90::desc_advance(desc0, a_at - base),
                                    sm90::desc_advance(desc0, q_at - base), ks > 0);
    }
    sm90::wgmma_commit();
}

// DSPLIT: acc (+)= A B over the step's BM queries, for this warpgroup's WG_PANELS panels of the head dim: A (keys x
// queries) a K-major tile in shared memory (P^T or dS^T), B a queries x D tile (dO or Q), MN-major.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::issue_keys_by_d_half(
    float (&acc)[WG_PANELS * 8][4], u32 a_tile, u32 tile) const {
    const auto a0 = sm90::smem_desc(base), b0 = sm90::smem_desc_mn(base, Q_PANEL);
#pragma unroll
    for (int kk = 0; kk < KK; ++kk)
#pragma unroll
        for (int pl = 0; pl < WG_PANELS; ++pl)
            sm90::wgmma_m64n64k16_ss_bmn<T>(
                *reinterpret_cast<float(*)[32]>(&acc[pl * 8][0]), sm90::desc_advance(a0, a_tile + kk * 32 - base),
                sm90::desc_advance(b0, tile + (wg * WG_PANELS + pl) * Q_PANEL + kk * 2048 - base), true);
    sm90::wgmma_commit();
}

// DSPLIT: dQ's panel pn (64 columns, all BM rows) over the block's 64 keys: dS (dS^T read MN-major) times K's
// panel (MN-major).
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::issue_dq_panel(
    float (&dq)[8][4], int pn) const {
    static_assert(DS_PANEL == K_PANEL, "one descriptor form for dS^T and K (64-row panels)");
    const auto desc0 = sm90::smem_desc_mn(base, K_PANEL);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        sm90::wgmma_m64n64k16_ss_mn<T>(*reinterpret_cast<float(*)[32]>(&dq[0][0]),
                                       sm90::desc_advance(desc0, OFF_DS + kk * 2048),
                                       sm90::desc_advance(desc0, pn * K_PANEL + kk * 2048), kk > 0);
    sm90::wgmma_commit();
}

// One step at d = 256 (DSPLIT; a consumer of the warp-specialized CTA): S^T and dP^T for this warpgroup's 32 queries,
// P^T and dS^T into shared memory (both consumers' halves: DsReady), then dV and dK for its 128 columns over all BM
// queries and dQ for them, one 64-column panel at a time through its staging tile. The producer loads the next
// step's dO once both consumers' dV is done (do_empty). Under a band (HOLD_DQ) the two panels go into registers of
// their own, both issued behind dK: the first is staged while the second computes, and the second is held
// (HeldPanel) and staged in the next step, after the softmax of its S^T and under its dP^T (the key block's last
// step's by consume), so that its conversion and stores leave the end of the step. Without a band that order
// measured 3-5% slower, and the second panel is staged at the step's end, read out under the next S^T.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::step_split(
    char* smem, int t, int tt, int m_min, int m_count, HeldPanel& held) {
    static_assert(WS, "the d = 256 step runs in the warp-specialized CTA");
    // begin_step's work, written out: through it ptxas schedules this kernel differently (not measured)
    asm volatile("" : "+r"(base), "+r"(mask.seqlen_k), "+r"(mask.diag));
    base = uniform(base);
    int h, m;
    step_of(t, m_min, m_count, h, m);
    const int buf = uniform(tt % 2);
    const float* lse = rows(smem, tt % 2);
    const float* dsum = lse + BM;
    const int key0 = n_key0 + warp() * 16 + lane() / 4, col0 = wg * 32;
    // dropout: the keep bits of this warp's 16 keys x the warpgroup's 32 queries (bit 4 j + e: element [j][e]),
    // drawn while Q and dO load
    u32 kept = ~0u;
    if constexpr (DROPOUT) {
        if (p.dropout_threshold < (int)Dropout::LEVELS)
            kept = Dropout::of(p, b * p.nheads + h).template keep_mask_cols<NT>(n_key0 / 16 + warp(),
                                                                               (m * BM + col0) / 16, lane());
    }
    sm90::mbar_wait(qd_bar(buf), (tt / 2) & 1);  // Q
    sm90::mbar_wait(do_bar(), tt & 1);           // dO: one load per step
    float st[NT][4], dpt[NT][4];
    sm90::wgmma_fence();
    issue_keys_by_query_half(st, base, q_tile(buf));
    issue_keys_by_query_half(dpt, base + OFF_V, do_tile(0));
    if constexpr (SCORE_MOD) {  // both products first: softcap's derivative goes straight into dS
        const float slope = alibi_slope(h);
        sm90::wgmma_wait<0>();
        if (HOLD_DQ && t > 0) stage_held(held, tt - 1);
        const u32 kept_bits[QH] = {kept};  // (bit 4 j + e: dropped's layout, NT = 4)
        mod_probabilities(slope, st, dpt, lse + col0, dsum + col0, key0, m, col0, kept_bits);
        if constexpr (DROPOUT) {  // dV takes P^T M (its 1 / keep in store_dkdv)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!((kept >> (4 * j + e)) & 1u)) st[j][e] = 0.f;
        }
    } else {
        sm90::wgmma_wait<1>();  // S^T
        if (all_visible(m)) probabilities<false>(st, lse + col0, key0, m, col0);
        else probabilities<true>(st, lse + col0, key0, m, col0);
        if (HOLD_DQ && t > 0) stage_held(held, tt - 1);  // under dP^T
        sm90::wgmma_wait<0>();  // dP^T
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dp = dpt[j][e];
                if constexpr (DROPOUT) {  // dS^T from dP^T M / keep; dV takes P^T M (its 1 / keep in store_dkdv)
                    const bool keep = (kept >> (4 * j + e)) & 1u;
                    dp = keep ? dp * p.dropout_scale : 0.f;
                    dpt[j][e] = st[j][e] * (dp - dsum[col0 + 8 * j + 2 * (lane() % 4) + e % 2]) * p.softmax_scale;
                    if (!keep) st[j][e] = 0.f;
                } else {
                    dpt[j][e] = st[j][e] * (dp - dsum[col0 + 8 * j + 2 * (lane() % 4) + e % 2]) * p.softmax_scale;
                }
            }
    }
    // P^T and dS^T, 64 keys x 64 queries each, 128-byte swizzled rows of keys: (key r, query c) at r 128 +
    // (((c / 8) ^ (r % 8)) 16) + (c % 8) 2
    if (tt > 0) sm90::named_sync<256>(int(BwdBarrier::DsFree0) + wg);  // the other's products have read both tiles
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = warp() * 16 + lane() / 4 + 8 * hh, c = col0 + 8 * j + 2 * (lane() % 4);
            const u32 at = r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
            sm90::st_shared_b32(base + OFF_PT + at, pack2<T>(st[j][2 * hh], st[j][2 * hh + 1]));
            sm90::st_shared_b32(base + OFF_DS + at, pack2<T>(dpt[j][2 * hh], dpt[j][2 * hh + 1]));
        }
    sm90::fence_proxy_async();  // generic-proxy stores, read by wgmma (async proxy) below
    sm90::named_sync<BwdBarrier::DsReady, 256>();  // both consumers' queries
    float dq[8][4];
    sm90::wgmma_fence();
    issue_keys_by_d_half(acc_dv, base + OFF_PT, do_tile(0));
    issue_keys_by_d_half(acc_dk, base + OFF_DS, q_tile(buf));
    issue_dq_panel(dq, wg * WG_PANELS);
    if constexpr (HOLD_DQ) {
        issue_dq_panel(held.dq, wg * WG_PANELS + 1);
        sm90::wgmma_wait<3>();  // dV: this warpgroup is done with dO
        sm90::mbar_arrive(do_empty());  // the producer loads the next step's dO once both consumers are here
        sm90::wgmma_wait<1>();  // dK and dQ's first panel
        stage_dq(dq, wg * WG_PANELS, tt, lse + 2 * BM);
        sm90::wgmma_wait<0>();
        sm90::named_arrive<256>(int(BwdBarrier::DsFree1) - wg);  // every product has read P^T and dS^T
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)  // the rows buffer is handed back below
            held.scale[hh] = dq_scale_of(lse + 2 * BM, warp() * 16 + lane() / 4 + 8 * hh);
    } else {
        sm90::wgmma_wait<2>();  // dV: this warpgroup is done with dO
        sm90::mbar_arrive(do_empty());  // the producer loads the next step's dO once both consumers are here
        sm90::wgmma_wait<0>();  // dK and dQ's first panel
        stage_dq(dq, wg * WG_PANELS, tt, lse + 2 * BM);
        sm90::wgmma_fence();
        issue_dq_panel(dq, wg * WG_PANELS + 1);
        sm90::wgmma_wait<0>();
        // (stage_dq waits for the staging tile) every product has read P^T and dS^T
        sm90::named_arrive<256>(int(BwdBarrier::DsFree1) - wg);
        stage_dq(dq, wg * WG_PANELS + 1, tt, lse + 2 * BM);  // read out under the next S^T
    }
    sm90::mbar_arrive(qd_empty(tt % 2));  // done with Q and the rows
}

}  // namespace cuflash

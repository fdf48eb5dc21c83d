// The Hopper backward's dQ additions (BwdSm90::add_dq_red, add_dq_tma; the class in bwd_sm90_block.cuh).
#pragma once
#include "bwd_sm90_block.cuh"

namespace cuflash {

// d = 64 with 64 rows (the score-mod kernel): both warpgroups add to every element of the 64 x 64 tile, each
// over its own 64 keys, with fp32 vector reductions (two adjacent columns each: whole 32-byte sectors per quad).
// Deterministic mode: each slot adds to its own slice, warpgroup 0 first (BwdBarrier::DqOrder: it arrives once its
// additions are ordered, warpgroup 1 waits); the end-of-step barrier orders warpgroup 1's before the next step's.
// The threads ordering each other are in one CTA, so CTA-scope fences suffice.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::add_dq_red(
    const float (&dq)[1][8][4], int h, int m, int seqlen_q) const {
    float* dq_rows = p.dq_accum + (p.deterministic ? (i64)blockIdx.x * p.dq_slice_stride : 0) +
                     SeqInfo::offset(q_begin, p.dq_batch_stride, 0, 0) + (i64)h * D;
    const i64 row_stride = (i64)p.nheads * D;
    if (p.deterministic && wg == 1) sm90::named_sync<BwdBarrier::DqOrder, 256>();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = m * BM + warp * 16 + lane / 4 + 8 * hh;
        if (row >= seqlen_q) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            sm90::red_add_v2(dq_rows + row * row_stride + 8 * j + 2 * (lane % 4), dq[0][j][2 * hh],
                       dq[0][j][2 * hh + 1]);
    }
    if (p.deterministic) __threadfence_block();
    if (p.deterministic && wg == 0) sm90::named_arrive<BwdBarrier::DqOrder, 256>();
}

// This warpgroup's dQ tile (rows row0.. of head h in this sequence, columns panel 64..) added to dq_accum by TMA
// from staging buffer tt % 2: (row r, column c) at box c / 32, line r, 16-byte chunk (c % 32) / 4 ^ (r % 8).
// A thread holds columns 8 j + 2 (lane % 4) + {0, 1} of rows lane / 4 (+ 8): a half-warp's 8-byte stores of one
// j fall on 4 chunk pairs twice each (rows 2i and 2i + 1 share a pair), two wavefronts where one would do. At
// d = 256 odd rows store j ^ 2 in j's turn instead (the other chunk pair of the same box), so that each half-warp
// covers all 32 banks once. At d = 128 the selects cost more than the conflicts save, so the plain order stays
// there (docs/perf-notes.md, the dQ staging stores).
// Deterministic mode 1: each slot adds to its own slice in program order. The steps of one key block add to
// disjoint rows (one query block of one head each), so only the first step of a key block, which may add to the
// rows of the last step before it (the zigzag walk), waits until the slot's earlier additions are made. Mode 2:
// the tile as int32 fixed point (row r times scales[r]) into the one int32 accumulator, in any order.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::add_dq_tma(
    const float (&dq)[8][4], int h, int row0, int panel, int tt, bool first, const float* scales) const {
    const u32 tile = base + OFF_DQ + (DSPLIT ? 0 : (tt % 2) * 2 * DQ_TILE) + wg * DQ_TILE;
    if constexpr (WS && DSPLIT) {  // one tile per consumer, two panels a step: the dQ warp has read the last out
        const int k = 2 * tt + panel % 2;
        if (k > 0) sm90::mbar_wait(dq_empty(wg), (k - 1) & 1);
    } else if constexpr (WS) {
        if (tt > 0) sm90::mbar_wait(dq_empty(), (tt - 1) & 1);  // the dQ warp has read step tt - 2's tile out
    }
    // (WS with 128 rows: the lane made opaque per step, so that ptxas computes the swizzled offsets here rather than
    // hoisting them out of the step loop, where they spill at 240 registers)
    int ln = lane;
    if constexpr (WS && ROW_SPLIT) asm volatile("" : "+r"(ln));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = warp * 16 + ln / 4 + 8 * hh;
        const float scale = FIXED ? scales[r] : 0.f;
        const bool odd = DSPLIT && r % 2;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int jj = odd ? j ^ 2 : j;  // the same box (j / 4)
            const int chunk = 2 * (jj % 4) + (ln % 4) / 2;
            const u32 addr = tile + (j / 4) * DQ_BOX + r * 128 + ((chunk ^ (r % 8)) * 16) + (ln % 2) * 8;
            const float x = odd ? dq[j ^ 2][2 * hh] : dq[j][2 * hh];
            const float y = odd ? dq[j ^ 2][2 * hh + 1] : dq[j][2 * hh + 1];
            if constexpr (FIXED)
                st_shared_fixed2(addr, x, y, scale);
            else
                st_shared_f2(addr, x, y);
        }
    }
    sm90::fence_proxy_async();  // generic-proxy stores, read by TMA (async proxy) below
    if constexpr (WS) {  // the dQ warp adds it (produce_dq)
        sm90::named_arrive<160>(int(BwdBarrier::DqFull0) + wg);
        return;
    }
    sm90::named_sync<128>(int(BwdBarrier::Warpgroup0) + wg);
    if (tid % 128 != 0) return;
    if (!FIXED && p.deterministic == 1 && first) sm90::bulk_wait<0>();
    // rows of all sequences: padded, sequence b starts at row b seqlen_q; packed, at cu_seqlens_q[b]. A box
    // past this sequence's rows adds zeros there (its dS is 0) or is clipped at the end of the tensor.
    const int row = (p.cu_seqlens_q != nullptr ? q_begin : q_begin * p.seqlen_q) + row0;
    const int slice = !FIXED && p.deterministic == 1 ? blockIdx.x : 0;
#pragma unroll
    for (int box = 0; box < 2; ++box)
        sm90::tma_reduce_add_4d(&P.dq, panel * 64 + box * 32, h, row, slice, tile + box * DQ_BOX);
    sm90::bulk_commit();
}

}  // namespace cuflash

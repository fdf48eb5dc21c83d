// The Hopper backward's dQ additions (BwdSm90::add_dq_red, stage_dq; the class in bwd_sm90_block.cuh).
#pragma once
#include "bwd_sm90_block.cuh"

namespace cuflash {

// d = 64 with 64 rows (score mods with dropout): both warpgroups add to every element of the 64 x 64 tile, each
// over its own 64 keys, with fp32 vector reductions (two adjacent columns each: whole 32-byte sectors per quad).
// Deterministic mode: each slot adds to its own slice, warpgroup 0 first (BwdBarrier::DqOrder: it arrives once its
// additions are ordered, warpgroup 1 waits); the end-of-step barrier orders warpgroup 1's before the next step's.
// The threads ordering each other are in one CTA, so CTA-scope fences suffice.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::add_dq_red(
    const float (&dq)[1][8][4], int h, int m, int seqlen_q) const {
    float* dq_rows = p.dq_accum + (p.deterministic ? (i64)blockIdx.x * p.dq_slice_stride : 0) +
                     SeqInfo::offset(q_begin, p.dq_batch_stride, 0, 0) + (i64)h * p.headdim;
    const i64 row_stride = (i64)p.nheads * p.headdim;  // the accumulator has the call's head dim
    if (p.deterministic && wg == 1) sm90::named_sync<BwdBarrier::DqOrder, 256>();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = m * BM + warp() * 16 + lane() / 4 + 8 * hh;
        if (row >= seqlen_q) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = 8 * j + 2 * (lane() % 4);
            if (col < p.headdim)  // a head dim below D
                sm90::red_add_v2(dq_rows + row * row_stride + col, dq[0][j][2 * hh], dq[0][j][2 * hh + 1]);
        }
    }
    if (p.deterministic) __threadfence_block();
    if (p.deterministic && wg == 0) sm90::named_arrive<BwdBarrier::DqOrder, 256>();
}

// This consumer's dQ tile (64 rows, 64 columns of panel `panel`) stored to its staging tile for the dQ warp
// (produce_dq, bwd_sm90_ws.cuh), which adds it to dq_accum by TMA: (row r, column c) at box c / 32, line r, 16-byte
// chunk (c % 32) / 4 ^ (r % 8). Two staging buffers by step parity; at d = 256 one tile per consumer, which carries
// its two panels in turn. A thread holds columns 8 j + 2 (lane % 4) + {0, 1} of rows lane / 4 (+ 8): a half-warp's
// 8-byte stores of one j fall on 4 chunk pairs twice each (rows 2i and 2i + 1 share a pair), two wavefronts where
// one would do. At d = 256 odd rows store j ^ 2 in j's turn instead (the other chunk pair of the same box), so that
// each half-warp covers all 32 banks once. At d = 128 the selects cost more than the conflicts save, so the plain
// order stays there (docs/perf-notes.md, the dQ staging stores). Fixed point (deterministic mode 2): the tile as
// int32, row r times scales[r] (stage_held: the held panel's scales).
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::stage_dq(
    const float (&dq)[8][4], int panel, int tt, const float* scales) const {
    stage_tile(dq, panel, tt, [&](int r, int) { return dq_scale_of(scales, r); });
}

// (by its 32-bit shared address: through the generic pointer the score-mod kernel with 128 rows spills under
// NVRTC 13.5)
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ float BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::dq_scale_of(const float* scales,
                                                                                                int r) const {
    return FIXED ? __uint_as_float(ld_shared_u32(smem_u32(scales) + 4 * r)) : 0.f;
}

// HOLD_DQ: step tt's second dQ panel, held in registers since that step (step_split).
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::stage_held(const HeldPanel& held,
                                                                                              int tt) const {
    stage_tile(held.dq, wg * WG_PANELS + 1, tt, [&](int, int hh) { return held.scale[hh]; });
}

template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
template <class ScaleOf>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::stage_tile(
    const float (&dq)[8][4], int panel, int tt, ScaleOf scale_of) const {
    static_assert(WS && TMA_DQ, "the dQ warp adds the staging tiles");
    const u32 tile = base + OFF_DQ + (DSPLIT ? 0 : (tt % 2) * 2 * DQ_TILE) + wg * DQ_TILE;
    if constexpr (DSPLIT) {  // one tile per consumer, two panels a step: the dQ warp has read the last out
        const int k = 2 * tt + panel % 2;
        if (k > 0) sm90::mbar_wait(dq_empty(wg), (k - 1) & 1);
    } else {
        if (tt > 0) sm90::mbar_wait(dq_empty(), (tt - 1) & 1);  // the dQ warp has read step tt - 2's tile out
    }
    // (128 rows: the lane made opaque per step, so that ptxas computes the swizzled offsets here rather than
    // hoisting them out of the step loop, where they spill at 240 registers)
    int ln = lane();
    if constexpr (ROW_SPLIT) asm volatile("" : "+r"(ln));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = warp() * 16 + ln / 4 + 8 * hh;
        const float scale = scale_of(r, hh);
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
    sm90::fence_proxy_async();  // generic-proxy stores, read by TMA (async proxy) in the dQ warp
    sm90::named_arrive<160>(int(BwdBarrier::DqFull0) + wg);
}

// BwdParams::dq_first_store (a padded batch, one accumulator, not d = 256): the preprocess does not zero the rows of
// whole query blocks. The first CTA to add to such a block (the first ticket, an atomicAdd on the block's counter
// after dq_accum) stores its tiles instead, waits until they are written, and releases the block's ready flag; every
// later CTA acquires the flag before its first reduction to the block. The first ticket's holder is running and waits
// on nothing, so no CTA waits on one that has not started. Blocks no key block visits see no key at all: their rows
// have lse -inf, and the preprocess zeroes those. Partial last blocks (past seqlen_q / BM whole ones) are added to as
// before, zeroed by the preprocess: a store there would write the next sequence's rows.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ bool BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::dq_ticket(int h, int m) const {
    const int blocks = p.dq_first_store;
    if (blocks == 0 || (m + 1) * BM > p.seqlen_q) return false;
    const DqStoreCounters counters(p.dq_accum, p.dq_slice_stride, p.batch, p.nheads, blocks);
    if (atomicAdd(counters.ticket(((i64)b * p.nheads + h) * blocks + m), 1) == 0) return true;
    while (sm90::ld_acquire(dq_ready(h, m)) == 0) __nanosleep(64);
    sm90::fence_proxy_async_global();  // the first CTA's stores (seen by this thread) before its TMA reductions
    return false;
}

// Ordered mode (BwdParams::deterministic DQ_ORDERED, a padded batch, the counters of dq_first_store): each query
// block's dQ is added to by its key blocks one at a time, in an order fixed by the shapes, so that every fp32 sum is
// made in the same order on every run. Under a band (causal, or a window with a right edge) key block n reaches query
// block m at step m - m_min(n), so the order is the visiting key blocks from the last down: the one before adds two
// steps earlier (BN = 2 BM) and rarely keeps the next waiting. Without a band each walk starts at query block
// n M / N (step_of) and the order is cyclic: from the last key block whose walk has started by m, down, then on
// from N - 1. The first in the order stores the block (its tensor map is per sequence, so a partial block's rows
// stop at the sequence's end), later ones wait on the block's counter (ready) until it holds their rank, add, and
// pass the counter on once their additions are made. A CTA waits only on key blocks of its own (KV head, sequence),
// whose CTAs are launched beside it: the plan takes this mode only where they are few (backward.ORDERED_MAX_BLOCKS),
// so that a group's CTAs run at once.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ int BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::dq_rank(int m, int m_blocks) const {
    const int n = n_key0 / BN, blocks = ceil_div(mask.seqlen_k, BN);
    // the key block that adds to m first: the last that sees it (band), or whose walk starts last by m
    const int first = BAND ? floor_div((m + 1) * BM - 1 + mask.diag + p.window_right, BN)
                           : ((m + 1) * blocks - 1) / m_blocks;
    const int rank = min(first, blocks - 1) - n;
    return rank < 0 ? rank + blocks : rank;
}

template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ bool BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::dq_turn(int h, int m,
                                                                                           int rank) const {
    if (rank == 0) return true;  // (a partial block's box stops at the sequence's end: dq_accum_layout)
    while (sm90::ld_acquire(dq_ready(h, m)) < rank) __nanosleep(32);
    sm90::fence_proxy_async_global();  // the additions before (seen by this thread) before this CTA's
    return false;
}

template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::dq_pass(int h, int m,
                                                                                           int rank) const {
    sm90::bulk_wait<0>();              // this CTA's additions made (stores too: then every group, read out too)
    sm90::fence_proxy_async_global();  // (async-proxy writes, published by a generic release)
    sm90::st_release(dq_ready(h, m), rank + 1);
}

}  // namespace cuflash

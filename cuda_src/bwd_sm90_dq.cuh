// The Hopper backward's dQ additions (BwdSm90::add_dq_red, stage_dq) and the fused convert (count_dq, convert_dq,
// zero_unseen_dq); the class in bwd_sm90_block.cuh.
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

// This consumer's dQ tile (64 rows, 64 columns of panel `panel`) stored to its staging tile for the dQ warp
// (produce_dq, bwd_sm90_ws.cuh), which adds it to dq_accum by TMA: (row r, column c) at box c / 32, line r, 16-byte
// chunk (c % 32) / 4 ^ (r % 8). Two staging buffers by step parity; at d = 256 one tile per consumer, which carries
// its two panels in turn. A thread holds columns 8 j + 2 (lane % 4) + {0, 1} of rows lane / 4 (+ 8): a half-warp's
// 8-byte stores of one j fall on 4 chunk pairs twice each (rows 2i and 2i + 1 share a pair), two wavefronts where
// one would do. At d = 256 odd rows store j ^ 2 in j's turn instead (the other chunk pair of the same box), so that
// each half-warp covers all 32 banks once. At d = 128 the selects cost more than the conflicts save, so the plain
// order stays there (docs/perf-notes.md, the dQ staging stores). Fixed point (deterministic mode 2): the tile as
// int32, row r times scales[r].
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::stage_dq(
    const float (&dq)[8][4], int panel, int tt, const float* scales) const {
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
    int ln = lane;
    if constexpr (ROW_SPLIT) asm volatile("" : "+r"(ln));
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
    sm90::fence_proxy_async();  // generic-proxy stores, read by TMA (async proxy) in the dQ warp
    sm90::named_arrive<160>(int(BwdBarrier::DqFull0) + wg);
}

// Lane 0 of the dQ warp: a staging tile's two boxes added to dq_accum at (column col, head h, row row, slice). In
// slices (deterministic mode 1) a key block's first addition waits for the last one's (`wait_slices`), which may
// add to the same rows.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::add_tile(
    u32 tile, int col, int h, int row, int slice, bool wait_slices) const {
    if (!FIXED && p.deterministic == 1 && wait_slices) sm90::bulk_wait<0>();
#pragma unroll
    for (int box = 0; box < 2; ++box) sm90::tma_reduce_add_4d(&P.dq, col + box * 32, h, row, slice, tile + box * DQ_BOX);
}

// The dQ warp (not DSPLIT): step tt's two staging tiles, each once its consumer stored it, added by lane 0 as one
// bulk group (consumer c's tile: ROW_SPLIT, dQ's rows 64 c ..; else its columns 64 c ..). `first`: the key
// block's first step.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::add_step(int tt, int h, int row,
                                                                                             int slice,
                                                                                             bool first) const {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        sm90::named_sync<160>(int(BwdBarrier::DqFull0) + c);
        if (tid % 32 == 0)
            add_tile(base + OFF_DQ + (tt % 2) * 2 * DQ_TILE + c * DQ_TILE, ROW_SPLIT ? 0 : c * 64, h,
                     row + (ROW_SPLIT ? c * 64 : 0), slice, first && c == 0);
    }
    if (tid % 32 == 0) sm90::bulk_commit();
}

// The fused convert (the dQ warp of a warp-specialized kernel but at d = 256, where p.dq_count is set: atomic mode
// and the fixed point). Each query block (sequence b, head h, block m) has an int32 counter, zeroed by
// bwd_preprocess. Once a CTA's additions to the block are made, the dQ warp adds 1 to it; the CTA whose addition
// makes it key_blocks_seeing(m) has the block's last additions, loads the block's accumulator rows into a tile of
// its own (the staging buffers stay with the steps), and casts them to dq. bwd_convert_dq does not run.

// How many key blocks see query block m: those whose walk (walk_key_blocks) includes m, in closed form: key block n
// has m_min <= m < m_max exactly where lo <= n <= hi.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ int BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::key_blocks_seeing(int m) const {
    int lo = 0, hi = ceil_div(mask.seqlen_k, BN) - 1;
    if (BAND) {
        if (p.window_right >= 0) hi = min(hi, floor_div((m + 1) * BM + mask.diag + p.window_right - 1, BN));
        if (p.window_left >= 0) lo = max(lo, floor_div(m * BM + mask.diag - p.window_left, BN));
    }
    return max(0, hi - lo + 1);
}

// The dQ warp, after query block (h, m)'s additions are made (bulk_wait): lane 0 counts them (a release: the
// additions, then the count); the last key block's CTA converts the block.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::count_dq(int h, int m,
                                                                                             u32& conversions) const {
    int last = 0;
    if (tid % 32 == 0) {
        sm90::fence_proxy_async_global();
        __threadfence();
        const int blocks = ceil_div(p.seqlen_q, BM);  // the counters' stride: the longest sequence's query blocks
        if (m < blocks)  // (a packed sequence longer than max_seqlen_q stays inside the counters)
            last = atomicAdd(p.dq_count + ((i64)b * p.nheads + h) * blocks + m, 1) == key_blocks_seeing(m) - 1;
    }
    if (__shfl_sync(~0u, last, 0)) convert_dq(h, m, conversions);
}

// Query block (h, m) of dq_accum cast to dq by the dQ warp, a box (64 rows, 32 columns) at a time: box i of tile
// c = i / 2 (ROW_SPLIT: rows 64 c ..; else columns 64 c ..) is loaded by TMA into the convert's box (the layout
// stage_dq stores), then each lane casts 16 bytes at a time, rows past the sequence and columns past the head dim
// left out; in the fixed point, times each row's unit (conv_unit, read while the first box loads).
// `conversions`: conv_full's phases so far. The cast runs one load at a time: the warp has 24 registers.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::convert_dq(
    int h, int m, u32& conversions) const {
    static_assert(WS && !DSPLIT && BM * PANELS == 128, "a query block is two 64 x 64 tiles");
    const int lane = tid % 32;
    const int row0 = dq_row0(m), rows = min(BM, mask.seqlen_k - mask.diag - m * BM);  // (seqlen_q: 24 registers)
    if (lane == 0) {
        __threadfence();  // the count's acquire: every other CTA's additions before the loads
        sm90::fence_proxy_async_global();
    }
    const int k = lane % 8, row_stride = p.nheads * p.headdim;  // lane: chunk k of lines lane / 8, + 4, ..
    u16* dq = p.dq + ((i64)row0 * p.nheads + h) * p.headdim;
#pragma unroll 1
    for (int i = 0; i < 4; ++i) {
        const int first = ROW_SPLIT ? 64 * (i / 2) : 0, col0 = (ROW_SPLIT ? 0 : 64 * (i / 2)) + 32 * (i % 2);
        if (lane == 0) {
            sm90::fence_proxy_async();  // the lanes' reads of the box before the load's writes
            sm90::mbar_arrive_expect_tx(conv_full(), DQ_BOX);
            sm90::tma_load_4d(conv_box(), &P.dq, col0, h, row0 + first, 0, conv_full());
        }
        if (FIXED && i == 0) {
            const i64 at = SeqInfo::offset(SeqInfo::q_begin_of(p, b), p.lse_batch_stride, 1, m * BM) +
                           (i64)h * p.lse_head_stride;
#pragma unroll 1
            for (int r = lane; r < rows; r += 32)
                sm90::st_shared_b32(conv_unit() + 4 * r, __float_as_uint(dq_fixed_unit(p.dq_scale[at + r])));
            __syncwarp();
        }
        sm90::mbar_wait(conv_full(), conversions++ & 1);
        const int col = col0 + 4 * k;
#pragma unroll 1
        for (int r = lane / 8; r < 64 && first + r < rows && col < p.headdim; r += 4) {
            const uint4 x = sm90::ld_shared_v4(conv_box() + r * 128 + ((k ^ (r % 8)) * 16));
            float4 v;
            if constexpr (FIXED) {
                const float u = __uint_as_float(sm90::ld_shared_b32(conv_unit() + 4 * (first + r)));
                v = make_float4((float)(int)x.x * u, (float)(int)x.y * u, (float)(int)x.z * u, (float)(int)x.w * u);
            } else {
                v = make_float4(__uint_as_float(x.x), __uint_as_float(x.y), __uint_as_float(x.z),
                                __uint_as_float(x.w));
            }
            *reinterpret_cast<uint2*>(dq + (u32)((first + r) * row_stride + col)) =
                make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
        }
        __syncwarp();  // every lane's reads of the box (and of the units) done before it is loaded again
    }
}

// CTA 0 of each (KV head, sequence): the query blocks no key block sees are zeros in dq: the first ones under a
// causal mask or a window with seqlen_q past seqlen_k, all of them in a sequence without keys. A warp's 32 blocks
// are tested at once, and each one found is zeroed by the whole warp.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::zero_unseen_dq(
    int m_blocks) const {
    const int lane = tid % 32, row_stride = p.nheads * p.headdim, chunks = p.headdim / 4;
    for (int m0 = 0; m0 < m_blocks; m0 += 32) {
        u32 unseen = __ballot_sync(~0u, m0 + lane < m_blocks && key_blocks_seeing(m0 + lane) == 0);
        while (unseen != 0) {
            const int m = m0 + __ffs(unseen) - 1;
            unseen &= unseen - 1;
            const int rows = min(BM, mask.seqlen_k - mask.diag - m * BM);
            for (int hh = 0; hh < p.heads_per_kv; ++hh) {
                u16* dq = p.dq + ((i64)dq_row0(m) * p.nheads + h_kv * p.heads_per_kv + hh) * p.headdim;
                for (int i = lane; i < rows * chunks; i += 32)
                    *reinterpret_cast<uint2*>(dq + (i64)(i / chunks) * row_stride + 4 * (i % chunks)) = make_uint2(0, 0);
            }
        }
    }
}

}  // namespace cuflash

// The Hopper forward's epilogue (fwd_sm90.cu): O normalized by the row sums, to the output with lse. Two ways out:
//  - from registers, a 4-byte store per pair of columns (the lockstep kernel; rows of a packed sequence's last
//    tile, where a box would run into the next sequence; a persistent tile without key blocks when O is staged in
//    Q's tile, which the producer may be refilling then; the SPLIT kernel);
//  - p.o_tma (the other warp-specialized kernels): each warp writes its 16 rows into its rows of a staging tile (the
//    128-byte swizzle of the TMA boxes) and its lane 0 stores them by TMA, a box per 64-column panel. Rows past a
//    padded sequence's end, and columns past a head dim below D, fall outside the map (the register stores skip
//    those columns). The staging tile is the persistent kernel's own where it fits
//    (O_TILE), else Q's (this warpgroup's last S = Q K^T has completed), free again once the copies have read it.
#pragma once
#include "fwd_sm90_traits.cuh"

namespace cuflash {

template <class Tr>
struct FwdSm90Epilogue {
    using T = typename Tr::T;
    static constexpr int PANELS = Tr::PANELS;
    static constexpr bool O_TILE = Tr::O_TILE;
    FwdSm90State<Tr>& s;

    // O's two columns 8 j + 2 (lane % 4), + 1 of this thread's row hh (0: lane / 4, 1: lane / 4 + 8) of its warp's 16,
    // to 16 bits
    __device__ __forceinline__ u32 o_pair(int j, int hh) const {
        return pack2<T>(s.acc_o[0][j][2 * hh], s.acc_o[0][j][2 * hh + 1]);
    }

    // The thread of each consumer warp that issues its O copies (store_o_staged).
    __device__ __forceinline__ bool o_issuer() const { return s.lane == 0; }

    // The tile's O and lse out. In the persistent kernel every consumer thread arrives on q_empty once the tile's Q
    // may be overwritten. q_loaded: the tile had key blocks, so its Q was loaded (else Q's tile may be the next
    // tile's).
    __device__ __forceinline__ void store(bool q_loaded) {
        const FwdSm90Params& p = s.p;
        const FwdSm90Tile<Tr::BAND>& t = s.tile;
        float lse[1][2];
        s.softmax.finalize(s.acc_o, p.scale_log2, lse);
        if constexpr (Tr::DROPOUT)
            if (p.dropout_threshold < (int)Dropout::LEVELS)  // the kept probabilities' scale
#pragma unroll
                for (int dt = 0; dt < Tr::PANELS * 8; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s.acc_o[0][dt][e] *= p.dropout_scale;
        const int wg_row0 = t.row0 + s.wg * 64;
        // (OVERLAP_TILES: handed back by FwdSm90Mainloop::s_done)
        const bool arrive_q = Tr::PERSISTENT && q_loaded && !Tr::OVERLAP_TILES;
        const bool staged = Tr::WS && !Tr::SPLIT && p.o_tma && (q_loaded || !Tr::PERSISTENT || O_TILE) &&
                            (p.cu_seqlens_q == nullptr || wg_row0 + 64 <= t.seqlen_q);
        const bool q_free_now = arrive_q && (O_TILE || !staged);  // else after the copies have read Q's tile
        if constexpr (Tr::PERSISTENT)
            if (q_free_now) sm90::mbar_arrive(s.smem.q_empty(t.qb));
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wg_row0 + s.warp * 16 + s.lane / 4 + 8 * hh;
            if (p.lse != nullptr && s.lane % 4 == 0 && r < t.seqlen_q)
                p.lse[SeqInfo::offset(t.q_begin, p.lse_batch_stride, 1, r) + (i64)t.h * p.lse_head_stride] = lse[0][hh];
        }
        if (staged) {
            store_o_staged(wg_row0);
            if constexpr (Tr::PERSISTENT)
                if (arrive_q && !q_free_now) sm90::mbar_arrive(s.smem.q_empty(t.qb));
            return;
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wg_row0 + s.warp * 16 + s.lane / 4 + 8 * hh;
            if (r >= t.seqlen_q) continue;
            u16* o_row =
                p.o + SeqInfo::offset(t.q_begin, p.o_batch_stride, p.o_row_stride, r) + (i64)t.h * p.o_head_stride;
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = pn * 64 + 8 * j + 2 * (s.lane % 4);
                    if (col < p.headdim) *reinterpret_cast<u32*>(o_row + col) = o_pair(pn * 8 + j, hh);
                }
        }
    }

    // This warp's 16 rows of O into its rows of the staging tile (sm90::stage_warp_rows), then out by TMA, a box of
    // 16 rows per 64-column panel issued by the warp's lane 0: no barrier across the warpgroup, whose warps reach
    // their epilogue at different times. With O_TILE the issuing lane waits for its copies to read the tile only
    // before the next tile's rows go in (and before the kernel ends, drain), so the reads overlap the next tile's
    // work.
    __device__ __forceinline__ void store_o_staged(int wg_row0) {
        const int lane = s.lane;
        const u32 rows = s.smem.o_tile() + (s.wg * 64 + s.warp * 16) * 128;  // this warp's rows of panel 0
        if (O_TILE) {
            if (o_issuer()) sm90::bulk_wait_read<0>();
            __syncwarp();
        }
        sm90::stage_warp_rows<PANELS>(rows, Tr::Q_PANEL, lane, [&](int j, int hh) { return o_pair(j, hh); });
        if (o_issuer()) {
            const FwdSm90Tile<Tr::BAND>& t = s.tile;
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn)
                sm90::tma_store_rows(&s.p.o_map, s.p.cu_seqlens_q != nullptr, pn * 64, t.h, t.q_begin,
                                     wg_row0 + s.warp * 16, t.b, rows + pn * Tr::Q_PANEL);
            sm90::bulk_commit();
            if (!O_TILE) sm90::bulk_wait_read<0>();
        }
    }

    // The OVERLAP_TILES kernel: the tile that was current (rows `done`, row statistics `done_softmax`, O in acc_o)
    // out while the state's tile is already the next one.
    __device__ __forceinline__ void store_done(const FwdSm90TileRows& done, const OnlineSoftmax<1>& done_softmax) {
        const FwdSm90TileRows next = s.tile.rows();
        const OnlineSoftmax<1> next_softmax = s.softmax;
        s.tile.set_rows(done);
        s.softmax = done_softmax;
        store(true);
        s.tile.set_rows(next);
        s.softmax = next_softmax;
    }

    // The persistent kernel's end: its last copies out of its own staging tile have read it.
    __device__ __forceinline__ void drain() {
        if (O_TILE && o_issuer()) sm90::bulk_wait_read<0>();
    }
};

}  // namespace cuflash

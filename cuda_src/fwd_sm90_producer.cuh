// The Hopper forward's loads (fwd_sm90.cu): Q's tile and the K/V ring, by TMA. In the warp-specialized kernels one
// thread of the producer warpgroup issues them, each ring slot as soon as its "empty" barrier says the consumers are
// done with it; in the lockstep kernel thread 0 of the consumers does, after each block's CTA barrier. Paged keys
// (PAGED) come from page pools, a box of page_box rows at a time.
#pragma once
#include "fwd_sm90_traits.cuh"

namespace cuflash {

template <class Tr>
struct FwdSm90Producer {
    static constexpr int PANELS = Tr::PANELS, STAGES = Tr::STAGES;
    FwdSm90State<Tr>& s;

    // The box of 64 columns from `col`, rows `row` .. of this tile's sequence, head `head` (sm90::tma_load_rows).
    __device__ __forceinline__ void load_rows(u32 dst, const sm90::TmaMap* map, int col, int head, int begin, int row,
                                              u32 bar) const {
        sm90::tma_load_rows(dst, map, s.p.cu_seqlens_q != nullptr, col, head, begin, row, s.tile.b, bar);
    }

    // The tile's Q into its Q tile. One thread.
    __device__ __forceinline__ void issue_q() {
        const u32 q_full = s.smem.q_full(s.tile.qb);
        sm90::mbar_arrive_expect_tx(q_full, Tr::Q_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            load_rows(s.smem.q_tile(s.tile.qb) + pn * Tr::Q_PANEL, &s.p.q, pn * 64, s.tile.h, s.tile.q_begin,
                      s.tile.row0, q_full);
    }

    // K (half 0) or V (half 1) of key block n into ring slot `slot`. One thread.
    __device__ __forceinline__ void issue_half(int n, int slot, int half) {
        const u32 full = s.smem.full(slot, half);
        sm90::mbar_arrive_expect_tx(full, Tr::KV_BYTES);
        const u32 dst = s.smem.kv_tile(slot, half);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            load_rows(dst + pn * Tr::KV_PANEL, half ? &s.p.v : &s.p.k, pn * 64, s.tile.h_kv, s.tile.k_begin,
                      n * Tr::BN, full);
    }

    // PAGED (the lockstep kernel): K and V of key block n into ring slot `slot` from the sequence's pages, issued by
    // the 32 threads of warp 0 together. The pools' maps are 4-D (d, heads_k, page rows, pages) with boxes of
    // page_box rows (a divisor of the page size and of BN, a multiple of 16, so that each box starts on a swizzle
    // atom of the tile): BN / page_box boxes per 64-column panel, for each panel of K and of V, at most 32 in all
    // (16 boxes of 16 rows x two panels at d 128, 4 x four at d 256). Lane i issues box i after looking its page up
    // itself, so that small pages cost one lookup and one issue per lane rather than a serial chain of them in one
    // thread. Lane 0 sets each half's expected bytes with its arrival; another lane's copy may complete first (the
    // transaction count may go below zero, as with a multicast from another CTA), but the phase also waits for that
    // arrival. No lane branches or waits for another (a predicated copy): ptxas serializes the consumers' wgmmas
    // around a divergent path (C7520). A box past the sequence's keys, or in a page the pool does not have, reads
    // page num_pages, one past the last, which TMA fills with zeros: no row outside the sequence's own pages is read
    // (an idle lane's lookup stays inside the table's row too).
    __device__ __forceinline__ void issue_kv_paged(int n, int slot, int lane) {
        const FwdSm90Params& p = s.p;
        const int boxes = Tr::BN / p.page_box;
        if (lane == 0) {
            sm90::mbar_arrive_expect_tx(s.smem.full(slot, 0), Tr::KV_BYTES);
            sm90::mbar_arrive_expect_tx(s.smem.full(slot, 1), Tr::KV_BYTES);
        }
        static_assert(2 * PANELS * (Tr::BN / 16) <= 32, "a box per lane");
        const int* pages = p.block_table + (i64)s.tile.b * p.block_table_stride;
        const int half = lane / (PANELS * boxes), pn = lane / boxes % PANELS, box = lane % boxes;
        const int pos = n * Tr::BN + box * p.page_box, at = pos / p.page_size;
        const int w = pos < s.tile.mask.seqlen_k && at < p.max_pages ? __ldg(pages + at) : -1;
        sm90::tma_load_4d_if(lane < 2 * PANELS * boxes, s.smem.kv_tile(slot, half & 1) + pn * Tr::KV_PANEL +
                                 box * p.page_box * 128, (half & 1) ? &p.v : &p.k, pn * 64, s.tile.h_kv,
                             pos - at * p.page_size, w >= 0 && w < p.num_pages ? w : p.num_pages,
                             s.smem.full(slot, half & 1));
    }
    // K and V of key block n into ring slot `slot`: one thread, or with PAGED the 32 threads of warp 0.
    __device__ __forceinline__ void issue_kv(int n, int slot) {
        if constexpr (Tr::PAGED) {
            issue_kv_paged(n, slot, s.tid % 32);
            return;
        }
        issue_half(n, slot, 0);
        issue_half(n, slot, 1);
    }

    // The warp-specialized producer thread: the tile's key blocks into the ring from position `it` (each slot once
    // the consumers have emptied it), and Q. `tile`: how many tiles this CTA loaded before; the persistent kernel
    // issues Q into Q tile tile % Q_BUFS after the first key block, once the consumers are done with the tile that
    // used it last (with one Q tile the previous one: Q lands during their epilogue; with Q_BUFS, the one Q_BUFS
    // tiles back).
    __device__ __forceinline__ void produce(const BlockRange& range, int count, int it, int tile) {
        if (!Tr::PERSISTENT) issue_q();
        for (int t = 0; t < count; ++t) {
            const int i = it + t, slot = slot_of<STAGES>(i), n = range.n_max - 1 - t;
            if (i >= STAGES) sm90::mbar_wait(s.smem.empty(slot, 0), pass_of<STAGES>(i) ^ 1);
            issue_half(n, slot, 0);
            if constexpr (Tr::PERSISTENT) {
                if (t == 0) {
                    s.tile.qb = tile % Tr::Q_BUFS;
                    if (tile >= Tr::Q_BUFS) sm90::mbar_wait(s.smem.q_empty(s.tile.qb), (tile / Tr::Q_BUFS - 1) & 1);
                    issue_q();
                }
            }
            if (i >= STAGES) sm90::mbar_wait(s.smem.empty(slot, 1), pass_of<STAGES>(i) ^ 1);
            issue_half(n, slot, 1);
        }
    }
};

}  // namespace cuflash

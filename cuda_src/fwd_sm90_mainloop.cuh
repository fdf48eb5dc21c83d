// The Hopper forward's consumer main loops (fwd_sm90.cu). Per key block each consumer warpgroup runs
//     S = Q K^T            wgmma m64nBNk16 (BN = 64, 80, 128 or 176 keys), both from shared memory (K-major, 128-byte
//                          swizzle)
//     mask, online softmax  on the accumulators, which have the mma.sync layout per warp (softmax.cuh, mask.cuh)
//     O += P V              wgmma m64n64k16 with P in registers and V MN-major per 64-column panel of O (m64n128k16
//                           per pair of panels: d = 128, 256)
// The key blocks of a tile are walked from the last (n_max - 1) down; only blocks a mask cuts take the masked step.
// Three loops:
//  - step (the lockstep kernel): S, softmax, P V, each waited for;
//  - consume_pipelined (warp-specialized): S of block t and O += P V of block t - 1 in flight together, then the
//    softmax of block t while P V still computes; with PINGPONG the two warpgroups also take turns issuing their
//    GEMMs, so one's softmax overlaps the other's GEMMs;
//  - consume_split (SPLIT): a tile whose rows fit in 64, its key blocks dealt out to all three warpgroups, then
//    merged in warpgroup 0 (split_leave, split_merge).
#pragma once
#include "fwd_sm90_traits.cuh"

namespace cuflash {

template <class Tr>
struct FwdSm90Mainloop {
    using T = typename Tr::T;
    static constexpr int BN = Tr::BN, D = Tr::D, PANELS = Tr::PANELS, STAGES = Tr::STAGES, WGS = Tr::WGS;
    static constexpr bool BAND = Tr::BAND, PINGPONG = Tr::PINGPONG;
    using Scores = float[1][BN / 8][4];    // S, then P, of one warpgroup's 64 rows: the wgmma accumulators
    using Fragments = u32[BN / 16][4];     // P as the A fragments of O += P V
    FwdSm90State<Tr>& s;

    __device__ __forceinline__ u32 full(int slot, int half) const { return s.smem.full(slot, half); }
    __device__ __forceinline__ u32 empty(int slot, int half) const { return s.smem.empty(slot, half); }

    // ------------------------------------------------------------------------------------------------ GEMMs

    // S = Q K^T for the block in ring slot `slot`, issued as one wgmma group (the caller fences and waits).
    // FIRST_ROWS: the Q tile's first 64 rows, whichever the warpgroup (a split tile's, SPLIT).
    template <bool FIRST_ROWS = false>
    __device__ __forceinline__ void issue_s(Scores& sc, int slot) const {
        const u32 base = s.smem.base;
        const u32 k_tile = s.smem.kv_offset(slot, 0);  // (offsets from base: smem_desc(base) advanced)
        // this warpgroup's 64 rows of Q
        const u32 q_rows = s.smem.q_tile(s.tile.qb) - base + (FIRST_ROWS ? 0 : s.wg * 64 * 128);
        float(&sf)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&sc[0][0][0]);
        // the tiles' descriptors once, then advanced by constants (one add per wgmma and operand)
        const auto desc0 = sm90::smem_desc(base);
        const auto q_desc = sm90::desc_advance(desc0, q_rows), k_desc = sm90::desc_advance(desc0, k_tile);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const auto a = sm90::desc_advance(q_desc, (ks / 4) * Tr::Q_PANEL + (ks % 4) * 32);
            const auto b = sm90::desc_advance(k_desc, (ks / 4) * Tr::KV_PANEL + (ks % 4) * 32);
            if constexpr (BN == 176) sm90::wgmma_m64n176k16_ss<T>(sf, a, b, ks > 0);
            else if constexpr (BN == 128) sm90::wgmma_m64n128k16_ss<T>(sf, a, b, ks > 0);
            else if constexpr (BN == 80) sm90::wgmma_m64n80k16_ss<T>(sf, a, b, ks > 0);
            else sm90::wgmma_m64n64k16_ss<T>(sf, a, b, ks > 0);
        }
        sm90::wgmma_commit();
    }

    // O += P V over keys 16 kk .. 16 kk + 15 of the block in slot `slot`: P's A fragment `a` from registers
    // (m64n128k16 per pair of 64-column panels where PV_N128, else m64n64k16 per panel).
    __device__ __forceinline__ void issue_pv_k16(const u32 (&a)[4], int kk, int slot) {
        const auto v_desc =
            sm90::desc_advance(sm90::smem_desc_mn(s.smem.base, Tr::KV_PANEL), s.smem.kv_offset(slot, 1));
        constexpr int STEP = Tr::PV_N128 ? 2 : 1;
#pragma unroll
        for (int pn = 0; pn < PANELS; pn += STEP) {
            const auto b = sm90::desc_advance(v_desc, pn * Tr::KV_PANEL + kk * 2048);
            if constexpr (Tr::PV_N128)
                sm90::wgmma_m64n128k16_rs<T>(*reinterpret_cast<float(*)[64]>(&s.acc_o[0][pn * 8][0]), a, b, true);
            else sm90::wgmma_m64n64k16_rs<T>(s.panel(pn), a, b, true);
        }
    }

    // O += P V for the whole block, P packed beforehand, issued as one wgmma group. The registers of P and O belong
    // to the wgmma until a wait says it is done.
    __device__ __forceinline__ void issue_pv(const Fragments& pa, int slot) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) issue_pv_k16(pa[kk], kk, slot);
        sm90::wgmma_commit();
    }

    // -------------------------------------------------------------------------------------------- softmax

    // Block n's scores to probabilities, in place: score mod, mask (MASK), online softmax; alpha: the factor O must
    // be rescaled by before this block's P V is added. NT: the block's first NT 8-key columns (left_half).
    template <bool MASK, bool FIRST, int NT>
    __device__ __forceinline__ void probabilities(float (&sc)[1][NT][4], int n, float (&alpha)[1][2]) {
        if (Tr::SCORE_MOD) s.tile.mod.apply(sc, s.warp_row0(), n * BN, s.lane);
        if (MASK && !(Tr::DIAGONAL && s.tile.mask.apply_diagonal(sc[0], s.warp_row0(), n * BN, s.lane))) {
            const int r = s.warp_row0() + s.lane / 4, col_lane = n * BN + 2 * (s.lane % 4);
            s.tile.mask.apply_row(sc[0], 0, r, col_lane);
            s.tile.mask.apply_row(sc[0], 1, r + 8, col_lane);
        }
        s.softmax.template update_scores<FIRST, MASK>(sc, s.p.scale_log2, alpha);
    }

    // Dropout (DROPOUT kernels, where the call asks for it): this warp's probabilities of block n that the mask
    // drops set to 0 in P's A fragments, after the row sums took them (out = (P M / keep) V; the epilogue scales by
    // 1 / keep). One Philox call per 16 elements (dropout.cuh).
    __device__ __forceinline__ void drop(Fragments& pa, int n) const {
        if constexpr (Tr::DROPOUT) {
            if (s.p.dropout_threshold >= (int)Dropout::LEVELS) return;
            Dropout::of(s.p, s.tile.b * s.p.nheads + s.tile.h).drop_fragments(pa, s.warp_row0() / 16, n * BN / 16,
                                                                               s.lane);
        }
    }

    // P of block n as the A fragments of O += P V, dropout applied.
    __device__ __forceinline__ void pack(const Scores& sc, Fragments& pa, int n) const {
        sm90::a_fragments<T>(sc[0], pa);
        drop(pa, n);
    }

    // probabilities() of block t of the walk (n = range.n_max - 1 - t), masked where the block needs it.
    template <bool FIRST>
    __device__ __forceinline__ void probabilities_of(const BlockRange& range, int t, Scores& sc, float (&alpha)[1][2]) {
        const int n = range.n_max - 1 - t;
        // Without a band only the walk's first block (the last key block, cut by seqlen_k) can need masking.
        bool masked = (BAND || FIRST) && (n > range.full_hi || n < range.full_lo);
        // (OVERLAP_TILES: else the step leaves the uniform datapath)
        if (Tr::OVERLAP_TILES && FIRST) masked = sm90::warp_uniform(masked);
        if (masked) probabilities<true, FIRST>(sc, n, alpha);
        else probabilities<false, FIRST>(sc, n, alpha);
    }

    // A tile's first block (the walk's last key block) whose right half no row of this warpgroup sees: the causal
    // diagonal's upper warpgroup where the tile's rows start at a key-block boundary (equal lengths, BM = BN), or a
    // sequence that ends in the block's left half. Its softmax then runs over the left half only and P's right half
    // is zero, which is what the whole block's softmax makes of keys no row sees (the GEMMs stay whole).
    __device__ __forceinline__ bool left_half(const BlockRange& range) const {
        if constexpr (!Tr::LEFT_HALF) return false;
        const Mask<BAND>& mask = s.tile.mask;
        int seen = mask.seqlen_k;  // no row of the warpgroup sees a key from `seen` on
        if (BAND && mask.right >= 0) seen = min(seen, s.tile.row0 + s.wg * 64 + 64 + mask.diag + mask.right);
        return sm90::warp_uniform(seen <= (range.n_max - 1) * BN + BN / 2);
    }

    // probabilities_of the tile's first block; over the block's left half where left_half, the right half's
    // probabilities then set to zero.
    __device__ __forceinline__ void first_probabilities(const BlockRange& range, Scores& sc, float (&alpha)[1][2]) {
        if (Tr::LEFT_HALF && left_half(range)) {
            probabilities<true, true>(*reinterpret_cast<float(*)[1][BN / 16][4]>(&sc[0][0][0]), range.n_max - 1,
                                      alpha);
#pragma unroll
            for (int nt = BN / 16; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[0][nt][e] = 0.f;
        } else {
            probabilities_of<true>(range, 0, sc, alpha);
        }
    }

    // ----------------------------------------------------------------------------------------- lockstep

    // Lockstep kernel, block t (key block n): S, softmax, O += P V, each waited for. MASK: the block needs
    // element-wise masking (a template parameter here: one copy of the whole step per case keeps ptxas from
    // injecting warpgroup fences around the branch, C7519).
    template <bool MASK, bool FIRST>
    __device__ __forceinline__ void step(int n, int t) {
        const int slot = slot_of<STAGES>(t);
        sm90::mbar_wait(full(slot, 0), pass_of<STAGES>(t));
        float sc[1][BN / 8][4], alpha[1][2];
        sm90::wgmma_fence();
        issue_s(sc, slot);
        sm90::wgmma_wait<0>();
        probabilities<MASK, FIRST>(sc, n, alpha);
        if (!FIRST) OnlineSoftmax<1>::rescale(s.acc_o, alpha);
        sm90::mbar_wait(full(slot, 1), pass_of<STAGES>(t));
        if constexpr (Tr::DROPOUT) {
            Fragments pa;
            pack(sc, pa, n);
            sm90::wgmma_fence();
            issue_pv(pa, slot);
        } else {
            sm90::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {  // P packed a fragment at a time, next to its wgmma
                u32 a[4];
                sm90::a_fragment<T>(sc[0], kk, a);
                issue_pv_k16(a, kk, slot);
            }
            sm90::wgmma_commit();
        }
        sm90::wgmma_wait<0>();
    }

    // ------------------------------------------------------------------------------- warp-specialized

    // PINGPONG: the two consumer warpgroups take turns issuing their GEMMs (named barriers Turn0 and Turn1: "my
    // turn", over both warpgroups' threads), so that one's softmax runs while the other's GEMMs keep the tensor cores
    // busy.
    static constexpr int TURN_THREADS = 2 * 128;
    __device__ __forceinline__ void my_turn() const {
        if (PINGPONG) named_sync(turn_barrier(s.wg), TURN_THREADS);
    }
    __device__ __forceinline__ void your_turn() const {
        if (PINGPONG) named_arrive(turn_barrier(1 - s.wg), TURN_THREADS);
    }
    // Warpgroup 0 goes first in each tile.
    __device__ __forceinline__ void first_turn() const {
        if (PINGPONG && s.wg == 1) named_arrive(FwdSm90Barrier::Turn0, TURN_THREADS);
    }

    // The consumers' Q for the loaded-th tile with key blocks: its Q tile, once loaded.
    __device__ __forceinline__ void wait_q(int loaded) {
        s.tile.qb = s.uniform(loaded % Tr::Q_BUFS);
        sm90::mbar_wait(s.smem.q_full(s.tile.qb), (loaded / Tr::Q_BUFS) & 1);
    }

    // S of block t of a tile of `count` blocks is done: the OVERLAP_TILES kernel hands the tile's Q back after the
    // last.
    __device__ __forceinline__ void s_done(int t, int count) {
        if constexpr (Tr::OVERLAP_TILES)
            if (t == count - 1) sm90::mbar_arrive(s.smem.q_empty(s.tile.qb));
    }

    // S of the block in slot `slot` and O += P V of the block before it in slot `prev`, issued together in this
    // warpgroup's turn (the pipelined step: the softmax of S then runs while P V still computes).
    template <bool FIRST_ROWS = false>
    __device__ __forceinline__ void issue_s_pv(Scores& sc, const Fragments& pa, int slot, int prev) {
        my_turn();
        sm90::wgmma_fence();
        issue_s<FIRST_ROWS>(sc, slot);
        issue_pv(pa, prev);
        your_turn();
    }

    // Block 0 of a tile (ring position it0): S, then its softmax, with nothing of the tile to overlap; P packed.
    __device__ __forceinline__ void first_block(const BlockRange& range, int count, int it0, Scores& sc,
                                                float (&alpha)[1][2], Fragments& pa) {
        const int slot = slot_of<STAGES>(it0);
        sm90::mbar_wait(full(slot, 0), pass_of<STAGES>(it0));
        my_turn();
        sm90::wgmma_fence();
        issue_s(sc, slot);
        your_turn();
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty(slot, 0));
        s_done(0, count);
        first_probabilities(range, sc, alpha);
        pack(sc, pa, range.n_max - 1);
    }

    // Blocks 1 .. count - 1: S of block t and O += P V of block t - 1 in flight together, then block t's softmax
    // while P V still computes; O rescaled and P packed once that lands. A slot's K is handed back when S of its
    // block is done, its V when the P V that read it is.
    __device__ __forceinline__ void middle_blocks(const BlockRange& range, int count, int it0, Scores& sc,
                                                  float (&alpha)[1][2], Fragments& pa) {
        for (int t = 1; t < count; ++t) {
            const int slot = s.uniform(slot_of<STAGES>(it0 + t)), prev = slot == 0 ? STAGES - 1 : slot - 1;
            sm90::mbar_wait(full(slot, 0), pass_of<STAGES>(it0 + t));
            sm90::mbar_wait(full(prev, 1), pass_of<STAGES>(it0 + t - 1));
            issue_s_pv(sc, pa, slot, prev);
            sm90::wgmma_wait<1>();  // groups complete in order: S of block t is in
            sm90::mbar_arrive(empty(slot, 0));
            s_done(t, count);
            probabilities_of<false>(range, t, sc, alpha);
            sm90::wgmma_wait<0>();  // and O += P V of block t - 1
            sm90::mbar_arrive(empty(prev, 1));
            OnlineSoftmax<1>::rescale(s.acc_o, alpha);
            pack(sc, pa, range.n_max - 1 - t);
        }
    }

    // O += P V of the block at ring position `it`, the tile's last.
    __device__ __forceinline__ void last_pv(const Fragments& pa, int it) {
        sm90::mbar_wait(full(slot_of<STAGES>(it), 1), pass_of<STAGES>(it));
        my_turn();
        sm90::wgmma_fence();
        issue_pv(pa, slot_of<STAGES>(it));
        if (s.wg == 0) your_turn();  // warpgroup 1's last turn has no taker: skipped, so every arrival is consumed
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty(slot_of<STAGES>(it), 1));
    }

    // A tile of `count` key blocks from ring position it0, its Q loaded.
    __device__ __forceinline__ void consume_pipelined(const BlockRange& range, int count, int it0) {
        float sc[1][BN / 8][4], alpha[1][2];
        u32 pa[BN / 16][4];
        first_turn();
        first_block(range, count, it0, sc, alpha, pa);
        middle_blocks(range, count, it0, sc, alpha, pa);
        last_pv(pa, it0 + count - 1);
    }

    // --------------------------------------------------------------------------------------------- split

    // SPLIT: a tile whose rows all lie in its first 64, which every warpgroup takes (row0 moved back by 64 wg, and
    // issue_s<true>). Block t of its walk is warpgroup t % WGS's; the others hand its K and V back once they are in
    // (pass_block: an arrival before that could count toward the slot's previous fill, which another warpgroup may
    // still be reading). Each warpgroup's blocks are software-pipelined as in consume_pipelined; a V it still holds
    // does not stall the ring, since its next block is WGS < STAGES positions on. Then split_leave and split_merge
    // bring warpgroups 1 and 2's O, max and sum to warpgroup 0.
    // The SPLIT kernel writes O from registers, whatever p.o_tma says (FwdSm90Epilogue): the merge passes O through
    // the staging tile, which with O by TMA stores warpgroups 1 and 2 would first have to wait for their last copies
    // out of (compute-sanitizer's racecheck reports the merge's accesses with that wait in place).
    __device__ __forceinline__ bool split_tile(int count) const {
        return Tr::SPLIT && count > 0 && s.uniform(s.tile.row0 + 64 >= s.tile.seqlen_q);
    }

    __device__ __forceinline__ void pass_block(int it) {
        const int slot = s.uniform(slot_of<STAGES>(it));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            sm90::mbar_wait(full(slot, half), pass_of<STAGES>(it));
            sm90::mbar_arrive(empty(slot, half));
        }
    }

    __device__ __forceinline__ void consume_split(const BlockRange& range, int count, int it0) {
        const int wg = s.wg;
        for (int t = 0; t < wg && t < count; ++t) pass_block(it0 + t);
        if (wg >= count) return;  // fewer blocks than warpgroups: none of its own
        float sc[1][BN / 8][4], alpha[1][2];
        u32 pa[BN / 16][4];
        int last = it0 + wg;  // the ring position whose O += P V is still to come
        sm90::mbar_wait(full(slot_of<STAGES>(last), 0), pass_of<STAGES>(last));
        sm90::wgmma_fence();
        issue_s<true>(sc, slot_of<STAGES>(last));
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty(slot_of<STAGES>(last), 0));
        probabilities_of<true>(range, wg, sc, alpha);
        pack(sc, pa, range.n_max - 1 - wg);
        for (int t = wg + 1; t < count; ++t) {
            const int it = it0 + t;
            if (t % WGS != wg) {
                pass_block(it);
                continue;
            }
            const int slot = s.uniform(slot_of<STAGES>(it)), prev = s.uniform(slot_of<STAGES>(last));
            sm90::mbar_wait(full(slot, 0), pass_of<STAGES>(it));
            sm90::mbar_wait(full(prev, 1), pass_of<STAGES>(last));
            issue_s_pv<true>(sc, pa, slot, prev);
            sm90::wgmma_wait<1>();  // S is in
            sm90::mbar_arrive(empty(slot, 0));
            probabilities_of<false>(range, t, sc, alpha);
            sm90::wgmma_wait<0>();  // and O += P V of the block before
            sm90::mbar_arrive(empty(prev, 1));
            OnlineSoftmax<1>::rescale(s.acc_o, alpha);
            pack(sc, pa, range.n_max - 1 - t);
            last = it;
        }
        last_pv(pa, last);
    }

    // Where warpgroup w (1, 2) leaves the 16 floats `part` (0, 1) of its O per thread, 16 bytes per thread and
    // quarter: its rows of the O staging tile (part 0), Q's rows 64 w .. 64 w + 63, which no warpgroup of a split
    // tile reads (part 1).
    __device__ __forceinline__ u32 merge_o(int w, int part, int quarter) const {
        return (part ? s.smem.q_tile(s.tile.qb) : s.smem.o_tile()) + w * 64 * 128 +
               (quarter * 128 + s.warp * 32 + s.lane) * 16;
    }

    // Warpgroups 1 and 2 after a split tile: O (not normalized), max and sum to shared memory for warpgroup 0
    // (MergeWritten), Q's tile handed back, and a wait until warpgroup 0 has read them (MergeRead). Every side syncs
    // on both barriers (an arrival would gain nothing: each side waits for the other at one of them anyway).
    __device__ __forceinline__ void split_leave() {
#pragma unroll
        for (int j = 0; j < 8; ++j) st_shared_f4(merge_o(s.wg, j / 4, j % 4), s.acc_o[0][j]);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float sum = quad_sum(s.softmax.row_sum[0][hh]);
            if (s.lane % 4 == 0)
                st_shared_f2(s.smem.merge_row(s.wg, s.warp * 16 + s.lane / 4 + 8 * hh), s.softmax.row_max[0][hh], sum);
        }
        sm90::fence_proxy_async();  // (Q's tile is the TMA's again once q_empty completes)
        named_sync(FwdSm90Barrier::MergeWritten, 128 * WGS);
        sm90::mbar_arrive(s.smem.q_empty(s.tile.qb));
        named_sync(FwdSm90Barrier::MergeRead, 128 * WGS);
    }

    // Warpgroup 0 after a split tile: the others' O, max and sum merged into its own, as the online softmax would
    // have had them (each part scaled by 2^(its max - the joint max)); lane 0 of each quad adds their sums, which
    // split_leave reduced over the quad.
    __device__ __forceinline__ void split_merge() {
        OnlineSoftmax<1>& softmax = s.softmax;
        const float scale_log2 = s.p.scale_log2;
        float c[WGS][2];
        named_sync(FwdSm90Barrier::MergeWritten, 128 * WGS);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = s.warp * 16 + s.lane / 4 + 8 * hh;
            float m[WGS], l[WGS];
            m[0] = softmax.row_max[0][hh];
            float joint = m[0];
#pragma unroll
            for (int w = 1; w < WGS; ++w) {
                ld_shared_f2(m[w], l[w], s.smem.merge_row(w, row));
                joint = fmaxf(joint, m[w]);
            }
            const float neg = -(joint == NEG_INF ? 0.f : joint) * scale_log2;
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < WGS; ++w) {
                c[w][hh] = exp2f(fmaf(m[w], scale_log2, neg));
                if (w > 0) sum += l[w] * c[w][hh];
            }
            softmax.row_sum[0][hh] = softmax.row_sum[0][hh] * c[0][hh] + (s.lane % 4 == 0 ? sum : 0.f);
            softmax.row_max[0][hh] = joint;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s.acc_o[0][j][e] *= c[0][e / 2];
#pragma unroll
            for (int w = 1; w < WGS; ++w) {
                float o[4];
                ld_shared_f4(o, merge_o(w, j / 4, j % 4));
#pragma unroll
                for (int e = 0; e < 4; ++e) s.acc_o[0][j][e] = fmaf(o[e], c[w][e / 2], s.acc_o[0][j][e]);
            }
        }
        named_sync(FwdSm90Barrier::MergeRead, 128 * WGS);
    }
};

}  // namespace cuflash

// Forward attention on Hopper (sm_90a): TMA loads and wgmma.
//
// Grid (query blocks, heads, batch); a CTA owns BM = 64 WGS query rows as WGS consumer warpgroups of 64 rows each
// (two; three in the warp-specialized kernel at d = 64, FA3's 192-row tile),
// sharing K/V tiles that TMA brings into a ring of STAGES slots; each slot has a "full" mbarrier counting the
// bytes in. Per KV block each consumer warpgroup runs
//     S = Q K^T            wgmma m64nBNk16 (BN = 64 or 128 keys), both from shared memory (K-major, 128-byte swizzle)
//     mask, online softmax  on the accumulators, which have the mma.sync layout per warp (softmax.cuh, mask.cuh)
//     O += P V              wgmma m64n64k16 with P in registers and V MN-major per 64-column panel of O (m64n128k16
//                           per pair of panels: d = 128, 256)
// and the epilogue normalizes O by the row sums and writes lse from registers and O either from registers or, in the
// warp-specialized kernels (p.o_tma), through a swizzled staging tile in shared memory and TMA stores (epilogue).
//
// Two ways to feed the ring (template flag WS):
//  - WS = false (the first version, GPU-verified): thread 0 of the consumers issues the copies; after each block a
//    CTA barrier, then the freed slot is refilled. The two warpgroups run in lockstep.
//  - WS = true (warp-specialized): a third warpgroup is the producer; one of its threads issues Q and then every
//    K/V block as soon as the slot is free, which each slot's "empty" mbarrier tells (all 256 consumer threads
//    arrive when done with it). No CTA barrier in the loop: the consumer warpgroups drift apart, so one's softmax
//    overlaps the other's GEMMs, and the copies run STAGES - 1 blocks ahead. The producer gives its registers to the
//    consumers (setmaxnreg 24 / 240, or 24 / 160 with three: d = 256 keeps O in 128 of them). Within a warpgroup the
//    loop is software-pipelined (consume_pipelined): S of block t and O += P V of block t - 1 are issued together
//    and the softmax of block t runs while the second still computes. PINGPONG adds turns between the two consumer
//    warpgroups (named barriers): their GEMMs alternate, so one's softmax overlaps the other's GEMMs by design.
// Head dims 64, 128 and 256; softcap and ALiBi (SCORE_MOD, score_mod.cuh, before the mask as in fwd.cu); padded batches
// and packed sequences (seqlen.cuh; 3-D tensor maps over the tokens). Other head dims stay on fwd.cu.
#include "sm90.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "seqlen.cuh"

namespace cuflash {

struct FwdSm90Params {
    sm90::TmaMap q;        // (d, heads, seqlen_q, batch) padded or (d, heads, total_q) packed, box (64, 1, BM[, 1])
    sm90::TmaMap k;        // (d, heads_k, seqlen_k, batch) or (d, heads_k, total_k), box (64, 1, BN[, 1])
    sm90::TmaMap v;
    sm90::TmaMap o_map;    // O's map as q's, box (64, 1, 16[, 1]): one warp's rows of a 64-column panel
    u16* o;                // (batch, seqlen_q, nheads, headdim) or (total_q, nheads, headdim)
    float* lse;            // (batch, nheads, seqlen_q) or (nheads, total_q), contiguous; or nullptr
    const float* alibi;    // ALiBi slopes (nheads,) or (batch, nheads), or nullptr
    const int* cu_seqlens_q;  // packed sequences (seqlen.cuh), or nullptr for a padded batch
    const int* cu_seqlens_k;
    i64 o_batch_stride, o_row_stride, o_head_stride;  // packed: the row stride is the batch stride (seqlen.cuh)
    i64 lse_batch_stride, lse_head_stride, alibi_batch_stride;
    int seqlen_q, seqlen_k, nheads, heads_per_kv;      // packed: the maximum lengths
    int window_left, window_right;
    float scale_log2;      // log2(e) in score-mod kernels (scores leave ScoreMod in natural-log units)
    float mod_scale, softcap;  // score-mod kernels: see score_mod.cuh and plan.forward_scales
    int batch;             // sequences (the persistent kernel walks query blocks x heads x batch itself)
    int o_tma;             // warp-specialized kernels: O leaves through shared memory and TMA stores (epilogue)
    // The persistent kernel's walk (tile_of; plan.sm90_walk_chunk): under a band, chunks of `chunk` (sequence, head)
    // pairs (`chunk_last` in the last one); the divisions a tile index takes, by query blocks, heads, tiles per
    // chunk, pairs per chunk and in the last chunk
    int chunk, chunk_last;
    FastDiv by_m_blocks, by_heads, by_chunk_tiles, by_chunk, by_chunk_last;
};
// The layout cuflash/hopper.py PARAMS_DTYPE writes (NVRTC 13.0, the device's, has no offsetof: only the size is
// asserted).
static_assert(sizeof(FwdSm90Params) == 704, "FwdSm90Params no longer matches cuflash/hopper.py");

template <class T, int D, int BN, bool BAND, int STAGES, int WGS, bool WS, bool SCORE_MOD, bool PINGPONG,
          bool PERSISTENT, bool SPLIT_TILES = false>
struct FwdSm90 {
    static constexpr int BM = 64 * WGS, PANELS = D / 64;  // WGS consumer warpgroups of 64 query rows each
    static constexpr int THREADS = 128 * (WGS + (WS ? 1 : 0)), CONSUMER0 = WS ? 128 : 0;  // consumers: CONSUMER0 ..
    // setmaxnreg after the split: the producer keeps 24 registers, the consumers share the rest of the SM's 64 K
    // (240 each for two warpgroups, 160 for three)
    static constexpr int CONSUMER_REGS = WGS == 2 ? 240 : 160;
    static constexpr u32 Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
    static constexpr u32 Q_PANEL = BM * 128, KV_PANEL = BN * 128;  // bytes of one 64-column panel
    // shared memory (1024-aligned): Q | K[STAGES] | V[STAGES] [| O] [| Q'] | barriers (q full[Q_BUFS], full[K, V]
    // [STAGES], empty[K, V][STAGES][, q_empty[Q_BUFS]]). O: the persistent kernel's own staging tile for the
    // epilogue's TMA stores where it fits (else O is staged in Q's tile, which the next tile's Q then waits for).
    // Q': where that fits too, the persistent kernel's second Q tile (at d 64 a second and a third): tiles take them
    // in turn, so the next tile's Q loads while this one computes (with three, while the one before ends too: a
    // causal tile of a block or two hands its Q tile back only a block or two before the next needs one). The third
    // measured +1 to +3% at d 64 non-causal 512-2k, causal within noise (docs/bench/fwd_bwd_session15_call1.txt).
    static constexpr u32 OFF_K = Q_BYTES, OFF_V = OFF_K + STAGES * KV_BYTES, OFF_O = OFF_V + STAGES * KV_BYTES;
    static constexpr u32 LIMIT = 227 * 1024 - 1024;  // the SM's shared memory per block, less room to align to 1024
    static constexpr bool O_TILE = PERSISTENT && OFF_O + Q_BYTES + (2 + 4 * STAGES) * 8 <= LIMIT;
    static constexpr int Q_BUFS = O_TILE && D == 64 && OFF_O + 3 * Q_BYTES + (6 + 4 * STAGES) * 8 <= LIMIT ? 3
                                  : O_TILE && OFF_O + 2 * Q_BYTES + (4 + 4 * STAGES) * 8 <= LIMIT        ? 2
                                                                                                         : 1;
    // The persistent kernel with more than one Q tile at d 64 starts each tile (its first S and softmax) while the
    // last P V of the tile before computes (consume_overlapped), and hands a tile's Q back once the tile's last
    // S = Q K^T is done (Q_EARLY), not after its epilogue, so that the producer loads a later tile's Q sooner: the
    // overlapped step needs the next tile's Q and first K about a key block earlier. Measured at d 64 with the
    // four-slot ring (ws_n128_p): +2 to +7% up to 2k keys; with two slots the step waited for them, -6 to -14%. At
    // d 128 (two slots, the most that fit beside two Q tiles and the O tile) it lost 2-4% (docs/perf-notes.md,
    // session 14). Two consumer warpgroups only: with three, the next tile's S does not fit in 160 registers beside
    // P and O (200-336 bytes of spills).
    static constexpr bool OVERLAP = PERSISTENT && Q_BUFS >= 2 && D == 64 && WGS == 2;
    // HANDED_TILES (the OVERLAP kernels): the producer, which walks the tiles anyway, hands each tile with
    // rows to the consumers through a ring of TILE_SLOTS entries of TILE_BYTES in shared memory at OFF_TILES (its
    // rows, sequence, lengths and key blocks), and one entry that ends the walk, so that the consumers read three
    // 16-byte words where they ran the walk's arithmetic themselves (about 150 instructions a warp between a tile's
    // last block and the next tile's first GEMMs: 7% of the consumers' warp samples at d 64 causal 512). Session 26
    // (three rounds): d 64 causal 512 / 1k / 2k 258.3 / 336.2 / 389.0 -> 272.0 / 349.0 / 397.4, non-causal 512
    // unchanged; in the other persistent kernels with two consumer warpgroups (d 128) it lost 1-3%, and with three
    // the ring's registers spill (drafts/session26-handed-tiles-all.patch). The ring's barriers (tile_full,
    // tile_empty per entry) come after the others.
    static constexpr bool HANDED_TILES = OVERLAP;
    static constexpr int TILE_SLOTS = HANDED_TILES ? 8 : 0;
    static constexpr int BARRIERS = Q_BUFS * (PERSISTENT ? 2 : 1) + 4 * STAGES + 2 * TILE_SLOTS;
    static constexpr u32 OFF_Q2 = OFF_O + (O_TILE ? Q_BYTES : 0), OFF_BAR = OFF_Q2 + (Q_BUFS - 1) * Q_BYTES;
    // SPLIT (consume_split): a tile whose rows all lie in its first 64 is worked by all three consumer warpgroups,
    // each on every third key block, and merged by warpgroup 0: one tile in six at 1k keys (1024 = 5 x 192 + 64),
    // which otherwise takes a whole tile's time with two of three warpgroups idle. The merge passes warpgroups 1 and
    // 2's O through their rows of the O staging tile and the split tile's unused Q rows, and each row's max and sum
    // through OFF_MERGE (8 bytes per row and warpgroup), after the barriers. A kernel of its own (SPLIT_TILES, the
    // variant ws3_n128_p_split): in ws3_n128_p itself the split's code cost 2-4% at 2k and 4k keys, where no tile is
    // split (ptxas schedules the common loop differently), while it gained 4% at 1k.
    static constexpr bool SPLIT = SPLIT_TILES;
    static_assert(!SPLIT || (PERSISTENT && WGS == 3 && O_TILE && D == 64 && STAGES > WGS),
                  "split tiles: the persistent kernel with three consumer warpgroups, d 64, its own O tile");
    static constexpr u32 OFF_MERGE = OFF_BAR + BARRIERS * 8, MERGE_BYTES = SPLIT ? (WGS - 1) * 64 * 8 : 0;
    // HANDED_TILES' ring after the barriers (16-aligned: an even number of barriers, no merge area)
    static constexpr u32 TILE_BYTES = 64, OFF_TILES = OFF_MERGE + MERGE_BYTES;
    static_assert(TILE_SLOTS == 0 || OFF_TILES % 16 == 0, "the tile ring's 16-byte words are aligned");
    static constexpr u32 SMEM_BYTES = OFF_TILES + TILE_SLOTS * TILE_BYTES + 1024;  // + room to align to 1024
    static_assert(D % 64 == 0, "whole 64-column panels");
    static_assert(BN == 64 || BN == 128 || BN == 176, "S = Q K^T is one wgmma m64n64, n128 or n176 per k16 step");
    static_assert(STAGES >= 2 && (WS || STAGES == 2), "the lockstep version refills after a CTA barrier: 2 slots");
    static_assert(WS || !PINGPONG, "ping-pong schedules the warp-specialized consumers");
    static_assert(WGS == 2 || (WGS == 3 && WS && !PINGPONG), "three consumer warpgroups: warp-specialized, no turns");
    static_assert(128 * 24 + 128 * WGS * CONSUMER_REGS <= 65536, "the register split exceeds the SM's file");
    static_assert(WS || !PERSISTENT, "the persistent kernel is the warp-specialized one");
    static_assert(Q_BUFS == 1 || O_TILE, "O is staged in Q's tile only with one Q tile");
    static_assert(SMEM_BYTES <= 227 * 1024, "the SM's shared memory per block");
    static constexpr bool Q_EARLY = OVERLAP;
    // A value every lane of the warp holds, made one ptxas can see as such (sm90::warp_uniform), so that the ring
    // position and the wgmma descriptors stay on the uniform datapath: +2 to +6% at d 128 up to 4k keys. Not in the
    // OVERLAP kernel, where the shuffles cost more than they saved (-1 to -10% at d 64 up to 4k keys; session 17).
    __device__ __forceinline__ static int uniform(int x) { return OVERLAP ? x : sm90::warp_uniform(x); }
    // The OVERLAP kernel instead makes the warp's index and `wg` (once), and each tile's block range, whether there
    // is one and whether its first block is masked (once per tile) values ptxas can see are warp-uniform: then the
    // ring position, the branches of the step and every wgmma descriptor are uniform too (d 64 ws_n128_p: R2UR in
    // the SASS 123 -> 25 under a band, 122 -> 18 without; 16% and 29% less code). Each part alone changes nothing.
    static constexpr bool UNIFORM_TILES = OVERLAP;

    const FwdSm90Params& p;
    int tid, wg, warp, lane;  // wg: consumer warpgroup (0, 1); warp: within the warpgroup
    u32 base;
    int qb = 0;  // the Q tile this tile uses (0; 1, 2 from OFF_Q2)
    int row0, b, h, h_kv;
    // What the epilogue reads of a tile, kept for the last tile while begin_tile has moved on to the next one.
    struct TileRows {
        int row0, b, h, q_begin, seqlen_q, qb;
    };
    int q_begin, k_begin, seqlen_q;  // this sequence (seqlen.cuh): where its rows start, how many queries
    Mask<BAND> mask;
    ScoreMod mod;  // softcap / ALiBi (SCORE_MOD kernels)
    OnlineSoftmax<1> softmax;
    // O's accumulators: per 64-column panel the 32 of one wgmma m64n64; viewed whole, the [rows][8-col tiles][4]
    // layout softmax.cuh rescales and normalizes
    float acc_o[1][PANELS * 8][4];

    __device__ __forceinline__ explicit FwdSm90(const FwdSm90Params& params) : p(params) {}

    __device__ __forceinline__ u32 q_tile() const { return base + (qb ? OFF_Q2 + (qb - 1) * Q_BYTES : 0); }
    __device__ __forceinline__ u32 q_full_bar() const { return base + OFF_BAR + 8 * qb; }
    // A ring slot's K (half 0) and V (half 1) have barriers of their own: K is handed back once S = Q K^T is done,
    // V once O += P V is, so the producer can refill K a softmax earlier than the slot as a whole.
    __device__ __forceinline__ u32 full_bar(int slot, int half) const {
        return base + OFF_BAR + 8 * (Q_BUFS + half * STAGES + slot);
    }
    __device__ __forceinline__ u32 empty_bar(int slot, int half) const {
        return base + OFF_BAR + 8 * (Q_BUFS + (2 + half) * STAGES + slot);
    }
    // Ring position i (counted from 0 over the CTA's key blocks): its slot, and the parity of the slot's fill that
    // holds it (unsigned: no sign fix-ups in the division)
    __device__ __forceinline__ static int slot_of(int i) { return (int)((u32)i % STAGES); }
    __device__ __forceinline__ static u32 pass_of(int i) { return ((u32)i / STAGES) & 1; }
    // persistent kernel: the consumers are done with Q tile qb (all their wgmma of a tile have completed)
    __device__ __forceinline__ u32 q_empty_bar() const { return base + OFF_BAR + 8 * (Q_BUFS + 4 * STAGES + qb); }
    // HANDED_TILES: entry `slot` of the tile ring is written (tile_full) or read by every consumer (tile_empty)
    __device__ __forceinline__ u32 tile_full_bar(int slot) const {
        return base + OFF_BAR + 8 * (2 * Q_BUFS + 4 * STAGES + slot);
    }
    __device__ __forceinline__ u32 tile_empty_bar(int slot) const { return tile_full_bar(slot) + 8 * TILE_SLOTS; }

    // The TMA box of 64 columns from `col`, rows `row` .. of this sequence, head `head`: a 4-D map (d, heads, seqlen,
    // batch) of a padded batch, or a 3-D one (d, heads, total) of packed sequences whose rows start at `begin`. Rows
    // past the tensor's end arrive as zeros; rows past a packed sequence's end (the next sequence's) are masked.
    __device__ __forceinline__ void load_box(u32 dst, const sm90::TmaMap* map, int col, int head, int begin, int row,
                                             u32 bar) const {
        if (p.cu_seqlens_q != nullptr) sm90::tma_load_3d(dst, map, col, head, begin + row, bar);
        else sm90::tma_load_4d(dst, map, col, head, row, b, bar);
    }

    __device__ __forceinline__ void issue_q() {  // one thread
        sm90::mbar_arrive_expect_tx(q_full_bar(), Q_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            load_box(q_tile() + pn * Q_PANEL, &p.q, pn * 64, h, q_begin, row0, q_full_bar());
    }

    // K (half 0) or V (half 1) of key block n into ring slot `slot`. One thread.
    __device__ __forceinline__ void issue_half(int n, int slot, int half) {
        sm90::mbar_arrive_expect_tx(full_bar(slot, half), KV_BYTES);
        const u32 dst = base + (half ? OFF_V : OFF_K) + slot * KV_BYTES;
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            load_box(dst + pn * KV_PANEL, half ? &p.v : &p.k, pn * 64, h_kv, k_begin, n * BN,
                     full_bar(slot, half));
    }
    __device__ __forceinline__ void issue_kv(int n, int slot) {
        issue_half(n, slot, 0);
        issue_half(n, slot, 1);
    }

    // S = Q K^T for the block in ring slot `slot`, issued as one wgmma group (the caller fences and waits).
    // FIRST_ROWS: the Q tile's first 64 rows, whichever the warpgroup (a split tile's, SPLIT).
    template <bool FIRST_ROWS = false>
    __device__ __forceinline__ void issue_s(float (&s)[1][BN / 8][4], int slot) const {
        const u32 k_tile = OFF_K + slot * KV_BYTES;  // (offsets from base: smem_desc(base) advanced)
        const u32 q_rows = q_tile() - base + (FIRST_ROWS ? 0 : wg * 64 * 128);  // this warpgroup's 64 rows of Q
        float(&sf)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s[0][0][0]);
        // the tiles' descriptors once, then advanced by constants (one add per wgmma and operand)
        const auto desc0 = sm90::smem_desc(base);
        const auto q_desc = sm90::desc_advance(desc0, q_rows), k_desc = sm90::desc_advance(desc0, k_tile);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const auto a = sm90::desc_advance(q_desc, (ks / 4) * Q_PANEL + (ks % 4) * 32);
            const auto b = sm90::desc_advance(k_desc, (ks / 4) * KV_PANEL + (ks % 4) * 32);
            if constexpr (BN == 176) sm90::wgmma_m64n176k16_ss<T>(sf, a, b, ks > 0);
            else if constexpr (BN == 128) sm90::wgmma_m64n128k16_ss<T>(sf, a, b, ks > 0);
            else sm90::wgmma_m64n64k16_ss<T>(sf, a, b, ks > 0);
        }
        sm90::wgmma_commit();
    }

    // O += P V over keys 16 kk .. 16 kk + 15 of the block in slot `slot`: P's A fragment `a` from registers. Where
    // the head dim has an even number of 64-column panels one m64n128k16 covers two of them (PV_N128: P's fragment
    // read once for both), else one m64n64k16 per panel.
    static constexpr bool PV_N128 = PANELS % 2 == 0;
    __device__ __forceinline__ void issue_pv_k16(const u32 (&a)[4], int kk, int slot) {
        const auto v_desc = sm90::desc_advance(sm90::smem_desc_mn(base, KV_PANEL), OFF_V + slot * KV_BYTES);
        constexpr int STEP = PV_N128 ? 2 : 1;
#pragma unroll
        for (int pn = 0; pn < PANELS; pn += STEP) {
            const auto b = sm90::desc_advance(v_desc, pn * KV_PANEL + kk * 2048);
            if constexpr (PV_N128)
                sm90::wgmma_m64n128k16_rs<T>(*reinterpret_cast<float(*)[64]>(&acc_o[0][pn * 8][0]), a, b, true);
            else sm90::wgmma_m64n64k16_rs<T>(panel(pn), a, b, true);
        }
    }

    // O += P V for the whole block, P packed beforehand, issued as one wgmma group. The registers of P and O belong
    // to the wgmma until a wait says it is done.
    __device__ __forceinline__ void issue_pv(const u32 (&pa)[BN / 16][4], int slot) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) issue_pv_k16(pa[kk], kk, slot);
        sm90::wgmma_commit();
    }

    // Masked blocks where a band's right edge meets each warp's rows on a 16-column boundary take the mask's per-warp
    // shapes (Mask::apply_diagonal), except with three consumer warpgroups, whose 160 registers the shapes overflow
    // (4 bytes of spills at d 64).
    static constexpr bool DIAGONAL = WGS == 2;

    // Block n's scores to probabilities, in place: mask (MASK), online softmax; alpha: the factor O must be
    // rescaled by before this block's P V is added. NT: the block's first NT 8-key columns (left_half).
    template <bool MASK, bool FIRST, int NT>
    __device__ __forceinline__ void probabilities(float (&s)[1][NT][4], int n, float (&alpha)[1][2]) {
        if (SCORE_MOD) mod.apply(s, row0 + wg * 64 + warp * 16, n * BN, lane);
        if (MASK && !(DIAGONAL && mask.apply_diagonal(s[0], row0 + wg * 64 + warp * 16, n * BN, lane))) {
            const int row = row0 + wg * 64 + warp * 16 + lane / 4, col_lane = n * BN + 2 * (lane % 4);
            mask.apply_row(s[0], 0, row, col_lane);
            mask.apply_row(s[0], 1, row + 8, col_lane);
        }
        softmax.template update_scores<FIRST, MASK>(s, p.scale_log2, alpha);
    }

    // probabilities() of block t of the walk (n = range.n_max - 1 - t), masked where the block needs it.
    template <bool FIRST>
    __device__ __forceinline__ void probabilities_of(const BlockRange& range, int t, float (&s)[1][BN / 8][4],
                                                     float (&alpha)[1][2]) {
        const int n = range.n_max - 1 - t;
        // Without a band only the walk's first block (the last key block, cut by seqlen_k) can need masking.
        bool masked = (BAND || FIRST) && (n > range.full_hi || n < range.full_lo);
        if (UNIFORM_TILES && FIRST) masked = sm90::warp_uniform(masked);  // (else the step leaves the uniform datapath)
        if (masked) probabilities<true, FIRST>(s, n, alpha);
        else probabilities<false, FIRST>(s, n, alpha);
    }

    // A tile's first block (the walk's last key block) whose right half no row of this warpgroup sees: the causal
    // diagonal's upper warpgroup where the tile's rows start at a key-block boundary (equal lengths, BM = BN), or a
    // sequence that ends in the block's left half. Its softmax then runs over the left half only and P's right half
    // is zero, which is what the whole block's softmax makes of keys no row sees (the GEMMs stay whole). Session 22
    // (three rounds): d 128 causal 512 / 1k 348.8 / 452.7 -> 357.2 / 462.4 (pingpong_n128_p_s2); in the OVERLAP
    // kernel it lost 3-7% at d 64 causal 512 / 1k (255.5 / 332.9 -> 237.4 / 321.1), so that kernel keeps the whole
    // block: its warpgroups then run different copies of the first block's step at once.
    static constexpr bool LEFT_HALF = BN == 128 && !OVERLAP;
    __device__ __forceinline__ bool left_half(const BlockRange& range) const {
        if constexpr (!LEFT_HALF) return false;
        int seen = mask.seqlen_k;  // no row of the warpgroup sees a key from `seen` on
        if (BAND && mask.right >= 0) seen = min(seen, row0 + wg * 64 + 64 + mask.diag + mask.right);
        return sm90::warp_uniform(seen <= (range.n_max - 1) * BN + BN / 2);
    }

    // probabilities_of the tile's first block; over the block's left half where left_half, the right half's
    // probabilities then set to zero.
    __device__ __forceinline__ void first_probabilities(const BlockRange& range, float (&s)[1][BN / 8][4],
                                                        float (&alpha)[1][2]) {
        if (LEFT_HALF && left_half(range)) {
            probabilities<true, true>(*reinterpret_cast<float(*)[1][BN / 16][4]>(&s[0][0][0]), range.n_max - 1, alpha);
#pragma unroll
            for (int nt = BN / 16; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][nt][e] = 0.f;
        } else {
            probabilities_of<true>(range, 0, s, alpha);
        }
    }

    // P of keys 16 kk .. 16 kk + 15 to 16 bits: the A fragment of O += P V (mma.sync layout of each warp's rows).
    __device__ __forceinline__ static void p_fragment(const float (&s)[1][BN / 8][4], int kk, u32 (&a)[4]) {
        a[0] = pack2<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
        a[1] = pack2<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
        a[2] = pack2<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
        a[3] = pack2<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
    }

    // Lockstep version, block t (key block n): S, softmax, O += P V, each waited for. MASK: the block needs
    // element-wise masking (a template parameter here: one copy of the whole step per case keeps ptxas from
    // injecting warpgroup fences around the branch, C7519).
    template <bool MASK, bool FIRST>
    __device__ __forceinline__ void step(int n, int t) {
        const int slot = slot_of(t);
        sm90::mbar_wait(full_bar(slot, 0), pass_of(t));
        float s[1][BN / 8][4], alpha[1][2];
        sm90::wgmma_fence();
        issue_s(s, slot);
        sm90::wgmma_wait<0>();
        probabilities<MASK, FIRST>(s, n, alpha);
        if (!FIRST) OnlineSoftmax<1>::rescale(acc_o, alpha);
        sm90::mbar_wait(full_bar(slot, 1), pass_of(t));
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {  // P packed a fragment at a time, next to its wgmma
            u32 a[4];
            p_fragment(s, kk, a);
            issue_pv_k16(a, kk, slot);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
    }

    // Warp-specialized consumer loop, software-pipelined within the warpgroup: S of block t and O += P V of block
    // t - 1 are in flight together, then the softmax of block t runs (in place on S) while P V still computes. O is
    // rescaled and P packed once that lands: the registers of P and O are the wgmma's until the wait. A slot's K is
    // handed back (its "empty" barrier) when S of its block is done, its V when the P V that read it is.
    //
    // PINGPONG: the two consumer warpgroups also take turns issuing their GEMMs (named barriers 1 and 2, one per
    // warpgroup: "my turn"), so that one's softmax runs while the other's GEMMs keep the tensor cores busy.
    __device__ __forceinline__ void my_turn() const {
        if (PINGPONG) sm90::named_sync(1 + wg, 256);
    }
    __device__ __forceinline__ void your_turn() const {
        if (PINGPONG) sm90::named_arrive(2 - wg, 256);
    }

    // Block 0 of a tile (ring position it0): S, then its softmax, with nothing of the tile to overlap; P packed.
    __device__ __forceinline__ void first_block(const BlockRange& range, int count, int it0,
                                                float (&s)[1][BN / 8][4], float (&alpha)[1][2],
                                                u32 (&pa)[BN / 16][4]) {
        sm90::mbar_wait(full_bar(slot_of(it0), 0), pass_of(it0));
        my_turn();
        sm90::wgmma_fence();
        issue_s(s, slot_of(it0));
        your_turn();
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty_bar(slot_of(it0), 0));
        s_done(0, count);
        first_probabilities(range, s, alpha);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) p_fragment(s, kk, pa[kk]);
    }

    // Blocks 1 .. count - 1: S of block t and O += P V of block t - 1 in flight together, then block t's softmax.
    __device__ __forceinline__ void middle_blocks(const BlockRange& range, int count, int it0,
                                                  float (&s)[1][BN / 8][4], float (&alpha)[1][2],
                                                  u32 (&pa)[BN / 16][4]) {
        for (int t = 1; t < count; ++t) {
            const int slot = uniform(slot_of(it0 + t)), prev = slot == 0 ? STAGES - 1 : slot - 1;
            sm90::mbar_wait(full_bar(slot, 0), pass_of(it0 + t));
            sm90::mbar_wait(full_bar(prev, 1), pass_of(it0 + t - 1));
            my_turn();
            sm90::wgmma_fence();
            issue_s(s, slot);
            issue_pv(pa, prev);
            your_turn();
            sm90::wgmma_wait<1>();  // groups complete in order: S of block t is in
            sm90::mbar_arrive(empty_bar(slot, 0));
            s_done(t, count);
            probabilities_of<false>(range, t, s, alpha);
            sm90::wgmma_wait<0>();  // and O += P V of block t - 1
            sm90::mbar_arrive(empty_bar(prev, 1));
            OnlineSoftmax<1>::rescale(acc_o, alpha);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) p_fragment(s, kk, pa[kk]);
        }
    }

    // The consumers' Q for the loaded-th tile with key blocks: its Q tile, once loaded.
    __device__ __forceinline__ void wait_q(int loaded) {
        qb = uniform(loaded % Q_BUFS);
        sm90::mbar_wait(q_full_bar(), (loaded / Q_BUFS) & 1);
    }

    // S of block t of a tile of `count` blocks is done: the last hands the tile's Q back (Q_EARLY).
    __device__ __forceinline__ void s_done(int t, int count) {
        if (Q_EARLY && t == count - 1) sm90::mbar_arrive(q_empty_bar());
    }

    // O += P V of the block at ring position `it`, the tile's last.
    __device__ __forceinline__ void last_pv(const u32 (&pa)[BN / 16][4], int it) {
        sm90::mbar_wait(full_bar(slot_of(it), 1), pass_of(it));
        my_turn();
        sm90::wgmma_fence();
        issue_pv(pa, slot_of(it));
        if (wg == 0) your_turn();  // warpgroup 1's last turn has no taker: skipped, so every arrival is consumed
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty_bar(slot_of(it), 1));
    }

    __device__ __forceinline__ void consume_pipelined(const BlockRange& range, int count, int it0) {
        float s[1][BN / 8][4], alpha[1][2];
        u32 pa[BN / 16][4];
        if (PINGPONG && wg == 1) sm90::named_arrive(1, 256);  // warpgroup 0 goes first
        first_block(range, count, it0, s, alpha, pa);
        middle_blocks(range, count, it0, s, alpha, pa);
        last_pv(pa, it0 + count - 1);
    }

    // SPLIT: a tile whose rows all lie in its first 64, which every warpgroup takes (row0 moved back by 64 wg, and
    // issue_s<true>). Block t of its walk is warpgroup t % WGS's; the others hand its K and V back once they are in
    // (pass_block: an arrival before that could count toward the slot's previous fill, which another warpgroup may
    // still be reading). Each warpgroup's blocks are software-pipelined as in consume_pipelined (S of one and
    // O += P V of the one before in flight together); a V it still holds does not stall the ring, since its next
    // block is WGS < STAGES positions on. Then split_leave and split_merge bring warpgroups 1 and 2's O, max and sum
    // to warpgroup 0.
    // The SPLIT kernel writes O from registers, whatever p.o_tma says (epilogue): with O by TMA stores warpgroups 1
    // and 2 would first wait for their last copies out of the staging tile, and with that wait compute-sanitizer's
    // racecheck flagged the merge's accesses (partly; without it, none), which we could not explain.
    __device__ __forceinline__ bool split_tile(int count) const {
        return SPLIT && count > 0 && uniform(row0 + 64 >= seqlen_q);
    }

    __device__ __forceinline__ void pass_block(int it) {
        const int slot = uniform(slot_of(it));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            sm90::mbar_wait(full_bar(slot, half), pass_of(it));
            sm90::mbar_arrive(empty_bar(slot, half));
        }
    }

    __device__ __forceinline__ void consume_split(const BlockRange& range, int count, int it0) {
        for (int t = 0; t < wg && t < count; ++t) pass_block(it0 + t);
        if (wg >= count) return;  // fewer blocks than warpgroups: none of its own
        float s[1][BN / 8][4], alpha[1][2];
        u32 pa[BN / 16][4];
        int last = it0 + wg;  // the ring position whose O += P V is still to come
        sm90::mbar_wait(full_bar(slot_of(last), 0), pass_of(last));
        sm90::wgmma_fence();
        issue_s<true>(s, slot_of(last));
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty_bar(slot_of(last), 0));
        probabilities_of<true>(range, wg, s, alpha);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) p_fragment(s, kk, pa[kk]);
        for (int t = wg + 1; t < count; ++t) {
            const int it = it0 + t;
            if (t % WGS != wg) {
                pass_block(it);
                continue;
            }
            const int slot = uniform(slot_of(it)), prev = uniform(slot_of(last));
            sm90::mbar_wait(full_bar(slot, 0), pass_of(it));
            sm90::mbar_wait(full_bar(prev, 1), pass_of(last));
            sm90::wgmma_fence();
            issue_s<true>(s, slot);
            issue_pv(pa, prev);
            sm90::wgmma_wait<1>();  // S is in
            sm90::mbar_arrive(empty_bar(slot, 0));
            probabilities_of<false>(range, t, s, alpha);
            sm90::wgmma_wait<0>();  // and O += P V of the block before
            sm90::mbar_arrive(empty_bar(prev, 1));
            OnlineSoftmax<1>::rescale(acc_o, alpha);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) p_fragment(s, kk, pa[kk]);
            last = it;
        }
        last_pv(pa, last);
    }

    // Where warpgroup w (1, 2) leaves the 16 floats `part` (0, 1) of its O per thread, 16 bytes per thread and
    // quarter: its rows of the O staging tile (part 0), Q's rows 64 w .. 64 w + 63, which no warpgroup of a split
    // tile reads (part 1). And where it leaves the max and sum of its row `row`.
    __device__ __forceinline__ u32 merge_o(int w, int part, int quarter) const {
        return (part ? q_tile() : base + OFF_O) + w * 64 * 128 + (quarter * 128 + warp * 32 + lane) * 16;
    }
    __device__ __forceinline__ u32 merge_row(int w, int row) const {
        return base + OFF_MERGE + ((w - 1) * 64 + row) * 8;
    }

    // Warpgroups 1 and 2 after a split tile: O (not normalized), max and sum to shared memory for warpgroup 0 (named
    // barrier 6), Q's tile handed back, and a wait until warpgroup 0 has read them (barrier 7). Every side syncs on
    // both barriers (an arrival would gain nothing: each side waits for the other at one of them anyway).
    __device__ __forceinline__ void split_leave() {
#pragma unroll
        for (int j = 0; j < 8; ++j) st_shared_f4(merge_o(wg, j / 4, j % 4), acc_o[0][j]);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float sum = quad_sum(softmax.row_sum[0][hh]);
            if (lane % 4 == 0) st_shared_f2(merge_row(wg, warp * 16 + lane / 4 + 8 * hh), softmax.row_max[0][hh], sum);
        }
        sm90::fence_proxy_async();  // (Q's tile is the TMA's again once q_empty completes)
        sm90::named_sync(6, 128 * WGS);
        sm90::mbar_arrive(q_empty_bar());
        sm90::named_sync(7, 128 * WGS);
    }

    // Warpgroup 0 after a split tile: the others' O, max and sum merged into its own, as the online softmax would
    // have had them (each part scaled by 2^(its max - the joint max)); lane 0 of each quad adds their sums, which
    // split_leave reduced over the quad.
    __device__ __forceinline__ void split_merge() {
        float c[WGS][2];
        sm90::named_sync(6, 128 * WGS);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = warp * 16 + lane / 4 + 8 * hh;
            float m[WGS], l[WGS];
            m[0] = softmax.row_max[0][hh];
            float joint = m[0];
#pragma unroll
            for (int w = 1; w < WGS; ++w) {
                ld_shared_f2(m[w], l[w], merge_row(w, row));
                joint = fmaxf(joint, m[w]);
            }
            const float neg = -(joint == NEG_INF ? 0.f : joint) * p.scale_log2;
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < WGS; ++w) {
                c[w][hh] = exp2f(fmaf(m[w], p.scale_log2, neg));
                if (w > 0) sum += l[w] * c[w][hh];
            }
            softmax.row_sum[0][hh] = softmax.row_sum[0][hh] * c[0][hh] + (lane % 4 == 0 ? sum : 0.f);
            softmax.row_max[0][hh] = joint;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][j][e] *= c[0][e / 2];
#pragma unroll
            for (int w = 1; w < WGS; ++w) {
                float o[4];
                ld_shared_f4(o, merge_o(w, j / 4, j % 4));
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[0][j][e] = fmaf(o[e], c[w][e / 2], acc_o[0][j][e]);
            }
        }
        sm90::named_sync(7, 128 * WGS);
    }

    __device__ __forceinline__ float (&panel(int pn))[32] {
        return *reinterpret_cast<float(*)[32]>(&acc_o[0][pn * 8][0]);
    }

    // O normalized by the row sums, to the output with lse. Two ways out:
    //  - from registers, a 4-byte store per pair of columns (the lockstep kernel; rows of a packed sequence's last
    //    tile, where a box would run into the next sequence; a persistent tile without key blocks when O is staged
    //    in Q's tile, which the producer may be refilling then);
    //  - p.o_tma (warp-specialized kernels but SPLIT): each warp writes its 16 rows into its rows of a staging tile
    //    (the 128-byte swizzle of the TMA boxes) and its lane 0 stores them by TMA, a box per 64-column panel. Rows
    //    past a padded sequence's end fall outside the map. The staging tile is the persistent kernel's own where it
    //    fits (O_TILE), else Q's (this warpgroup's last S = Q K^T has completed), free again once the copies have
    //    read it.
    // In the persistent kernel every consumer thread arrives on q_empty once the tile's Q may be overwritten.
    // q_loaded: the tile had key blocks, so its Q was loaded (else Q's tile may be the next tile's).
    __device__ __forceinline__ void epilogue(bool q_loaded) {
        float lse[1][2];
        softmax.finalize(acc_o, p.scale_log2, lse);
        const int wg_row0 = row0 + wg * 64;
        const bool arrive_q = PERSISTENT && q_loaded && !Q_EARLY;  // (Q_EARLY: handed back by s_done)
        const bool staged = WS && !SPLIT && p.o_tma && (q_loaded || !PERSISTENT || O_TILE) &&
                            (p.cu_seqlens_q == nullptr || wg_row0 + 64 <= seqlen_q);
        const bool q_free_now = arrive_q && (O_TILE || !staged);  // else after the copies have read Q's tile
        if (q_free_now) sm90::mbar_arrive(q_empty_bar());
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wg_row0 + warp * 16 + lane / 4 + 8 * hh;
            if (p.lse != nullptr && lane % 4 == 0 && r < seqlen_q)
                p.lse[SeqInfo::offset(q_begin, p.lse_batch_stride, 1, r) + (i64)h * p.lse_head_stride] = lse[0][hh];
        }
        if (staged) {
            store_o_staged(wg_row0);
            if (arrive_q && !q_free_now) sm90::mbar_arrive(q_empty_bar());
            return;
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wg_row0 + warp * 16 + lane / 4 + 8 * hh;
            if (r >= seqlen_q) continue;
            u16* o_row = p.o + SeqInfo::offset(q_begin, p.o_batch_stride, p.o_row_stride, r) + (i64)h * p.o_head_stride;
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    *reinterpret_cast<u32*>(o_row + pn * 64 + 8 * j + 2 * (lane % 4)) =
                        pack2<T>(acc_o[0][pn * 8 + j][2 * hh], acc_o[0][pn * 8 + j][2 * hh + 1]);
        }
    }

    // The thread of each consumer warp that issues its O copies (store_o_staged).
    __device__ __forceinline__ bool o_issuer() const { return lane == 0; }

    // This warp's 16 rows of O into its rows of the staging tile, then out by TMA (see epilogue), a box of 16 rows
    // per 64-column panel issued by the warp's lane 0: no barrier across the warpgroup, whose warps reach their
    // epilogue at different times. Row r of a panel holds its 16-byte chunk c at chunk c ^ (r % 8) (the 128-byte
    // swizzle; a warp's rows start at a multiple of 8 rows, 1024 bytes): a store's 32 lanes hit 32 banks. With
    // O_TILE the issuing lane waits for its copies to read the tile only before the next tile's rows go in (and
    // before the kernel ends, run_persistent), so the reads overlap the next tile's work.
    __device__ __forceinline__ void store_o_staged(int wg_row0) {
        const u32 rows = base + (O_TILE ? OFF_O : 0) + (wg * 64 + warp * 16) * 128;  // this warp's rows of panel 0
        if (O_TILE) {
            if (o_issuer()) sm90::bulk_wait_read<0>();
            __syncwarp();
        }
        // rows r and r + 8 of this thread: r % 8 = lane / 4 picks the chunk swizzle
        const u32 row = rows + (lane / 4) * 128 + 4 * (lane % 4), swz = (lane / 4) * 16;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    st_shared(row + hh * 1024 + pn * Q_PANEL + ((j * 16) ^ swz),
                              pack2<T>(acc_o[0][pn * 8 + j][2 * hh], acc_o[0][pn * 8 + j][2 * hh + 1]));
        sm90::fence_proxy_async();
        __syncwarp();  // the warp's rows are written
        if (o_issuer()) {
            const int row0_w = wg_row0 + warp * 16;
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn) {
                const u32 src = rows + pn * Q_PANEL;
                if (p.cu_seqlens_q != nullptr) sm90::tma_store_3d(&p.o_map, pn * 64, h, q_begin + row0_w, src);
                else sm90::tma_store_4d(&p.o_map, pn * 64, h, row0_w, b, src);
            }
            sm90::bulk_commit();
            if (!O_TILE) sm90::bulk_wait_read<0>();
        }
    }

    // Query block m_block of head `head` in sequence `batch` as this thread's tile: its rows, sequence, mask, score
    // mod and key-block range. False when a packed sequence shorter than the longest has no rows there.
    __device__ __forceinline__ bool begin_tile(int m_block, int head, int batch, BlockRange& range) {
        h = head;
        b = batch;
        h_kv = h / p.heads_per_kv;
        row0 = m_block * BM;
        const SeqInfo seq(p, b);
        if (row0 >= seq.seqlen_q) return false;
        q_begin = seq.q_begin;
        k_begin = seq.k_begin;
        seqlen_q = seq.seqlen_q;
        mask = Mask<BAND>{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
        if (SCORE_MOD)
            mod = ScoreMod{p.mod_scale, p.softcap,
                           p.alibi != nullptr ? p.alibi[(i64)b * p.alibi_batch_stride + h] : 0.f,
                           seq.seqlen_k - seq.seqlen_q};
        range = block_range<BM, BN, BAND>(mask, row0);
        return true;
    }

    __device__ __forceinline__ void zero_o() {
#pragma unroll
        for (int dt = 0; dt < PANELS * 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    }
    __device__ __forceinline__ void reset_accumulators() {
        zero_o();
        softmax.reset();
    }

    __device__ __forceinline__ void init_barriers() {
        if (tid == 0) {
            for (int i = 0; i < 2 * STAGES; ++i) {
                sm90::mbar_init(full_bar(i % STAGES, i / STAGES), 1);
                sm90::mbar_init(empty_bar(i % STAGES, i / STAGES), THREADS - CONSUMER0);
            }
            for (qb = 0; qb < Q_BUFS; ++qb) {
                sm90::mbar_init(q_full_bar(), 1);
                if (PERSISTENT) sm90::mbar_init(q_empty_bar(), THREADS - CONSUMER0);
            }
            qb = 0;
            for (int i = 0; i < TILE_SLOTS; ++i) {
                sm90::mbar_init(tile_full_bar(i), 1);
                sm90::mbar_init(tile_empty_bar(i), THREADS - CONSUMER0);
            }
            sm90::mbar_fence_init();
        }
        __syncthreads();  // the last CTA-wide barrier of the warp-specialized kernel
    }

    // The producer thread: the tile's key blocks into the ring from position `it` (each slot once the consumers have
    // emptied it), and Q. `tile`: how many tiles this CTA loaded before; the persistent kernel issues Q into Q tile
    // tile % Q_BUFS after the first key block, once the consumers are done with the tile that used it last (with one
    // Q tile the previous one: Q lands during their epilogue; with Q_BUFS, the one Q_BUFS tiles back).
    __device__ __forceinline__ void produce(const BlockRange& range, int count, int it, int tile) {
        if (!PERSISTENT) issue_q();
        for (int t = 0; t < count; ++t) {
            const int i = it + t, slot = slot_of(i), n = range.n_max - 1 - t;
            if (i >= STAGES) sm90::mbar_wait(empty_bar(slot, 0), pass_of(i) ^ 1);
            issue_half(n, slot, 0);
            if (PERSISTENT && t == 0) {
                qb = tile % Q_BUFS;
                if (tile >= Q_BUFS) sm90::mbar_wait(q_empty_bar(), (tile / Q_BUFS - 1) & 1);
                issue_q();
            }
            if (i >= STAGES) sm90::mbar_wait(empty_bar(slot, 1), pass_of(i) ^ 1);
            issue_half(n, slot, 1);
        }
    }

    // The role as a value the compiler can see is warp-uniform (a shuffle from lane 0): a branch on tid alone looks
    // divergent to ptxas, which then serializes every wgmma behind it (C7520).
    __device__ __forceinline__ bool is_producer() const { return __shfl_sync(0xffffffff, tid / 128, 0) == 0; }

    __device__ __forceinline__ void start(char* smem) {
        tid = threadIdx.x;
        // consumers 0 .. WGS - 1 (producer threads never use it)
        wg = sm90::warp_uniform((tid - CONSUMER0) / 128);  // (uniform() would skip it in the OVERLAP kernel)
        warp = UNIFORM_TILES ? sm90::warp_uniform((tid / 32) % 4) : (tid / 32) % 4;
        lane = tid % 32;
        base = (smem_u32(smem) + 1023) & ~1023u;
    }

    // The key blocks of a tile. Rows that see no key can have n_max < n_min (a causal mask's rows above a bottom-right
    // diagonal): none. Producer and consumers must agree, or the producer's ring position runs ahead of theirs.
    __device__ __forceinline__ static int blocks(const BlockRange& range) { return max(range.n_max - range.n_min, 0); }

    // One tile per CTA: grid (query blocks, heads, batch).
    __device__ __forceinline__ void run(char* smem) {
        start(smem);
        BlockRange range;
        bool has_rows = begin_tile(BAND ? gridDim.x - 1 - blockIdx.x : blockIdx.x, blockIdx.y, blockIdx.z, range);
        if (WS) has_rows = uniform(has_rows);  // (in the lockstep kernel the shuffle made ptxas serialize wgmma: C7520)
        if (!has_rows) return;
        reset_accumulators();
        const int count = uniform(blocks(range));  // walked from n_max - 1 down
        init_barriers();
        if constexpr (WS) {
            if (is_producer()) {  // producer warpgroup: one thread moves the data
                sm90::regs_dealloc<24>();
                if (tid == 0 && count > 0) produce(range, count, 0, 0);
                return;
            }
            sm90::regs_alloc<CONSUMER_REGS>();
            if (count > 0) {
                sm90::mbar_wait(q_full_bar(), 0);
                consume_pipelined(range, count, 0);
            }
        } else if (count > 0) {
            if (tid == 0) {
                issue_q();
                for (int i = 0; i < 2 && i < count; ++i) issue_kv(range.n_max - 1 - i, i);
            }
            sm90::mbar_wait(q_full_bar(), 0);
            for (int t = 0; t < count; ++t) {
                const int n = range.n_max - 1 - t;
                const bool masked = n > range.full_hi || n < range.full_lo;
                if (t == 0) {
                    if (masked) step<true, true>(n, t);
                    else step<false, true>(n, t);
                } else {
                    if (masked) step<true, false>(n, t);
                    else step<false, false>(n, t);
                }
                __syncthreads();  // both warpgroups are done with this slot
                if (tid == 0 && t + 2 < count) issue_kv(range.n_max - 1 - t - 2, t % 2);
            }
        }
        epilogue(count > 0);
    }

    // Persistent (warp-specialized): gridDim.x CTAs (one per SM) walk the tiles in rounds of gridDim.x. The tiles are
    // ordered as the grid of the other kernels: query blocks fastest (longest first under a band), then heads, then
    // sequences, so the tiles running at once are the query blocks of a few heads, which share those heads' K and V
    // in L2 (one head per CTA read K/V from DRAM once per query block: 284 against 345 TFLOP/s at d 64, 512 keys;
    // query-block-major under a band read it once per query block, too). CTA x takes tile x of each round; with a
    // band every other round backwards (gridDim.x - 1 - x): the tiles of a head differ in length, and a plain stride
    // gave a CTA the same query block of every head when gridDim.x is a multiple of the query blocks (all the longest
    // to some CTAs: d 64 causal at 512 keys 199 -> 142 TFLOP/s), where the snake pairs a long tile with a short one.
    // The ring and Q's barrier carry on from tile to tile, so the producer loads the next tile while the consumers
    // finish the last one. Producer and consumers each run their own copy of the walk: code both roles share would
    // keep ptxas from honouring setmaxnreg (C7507).
    __device__ __forceinline__ int walk(int round) const {
        return round * gridDim.x + (BAND && (round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    }

    // Tile idx of the walk: its query block level m (0: the first; under a band the last query block, the longest
    // tile) and its (sequence, head) pair. Without a band each pair's query blocks in turn. Under a band, chunks of
    // p.chunk pairs, each walked level by level (every pair's longest tile, then every pair's next one ...): with
    // p.chunk a divisor of the CTA count each round takes tiles of one length, where the pair-by-pair order left the
    // busiest CTA a whole tile above the mean (plan.sm90_walk_chunk).
    __device__ __forceinline__ bool tile_of(int idx, int m_blocks, BlockRange& range) {
        int m, pair;
        if constexpr (BAND) {
            const int chunk = p.by_chunk_tiles.div(idx), within = idx - chunk * p.chunk * m_blocks;
            const int first = chunk * p.chunk;
            const bool last = first + p.chunk > p.nheads * p.batch;  // the last chunk may hold fewer pairs
            m = (last ? p.by_chunk_last : p.by_chunk).div(within);
            pair = first + within - m * (last ? p.chunk_last : p.chunk);
        } else {
            pair = p.by_m_blocks.div(idx);
            m = idx - pair * m_blocks;
            if (SPLIT && (u32)(p.seqlen_q % BM - 1) < 64u) {
                // Where the last query block is a split tile: the pair's query blocks rotated by the round of its
                // first tile. Where m_blocks divides the CTA count, CTA x would otherwise take query block
                // x % m_blocks in every round (all the split tiles to a few CTAs: 22 of 132 at 1k keys); rotated,
                // each CTA takes every query block in turn.
                const int rot = (int)((u32)(pair * m_blocks) / gridDim.x);
                m += rot - p.by_m_blocks.div(rot) * m_blocks;
                if (m >= m_blocks) m -= m_blocks;
            }
        }
        const int batch = p.by_heads.div(pair);
        return begin_tile(BAND ? m_blocks - 1 - m : m, pair - batch * p.nheads, batch, range);
    }

    __device__ __forceinline__ TileRows rows() const { return {row0, b, h, q_begin, seqlen_q, qb}; }
    __device__ __forceinline__ void set_rows(const TileRows& t) {
        row0 = t.row0;
        b = t.b;
        h = t.h;
        q_begin = t.q_begin;
        seqlen_q = t.seqlen_q;
        qb = t.qb;
    }

    // UNIFORM_TILES: `have` and the tile's block range made warp-uniform.
    __device__ __forceinline__ static bool uniform_tile(bool have, BlockRange& range) {
        if constexpr (!UNIFORM_TILES) return have;
        range.n_min = sm90::warp_uniform(range.n_min);
        range.n_max = sm90::warp_uniform(range.n_max);
        range.full_lo = sm90::warp_uniform(range.full_lo);
        range.full_hi = sm90::warp_uniform(range.full_hi);
        return sm90::warp_uniform(have);
    }

    // The tile ring's length as a divisor (1 in the kernels without one, which never call what follows).
    static constexpr int RING = TILE_SLOTS > 0 ? TILE_SLOTS : 1;

    // HANDED_TILES, the producer: the handed-th tile with rows of its walk (this thread's tile, begin_tile's state),
    // or with have false the walk's end, into the tile ring once every consumer has read what that entry held last.
    // Entry: have, row0, b, h | q_begin, k_begin, seqlen_q, seqlen_k | the block range | the ALiBi slope (SCORE_MOD).
    __device__ __forceinline__ void hand_tile(int handed, bool have, const BlockRange& range) {
        const int slot = handed % RING;
        if (handed >= RING) sm90::mbar_wait(tile_empty_bar(slot), (handed / RING - 1) & 1);
        const u32 entry = base + OFF_TILES + slot * TILE_BYTES;
        st_shared_i4(entry, have, row0, b, h);
        if (have) {
            st_shared_i4(entry + 16, q_begin, k_begin, seqlen_q, mask.seqlen_k);
            st_shared_i4(entry + 32, range.n_min, range.n_max, range.full_lo, range.full_hi);
            if (SCORE_MOD) st_shared(entry + 48, __float_as_uint(mod.slope));
        }
        sm90::mbar_arrive(tile_full_bar(slot));  // (a release: the entry's stores are seen by whoever waits on it)
    }

    // HANDED_TILES, the consumers: the taken-th entry of the tile ring as this thread's tile (begin_tile's state);
    // false at the walk's end.
    __device__ __forceinline__ bool take_tile(int taken, BlockRange& range) {
        const int slot = taken % RING;
        sm90::mbar_wait(tile_full_bar(slot), (taken / RING) & 1);
        const u32 entry = base + OFF_TILES + slot * TILE_BYTES;
        int head[4], seq[4], blocks[4];
        ld_shared_i4(head, entry);
        ld_shared_i4(seq, entry + 16);
        ld_shared_i4(blocks, entry + 32);
        const float slope = SCORE_MOD ? __uint_as_float(ld_shared_u32(entry + 48)) : 0.f;
        sm90::mbar_arrive(tile_empty_bar(slot));  // (a release: the loads above are done with the entry)
        row0 = head[1];
        b = head[2];
        h = head[3];
        q_begin = seq[0];
        k_begin = seq[1];
        seqlen_q = seq[2];
        mask = Mask<BAND>{seq[3], seq[3] - seq[2], p.window_left, p.window_right};
        if (SCORE_MOD) mod = ScoreMod{p.mod_scale, p.softcap, slope, seq[3] - seq[2]};
        range = {blocks[0], blocks[1], blocks[2], blocks[3]};
        return head[0] != 0;
    }

    // The tile that was current (rows `done`, row statistics `done_softmax`, O in acc_o) out through the epilogue
    // while begin_tile's state is the next tile's.
    __device__ __forceinline__ void epilogue_of(const TileRows& done, const OnlineSoftmax<1>& done_softmax) {
        const TileRows next = rows();
        const OnlineSoftmax<1> next_softmax = softmax;
        set_rows(done);
        softmax = done_softmax;
        epilogue(true);
        set_rows(next);
        softmax = next_softmax;
    }

    // The persistent consumers with OVERLAP: when the next tile has key blocks, its first S = Q K^T is issued beside
    // this tile's last O += P V (its Q is in the other Q tile), and its softmax runs while that P V computes; then
    // this tile's epilogue, and the next tile goes on from its second block. Without it every tile begins with an S
    // and a softmax that nothing overlaps and ends with a P V that nothing overlaps.
    // PINGPONG: the joined issue is one turn of each warpgroup, in place of the last P V's turn and the next tile's
    // first S's; each side gives up one wait and one hand-over, so the turns stay balanced. A tile that starts on
    // its own (the first, or one after a tile that ended on its own) starts as consume_pipelined does.
    __device__ __forceinline__ void consume_overlapped() {
        float s[1][BN / 8][4], alpha[1][2];
        u32 pa[BN / 16][4];
        int it = 0, loaded = 0, taken = 0;
        bool started = false;  // the current tile's first block is done (by the tile before's end)
        BlockRange range;
        bool have = uniform_tile(take_tile(taken++, range), range);
        while (have) {
            const int count = blocks(range);
            if (count == 0) {  // rows that see no key: O = 0, lse = -inf
                reset_accumulators();
                epilogue(false);
                have = uniform_tile(take_tile(taken++, range), range);
                continue;
            }
            if (!started) {
                wait_q(loaded);
                reset_accumulators();
                if (PINGPONG && wg == 1) sm90::named_arrive(1, 256);  // warpgroup 0 goes first
                first_block(range, count, it, s, alpha, pa);
            }
            middle_blocks(range, count, it, s, alpha, pa);
            const int last = it + count - 1;
            it += count;
            ++loaded;
            const TileRows done = rows();
            BlockRange next;
            have = uniform_tile(take_tile(taken++, next), next);
            const int next_count = have ? blocks(next) : 0;
            started = next_count > 0;
            if (started) {
                wait_q(loaded);
                sm90::mbar_wait(full_bar(slot_of(it), 0), pass_of(it));
                sm90::mbar_wait(full_bar(slot_of(last), 1), pass_of(last));
                my_turn();
                sm90::wgmma_fence();
                issue_s(s, slot_of(it));
                issue_pv(pa, slot_of(last));
                your_turn();
                sm90::wgmma_wait<1>();  // the next tile's S is in
                sm90::mbar_arrive(empty_bar(slot_of(it), 0));
                s_done(0, next_count);
                const OnlineSoftmax<1> done_softmax = softmax;
                softmax.reset();
                first_probabilities(next, s, alpha);
                sm90::wgmma_wait<0>();  // and this tile's last P V
                sm90::mbar_arrive(empty_bar(slot_of(last), 1));
                epilogue_of(done, done_softmax);
                zero_o();
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) p_fragment(s, kk, pa[kk]);
            } else {
                last_pv(pa, last);
                epilogue_of(done, softmax);
            }
            range = next;
        }
    }

    __device__ __forceinline__ void run_persistent(char* smem) {
        start(smem);
        init_barriers();
        const int m_blocks = (p.seqlen_q + BM - 1) / BM, tiles = m_blocks * p.nheads * p.batch;
        int it = 0, loaded = 0;  // ring position, tiles with key blocks so far
        if (is_producer()) {
            sm90::regs_dealloc<24>();
            if (tid != 0) return;
            int handed = 0;
            for (int round = 0, idx; (idx = walk(round)) < tiles; ++round) {
                BlockRange range;
                if (!tile_of(idx, m_blocks, range)) continue;
                if (HANDED_TILES) hand_tile(handed++, true, range);
                const int count = blocks(range);
                if (count == 0) continue;
                produce(range, count, it, loaded);
                it += count;
                ++loaded;
            }
            if (HANDED_TILES) hand_tile(handed, false, BlockRange{});
            return;
        }
        sm90::regs_alloc<CONSUMER_REGS>();
        if constexpr (OVERLAP) {
            consume_overlapped();
        } else {
            for (int round = 0, idx; (idx = walk(round)) < tiles; ++round) {
                BlockRange range;
                if (!uniform(tile_of(idx, m_blocks, range))) continue;
                const int count = uniform(blocks(range));
                const bool split = split_tile(count);
                if (split) row0 -= wg * 64;  // every warpgroup takes the tile's first 64 rows (row0 + wg * 64)
                reset_accumulators();
                if (count > 0) {
                    wait_q(loaded);
                    if (split) consume_split(range, count, it);
                    else consume_pipelined(range, count, it);
                    it += count;
                    ++loaded;
                }
                if (split && wg > 0) {
                    split_leave();
                    continue;
                }
                if (split) split_merge();
                epilogue(count > 0);
            }
        }
        if (O_TILE && o_issuer()) sm90::bulk_wait_read<0>();  // the last copies out of the staging tile
    }
};

template <class T, int D, int BN, int STAGES, int WGS, bool BAND, bool WS, bool SCORE_MOD, bool PINGPONG,
          bool PERSISTENT, bool SPLIT_TILES>
__global__ void __launch_bounds__(128 * (WGS + (WS ? 1 : 0)), 1)
    fwd_sm90_kernel(const __grid_constant__ FwdSm90Params p) {
    extern __shared__ __align__(1024) char smem[];
    FwdSm90<T, D, BN, BAND, STAGES, WGS, WS, SCORE_MOD, PINGPONG, PERSISTENT, SPLIT_TILES> block(p);
    if constexpr (PERSISTENT) block.run_persistent(smem);
    else block.run(smem);
}

}  // namespace cuflash

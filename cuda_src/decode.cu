// Decode: a few new query rows attend to a KV cache (contiguous or paged), with the keys split across CTAs.
//
// Grid (row tiles x splits, KV heads, batch). GQA packing: the g = nheads / nheads_k query heads that share a KV
// head run in one CTA; packed row r = i * g + j is query i of head h_kv * g + j, so each K/V byte is read from
// memory once per row tile. Decode is bound by that read, and everything here serves it:
//  - up to 16 packed rows (the usual decode): the four warps share one 16-row mma tile and split every KV block's
//    keys between them (KEY_WARPS = 4), each with its own online softmax, merged once through shared memory at the
//    end. Longer tiles (speculative decoding) give each warp 16 rows of its own (ROW_WARPS = 4);
//  - K/V blocks stream through a STAGES-deep cp.async ring with one barrier per block;
//  - with num_splits > 1 a CTA covers 1/num_splits of the visible KV blocks and writes fp32 partial O and lse,
//    which decode_combine (decode_aux.cu) merges, or, in the TMA kernel given split counters, the row tile's last
//    CTA to finish.
// Blocks run from the last to the first, so the masked tail block (cache length, causal diagonal) comes first.
//
// decode_tma_kernel (sm_90a; DecodeBlock with TMA = true) is the same computation with K/V blocks brought in by
// TMA: one thread issues each block's copies (two 64-column panels of K and of V, 128-byte swizzle: the SmemTile
// layout) completing on the slot's mbarrier, so a deep ring costs no issue slots and no registers. Rows past the
// cache length inside the capacity are not zero-filled by TMA: the tail block's V rows there are zeroed in shared
// memory before use (K's are masked). Contiguous caches, and paged ones whose page size is a multiple of BN or
// BN / PAGE_BOXES (a box per page and panel). An e4m3 row of d bytes is one box as wide: 128 bytes at d = 128 (the
// 128-byte swizzle), 64 at d = 64 (NarrowTile's 64-byte swizzle).
//
// An e4m3 cache (FP8 = true; either kernel): K/V blocks land as bytes, a 16-byte chunk holding 16 columns, and
// are converted to fp16 in registers as ldmatrix hands them over (e4m3.cuh), so the ring holds half the bytes and no
// extra pass over shared memory runs. Both products are fp16 mma. ldmatrix on byte rows gives a thread four
// consecutive columns where a 16-bit fragment has two pairs 8 apart; the math follows that order instead of moving
// bytes:
//  - S = Q K^T: the k index of the mma is a permutation of the head dim (pairs (2c, 2c + 1) and (2c + 8, 2c + 9) of
//    a 16-column chunk are columns 4c..4c + 3), and Q's fragments are read from shared memory in the same order. A
//    bf16 Q becomes fp16 times a power of two that brings the warp's largest |q| to [2^13, 2^14) (exact in fp16's
//    range, no overflow).
//  - O = P V: P is packed as fp16, and each 16-column chunk of O is two mma tiles, its even and its odd columns,
//    which the epilogue puts back in order.
// Q's power of two and the descales fold into one factor on S and one on O.
#include "params.cuh"
#include "kvcache.cuh"
#include "tile.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "sm90.cuh"
#include "e4m3.cuh"

namespace cuflash {

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <class T_, int D, int ROW_WARPS_, int BN_, int STAGES_, bool FP8_ = false>
struct DecodeTraits {
    using T = T_;
    static constexpr bool FP8 = FP8_;  // e4m3 cache
    static constexpr int HEADDIM = D, DP = (D + 63) / 64 * 64;
    static constexpr int WARPS = 4, THREADS = WARPS * 32;
    static constexpr int ROW_WARPS = ROW_WARPS_, KEY_WARPS = WARPS / ROW_WARPS;
    static constexpr int BM = 16 * ROW_WARPS, BN = BN_, STAGES = STAGES_;
    static constexpr int WARP_KEYS = BN / KEY_WARPS;  // keys of each block that one warp handles
    static constexpr int NT = WARP_KEYS / 8, DT = D / 8;
    // A K/V row in 16-bit columns: D of them, or D / 2 holding an e4m3 row's D bytes; e4m3 rows of 64 bytes
    // (D = 64) in a dense NarrowTile rather than half of each 128-byte row.
    static constexpr int KV_COLS = FP8 ? D / 2 : D, KV_DP = (KV_COLS + 63) / 64 * 64;
    static constexpr bool NARROW = KV_COLS == 32;
    using QTile = SmemTile<BM, DP>;
    using KVTile = typename Pick<NARROW, NarrowTile<BN>, SmemTile<BN, KV_DP>>::type;
    using KVCopy = typename Pick<NARROW, NarrowTileCopy<BN, THREADS>, TileCopy<BN, KV_COLS, KV_DP, THREADS>>::type;
    using KVAddr = typename Pick<NARROW, NarrowLdmatrixAddr, LdmatrixAddr<KVTile>>::type;
    static constexpr int STAGE_BYTES = 2 * KVTile::BYTES;  // K, then V
    // Q's fragments stay in registers (D / 4 of them) unless a 16-row warp tile at d > 192 cannot afford them
    // beside its O accumulator and scores, nor an e4m3 kernel at d > 192 beside its converted fragments; then they
    // are re-read from shared memory for every block.
    static constexpr bool Q_IN_REGS = !((ROW_WARPS > 1 || FP8) && D > 192);
    // Merge buffer (reuses the tiles' space): per warp slot and row, O (padded rows), max and sum.
    static constexpr int O_STRIDE = D + 4;
    static constexpr int MERGE_ROWS = KEY_WARPS * BM;
    static constexpr int MERGE_BYTES = MERGE_ROWS * (O_STRIDE + 2) * 4;
    static constexpr int SMEM_BYTES = cmax(QTile::BYTES + STAGES * STAGE_BYTES, MERGE_BYTES);

    static_assert(WARP_KEYS % 16 == 0 && D % 16 == 0, "ldmatrix.x4 loads 16 x 16 pieces");
    static_assert(STAGES >= 2, "the ring needs a block in flight while one is computed");
    static_assert(!FP8 || D % 32 == 0, "an e4m3 ldmatrix.x4 covers 32 columns");
};

template <class Traits, bool SCORE_MOD, bool TMA = false, int PAGE_BOXES = 1>
struct DecodeBlock {
    using T = typename Traits::T;
    static constexpr bool FP8 = Traits::FP8;
    using E = typename Pick<FP8, u8, u16>::type;          // the cache's element
    using MT = typename Pick<FP8, half_t, T>::type;       // the mma operands' type
    static constexpr int D = Traits::HEADDIM, DP = Traits::DP, BM = Traits::BM, BN = Traits::BN;
    static constexpr int THREADS = Traits::THREADS, NT = Traits::NT, DT = Traits::DT, STAGES = Traits::STAGES;
    using QTile = typename Traits::QTile;
    using KVTile = typename Traits::KVTile;
    using QCopy = TileCopy<BM, D, DP, THREADS>;
    using KVCopy = typename Traits::KVCopy;
    // A K/V row in shared memory: KV_PANELS panels (TMA boxes) of PANEL_COLS columns of the cache's elements, and
    // KV_CHUNKS 16-byte chunks in all.
    static constexpr int KV_PANELS = Traits::NARROW ? 1 : Traits::KV_DP / 64;
    static constexpr int PANEL_COLS = Traits::NARROW ? 64 : FP8 ? 128 : 64;
    static constexpr int PANEL_BYTES = KVTile::BYTES / KV_PANELS;
    static constexpr int KV_CHUNKS = Traits::NARROW ? 4 : Traits::KV_DP / 8;
    // TMA: a panel's bytes in one box (of PAGE_BOXES per panel)
    static constexpr int BOX_BYTES = PANEL_BYTES / PAGE_BOXES;

    const DecodeParams& p;
    int tid, lane, row_warp, key_warp;
    int b, h_kv, group, rows, row0;  // group: query heads per KV head; rows: packed rows in all; row0: the tile's
    int len;                         // keys this batch row sees
    int n_begin, n_end;              // this split's KV blocks
    u32 sQ, sKV;
    LdmatrixAddr<QTile> q_addr;
    typename Traits::KVAddr k_addr, v_addr;  // into ring slot 0, as if K and V both started there
    CacheView<E> cache;
    float k_factor = 1.f, v_factor = 1.f;  // e4m3: the factors on S (k_descale over Q's scale) and on O (v_descale)
    float q_scale = 1.f;                   // e4m3, bf16 q: Q's power of two (set_q_scale)
    Mask<true> mask;
    ScoreMod mod;
    int query[2];    // query index of this thread's two rows
    float slope[2];  // their ALiBi slopes
    OnlineSoftmax<1> softmax;
    float acc_o[1][DT][4];
    u32 q_frag[Traits::Q_IN_REGS ? D / 16 : 1][4];
    // TMA only: the maps of the K and V caches (4-D: head dim, KV heads, rows, cache rows or pages), the ring's
    // mbarriers (one per slot, after the ring), and the cache row of this batch row (contiguous caches).
    const sm90::TmaMap* k_map = nullptr;
    const sm90::TmaMap* v_map = nullptr;
    u32 bars = 0;
    int cache_row = 0;

    __device__ __forceinline__ DecodeBlock(const DecodeParams& params, int b_, int h_kv_)
        : p(params), b(b_), h_kv(h_kv_), q_addr(0, 0, 0), k_addr(0, 0, 0), v_addr(0, 0, 0),
          cache(params, b_, h_kv_) {}

    __device__ __forceinline__ int row_tiles() const { return (p.seqlen_q * p.heads_per_kv + BM - 1) / BM; }

    // The CTA's (split, row tile) computed anew from an opaque copy of its block index: the TMA kernel's epilogue
    // takes them so, so that they are not held in registers across the key-block loop (held there, they spill in
    // the bf16 d 64 kernel over an e4m3 cache in pages of 32 rows with a score mod).
    __device__ __forceinline__ int2 placement_again() const {
        int x = blockIdx.x;
        asm volatile("" : "+r"(x));
        return make_int2(x / row_tiles(), x % row_tiles());
    }

    // Packed row -> address of its query row (nullptr past the last row: zero-filled); with rotary embedding, the
    // rotated copy decode_append wrote.
    __device__ __forceinline__ const u16* q_row(int r) const {
        const int pr = row0 + r;
        if (pr >= rows) return nullptr;
        const int i = pr / group, head = h_kv * group + pr % group;
        if (p.q_rot != nullptr) return p.q_rot + (((i64)b * p.seqlen_q + i) * p.nheads + head) * p.headdim;
        return p.q + (i64)b * p.q_batch_stride + (i64)i * p.q_row_stride + (i64)head * p.q_head_stride;
    }

    // Issues K and V of block n into ring slot `stage` (positions past the cache length, or in a page the pool does
    // not have, are zero-filled).
    __device__ __forceinline__ void load_kv(int stage, int n) {
        const u32 dst = sKV + stage * Traits::STAGE_BYTES;
        const int pos0 = n * BN, cols = FP8 ? p.headdim / 2 : p.headdim;
        KVCopy::load_rows_async(dst, [&](int r) -> const u16* {
            i64 k_off, v_off;
            return pos0 + r < len && cache.locate(pos0 + r, k_off, v_off)
                       ? reinterpret_cast<const u16*>(cache.k + k_off) : nullptr;
        }, cols, p.k_cache, tid);
        KVCopy::load_rows_async(dst + KVTile::BYTES, [&](int r) -> const u16* {
            i64 k_off, v_off;
            return pos0 + r < len && cache.locate(pos0 + r, k_off, v_off)
                       ? reinterpret_cast<const u16*>(cache.v + v_off) : nullptr;
        }, cols, p.v_cache, tid);
    }

    // TMA: K and V of block n into ring slot `stage`, completing on the slot's mbarrier, issued by the threads that
    // issues_box() names. Each panel of a block is PAGE_BOXES boxes of BN / PAGE_BOXES rows: one (the block lies
    // inside one page, or the cache is contiguous), or one per page where pages are smaller than the block; each box
    // starts on whole swizzle atoms of the panel. A box in a page the pool does not have, or past the row's length,
    // reads page `pool` (one past the last), which TMA fills with zeros.
    // Boxes of 2 KB or less (pages of 16 rows, and e4m3 pages of 32 at d 64) are looked up and issued by lane 0 of
    // warp i for box i, side by side, instead of all by thread 0: e4m3 d 128 in pages of 16 ran up to 1.39x faster,
    // bf16 1-4% (docs/perf-notes.md, "decode in pages of 16 and 32 rows"), and 4 KB boxes 3.7% slower. Warp 0's
    // thread sets the slot's byte count; a box may complete before it does, as the phase waits for that arrival.
    static constexpr bool BOX_WARPS = PAGE_BOXES > 1 && BOX_BYTES <= 2048;
    __device__ __forceinline__ bool issues_box() const {
        return BOX_WARPS ? tid % 32 == 0 && tid / 32 < PAGE_BOXES : tid == 0;
    }
    __device__ __forceinline__ void issue_kv_tma(int stage, int n) {
        static_assert(!BOX_WARPS || PAGE_BOXES <= THREADS / 32, "a warp per box");
        constexpr int BOXES = BOX_WARPS ? 1 : PAGE_BOXES;  // this thread's
        const int first = BOX_WARPS ? tid / 32 : 0;
        const u32 bar = bars + 8 * stage, dst = sKV + stage * Traits::STAGE_BYTES;
        int z[BOXES], w[BOXES];
#pragma unroll
        for (int j = 0; j < BOXES; ++j) {
            const int pos = n * BN + (first + j) * (BN / PAGE_BOXES);
            z[j] = pos, w[j] = cache_row;
            if (cache.pages != nullptr) {
                w[j] = PAGE_BOXES == 1 || pos < len ? cache.page_of(pos) : -1;  // block 0's first box: pos < len
                w[j] = w[j] < 0 ? cache.pool : w[j];
                z[j] = pos - pos / cache.page_size * cache.page_size;
            }
        }
        if (first == 0) sm90::mbar_arrive_expect_tx(bar, Traits::STAGE_BYTES);
        if (p.kv_evict_first) {
            const unsigned long long policy = sm90::l2_policy_evict_first();
#pragma unroll
            for (int j = 0; j < BOXES; ++j) {
#pragma unroll
                for (int pn = 0; pn < KV_PANELS; ++pn) {
                    const u32 k_dst = dst + pn * PANEL_BYTES + (first + j) * BOX_BYTES;
                    sm90::tma_load_4d(k_dst, k_map, pn * PANEL_COLS, h_kv, z[j], w[j], bar, policy);
                    sm90::tma_load_4d(k_dst + KVTile::BYTES, v_map, pn * PANEL_COLS, h_kv, z[j], w[j], bar, policy);
                }
            }
            return;
        }
#pragma unroll
        for (int j = 0; j < BOXES; ++j) {
#pragma unroll
            for (int pn = 0; pn < KV_PANELS; ++pn) {
                const u32 k_dst = dst + pn * PANEL_BYTES + (first + j) * BOX_BYTES;
                sm90::tma_load_4d(k_dst, k_map, pn * PANEL_COLS, h_kv, z[j], w[j], bar);
                sm90::tma_load_4d(k_dst + KVTile::BYTES, v_map, pn * PANEL_COLS, h_kv, z[j], w[j], bar);
            }
        }
    }

    // TMA: V rows [valid, BN) of ring slot `stage` set to zero (cache rows past the length hold anything, NaN
    // included, and P = 0 times NaN is NaN); fenced, so that the next TMA into this slot is ordered after them.
    __device__ __forceinline__ void zero_v_tail(int stage, int valid) {
        const u32 v_base = sKV + stage * Traits::STAGE_BYTES + KVTile::BYTES;
        for (int idx = tid; idx < (BN - valid) * KV_CHUNKS; idx += THREADS)
            st_shared_zero16(v_base + KVTile::offset(valid + idx / KV_CHUNKS, idx % KV_CHUNKS));
        sm90::fence_proxy_async();
    }

    // e4m3: Q's columns 16 ks + 4c .. 4c + 3 (c = lane % 4) of the thread's two rows, the order K's converted
    // fragments have, as one 8-byte load per row: {qa[0], qa[2]} of row lane / 4, {qa[1], qa[3]} of row lane / 4 + 8.
    __device__ __forceinline__ void load_q_e4m3_order(u32 (&qa)[4], int ks) const {
        const int row = row_warp * 16 + lane / 4, c = lane % 4;
        const u32 addr = sQ + QTile::offset(row, 2 * ks + c / 2) + (c % 2) * 8;  // row + 8: 8 swizzle rows on
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(qa[0]), "=r"(qa[2]) : "r"(addr));
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(qa[1]), "=r"(qa[3]) : "r"(addr + 8 * 128));
    }

    // Q's A fragment for head-dim chunk ks (16 columns); e4m3: in load_q_e4m3_order's order and in fp16 (q_scale).
    __device__ __forceinline__ void load_q(u32 (&qa)[4], int ks) const {
        if constexpr (FP8) {
            load_q_e4m3_order(qa, ks);
            if constexpr (T::is_bf16) {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    qa[e] = pack2<half_t>(__uint_as_float(qa[e] << 16) * q_scale,
                                          __uint_as_float(qa[e] & 0xffff0000u) * q_scale);
            }
        } else {
            ldmatrix_x4(qa, q_addr(row_warp, ks));
        }
    }

    // e4m3, bf16 q: q_scale, the power of two that brings the largest |q| of the warp's rows to [2^13, 2^14), and
    // its inverse into k_factor. Once, when Q has landed.
    __device__ __forceinline__ void set_q_scale() {
        float m = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 x[4];
            load_q_e4m3_order(x, ks);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                m = fmaxf(m, fmaxf(fabsf(__uint_as_float(x[e] << 16)), fabsf(__uint_as_float(x[e] & 0xffff0000u))));
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const int e = min(125, max(-125, 13 - ((int)(__float_as_uint(m) >> 23 & 0xff) - 127)));
        q_scale = __uint_as_float((u32)(127 + e) << 23);
        k_factor *= __uint_as_float((u32)(127 - e) << 23);
    }

    // S += Q K^T for this warp's keys of the block in ring slot offset k_slot, e4m3 K: each ldmatrix.x4 brings 16
    // keys x 32 columns, converted to fp16 for the B fragments of 4 mma (two 16-column chunks x two 8-key tiles).
    __device__ __forceinline__ void scores_e4m3(float (&s)[NT][4], float (&s_odd)[NT][4], u32 k_slot,
                                                bool two_chains) {
#pragma unroll
        for (int ks2 = 0; ks2 < D / 32; ++ks2) {
            u32 qa[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (Traits::Q_IN_REGS) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) qa[h][e] = q_frag[2 * ks2 + h][e];
                } else {
                    load_q(qa[h], 2 * ks2 + h);
                }
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 kb[4];  // (keys 0-7, chunk 0), (keys 0-7, chunk 1), (keys 8-15, chunk 0), (keys 8-15, chunk 1)
                ldmatrix_x4(kb, k_addr(key_warp * (NT / 2) + np, ks2) + k_slot);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 b0, b1;
                    e4m3x4_to_f16(kb[j], b0, b1);
                    float(&acc)[4] = two_chains && j % 2 ? s_odd[2 * np + j / 2] : s[2 * np + j / 2];
                    mma_16816<half_t>(acc, qa[j % 2], b0, b1);
                }
            }
        }
    }

    // O += P V for the warp's keys (A fragments pa of 16 keys, key piece kk), e4m3 V in ring slot offset v_slot:
    // each ldmatrix.x4.trans brings 16 keys x 32 columns; chunk q's even columns go to O tile 2q, its odd ones to
    // tile 2q + 1.
    __device__ __forceinline__ void pv_e4m3(const u32 (&pa)[4], int kk, u32 v_slot) {
#pragma unroll
        for (int dp2 = 0; dp2 < D / 32; ++dp2) {
            u32 vb[4];  // (keys 0-7, chunk 0), (keys 8-15, chunk 0), (keys 0-7, chunk 1), (keys 8-15, chunk 1)
            ldmatrix_x4_trans(vb, v_addr(key_warp * (NT / 2) + kk, dp2) + v_slot);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 even0, odd0, even1, odd1;
                e4m3x4_to_f16_interleaved(vb[2 * h], even0, odd0);
                e4m3x4_to_f16_interleaved(vb[2 * h + 1], even1, odd1);
                const int q = 2 * dp2 + h;
                mma_16816<half_t>(acc_o[0][2 * q], pa, even0, even1);
                mma_16816<half_t>(acc_o[0][2 * q + 1], pa, odd0, odd1);
            }
        }
    }

    // Iteration t handles block n = n_end - 1 - t from ring slot t % STAGES; block t + STAGES - 1 is issued.
    // One instantiation for every block: masked or not and first or not are run-time flags. A decode CTA often
    // sees only a few blocks, so every separately instantiated step would run from a cold instruction cache
    // (Nsight Compute at batch 1 x 8k: 45% of the warps' stall cycles waited on instruction fetch).
    __device__ __forceinline__ void step(int t, bool masked) {
        const int t_next = t + STAGES - 1;
        if constexpr (TMA) {
            if (t == 0) cp_async_wait<0>();  // Q (cp.async)
            sm90::mbar_wait(bars + 8 * (t % STAGES), (t / STAGES) & 1);
            const int valid = len - (n_end - 1 - t) * BN;
            if (valid < BN) zero_v_tail(t % STAGES, valid);
            __syncthreads();  // block t is in (its tail zeroed), and every warp is done with slot (t - 1) % STAGES
            if (issues_box() && n_end - 1 - t_next >= n_begin) issue_kv_tma(t_next % STAGES, n_end - 1 - t_next);
        } else {
            cp_async_wait<STAGES - 2>();
            __syncthreads();  // block t has landed, and every warp is done with slot (t - 1) % STAGES
            if (n_end - 1 - t_next >= n_begin) load_kv(t_next % STAGES, n_end - 1 - t_next);
            cp_async_commit();  // possibly empty: keeps one group per iteration
        }
        if constexpr (FP8 && T::is_bf16) {
            if (t == 0) set_q_scale();
        }
        if (t == 0 && Traits::Q_IN_REGS) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) load_q(q_frag[ks], ks);
        }
        const u32 k_slot = (t % STAGES) * Traits::STAGE_BYTES, v_slot = k_slot + KVTile::BYTES;

        // S = Q K^T over D / 16 k-steps. With few accumulator tiles (NT = 2 for a warp's 16 keys), one chain of
        // D / 16 dependent mma each would be bound by the mma latency: then even and odd k-steps go to two sets,
        // added at the end.
        constexpr bool TWO_CHAINS = NT <= 4;
        float s[1][NT][4], s_odd[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] = s_odd[nt][e] = 0.f;
        if constexpr (FP8) {
            scores_e4m3(s[0], s_odd, k_slot, TWO_CHAINS);
        } else {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                u32 qa[4];
                if (Traits::Q_IN_REGS) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) qa[e] = q_frag[ks][e];
                } else {
                    load_q(qa, ks);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    u32 kb[4];
                    ldmatrix_x4(kb, k_addr(key_warp * (NT / 2) + np, ks) + k_slot);
                    float(&acc0)[4] = TWO_CHAINS && ks % 2 ? s_odd[2 * np] : s[0][2 * np];
                    float(&acc1)[4] = TWO_CHAINS && ks % 2 ? s_odd[2 * np + 1] : s[0][2 * np + 1];
                    mma_16816<T>(acc0, qa, kb[0], kb[1]);
                    mma_16816<T>(acc1, qa, kb[2], kb[3]);
                }
            }
        }
        if (TWO_CHAINS) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][nt][e] += s_odd[nt][e];
        }
        if constexpr (FP8) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][nt][e] *= k_factor;
        }

        const int n = n_end - 1 - t;
        const int col_lane = n * BN + key_warp * Traits::WARP_KEYS + 2 * (lane % 4);
        if (SCORE_MOD) mod.apply_rows(s[0], query, slope, col_lane);
        if (masked) {
            mask.apply_row(s[0], 0, query[0], col_lane);
            mask.apply_row(s[0], 1, query[1], col_lane);
        }
        // Not FIRST: the running max starts at -inf, so the first block's rescale factor is 0 (on a zero
        // accumulator); a row still fully masked keeps max -inf and adds nothing.
        softmax.template update<false, true>(s, acc_o, p.scale_log2);

#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            u32 pa[4];
            pa[0] = pack2<MT>(s[0][2 * kk][0], s[0][2 * kk][1]);
            pa[1] = pack2<MT>(s[0][2 * kk][2], s[0][2 * kk][3]);
            pa[2] = pack2<MT>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
            pa[3] = pack2<MT>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
            if constexpr (FP8) {
                pv_e4m3(pa, kk, v_slot);
            } else {
#pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp) {
                    u32 vb[4];
                    ldmatrix_x4_trans(vb, v_addr(key_warp * (NT / 2) + kk, dp) + v_slot);
                    mma_16816<T>(acc_o[0][2 * dp], pa, vb[0], vb[1]);
                    mma_16816<T>(acc_o[0][2 * dp + 1], pa, vb[2], vb[3]);
                }
            }
        }
    }

    // Merges the key warps' (max, sum, O) per row and writes O and lse: final (one split) or fp32 partial.
    __device__ __forceinline__ void epilogue(char* smem, int split) {
        if constexpr (TMA) split = placement_again().x;
        cp_async_wait<0>();
        __syncthreads();  // the tiles' space becomes the merge buffer
        float* m_buf = reinterpret_cast<float*>(smem) + Traits::MERGE_ROWS * Traits::O_STRIDE;
        float* l_buf = m_buf + Traits::MERGE_ROWS;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int slot_row = key_warp * BM + row_warp * 16 + lane / 4 + 8 * h;
            const float sum = quad_sum(softmax.row_sum[0][h]);
            if (lane % 4 == 0) {
                m_buf[slot_row] = softmax.row_max[0][h] * p.scale_log2;  // log2 units; -inf stays -inf
                l_buf[slot_row] = sum;
            }
            float* o_row = reinterpret_cast<float*>(smem) + slot_row * Traits::O_STRIDE;
            if constexpr (FP8) {  // chunk q: tile 2q holds columns 16q + 4c, + 2; tile 2q + 1 the odd ones between
#pragma unroll
                for (int q = 0; q < D / 16; ++q)
                    *reinterpret_cast<float4*>(o_row + 16 * q + 4 * (lane % 4)) =
                        make_float4(acc_o[0][2 * q][2 * h] * v_factor, acc_o[0][2 * q + 1][2 * h] * v_factor,
                                    acc_o[0][2 * q][2 * h + 1] * v_factor, acc_o[0][2 * q + 1][2 * h + 1] * v_factor);
            } else {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    *reinterpret_cast<float2*>(o_row + 2 * (lane % 4) + dt * 8) =
                        make_float2(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
            }
        }
        __syncthreads();

        for (int idx = tid; idx < BM * (D / 4); idx += THREADS) {
            const int r = idx / (D / 4), c = idx % (D / 4) * 4;
            const int pr = row0 + r;
            if (pr >= rows || c >= p.headdim) continue;
            float m = NEG_INF;
#pragma unroll
            for (int w = 0; w < Traits::KEY_WARPS; ++w) m = fmaxf(m, m_buf[w * BM + r]);
            float l = 0.f;
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < Traits::KEY_WARPS; ++w) {
                const float mw = m_buf[w * BM + r];
                if (mw == NEG_INF) continue;  // this warp saw no key of the row: nothing to add
                const float wgt = exp2f(mw - m);
                const float4 ow = *reinterpret_cast<const float4*>(reinterpret_cast<float*>(smem) +
                                                                   (w * BM + r) * Traits::O_STRIDE + c);
                l += wgt * l_buf[w * BM + r];
                o.x += wgt * ow.x;
                o.y += wgt * ow.y;
                o.z += wgt * ow.z;
                o.w += wgt * ow.w;
            }
            const bool empty = !(l > 0.f);
            const float inv = empty ? 0.f : 1.f / l;
            const float lse = empty ? NEG_INF : (m + __log2f(l)) * LN2;
            const int i = pr / group, head = h_kv * group + pr % group;
            const i64 lse_index = ((i64)b * p.nheads + head) * p.seqlen_q + i;
            if (p.num_splits == 1) {
                u16* dst = p.o + (i64)b * p.o_batch_stride + (i64)i * p.o_row_stride + (i64)head * p.o_head_stride + c;
                *reinterpret_cast<uint2*>(dst) =
                    make_uint2(pack2<T>(o.x * inv, o.y * inv), pack2<T>(o.z * inv, o.w * inv));
                if (c == 0 && p.lse != nullptr) p.lse[lse_index] = lse;
            } else {
                const i64 partial = (i64)split * p.batch * p.nheads * p.seqlen_q + lse_index;
                *reinterpret_cast<float4*>(p.o_partial + partial * p.headdim + c) =
                    make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
                if (c == 0) p.lse_partial[partial] = lse;
            }
        }
        if constexpr (TMA) {  // the cp.async kernel (sm_80 too) leaves the merge to decode_combine: beside its
            if (p.num_splits > 1 && p.split_counters != nullptr) merge_if_last();  // loop it spilled on sm_80
        }
    }

    // The fused combine: every split CTA counts itself in on its row tile's counter once its partial results are
    // written (each thread fences its own writes first); the last one resets the counter to 0 for the next call on
    // the stream (cuflash/api.py keeps a zeroed buffer per stream) and merges the tile's rows: a thread per 4
    // columns of a row, one pass over the splits with a running max (decode_combine's weights exp(lse_s - max),
    // rescaled as the max grows), so that all the splits' loads can be in flight at once. It saves decode_combine's
    // launch.
    __device__ __forceinline__ void merge_if_last() {
        __threadfence();
        int last = 0;
        if (tid == 0) {
            // the tile's counter: (batch, KV head, row tile)
            const int counter = (b * gridDim.y + h_kv) * row_tiles() + placement_again().y;
            last = atomicAdd(p.split_counters + counter, 1) == p.num_splits - 1;
            if (last) p.split_counters[counter] = 0;
        }
        if (!__syncthreads_or(last)) return;
        __threadfence();  // the other splits' partial results are visible from here (read past L1: __ldcg)
        const int lanes = p.headdim / 4, per_pass = THREADS / lanes, splits = p.num_splits;
        const i64 rows_total = (i64)p.batch * p.nheads * p.seqlen_q;
        if (tid >= per_pass * lanes) return;
        const int c = tid % lanes * 4;
        for (int r = tid / lanes; r < BM && row0 + r < rows; r += per_pass) {
            const int i = (row0 + r) / group, head = h_kv * group + (row0 + r) % group;
            const i64 row = ((i64)b * p.nheads + head) * p.seqlen_q + i;
            float m = NEG_INF, sum = 0.f;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
            for (int s = 0; s < splits; ++s) {
                const float l = __ldcg(p.lse_partial + s * rows_total + row);
                const float4 x =
                    __ldcg(reinterpret_cast<const float4*>(p.o_partial + (s * rows_total + row) * p.headdim + c));
                if (l > m) {  // a new max: what is summed so far shrinks by exp(m - l) (0 from m = -inf)
                    const float shrink = exp2f((m - l) * LOG2E);
                    sum *= shrink;
                    acc.x *= shrink;
                    acc.y *= shrink;
                    acc.z *= shrink;
                    acc.w *= shrink;
                    m = l;
                }
                const float w = l == NEG_INF ? 0.f : exp2f((l - m) * LOG2E);  // a split that saw no key weighs 0
                sum += w;
                acc.x += w * x.x;
                acc.y += w * x.y;
                acc.z += w * x.z;
                acc.w += w * x.w;
            }
            const bool empty = !(sum > 0.f);
            const float inv = empty ? 0.f : __frcp_rn(sum);
            u16* dst = p.o + (i64)b * p.o_batch_stride + (i64)i * p.o_row_stride + (i64)head * p.o_head_stride + c;
            *reinterpret_cast<uint2*>(dst) =
                make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
            if (c == 0 && p.lse != nullptr) p.lse[row] = empty ? NEG_INF : m + __logf(sum);
        }
    }

    __device__ __forceinline__ void run(char* smem) {
        const int m_tiles = row_tiles();  // (unsigned divisions of the block index: signed ones spill on sm_80)
        const int m_tile = blockIdx.x % m_tiles, split = blockIdx.x / m_tiles;
        tid = threadIdx.x;
        lane = tid % 32;
        row_warp = (tid / 32) % Traits::ROW_WARPS;
        key_warp = (tid / 32) / Traits::ROW_WARPS;
        group = p.heads_per_kv;
        rows = p.seqlen_q * group;
        row0 = m_tile * BM;
        len = cache.length(p.seqlen_new_k);
        sQ = smem_u32(smem);
        sKV = sQ + QTile::BYTES;
        q_addr = LdmatrixAddr<QTile>(sQ, lane % 16, lane / 16);
        k_addr = typename Traits::KVAddr(sKV, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
        v_addr = typename Traits::KVAddr(sKV, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);  // + the slot's V offset
        mask = Mask<true>{len, len - p.seqlen_q, p.window_left, p.window_right};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int pr = row0 + row_warp * 16 + lane / 4 + 8 * h;  // past the last row: a harmless dummy
            query[h] = pr / group;
            const int head = h_kv * group + pr % group;
            slope[h] = SCORE_MOD && p.alibi != nullptr ? p.alibi[(i64)b * p.alibi_batch_stride + head] : 0.f;
        }
        if (SCORE_MOD) mod = ScoreMod{p.mod_scale, p.softcap, 0.f, len - p.seqlen_q};
        if constexpr (FP8) {
            const i64 di = (i64)b * p.descale_batch_stride + (i64)h_kv * p.descale_head_stride;
            k_factor = (p.k_descale != nullptr ? p.k_descale[di] : 1.f) * E4M3_F16_UNDO;
            v_factor = (p.v_descale != nullptr ? p.v_descale[di] : 1.f) * E4M3_F16_UNDO;
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
        softmax.reset();

        // The tile's visible blocks, cut into num_splits equal runs; this CTA takes run `split`.
        const int last = min(row0 + BM, rows) - 1;
        const BlockRange range = block_range<BN>(mask, row0 / group, last / group);
        const int per_split = (range.n_max - range.n_min + p.num_splits - 1) / p.num_splits;
        n_begin = range.n_min + split * per_split;
        n_end = min(range.n_max, n_begin + per_split);

        if constexpr (TMA) {
            bars = sKV + STAGES * Traits::STAGE_BYTES;
            cache_row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
            if (tid == 0) {
                for (int i = 0; i < STAGES; ++i) sm90::mbar_init(bars + 8 * i, 1);
                sm90::mbar_fence_init();
            }
            __syncthreads();
        }
        if (n_begin < n_end) {
            QCopy::load_rows_async(sQ, [&](int r) { return q_row(r); }, p.headdim, p.q, tid);
            if constexpr (TMA) {
                cp_async_commit();
                if (issues_box()) {
                    for (int t = 0; t < STAGES - 1 && n_end - 1 - t >= n_begin; ++t) issue_kv_tma(t, n_end - 1 - t);
                }
            } else {
#pragma unroll
                for (int t = 0; t < STAGES - 1; ++t) {  // one group per block; Q joins the first
                    if (n_end - 1 - t >= n_begin) load_kv(t, n_end - 1 - t);
                    cp_async_commit();
                }
            }
            for (int t = 0, n = n_end - 1; n >= n_begin; ++t, --n) step(t, n > range.full_hi || n < range.full_lo);
        }
        epilogue(smem, split);
    }
};

template <class T, int D, int ROW_WARPS, int BN, int STAGES, bool SCORE_MOD, bool FP8 = false>
__global__ void __launch_bounds__(128) decode_kernel(const __grid_constant__ DecodeParams p) {
    extern __shared__ __align__(1024) char smem[];
    pdl_launch_dependents();  // decode_combine's CTAs may take their place now; they wait for this grid's end
    DecodeBlock<DecodeTraits<T, D, ROW_WARPS, BN, STAGES, FP8>, SCORE_MOD> block(p, blockIdx.z, blockIdx.y);
    block.run(smem);
}

// The TMA decode kernel's parameter: DecodeParams first (the append and combine kernels of the same call read that
// prefix of the same buffer), then the K and V caches' tensor maps.
struct DecodeTmaParams {
    DecodeParams p;
    sm90::TmaMap k_map, v_map;
};

// Up to 16 packed rows (ROW_WARPS = 1), sm_90a. Shared memory: 1 KB of alignment slack (TMA's 128-byte swizzle
// wants 1024-byte panels), the Q tile, the ring, one mbarrier per slot.
template <class T, int D, int BN, int STAGES, int PAGE_BOXES, bool SCORE_MOD, bool FP8 = false>
__global__ void __launch_bounds__(128) decode_tma_kernel(const __grid_constant__ DecodeTmaParams P) {
    extern __shared__ __align__(1024) char smem_raw[];
    char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    pdl_launch_dependents();
    DecodeBlock<DecodeTraits<T, D, 1, BN, STAGES, FP8>, SCORE_MOD, true, PAGE_BOXES> block(P.p, blockIdx.z, blockIdx.y);
    block.k_map = &P.k_map;
    block.v_map = &P.v_map;
    block.run(smem);
}

}  // namespace cuflash

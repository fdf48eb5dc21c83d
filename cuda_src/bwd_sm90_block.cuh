// The Hopper backward (bwd_sm90.cu): the CTA's state and constants (BwdSm90), the loads, the masks and
// probabilities, the step at d = 64 and 128, dK and dV out, and the walk over key blocks (run). The dQ
// additions are defined in bwd_sm90_dq.cuh, the step at d = 256 in bwd_sm90_split.cuh.
#pragma once
#include "sm90.cuh"
#include "mma.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "seqlen.cuh"
#include "fixed_dq.cuh"
#include "params.cuh"
#include "dropout.cuh"
#include "bwd_sm90_layout.cuh"

namespace cuflash {

template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
struct BwdSm90 {
    // d = 256: dK and dV of 128 keys would need 256 registers a thread, so a CTA holds 64 keys and its two warpgroups
    // split the head dim instead of the keys: each computes S^T and dP^T for all 64 keys against its half of the
    // step's queries, leaves P^T and dS^T in shared memory, and accumulates dK, dV and adds dQ for its 128 columns
    // over all of them (step_split).
    static constexpr bool DSPLIT = D == 256;
    // Warp-specialized (bwd_sm90_ws.cuh) at d = 128 and 256, and at d = 64 with 128 query rows (the only d = 64 kernel
    // with dQ by TMA). A producer warpgroup loads Q, dO and their rows ahead and adds the dQ staging tiles by TMA; the
    // two consumer warpgroups hand buffers back through mbarriers instead of meeting the producer at CTA barriers.
    static constexpr bool WS = D != 64 || BM == 128;
    static constexpr int BN = DSPLIT ? 64 : 128, PANELS = D / 64, THREADS = WS ? 384 : 256;
    static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;  // WS: setmaxnreg
    static constexpr int WG_PANELS = DSPLIT ? PANELS / 2 : PANELS;  // 64-column panels of dK / dV a warpgroup holds
    // S^T's n-tiles per warpgroup (DSPLIT: of its half of the queries), k-steps over queries, 64-query halves
    static constexpr int NT = DSPLIT ? BM / 16 : BM / 8, KK = BM / 16, QH = BM / 64;
    // dQ by TMA wherever each dQ element has one adding thread per step (all but d = 64 with 64 rows, where both
    // warpgroups add to every element): a warpgroup's 64 x 64 fp32 tile is stored to a staging buffer (two boxes of
    // 32 columns, 128-byte swizzle; two buffers, by step parity) and the producer's dQ warp adds it to dq_accum with
    // bulk tensor reductions, so that the compute threads are done with dQ once the tile is stored.
    static constexpr bool TMA_DQ = !(D == 64 && BM == 64);
    static_assert(TMA_DQ == WS, "the warp-specialized kernels are those that add dQ by TMA (its dQ warp)");
    using Smem = BwdSm90Smem<D, BM, TMA_DQ>;
    using Tail = decltype(Smem::tail);
    static constexpr u32 K_PANEL = BN * 128, Q_PANEL = BM * 128;  // bytes of one 64-column panel
    static constexpr u32 DS_PANEL = BN * 128;                     // dS^T: all keys x 64 queries
    static constexpr u32 KV_BYTES = sizeof(Smem::k), QD_BYTES = sizeof(Smem::q[0]);
    static constexpr u32 DQ_BOX = sizeof(BwdSm90Tail<true>::dq[0][0][0]), DQ_TILE = 2 * DQ_BOX;
    // byte offsets from the CTA's 1024-aligned base (K at 0; the dQ staging buffers first in the tail)
    static constexpr u32 OFF_V = offsetof(Smem, v), OFF_Q = offsetof(Smem, q), OFF_DO = offsetof(Smem, dout);
    static constexpr u32 OFF_DS = offsetof(Smem, ds), OFF_ROWS = offsetof(Smem, rows), OFF_DQ = offsetof(Smem, tail);
    static constexpr u32 OFF_KV_BAR = OFF_DQ + offsetof(Tail, kv_full), OFF_QD_BAR = OFF_DQ + offsetof(Tail, qd_full);
    static constexpr u32 OFF_PT = OFF_DS + sizeof(Smem::ds), OFF_DO_BAR = OFF_QD_BAR + sizeof(Tail::qd_full);
    static constexpr u32 SMEM_BYTES =
        OFF_QD_BAR + sizeof(Tail::qd_full) + (DSPLIT ? 8 : 0) + (WS ? (DSPLIT ? 48 : 32) : 0) + 1024;
    static_assert(BN == Smem::BN && sizeof(Smem::ds[0]) == DS_PANEL && offsetof(Smem, k) == 0 &&
                  offsetof(BwdSm90Tail<true>, dq) == 0, "one layout");
    static_assert(OFF_V % 1024 == 0 && OFF_Q % 1024 == 0 && OFF_DO % 1024 == 0 && OFF_DS % 1024 == 0 &&
                  QD_BYTES % 1024 == 0 && OFF_DQ % 1024 == 0, "every tile and staging panel 1024-aligned");
    static_assert(OFF_QD_BAR == OFF_KV_BAR + 8, "the mbarriers side by side (initialized in one loop)");
    static_assert(!DSPLIT || (OFF_PT % 1024 == 0 && OFF_PT + DS_PANEL <= OFF_ROWS), "P^T after dS^T, 1024-aligned");
    static_assert(SMEM_BYTES <= 227 * 1024, "the SM's shared memory per block");
    static_assert(D == 64 || D == 128 || (D == 256 && BM == 64), "head dims 64, 128 and 256");
    static_assert(BM == 64 || (BM == 128 && D == 64), "128 query rows per step at d = 64 only");
    static_assert(!DROPOUT || ((BM == 64 || !SCORE_MOD) && !FIXED), "dropout: with a score mod, 64 query rows");
    // dV issued as soon as P^T is ready (its wgmma overlaps dS); at d = 128, or with 128 query rows, that keeps too
    // many registers live (P^T's fragments beside dP^T and the accumulators): there dV follows dQ.
    static constexpr bool EARLY_DV = D == 64 && !SCORE_MOD && BM == 64 && !DROPOUT;
    // d = 64 with 128 query rows: each warpgroup computes dQ for its 64-row half over all 128 keys (both dS^T halves
    // in shared memory first), so every dQ element gets one reduction per step instead of one per warpgroup.
    static constexpr bool ROW_SPLIT = PANELS == 1 && QH == 2;
    static_assert(sizeof(Smem::rows) == 2 * 3 * BM * 4, "a rows buffer per Q/dO buffer: step tt's is tt % 2");
    // UNIFORM: the step's buffer, base and warpgroup as values ptxas can see are warp-uniform (sm90::warp_uniform):
    // the descriptors then stay on the uniform datapath, advanced from one per operand (sm90::desc_advance). Not in
    // the plain kernel with 128 query rows at d = 64 (ROW_SPLIT without a score mod): at 255 registers there either
    // one makes ptxas spill, while the score-mod kernel spills without them.
    static constexpr bool UNIFORM = !ROW_SPLIT || SCORE_MOD;
    __device__ __forceinline__ static int uniform(int x) { return UNIFORM ? sm90::warp_uniform(x) : x; }

    const BwdSm90Params& P;
    const BwdParams& p;
    int tid, wg;
    // The thread's warp in its warpgroup and its lane, read from threadIdx where used: as members they would hold
    // two registers through the step
    __device__ __forceinline__ static int warp() { return (threadIdx.x / 32) % 4; }
    __device__ __forceinline__ static int lane() { return threadIdx.x % 32; }
    u32 base;
    int h_kv, b, q_begin, k_begin, n_key0;
    Mask<BAND> mask;
    bool backwards;  // this key block's walk in reverse (step_of)
    float acc_dk[WG_PANELS * 8][4], acc_dv[WG_PANELS * 8][4];

    __device__ __forceinline__ explicit BwdSm90(const BwdSm90Params& params) : P(params), p(params.p) {}

    __device__ __forceinline__ u32 q_tile(int buf) const { return base + OFF_Q + buf * QD_BYTES; }
    __device__ __forceinline__ u32 do_tile(int buf) const { return base + OFF_DO + buf * QD_BYTES; }
    __device__ __forceinline__ float* rows(char* smem, int buf) const {
        return reinterpret_cast<float*>(smem + (base - smem_u32(smem)) + OFF_ROWS) + buf * 3 * BM;
    }
    __device__ __forceinline__ u32 kv_bar() const { return base + OFF_KV_BAR; }
    __device__ __forceinline__ u32 qd_bar(int buf) const { return base + OFF_QD_BAR + 8 * buf; }
    __device__ __forceinline__ u32 do_bar() const { return base + OFF_DO_BAR; }  // DSPLIT
    // WS: the consumers' hand-backs (Q/dO and rows of a buffer, K/V), and the dQ warp's (staging buffers read out)
    __device__ __forceinline__ u32 qd_empty(int buf) const { return base + OFF_DQ + offsetof(Tail, qd_empty) + 8 * buf; }
    __device__ __forceinline__ u32 kv_empty() const { return base + OFF_DQ + offsetof(Tail, kv_empty); }
    __device__ __forceinline__ u32 dq_empty(int c = 0) const {  // DSPLIT: one per consumer's staging tile
        return base + OFF_DQ + offsetof(Tail, dq_empty) + 8 * c;
    }
    __device__ __forceinline__ u32 do_empty() const { return base + OFF_DQ + offsetof(Tail, do_empty); }  // DSPLIT

    __device__ __forceinline__ void load_box(u32 dst, const sm90::TmaMap* map, int col, int head, int begin, int row,
                                             u32 bar) const {
        sm90::tma_load_rows(dst, map, p.cu_seqlens_q != nullptr, col, head, begin, row, b, bar);
    }

    // Step t of the walk over (query head of the group, query block): which head and block. A CTA with several key
    // blocks (deterministic mode's slots) walks every other one backwards, so that the dQ slice lines and Q/dO tiles
    // it touched last are the first it needs again, while some may still be in L2.
    // In ordered mode without a band the walk of key block n starts at query block n M / N (M query blocks, N key
    // blocks), so that the key blocks reach a query block one after another, in dq_rank's order (not with a score
    // mod: the kernels with one take no ordered mode, and there the rotation spills).
    __device__ __forceinline__ void step_of(int t, int m_min, int m_count, int& h, int& m) const {
        if (backwards) t = m_count * p.heads_per_kv - 1 - t;
        h = h_kv * p.heads_per_kv + t / m_count;
        m = t % m_count;
        if (!BAND && !SCORE_MOD && p.deterministic == DQ_ORDERED) {
            m += (n_key0 / BN) * m_count / ceil_div(mask.seqlen_k, BN);
            if (m >= m_count) m -= m_count;
        }
        m += m_min;
    }

    // The start of step t (the tt-th of this CTA): base and the mask's values made opaque per step, so that the
    // shared-memory descriptors derived from them are made where used, not hoisted out of the step loop and kept in
    // registers across steps; the step's head, query block, buffer and rows (lse, then D at + BM).
    struct StepAt {
        int h, m, buf;
        const float* lse;
    };
    __device__ __forceinline__ StepAt begin_step(char* smem, int t, int tt, int m_min, int m_count) {
        asm volatile("" : "+r"(base), "+r"(mask.seqlen_k), "+r"(mask.diag));
        base = uniform(base);
        StepAt at;
        step_of(t, m_min, m_count, at.h, at.m);
        at.buf = uniform(tt % 2);
        at.lse = rows(smem, tt % 2);
        return at;
    }

    // Issue (thread 0) the TMA loads of Q and dO of step t into buffer tt % 2.
    __device__ __forceinline__ void load_step(int t, int tt, int m_min, int m_count) const {
        if (tid != 0) return;
        int h, m;
        step_of(t, m_min, m_count, h, m);
        const int buf = tt % 2;
        sm90::mbar_arrive_expect_tx(qd_bar(buf), 2 * QD_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn) {
            load_box(q_tile(buf) + pn * Q_PANEL, &P.q, pn * 64, h, q_begin, m * BM, qd_bar(buf));
            load_box(do_tile(buf) + pn * Q_PANEL, &P.dout, pn * 64, h, q_begin, m * BM, qd_bar(buf));
        }
    }

    // DSPLIT (thread 0): Q of step t into buffer tt % 2 (on its Q barrier), or dO of step t into the one dO tile.
    __device__ __forceinline__ void load_q(int t, int tt, int m_min, int m_count) const {
        int h, m;
        step_of(t, m_min, m_count, h, m);
        const int buf = tt % 2;
        sm90::mbar_arrive_expect_tx(qd_bar(buf), QD_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            load_box(q_tile(buf) + pn * Q_PANEL, &P.q, pn * 64, h, q_begin, m * BM, qd_bar(buf));
    }
    __device__ __forceinline__ void load_do(int t, int m_min, int m_count) const {
        int h, m;
        step_of(t, m_min, m_count, h, m);
        sm90::mbar_arrive_expect_tx(do_bar(), QD_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            load_box(do_tile(0) + pn * Q_PANEL, &P.dout, pn * 64, h, q_begin, m * BM, do_bar());
    }

    // Threads < BM: lse_log2 and D of row `tid` of step t, read from global memory into registers a step ahead (the
    // load's latency hides behind a step's work) and stored to the rows of buffer tt % 2 once that buffer is free.
    // Fixed point (deterministic mode 2): the row's dQ scale too, which bwd_fixed_scale wrote (fixed_dq.cuh), fetched
    // like lse and D: making it here from |dO|, D and the KV head's bounds, or copying it by cp.async into a ring of
    // its own, costs more (docs/perf-notes.md).
    __device__ __forceinline__ float3 fetch_rows(int t, int m_min, int m_count, int seqlen_q) const {
        int h, m;
        step_of(t, m_min, m_count, h, m);
        const int row = m * BM + tid;
        if (row >= seqlen_q) return make_float3(__int_as_float(0x7f800000), 0.f, 0.f);  // lse +inf: P = 0
        const i64 i = SeqInfo::offset(q_begin, p.lse_batch_stride, 1, row) + (i64)h * p.lse_head_stride;
        return make_float3(p.lse_log2[i], p.dsum[i], FIXED ? p.dq_scale[i] : 0.f);
    }
    __device__ __forceinline__ void store_rows(char* smem, int tt, float3 r) const {
        float* at = rows(smem, tt % 2);
        at[tid] = r.x;
        at[BM + tid] = r.y;
        if (FIXED) at[2 * BM + tid] = r.z;
    }

    // S^T or dP^T of this warpgroup's 64 keys against the BM queries of a buffer (A = keys tile, B = queries tile).
    __device__ __forceinline__ void issue_keys_by_queries(float (&acc)[NT][4], u32 keys, u32 queries) const {
        const auto desc0 = sm90::smem_desc(base);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const u32 a_at = keys + wg * 64 * 128 + (ks / 4) * K_PANEL + (ks % 4) * 32;
            const u32 q_at = queries + (ks / 4) * Q_PANEL + (ks % 4) * 32;
            const auto a = UNIFORM ? sm90::desc_advance(desc0, a_at - base) : sm90::smem_desc(a_at);
            const auto q = UNIFORM ? sm90::desc_advance(desc0, q_at - base) : sm90::smem_desc(q_at);
            if constexpr (BM == 64)
                sm90::wgmma_m64n64k16_ss<T>(*reinterpret_cast<float(*)[32]>(&acc[0][0]), a, q, ks > 0);
            else
                sm90::wgmma_m64n128k16_ss<T>(*reinterpret_cast<float(*)[64]>(&acc[0][0]), a, q, ks > 0);
        }
        sm90::wgmma_commit();
    }

    // acc (+)= A B over the BM queries, A (keys x queries) from registers, B a queries x D tile (MN-major).
    __device__ __forceinline__ void issue_keys_by_d(float (&acc)[PANELS * 8][4], const u32 (&a)[KK][4], u32 tile) {
        const auto desc0 = sm90::smem_desc_mn(base, Q_PANEL);
#pragma unroll
        for (int kk = 0; kk < KK; ++kk)
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn) {
                const u32 at = tile + pn * Q_PANEL + kk * 2048;
                sm90::wgmma_m64n64k16_rs<T>(*reinterpret_cast<float(*)[32]>(&acc[pn * 8][0]), a[kk],
                                            UNIFORM ? sm90::desc_advance(desc0, at - base)
                                                    : sm90::smem_desc_mn(at, Q_PANEL), true);
            }
    }

    // Key `key` of this sequence is in query `query`'s band and below seqlen_k (queries past seqlen_q have lse +inf).
    __device__ __forceinline__ bool visible(int key, int query) const {
        bool in = key < mask.seqlen_k;
        if (BAND) {
            if (mask.left >= 0) in = in && key >= query + mask.diag - mask.left;
            if (mask.right >= 0) in = in && key <= query + mask.diag + mask.right;
        }
        return in;
    }

    // Every key of this CTA's block is below seqlen_k and in the band of every query of block m (queries past
    // seqlen_q need no mask: their lse is +inf). Most steps: they skip the per-element mask.
    __device__ __forceinline__ bool all_visible(int m) const {
        bool all = n_key0 + BN <= mask.seqlen_k;
        if (BAND) {
            if (mask.right >= 0) all = all && n_key0 + BN - 1 <= m * BM + mask.diag + mask.right;
            if (mask.left >= 0) all = all && n_key0 >= m * BM + BM - 1 + mask.diag - mask.left;
        }
        return all;
    }

    // P^T = exp2(S^T scale - lse), in place; MASKED: 0 where the key is not visible to the query. Per key (a
    // thread holds two), the visible queries are one interval, so an element costs two compares. st's columns are
    // queries m BM + col0 .. (col0: DSPLIT's query half), whose lse start at `lse`.
    template <bool MASKED>
    __device__ __forceinline__ void probabilities(float (&st)[NT][4], const float* lse, int key0, int m,
                                                  int col0 = 0) const {
        const int col_lane = 2 * (lane() % 4);
        int lo[2], hi[2];  // visible columns c (query m BM + col0 + col_lane + c) of key key0 + 8 i: lo <= c < hi
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int key = key0 + 8 * i, q0 = m * BM + col0 + col_lane;
            lo[i] = 0;
            hi[i] = key < mask.seqlen_k ? NT * 8 : 0;
            if (BAND) {
                if (mask.right >= 0) lo[i] = max(lo[i], key - mask.diag - mask.right - q0);
                if (mask.left >= 0) hi[i] = min(hi[i], key - mask.diag + mask.left + 1 - q0);
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 8 * j + e % 2;
                const float prob = exp2f(st[j][e] * p.scale_log2 - lse[col_lane + c]);
                st[j][e] = !MASKED || (c >= lo[e / 2] && c < hi[e / 2]) ? prob : 0.f;
            }
    }

    // Head h's ALiBi slope, 0 without ALiBi (read from global memory: the caller issues this before a wait).
    __device__ __forceinline__ float alibi_slope(int h) const {
        return p.alibi != nullptr ? p.alibi[(i64)b * p.alibi_batch_stride + h] : 0.f;
    }

    // SCORE_MOD: P^T and dS^T in place of S^T and dP^T (both waited for): the mod per element, its derivative
    // (softcap's 1 - tanh^2) straight into dS. st's columns are queries m BM + col0 .., whose lse and D start at
    // `lse` and `dsum`; with dropout (d = 64 and 256) dS takes dP^T M / keep (dV's P^T M: the caller's).
    __device__ __forceinline__ void mod_probabilities(float slope, float (&st)[NT][4], float (&dpt)[NT][4],
                                                      const float* lse, const float* dsum, int key0, int m, int col0,
                                                      const u32 (&kept)[QH]) const {
        const ScoreMod mod{p.mod_scale, p.softcap, slope, mask.diag};
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 8 * (e / 2), col = 8 * j + 2 * (lane() % 4) + e % 2, query = m * BM + col0 + col;
                float dmod;
                const float x = mod.modify(st[j][e], query, key, mod.slope, &dmod);
                const float prob = visible(key, query) ? exp2f(x * p.scale_log2 - lse[col]) : 0.f;
                float dp = dpt[j][e];
                if constexpr (DROPOUT) dp = dropped(dp, kept, j, e);
                st[j][e] = prob;
                // dS^T, in place (the products in this order: in the d = 128 fixed-point kernel another order
                // spills 4 bytes under NVRTC 13.5)
                dpt[j][e] = (prob * dmod) * ((dp - dsum[col]) * p.softmax_scale);
            }
    }

    // Dropout: P^T's fragments times the keep mask M. Fragment [kk][r] packs elements [2 kk + r / 2][2 (r % 2)] and
    // [..][2 (r % 2) + 1] (sm90::a_fragment): keep bits 8 kk + 2 r and 8 kk + 2 r + 1, its low and high halves.
    __device__ __forceinline__ static void drop_fragments(u32 (&a)[KK][4], const u32 (&kept)[QH]) {
#pragma unroll
        for (int kk = 0; kk < KK; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const u32 bits = kept[kk / 4] >> (8 * (kk % 4) + 2 * r);
                a[kk][r] &= (bits & 1u) * 0xFFFFu + (bits & 2u) * 0x7FFF8000u;
            }
    }
    // P^T's fragments for dV, packed from its floats st, and with dropout times M (its 1 / keep applied in store_dkdv)
    __device__ __forceinline__ static void pack_pt(u32 (&a)[KK][4], const float (&st)[NT][4], const u32 (&kept)[QH]) {
        sm90::a_fragments<T>(st, a);
        if constexpr (DROPOUT) drop_fragments(a, kept);
    }
    // dP^T's element [j][e] with dropout: times 1 / keep where it is kept (word j / 8, bit 4 (j % 8) + e), else 0
    __device__ __forceinline__ float dropped(float dp, const u32 (&kept)[QH], int j, int e) const {
        return (kept[j / 8] >> (4 * (j % 8) + e)) & 1u ? dp * p.dropout_scale : 0.f;
    }

    __device__ __forceinline__ void step(char* smem, int t, int tt, int m_min, int m_count, int seqlen_q) {
        const auto [h, m, buf, lse] = begin_step(smem, t, tt, m_min, m_count);
        const float* dsum = lse + BM;
        // P^T and dS^T; element (key, query): key = key0 + 8 (e / 2), query = 8 j + 2 (lane % 4) + e % 2
        const int key0 = n_key0 + wg * 64 + warp() * 16 + lane() / 4;
        // dropout: the keep bits of this warp's 16 keys x BM queries (word j / 8, bit 4 (j % 8) + e: element [j][e]),
        // drawn while Q and dO load and before S^T and dP^T take their registers (beside them, at d = 128, ptxas
        // spills)
        u32 kept[QH];
#pragma unroll
        for (int qh = 0; qh < QH; ++qh) kept[qh] = ~0u;
        if constexpr (DROPOUT) {
            if (p.dropout_threshold < (int)Dropout::LEVELS) {
#pragma unroll
                for (int qh = 0; qh < QH; ++qh)
                    kept[qh] = Dropout::of(p, b * p.nheads + h).template keep_mask_cols<NT / QH>(
                        (key0 - lane() / 4) / 16, m * BM / 16 + 4 * qh, lane());
            }
        }
        sm90::mbar_wait(qd_bar(buf), (tt / 2) & 1);
        float st[NT][4], dpt[NT][4];
        sm90::wgmma_fence();
        issue_keys_by_queries(st, base, q_tile(buf));
        issue_keys_by_queries(dpt, base + OFF_V, do_tile(buf));
        // Issue order: dV as soon as P^T is in registers (EARLY_DV), then, once dS^T is in shared memory, dQ (then
        // dV if not yet) and dK, so that dQ's reductions overlap the wgmma after it. A fragment register an in-flight
        // wgmma reads is not touched again before the wait that ends it.
        u32 a[KK][4], ds[KK][4];
        if constexpr (SCORE_MOD) {  // both products first: softcap's derivative goes straight into dS
            const float slope = alibi_slope(h);
            sm90::wgmma_wait<0>();
            mod_probabilities(slope, st, dpt, lse, dsum, key0, m, 0, kept);
            sm90::a_fragments<T>(st, a);
            if constexpr (DROPOUT) drop_fragments(a, kept);  // dV takes P^T M
        } else {
            sm90::wgmma_wait<1>();  // S^T (dP^T still computing)
            if (all_visible(m)) probabilities<false>(st, lse, key0, m);
            else probabilities<true>(st, lse, key0, m);
            // P^T's fragments: BM = 128 packs them after dS, so that its floats and fragments are not both live
            if constexpr (BM == 64) pack_pt(a, st, kept);
            if constexpr (EARLY_DV) {
                sm90::wgmma_fence();
                issue_keys_by_d(acc_dv, a, do_tile(buf));
                sm90::wgmma_commit();
                sm90::wgmma_wait<1>();  // dP^T (dV still computing)
            } else {
                sm90::wgmma_wait<0>();  // dP^T
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = 8 * j + 2 * (lane() % 4) + e % 2;
                    float dp = dpt[j][e];
                    if constexpr (DROPOUT) dp = dropped(dp, kept, j, e);
                    dpt[j][e] = st[j][e] * (dp - dsum[col]) * p.softmax_scale;  // dS^T, in place
                }
            if constexpr (BM == 128) pack_pt(a, st, kept);
        }
        sm90::a_fragments<T>(dpt, ds);
        // dS^T to shared memory, 128-byte swizzled rows of keys, one panel per 64 queries: (key r, query c) at
        // (c / 64) DS_PANEL + r 128 + (((c % 64) / 8) ^ (r % 8)) 16 + (c % 8) 2
        const u32 ds_tile = base + OFF_DS;
        if constexpr (WS) {  // the other consumer's dQ of the step before has read the tile
            if (tt > 0) sm90::named_sync<256>(int(BwdBarrier::DsFree0) + wg);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = wg * 64 + warp() * 16 + lane() / 4 + 8 * hh;
                const u32 addr = ds_tile + (j / 8) * DS_PANEL + r * 128 + (((j % 8) ^ (r % 8)) * 16) + (lane() % 4) * 4;
                sm90::st_shared_b32(addr, ds[j / 2][(j % 2) * 2 + hh]);
            }
        sm90::fence_proxy_async();  // generic-proxy stores, read by wgmma (async proxy) below
        if (WS) sm90::named_sync<BwdBarrier::DsReady, 256>();  // both dS^T halves (the consumers only)
        else sm90::named_sync<128>(int(BwdBarrier::Warpgroup0) + wg);  // its own keys only (d = 64, 64 rows)
        // dQ over 64 columns, as 64-row halves: d = 128, panel wg, all BM rows, over all 128 keys; d = 64 with 128
        // rows (ROW_SPLIT), the half wg over all 128 keys; d = 64 with 64 rows, all of it over its own 64 keys
        constexpr int KEYS = PANELS == 2 || ROW_SPLIT ? BN : 64, HALVES = ROW_SPLIT ? 1 : QH;
        const int key_base = KEYS == BN ? 0 : wg * 64, panel = PANELS == 2 ? wg : 0, half0 = ROW_SPLIT ? wg : 0;
        float dq[HALVES][8][4];
        sm90::wgmma_fence();
#pragma unroll
        for (int qh = 0; qh < HALVES; ++qh)
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk)
                sm90::wgmma_m64n64k16_ss_mn<T>(*reinterpret_cast<float(*)[32]>(&dq[qh][0][0]),
                                               sm90::smem_desc_mn(ds_tile + (half0 + qh) * DS_PANEL +
                                                                  (key_base + kk * 16) * 128, DS_PANEL),
                                               sm90::smem_desc_mn(base + panel * K_PANEL + (key_base + kk * 16) * 128,
                                                                  K_PANEL), kk > 0);
        sm90::wgmma_commit();
        if constexpr (!EARLY_DV) {
            issue_keys_by_d(acc_dv, a, do_tile(buf));
            sm90::wgmma_commit();
        }
        issue_keys_by_d(acc_dk, ds, q_tile(buf));
        sm90::wgmma_commit();
        sm90::wgmma_wait<EARLY_DV ? 1 : 2>();  // dQ done (and dV where issued early), dK computing
        if (WS) sm90::named_arrive<256>(int(BwdBarrier::DsFree1) - wg);  // dS^T read: the other's next store waits
        if constexpr (WS) {  // (TMA_DQ)
            stage_dq(dq[0], panel, tt, lse + 2 * BM + half0 * 64);
            sm90::wgmma_wait<0>();                 // dK: its fragments (ds) are free again
            sm90::mbar_arrive(qd_empty(buf));      // this thread is done with Q, dO and their rows
        } else {
            add_dq_red(dq, h, m, seqlen_q);
            sm90::wgmma_wait<0>();  // dK: its fragments (ds) are free again
        }
    }

    // d = 256 (DSPLIT): its step and the products it issues (bwd_sm90_split.cuh)
    __device__ __forceinline__ void issue_keys_by_query_half(float (&acc)[NT][4], u32 keys, u32 queries) const;
    __device__ __forceinline__ void issue_keys_by_d_half(float (&acc)[WG_PANELS * 8][4], u32 a_tile, u32 tile) const;
    __device__ __forceinline__ void issue_dq_panel(float (&dq)[8][4], int pn) const;
    // HOLD_DQ (d = 256 under a band): a consumer's second dQ panel of a step, held in registers until the next step's
    // softmax of S^T is done (or the key block ends), with the fixed point's scales of the thread's two rows (hh = 0, 1)
    static constexpr bool HOLD_DQ = DSPLIT && BAND;
    struct HeldPanel {
        float dq[8][4];
        float scale[2];
    };
    __device__ __forceinline__ void step_split(char* smem, int t, int tt, int m_min, int m_count, HeldPanel& held);

    // dQ added to dq_accum by vector reductions (lockstep), or stored to a staging tile for the dQ warp (WS), which
    // adds it by TMA (bwd_sm90_dq.cuh)
    __device__ __forceinline__ void add_dq_red(const float (&dq)[1][8][4], int h, int m, int seqlen_q) const;
    __device__ __forceinline__ void stage_dq(const float (&dq)[8][4], int panel, int tt, const float* scales) const;
    __device__ __forceinline__ void stage_held(const HeldPanel& held, int tt) const;
    // the fixed point's dQ scale of row r of a step's rows buffer (`scales`: its third array); 0 in other modes
    __device__ __forceinline__ float dq_scale_of(const float* scales, int r) const;
    template <class ScaleOf>
    __device__ __forceinline__ void stage_tile(const float (&dq)[8][4], int panel, int tt, ScaleOf scale_of) const;
    // BwdParams::dq_first_store: the issuing lane's ticket for query block m of head h (true: this CTA's additions
    // to it are the first, made as stores; dq_pass with rank 0 releases them once written; bwd_sm90_dq.cuh)
    __device__ __forceinline__ bool dq_ticket(int h, int m) const;
    // query block m of head h's ready flag (DqStoreCounters): set once the first stores are written (dq_pass with
    // rank 0), or in ordered mode the count of key blocks that have added
    __device__ __forceinline__ int* dq_ready(int h, int m) const {
        const int blocks = p.dq_first_store;
        return DqStoreCounters(p.dq_accum, p.dq_slice_stride, p.batch, p.nheads, blocks)
            .ready(((i64)b * p.nheads + h) * blocks + m);
    }
    // Ordered mode (BwdParams::deterministic DQ_ORDERED): this key block's place in query block m's order, the wait
    // for its turn (true: its additions are the first, made as stores) and the pass to the next (bwd_sm90_dq.cuh)
    __device__ __forceinline__ int dq_rank(int m, int m_blocks) const;
    __device__ __forceinline__ bool dq_turn(int h, int m, int rank) const;
    __device__ __forceinline__ void dq_pass(int h, int m, int rank) const;

    // dK and dV of this warpgroup's keys (DSPLIT: all the block's keys, its 128 columns) to global memory, 16 bytes a
    // thread and row: the four threads of a quad hold 4-byte column pairs 8 dt + 2 (lane % 4) of the same two rows, so
    // a 4 x 4 transpose in the quad (quad_transpose) gives thread q the columns 8 (4 g + q) .. + 7 of each group g of
    // four dt, stored by one 16-byte store. (4-byte stores make each warp store 8 rows' 16 bytes, eight lines an
    // instruction, four times the requests: at 512 keys the CTA's last steps wait on them.) Not in the kernel at d = 64
    // with 128 rows and a score mod, where the transposes make NVRTC 13.5's ptxas spill: a column pair a thread there.
    static constexpr bool WIDE_STORES = !(ROW_SPLIT && SCORE_MOD);
    __device__ __forceinline__ void store_dkdv(int seqlen_k) const {
        // (WS: the sequence's start read again here rather than held through the step loop at 240 registers)
        const int k_begin = WS ? SeqInfo::k_begin_of(p, b) : this->k_begin;
        const float dv_scale = DROPOUT ? p.dropout_scale : 1.f;  // dropout: dV = (P M)^T dO / keep
        constexpr int G = WIDE_STORES ? 4 : 1;  // column pairs a thread stores at once
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            // (WIDE_STORES: the whole quad holds one key, and skips the stores together after the shuffles)
            const int key = n_key0 + (DSPLIT ? 0 : wg * 64) + warp() * 16 + lane() / 4 + 8 * hh;
            if (!WIDE_STORES && key >= seqlen_k) continue;
            u16* dk =
                p.dk + SeqInfo::offset(k_begin, p.dk_batch_stride, p.dk_row_stride, key) + (i64)h_kv * p.dk_head_stride;
            u16* dv =
                p.dv + SeqInfo::offset(k_begin, p.dv_batch_stride, p.dv_row_stride, key) + (i64)h_kv * p.dv_head_stride;
#pragma unroll
            for (int g = 0; g < WG_PANELS * 8 / G; ++g) {
                // G = 4: thread q's 8 columns 8 (4 g + q) ..; G = 1: its pair 8 g + 2 q
                const int col = (DSPLIT ? wg * WG_PANELS * 64 : 0) + (G == 4 ? 8 * (4 * g + lane() % 4)
                                                                                : 8 * g + 2 * (lane() % 4));
                if (G == 1 && col >= p.headdim) continue;  // a head dim below D: TMA's zero fill
                u32 k4[G], v4[G];
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    k4[j] = pack2<T>(acc_dk[G * g + j][2 * hh], acc_dk[G * g + j][2 * hh + 1]);
                    v4[j] = pack2<T>(acc_dv[G * g + j][2 * hh] * dv_scale, acc_dv[G * g + j][2 * hh + 1] * dv_scale);
                }
                if constexpr (G == 4) {  // every lane takes part in the shuffles; 8 columns at a time past the head dim
                    quad_transpose(k4);
                    quad_transpose(v4);
                    if (key < seqlen_k && col < p.headdim) {
                        *reinterpret_cast<uint4*>(dk + col) = make_uint4(k4[0], k4[1], k4[2], k4[3]);
                        *reinterpret_cast<uint4*>(dv + col) = make_uint4(v4[0], v4[1], v4[2], v4[3]);
                    }
                } else {
                    *reinterpret_cast<u32*>(dk + col) = k4[0];
                    *reinterpret_cast<u32*>(dv + col) = v4[0];
                }
            }
        }
    }

    // x[j] of thread q of each quad becomes x[q] of thread j (a 4 x 4 transpose over the quad's lanes): two shuffle
    // stages, across lane bit 0 then bit 1, each swapping the two elements whose index differs from q in that bit.
    __device__ __forceinline__ static void quad_transpose(u32 (&x)[4]) {
#pragma unroll
        for (int bit = 1; bit <= 2; bit *= 2) {
            const bool hi = lane() & bit;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (j & bit) continue;  // pairs (j, j + bit): this thread keeps the one whose bit matches its own
                const u32 got = __shfl_xor_sync(0xFFFFFFFFu, hi ? x[j] : x[j + bit], bit);
                if (hi) x[j] = got;
                else x[j + bit] = got;
            }
        }
    }

    // Calls f(m_min, m_count, steps) for each key block of this CTA's walk, with n_key0 and backwards set; diag is
    // read per key block (the lockstep kernel's local copy, or mask.diag as begin_step leaves it). Slot x
    // takes key blocks x, 2 slots - 1 - x, 2 slots + x, ... (a snake: under a causal mask every two of them make the
    // same number of steps for every slot), walking every other one backwards (atomic mode: one).
    template <class F> __device__ __forceinline__ void walk_key_blocks(int m_blocks, const int& diag, F&& f) {
        backwards = false;
        for (int n = blockIdx.x; n < ceil_div(mask.seqlen_k, BN);
             n += backwards ? 2 * blockIdx.x + 1 : 2 * gridDim.x - 1 - 2 * blockIdx.x, backwards = !backwards) {
            n_key0 = n * BN;
            // query blocks that see keys [n BN, n BN + BN): i in [j - diag - right, j - diag + left]
            int m_min = 0, m_max = m_blocks;
            if (BAND) {
                if (p.window_right >= 0) m_min = max(0, floor_div(n * BN - diag - p.window_right, BM));
                if (p.window_left >= 0) m_max = min(m_max, floor_div(n * BN + BN - 1 - diag + p.window_left, BM) + 1);
            }
            const int m_count = max(0, m_max - m_min);
            f(m_min, m_count, m_count * p.heads_per_kv);
        }
    }

    // WS: the warp-specialized CTA and its roles (bwd_sm90_ws.cuh)
    __device__ __forceinline__ void run_ws(char* smem);
    __device__ __forceinline__ void produce_loads(int m_blocks);
    __device__ __forceinline__ void produce_rows(char* smem, int m_blocks, int seqlen_q);
    __device__ __forceinline__ void produce_dq(int m_blocks);
    __device__ __forceinline__ void consume(char* smem, int m_blocks, int seqlen_q);

    __device__ __forceinline__ void run(char* smem) {
        if constexpr (WS) run_ws(smem);
        else run_lockstep(smem);
    }

    // d = 64 with 64 query rows: 256 threads in lockstep. Thread 0 issues the loads, threads < BM store the rows, and
    // the warpgroups meet at a CTA barrier after each step, before the freed buffer is loaded again.
    __device__ __forceinline__ void run_lockstep(char* smem) {
        static_assert(!WS && !DSPLIT && !TMA_DQ, "d = 64 with 64 query rows: dQ by vector reductions");
        tid = threadIdx.x;
        wg = uniform(tid / 128);
        base = (smem_u32(smem) + 1023) & ~1023u;
        h_kv = blockIdx.y;
        b = blockIdx.z;
        const SeqInfo seq(p, b);
        q_begin = seq.q_begin;
        k_begin = seq.k_begin;
        const int diag = seq.seqlen_k - seq.seqlen_q;
        mask = Mask<BAND>{seq.seqlen_k, diag, p.window_left, p.window_right};
        const int m_blocks = ceil_div(seq.seqlen_q, BM);  // (key blocks: in the loop's test, or ptxas spills)
        if (tid == 0) {
            for (int i = 0; i < 3; ++i) sm90::mbar_init(kv_bar() + 8 * i, 1);  // kv, qd[2]
            sm90::mbar_fence_init();
        }
        __syncthreads();
        int tt = 0;  // steps so far (the Q/dO barriers' phases)
        // Each key block completes one phase of the K/V barrier (its loads, or a bare arrival where it has no
        // steps), so that phase's parity is `backwards`: no counter of loads stays live beside the step loop, which
        // at 255 registers (d = 64, 128 query rows) newer ptxas versions would spill.
        walk_key_blocks(m_blocks, diag, [&](int m_min, int m_count, int steps) {
#pragma unroll
            for (int dt = 0; dt < WG_PANELS * 8; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;
            if (tid == 0 && steps == 0) sm90::mbar_arrive(kv_bar());  // this key block's K/V phase
            if (steps > 0) {
                if (tid == 0) {
                    sm90::mbar_arrive_expect_tx(kv_bar(), 2 * KV_BYTES);
#pragma unroll
                    for (int pn = 0; pn < PANELS; ++pn) {
                        load_box(base + pn * K_PANEL, &P.k, pn * 64, h_kv, k_begin, n_key0, kv_bar());
                        load_box(base + OFF_V + pn * K_PANEL, &P.v, pn * 64, h_kv, k_begin, n_key0, kv_bar());
                    }
                }
                for (int t = 0; t < 2 && t < steps; ++t) {
                    load_step(t, tt + t, m_min, m_count);
                    if (tid < BM) store_rows(smem, tt + t, fetch_rows(t, m_min, m_count, seq.seqlen_q));
                }
                __syncthreads();  // the rows of the first two steps
                sm90::mbar_wait(kv_bar(), backwards);  // K and V of this key block
                for (int t = 0; t < steps; ++t, ++tt) {
                    float3 next_rows;  // step t + 2's, in flight during this step
                    if (tid < BM && t + 2 < steps) next_rows = fetch_rows(t + 2, m_min, m_count, seq.seqlen_q);
                    step(smem, t, tt, m_min, m_count, seq.seqlen_q);
                    __syncthreads();  // every read of this buffer (and of dS^T) is done
                    if (t + 2 < steps) {
                        load_step(t + 2, tt + 2, m_min, m_count);
                        if (tid < BM) store_rows(smem, tt + 2, next_rows);
                    }
                }
                __syncthreads();  // the last rows stores are read; K and V may be replaced
            }
            store_dkdv(seq.seqlen_k);
        });
    }
};

}  // namespace cuflash

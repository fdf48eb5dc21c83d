// Backward attention, FlashAttention-2 style (mma.sync path, sm_80+).
//
// Grid (KV block slots, KV heads, batch): a CTA owns BN = 64 keys of one KV head and walks every query block
// (of every query head sharing that KV head) that can see them, keeping dK and dV in registers. Per block of
// BM queries, eight warps:
//     S^T = K Q^T, dP^T = V dO^T         warp (key tile kb, query part): 16 keys x BM/SPLIT queries
//     P^T = exp2(S^T - lse), dS^T = P^T (dP^T - D) * scale, both to shared memory
//     dV += P^T dO, dK += dS^T Q         warp (key tile kb, column part): 16 keys x D/SPLIT
//     dQ = dS K -> fp32 accumulator      warp (query tile, column slice)
// dQ is added atomically into one fp32 buffer (default) or, in deterministic mode, by CTA x into its own slice x,
// where only one thread ever adds to an element, in the order the CTA walks KV blocks x, x + slots, ...;
// bwd_convert_dq sums the slices in a fixed order. Packed variable-length batches run the same code, with the
// offsets and lengths of sequence b from seqlen.cuh; a CTA past the end of a shorter sequence's keys does nothing.
#include "params.cuh"
#include "seqlen.cuh"
#include "tile.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "dropout.cuh"

namespace cuflash {

template <class T_, int D, int BM_, int BN_, int WARPS_, int QBUF_>
struct BwdTraits {
    using T = T_;
    static constexpr int HEADDIM = D, DP = (D + 63) / 64 * 64;
    static constexpr int WARPS = WARPS_, THREADS = WARPS * 32;
    static constexpr int BN = BN_;           // keys per CTA
    static constexpr int BM = BM_;           // queries per step
    static constexpr int KT = BN / 16;       // 16-key tiles: warp w owns tile w % KT ...
    static constexpr int SPLIT = WARPS / KT; // ... and part w / KT of the queries (S^T) and of the columns (dK, dV)
    static constexpr int NQW = BM / SPLIT / 8;  // 8-query tiles of S^T per warp
    static constexpr int DTW = D / SPLIT / 8;   // 8-column tiles of dK, dV per warp
    static constexpr int WQ = BM / 16;       // dQ product: WQ query tiles x (WARPS / WQ) column slices
    static constexpr int DQ_TILES = D / 8 / (WARPS / WQ);
    static constexpr int QBUF = QBUF_;       // Q/dO buffers: 2 loads the next query block while one computes
    // Above d = 128 registers are short: the k-loops of the products stay rolled (unrolled fully below).
    static constexpr bool WIDE = D > 128;
    // Dropout's keep bits need registers the wide kernels, the 64-key d = 128 kernels (on sm_80: the score-mod
    // ones) and, on sm_90a, the double-buffered ones do not have (ptxas spills); calls with dropout take a kernel
    // where DROPOUT holds (cuflash.ops.backward.dropout_config). DROPOUT_MOD: also with a score mod.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static constexpr bool DROPOUT = !WIDE && QBUF == 1 && !(D == 128 && BN == 64);
    static constexpr bool DROPOUT_MOD = DROPOUT;
#else
    static constexpr bool DROPOUT = !WIDE;
    static constexpr bool DROPOUT_MOD = DROPOUT && !(D == 128 && BN == 64);
#endif
    static constexpr int KS_UNROLL = WIDE ? 1 : D / 16, KK_UNROLL = WIDE ? 1 : BM / 16,
                         DQ_K_UNROLL = WIDE ? 1 : BN / 16;
    using KVTile = SmemTile<BN, DP>;
    using QTile = SmemTile<BM, DP>;
    using PTile = SmemTile<BN, 64>;          // P^T and dS^T: keys x queries
    static_assert(BM == 64 && WARPS == 8 && (BN == 64 || BN == 32),
                  "8 warps as 4 key tiles x 2 parts (64 keys) or 2 x 4 (32 keys); one 64-column panel holds P^T, dS^T");
    static_assert(D % 32 == 0 && NQW % 2 == 0 && DTW % 2 == 0 && DQ_TILES % 2 == 0, "parts made of 16-wide pairs");
    static_assert(QBUF == 1 || QBUF == 2, "one or two Q/dO buffers");
    // Shared-memory map (bytes from the start): K, V, then per buffer Q and dO, then P^T, dS^T, then per buffer
    // lse and D (BM floats each).
    static constexpr u32 OFF_K = 0, OFF_V = KVTile::BYTES, OFF_Q = 2 * KVTile::BYTES;
    static constexpr u32 OFF_P = OFF_Q + QBUF * 2 * QTile::BYTES, OFF_DS = OFF_P + PTile::BYTES;
    static constexpr u32 OFF_LSE = OFF_DS + PTile::BYTES, SMEM_BYTES = OFF_LSE + QBUF * 2 * BM * 4;
    __device__ static constexpr u32 q_tile(int buf) { return OFF_Q + buf * 2 * QTile::BYTES; }
    __device__ static constexpr u32 do_tile(int buf) { return q_tile(buf) + QTile::BYTES; }
};

template <class Traits, bool BAND, bool SCORE_MOD>
struct BwdBlock {
    using T = typename Traits::T;
    static constexpr int D = Traits::HEADDIM, DP = Traits::DP, BN = Traits::BN, BM = Traits::BM;
    static constexpr int THREADS = Traits::THREADS, NQW = Traits::NQW, DTW = Traits::DTW;
    using KVTile = typename Traits::KVTile;
    using QTile = typename Traits::QTile;
    using PTile = typename Traits::PTile;
    using KVCopy = TileCopy<BN, D, DP, THREADS>;
    using QCopy = TileCopy<BM, D, DP, THREADS>;

    const BwdParams& p;
    int tid, lane, warp, kb, half;  // kb: this warp's 16-key tile; half: its query part / column part (of SPLIT)
    u32 smem0;                      // shared-memory address of the block's buffer; tiles at Traits::OFF_*
    float* s_rows;                  // per buffer: lse_log2 of the block's queries (+inf past seqlen_q), then D (0)
    Mask<BAND> mask;
    ScoreMod mod;
    float acc_dk[DTW][4], acc_dv[DTW][4];

    __device__ __forceinline__ explicit BwdBlock(const BwdParams& params) : p(params) {}

    // This CTA's sequence (seqlen.cuh). Its lengths live in `mask`; its starts are read where they are needed, as
    // registers are short (a padded batch reads nothing).
    __device__ __forceinline__ int seqlen_q() const { return mask.seqlen_k - mask.diag; }
    __device__ __forceinline__ int q_begin() const { return SeqInfo::q_begin_of(p, blockIdx.z); }
    __device__ __forceinline__ int k_begin() const { return SeqInfo::k_begin_of(p, blockIdx.z); }

    // Address of this lane's ldmatrix row for the 16 x 16 piece at rows row16 + (lane pattern), 16-byte chunks
    // chunk + (0 | 1) of a tile. `b_layout`: the lane pattern of a B operand / of a transposed A (rows 0-7 | 8-15
    // at the second chunk first); else that of an A operand / of a transposed B.
    template <class Tile>
    __device__ __forceinline__ u32 ldm(u32 tile, int row16, int chunk, bool b_layout) const {
        const int row = b_layout ? lane % 8 + (lane / 16) * 8 : lane % 8 + ((lane / 8) % 2) * 8;
        const int lo = b_layout ? (lane / 8) % 2 : lane / 16;
        return smem0 + tile + Tile::offset(row16 + row, chunk + lo);
    }

    // acc[this warp's 16 keys x its BM/2 queries] = X Y^T over D: S^T (X = K, Y = Q) and dP^T (X = V, Y = dO).
    __device__ __forceinline__ void keys_by_queries(float (&acc)[1][NQW][4], u32 x_tile, u32 y_tile) const {
        const LdmatrixAddr<KVTile> xa(smem0 + x_tile, kb * 16 + lane % 16, lane / 16);
        const LdmatrixAddr<QTile> yb(smem0 + y_tile, half * (BM / Traits::SPLIT) + lane % 8 + (lane / 16) * 8,
                                     (lane / 8) % 2);
#pragma unroll
        for (int nt = 0; nt < NQW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[0][nt][e] = 0.f;
#pragma unroll Traits::KS_UNROLL
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 a[4];
            ldmatrix_x4(a, xa(0, ks));
#pragma unroll
            for (int np = 0; np < NQW / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, yb(np, ks));
                mma_16816<T>(acc[0][2 * np], a, b[0], b[1]);
                mma_16816<T>(acc[0][2 * np + 1], a, b[2], b[3]);
            }
        }
    }

    // acc[this warp's 16 keys x its D/2 columns] += A[16 keys x BM queries] Y[BM x D]: A (P^T or dS^T) from its
    // shared tile, Y (dO or Q, rows = queries) transposed.
    __device__ __forceinline__ void accumulate(float (&acc)[DTW][4], u32 a_tile, u32 y_tile) const {
        u32 y_addr[DTW / 2];  // the warp's column part is a run-time offset: form these few addresses here
#pragma unroll
        for (int dp = 0; dp < DTW / 2; ++dp) y_addr[dp] = ldm<QTile>(y_tile, 0, half * DTW + 2 * dp, false);
        const LdmatrixAddr<PTile> aa(smem0 + a_tile, kb * 16 + lane % 16, lane / 16);
#pragma unroll Traits::KK_UNROLL
        for (int kk = 0; kk < BM / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, aa(0, kk));
#pragma unroll
            for (int dp = 0; dp < DTW / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, y_addr[dp] + kk * 16 * 128);
                mma_16816<T>(acc[2 * dp], a, b[0], b[1]);
                mma_16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
            }
        }
    }

    // dQ[query tile x column slice] = dS K, added to the fp32 accumulator. dS^T and K are read transposed.
    __device__ __forceinline__ void dq_product(int row0, int h, int q_begin) const {
        // At most 8 column tiles at a time (32 accumulators): wide head dims take their columns in several passes.
        constexpr int TILES = Traits::DQ_TILES, CHUNK = TILES < 8 ? TILES : 8;
        static_assert(TILES % CHUNK == 0, "whole passes");
#pragma unroll 1
        for (int c0 = 0; c0 < TILES; c0 += CHUNK) dq_columns<CHUNK>(row0, h, q_begin, (warp / Traits::WQ) * TILES + c0);
    }

    // dQ[query tile x column tiles col_tile0 .. + TILES] = dS K, added to the fp32 accumulator.
    template <int TILES>
    __device__ __forceinline__ void dq_columns(int row0, int h, int q_begin, int col_tile0) const {
        const int seqlen_q = this->seqlen_q();
        // Formed here from values the CTA can read again at no cost, rather than a pointer held through the loops.
        float* dq_base = p.dq_accum + (p.deterministic ? (i64)blockIdx.x * p.dq_slice_stride : 0) +
                         SeqInfo::offset(q_begin, p.dq_batch_stride, 0, 0) + (i64)h * p.headdim;
        const int q_tile = warp % Traits::WQ;
        const u32 ds_addr = ldm<PTile>(Traits::OFF_DS, 0, 2 * q_tile, true);
        u32 k_addr[TILES / 2];
#pragma unroll
        for (int dp = 0; dp < TILES / 2; ++dp) k_addr[dp] = ldm<KVTile>(Traits::OFF_K, 0, col_tile0 + 2 * dp, false);
        float acc[TILES][4];
#pragma unroll
        for (int dt = 0; dt < TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;
#pragma unroll Traits::DQ_K_UNROLL
        for (int k16 = 0; k16 < BN / 16; ++k16) {
            u32 a[4];
            ldmatrix_x4_trans(a, ds_addr + k16 * 16 * 128);  // (q0-7,k0-7) (q8-15,k0-7) (q0-7,k8-15) (q8-15,k8-15)
#pragma unroll
            for (int dp = 0; dp < TILES / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, k_addr[dp] + k16 * 16 * 128);
                mma_16816<T>(acc[2 * dp], a, b[0], b[1]);
                mma_16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int dt = 0; dt < TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + q_tile * 16 + lane / 4 + 8 * (e / 2);
                const int c = (col_tile0 + dt) * 8 + 2 * (lane % 4) + e % 2;
                // Deterministic mode gives each CTA its own slice: one thread adds to an element, in loop order.
                if (r < seqlen_q && c < p.headdim) atomicAdd(dq_base + (i64)r * p.nheads * p.headdim + c, acc[dt][e]);
            }
    }

    // Writes 16-bit fragments (rows = this warp's keys, columns = its query part) into a keys x queries tile.
    __device__ __forceinline__ void store_keys_by_queries(u32 tile, const float (&x)[1][NQW][4]) const {
#pragma unroll
        for (int nt = 0; nt < NQW; ++nt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int r = kb * 16 + lane / 4 + 8 * h2, c = half * (BM / Traits::SPLIT) + nt * 8 + 2 * (lane % 4);
                st_shared(smem0 + tile + PTile::offset(r, c / 8) + (c % 8) * 2,
                          pack2<T>(x[0][nt][2 * h2], x[0][nt][2 * h2 + 1]));
            }
    }

    // Issues the loads of query block m of head h into buffer `buf`: Q and dO by cp.async (one commit group), lse and
    // D by plain loads into shared memory.
    __device__ __forceinline__ void load_queries(int h, int m, int buf) {
        const int row0 = m * BM, seqlen_q = this->seqlen_q(), q_begin = this->q_begin();
        const u16* q =
            p.q + SeqInfo::offset(q_begin, p.q_batch_stride, p.q_row_stride, row0) + (i64)h * p.q_head_stride;
        const u16* dout =
            p.dout + SeqInfo::offset(q_begin, p.do_batch_stride, p.do_row_stride, row0) + (i64)h * p.do_head_stride;
        QCopy::load_async(smem0 + Traits::q_tile(buf), q, p.q_row_stride, seqlen_q - row0, p.headdim, tid);
        QCopy::load_async(smem0 + Traits::do_tile(buf), dout, p.do_row_stride, seqlen_q - row0, p.headdim, tid);
        cp_async_commit();
        if (tid < BM) {
            const i64 i = SeqInfo::offset(q_begin, p.lse_batch_stride, 1, row0 + tid) + (i64)h * p.lse_head_stride;
            const bool valid = row0 + tid < seqlen_q;
            s_rows[buf * 2 * BM + tid] = valid ? p.lse_log2[i] : __int_as_float(0x7f800000);  // +inf: P = 0
            s_rows[buf * 2 * BM + BM + tid] = valid ? p.dsum[i] : 0.f;
        }
    }

    // Query block m of head h from buffer `buf` (landed, and visible to every thread): dK, dV and dQ updates. Ends with
    // a CTA barrier, after which the buffer, P^T and dS^T may be overwritten.
    template <bool MASK>
    __device__ __forceinline__ void compute(int h, int n, int m, int buf) {
        const int row0 = m * BM;
        const float* s_lse = s_rows + buf * 2 * BM;
        const float* s_dsum = s_lse + BM;
        // ---- S^T and dP^T for 16 keys x BM/2 queries; P^T and dS^T element by element, so that softcap's
        // derivative is used where it is computed ----
        const int key0 = n * BN + kb * 16, q0 = row0 + half * (BM / Traits::SPLIT);
        // dropout: out = (P M / keep) V, so dV takes P M / keep and dS = P (dP M / keep - D). The keep bits (one
        // word per pair of query tiles) are drawn before S^T and dP^T occupy their registers, so that the
        // generator's state never lives beside them. Only in the kernels that have the registers for them
        // (BwdTraits::DROPOUT, DROPOUT_MOD).
        const bool dropping =
            (SCORE_MOD ? Traits::DROPOUT_MOD : Traits::DROPOUT) && p.dropout_threshold < (int)Dropout::LEVELS;
        u32 kept[NQW / 2];
#pragma unroll
        for (int np = 0; np < NQW / 2; ++np)
            kept[np] = dropping ? Dropout::of(p, blockIdx.z * p.nheads + h)
                                      .template keep_mask_cols<2>(key0 / 16, q0 / 16 + np, lane)
                                : ~0u;
        float s[1][NQW][4], dp[1][NQW][4];
        keys_by_queries(dp, Traits::OFF_V, Traits::do_tile(buf));
        keys_by_queries(s, Traits::OFF_K, Traits::q_tile(buf));
        u32 dtanh[1][NQW][2];  // softcap's derivative, fp16 pairs (score-mod kernels only)
        if constexpr (SCORE_MOD) mod.template apply<true>(s, key0, q0, lane, dtanh);
        if (MASK) mask.apply_transposed(s, key0, q0, lane);
        const int col = half * (BM / Traits::SPLIT) + 2 * (lane % 4);
#pragma unroll
        for (int np = 0; np < NQW / 2; ++np) {
#pragma unroll
            for (int ch = 0; ch < 2; ++ch) {
                const int nt = 2 * np + ch;
                const float2 l = *reinterpret_cast<const float2*>(s_lse + col + nt * 8);
                const float2 dd = *reinterpret_cast<const float2*>(s_dsum + col + nt * 8);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float prob = exp2f(s[0][nt][e] * p.scale_log2 - (e % 2 ? l.y : l.x));
                    const float keep = dropping ? ((kept[np] >> (ch * 4 + e)) & 1u ? p.dropout_scale : 0.f) : 1.f;
                    float ds = prob * (dp[0][nt][e] * keep - (e % 2 ? dd.y : dd.x)) * p.softmax_scale;
                    if constexpr (SCORE_MOD) {
                        const u32 pair = dtanh[0][nt][e / 2];
                        ds *= to_float<half_t>(e % 2 ? (u16)(pair >> 16) : (u16)(pair & 0xffff));
                    }
                    s[0][nt][e] = prob * keep;
                    dp[0][nt][e] = ds;
                }
            }
        }
        store_keys_by_queries(Traits::OFF_P, s);
        store_keys_by_queries(Traits::OFF_DS, dp);
        __syncthreads();

        // ---- dV += P^T dO, dK += dS^T Q, dQ += dS K ----
        accumulate(acc_dv, Traits::OFF_P, Traits::do_tile(buf));
        accumulate(acc_dk, Traits::OFF_DS, Traits::q_tile(buf));
        dq_product(row0, h, this->q_begin());
        __syncthreads();  // before the next step overwrites this buffer, P, dS
    }

    // One query block, loaded and computed (one buffer).
    template <bool MASK>
    __device__ __forceinline__ void step(int h, int n, int m) {
        load_queries(h, m, 0);
        cp_async_wait<0>();
        __syncthreads();
        compute<MASK>(h, n, m, 0);
    }

    __device__ __forceinline__ void store_dkdv(int h_kv, int n) const {
        const int k_begin = this->k_begin();
#pragma unroll
        for (int dt = 0; dt < DTW; ++dt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int key = n * BN + kb * 16 + lane / 4 + 8 * h2, c = (half * DTW + dt) * 8 + 2 * (lane % 4);
                if (key < mask.seqlen_k && c < p.headdim) {
                    *reinterpret_cast<u32*>(p.dk + SeqInfo::offset(k_begin, p.dk_batch_stride, p.dk_row_stride, key) +
                                            (i64)h_kv * p.dk_head_stride + c) =
                        pack2<T>(acc_dk[dt][2 * h2], acc_dk[dt][2 * h2 + 1]);
                    *reinterpret_cast<u32*>(p.dv + SeqInfo::offset(k_begin, p.dv_batch_stride, p.dv_row_stride, key) +
                                            (i64)h_kv * p.dv_head_stride + c) =
                        pack2<T>(acc_dv[dt][2 * h2], acc_dv[dt][2 * h2 + 1]);
                }
            }
    }

    __device__ __forceinline__ void run(char* smem) {
        tid = threadIdx.x;
        lane = tid % 32;
        warp = tid / 32;
        kb = warp % Traits::KT;
        half = warp / Traits::KT;
        smem0 = smem_u32(smem);
        s_rows = reinterpret_cast<float*>(smem + Traits::OFF_LSE);
        const int h_kv = blockIdx.y;
        const SeqInfo seq(p, blockIdx.z);
        const int diag = seq.seqlen_k - seq.seqlen_q;
        mask = Mask<BAND>{seq.seqlen_k, diag, p.window_left, p.window_right};
        // A packed sequence shorter than the longest has fewer KV blocks: the loop below may not run at all. One
        // without queries still writes dK = dV = 0 for its keys.
        const int n_blocks = ceil_div(seq.seqlen_k, BN), m_blocks = ceil_div(seq.seqlen_q, BM);

        for (int n = blockIdx.x; n < n_blocks; n += gridDim.x) {
            // ---- prologue: this CTA's K and V ----
            const int k_begin = this->k_begin();
            const i64 k_off =
                SeqInfo::offset(k_begin, p.k_batch_stride, p.k_row_stride, n * BN) + (i64)h_kv * p.k_head_stride;
            const i64 v_off =
                SeqInfo::offset(k_begin, p.v_batch_stride, p.v_row_stride, n * BN) + (i64)h_kv * p.v_head_stride;
            KVCopy::load_async(smem0 + Traits::OFF_K, p.k + k_off, p.k_row_stride, mask.seqlen_k - n * BN, p.headdim,
                               tid);
            KVCopy::load_async(smem0 + Traits::OFF_V, p.v + v_off, p.v_row_stride, mask.seqlen_k - n * BN, p.headdim,
                               tid);
            cp_async_commit();
#pragma unroll
            for (int dt = 0; dt < DTW; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

            // Query blocks that can see keys [n*BN, n*BN + BN): i in [j - diag - right, j - diag + left].
            int m_min = 0, m_max = m_blocks;
            if (BAND) {
                if (p.window_right >= 0) m_min = max(0, floor_div(n * BN - diag - p.window_right, BM));
                if (p.window_left >= 0) m_max = min(m_max, floor_div(n * BN + BN - 1 - diag + p.window_left, BM) + 1);
            }
            const bool tail = (n + 1) * BN > mask.seqlen_k;
            int buf = 0;  // two buffers: the one block (h, m) is in; the next block's loads go to the other
            if (Traits::QBUF == 2 && m_min < m_max) load_queries(h_kv * p.heads_per_kv, m_min, 0);
            for (int i = 0; i < p.heads_per_kv; ++i) {
                const int h = h_kv * p.heads_per_kv + i;
                if (SCORE_MOD)
                    mod = ScoreMod{p.mod_scale, p.softcap,
                                   p.alibi != nullptr ? p.alibi[(i64)blockIdx.z * p.alibi_batch_stride + h] : 0.f,
                                   diag};
                for (int m = m_min; m < m_max; ++m) {
                    // Unmasked iff every (query, key) pair of the tile is inside the band and below seqlen_k.
                    bool full = !tail;
                    if (BAND) {
                        if (p.window_right >= 0) full = full && n * BN + BN - 1 <= m * BM + diag + p.window_right;
                        if (p.window_left >= 0) full = full && n * BN >= m * BM + BM - 1 + diag - p.window_left;
                    }
                    if constexpr (Traits::QBUF == 2) {
                        cp_async_wait<0>();
                        __syncthreads();  // block (h, m) has landed; the other buffer's last readers are done
                        if (m + 1 < m_max) load_queries(h, m + 1, buf ^ 1);          // overlaps the compute below
                        else if (i + 1 < p.heads_per_kv) load_queries(h + 1, m_min, buf ^ 1);
                        if (full && !SCORE_MOD) compute<false>(h, n, m, buf);
                        else compute<true>(h, n, m, buf);
                        buf ^= 1;
                    } else if (full && !SCORE_MOD) {  // score-mod kernels keep one (masked) copy of the step
                        step<false>(h, n, m);
                    } else {
                        step<true>(h, n, m);
                    }
                }
            }
            cp_async_wait<0>();  // a CTA whose keys no query sees never waited for its K and V
            __syncthreads();     // (and the next KV block's loads must not overtake this one's last reads)
            store_dkdv(h_kv, n);
        }
    }
};

template <class T, int D, int BM, int BN, int WARPS, int QBUF, bool BAND, bool SCORE_MOD>
__global__ void __launch_bounds__(WARPS * 32, 1) bwd_kernel(const __grid_constant__ BwdParams p) {
    extern __shared__ __align__(1024) char smem[];
    BwdBlock<BwdTraits<T, D, BM, BN, WARPS, QBUF>, BAND, SCORE_MOD> block(p);
    block.run(smem);
}

}  // namespace cuflash

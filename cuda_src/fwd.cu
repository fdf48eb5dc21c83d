// Forward attention, FlashAttention-2 style (mma.sync path, sm_80+).
//
// Grid (query blocks, heads, batch): one CTA owns BM query rows of one (batch, head) and walks the KV blocks its
// rows can see, from the last to the first. Each warp owns BM / WARPS whole rows (split-Q), so the softmax needs no
// inter-warp reduction; K and V tiles are shared in shared memory. Per KV block n:
//     wait K[n] | issue V[n] | S = Q K[n]^T | mask, online softmax | wait V[n] | issue K[n-1] | O += P V[n]
// so each tile's load overlaps the other's math. Normalization by the row sum waits for the epilogue.
// Packed variable-length batches run the same code: seqlen.cuh says where sequence b starts and how long it is,
// and CTAs past the end of a shorter sequence exit at once (the grid is sized for the longest). A packed batch may
// take its keys from a page pool (block_table: chunked prefill against a paged KV cache), gathered row by row, and
// its key counts from seqused_k; both are read from device memory, so they are bounded (seqlen.cuh).
#include "params.cuh"
#include "seqlen.cuh"
#include "tile.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "dropout.cuh"

namespace cuflash {

template <class T_, int D, int BM_, int BN_, int WARPS_, bool Q_IN_REGS_>
struct FwdTraits {
    using T = T_;
    static constexpr int HEADDIM = D;                 // compiled head dim; the real one may be smaller
    static constexpr int DP = (D + 63) / 64 * 64;     // shared-memory row width: whole 128-byte panels
    static constexpr int BM = BM_, BN = BN_, WARPS = WARPS_, THREADS = WARPS * 32;
    static constexpr int ROWS_PER_WARP = BM / WARPS;
    static constexpr int MT = ROWS_PER_WARP / 16;     // 16-row mma tiles per warp
    static constexpr int NT = BN / 8;                 // 8-column tiles of S
    static constexpr int DT = D / 8;                  // 8-column tiles of O
    // Dropout's keep bits beside a warp's scores: configurations with at most 16 score tiles a warp (the 128 x 128
    // 4-warp one holds 32 and has no registers to spare; cuflash.ops.forward plans dropout calls elsewhere).
    static constexpr bool DROPOUT_FITS = MT * NT <= 16;
    // Q's A fragments held in registers for the whole loop: halves the shared-memory traffic of S = Q K^T, at
    // D / 4 registers per 16-row tile. Pays off when a warp owns one 16-row tile (its B fragments are not reused).
    static constexpr bool Q_IN_REGS = Q_IN_REGS_;
    using QTile = SmemTile<BM, DP>;
    using KVTile = SmemTile<BN, DP>;
    static constexpr int SMEM_BYTES = QTile::BYTES + 2 * KVTile::BYTES;  // Q, K, V; O reuses Q's space

    static_assert(ROWS_PER_WARP % 16 == 0, "each warp owns whole 16-row mma tiles");
    static_assert(BN % 16 == 0 && D % 16 == 0, "ldmatrix.x4 loads 16 x 16 pieces");
};

// DROPOUT: the kernel applies FwdParams' dropout (a template flag: its registers and branches slow the kernels
// without it by up to 8%, docs/perf-notes.md).
template <class Traits, bool BAND, bool SCORE_MOD, bool DROPOUT>
struct FwdBlock {
    static_assert(!DROPOUT || Traits::DROPOUT_FITS, "dropout's keep bits need registers this configuration lacks");
    using T = typename Traits::T;
    static constexpr int D = Traits::HEADDIM, DP = Traits::DP, BM = Traits::BM, BN = Traits::BN;
    static constexpr int THREADS = Traits::THREADS, MT = Traits::MT, NT = Traits::NT, DT = Traits::DT;
    using QTile = typename Traits::QTile;
    using KVTile = typename Traits::KVTile;
    using QCopy = TileCopy<BM, D, DP, THREADS>;
    using KVCopy = TileCopy<BN, D, DP, THREADS>;

    const FwdParams& p;
    int tid, lane, warp_row0;  // warp_row0: the warp's first row inside the block
    int row0;                  // first query row of the block
    int n_min;
    u32 sQ, sK, sV;
    // ldmatrix lanes: Q as A (matrices: rows 0-7 | 8-15 at chunk 0, then at chunk 1), K as B (keys 0-7 at chunks
    // 0 | 1, then keys 8-15), V as transposed B (keys 0-7 | 8-15 at chunk 0, then at chunk 1).
    LdmatrixAddr<QTile> q_addr;
    LdmatrixAddr<KVTile> k_addr, v_addr;
    const u16* k_gmem;  // K and V of this (batch, kv head), row 0
    const u16* v_gmem;
    Mask<BAND> mask;
    ScoreMod mod;
    OnlineSoftmax<MT> softmax;
    float acc_o[MT][DT][4];
    u32 q_frag[Traits::Q_IN_REGS ? MT : 1][Traits::Q_IN_REGS ? D / 16 : 1][4];

    __device__ __forceinline__ explicit FwdBlock(const FwdParams& params)
        : p(params), q_addr(0, 0, 0), k_addr(0, 0, 0), v_addr(0, 0, 0) {}

    __device__ __forceinline__ void load_kv(u32 dst, const u16* gmem, i64 row_stride, i64 page_stride, int n) {
        if (p.block_table == nullptr) {
            KVCopy::load_async(dst, gmem + (i64)n * BN * row_stride, row_stride, mask.seqlen_k - n * BN, p.headdim,
                               tid);
        } else {  // paged: each row from its page (a page the pool does not have reads as zeros)
            const int* pages = p.block_table + (i64)blockIdx.z * p.block_table_stride;
            KVCopy::load_rows_async(dst, [&](int r) -> const u16* {
                const int pos = n * BN + r;
                if (pos >= mask.seqlen_k) return nullptr;
                const int page = pages[pos / p.page_size];
                return page >= 0 && page < p.num_pages
                    ? gmem + (i64)page * page_stride + (i64)(pos % p.page_size) * row_stride : nullptr;
            }, p.headdim, gmem, tid);
        }
        cp_async_commit();
    }

    // S = Q K^T for this warp's rows: A fragments of Q and B fragments of K straight from swizzled shared memory.
    __device__ __forceinline__ void qk(float (&s)[MT][NT][4]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (Traits::Q_IN_REGS) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][ks][e];
                } else {
                    ldmatrix_x4(a[mt], q_addr(warp_row0 / 16 + mt, ks));
                }
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 b[4];  // two 8-key tiles: {b0, b1} of keys np*16.., then of keys np*16+8..
                ldmatrix_x4(b, k_addr(np, ks));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }

    // P as 16-bit A fragments, straight from the S accumulators (the fp32 scores die here, freeing registers).
    __device__ __forceinline__ void to_a_fragments(const float (&s)[MT][NT][4], u32 (&pa)[MT][BN / 16][4]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                pa[mt][kk][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][kk][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][kk][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
    }

    // O += P V, P from registers, V through transposing ldmatrix (V is row-major (key, d); B wants k-major).
    __device__ __forceinline__ void pv(const u32 (&pa)[MT][BN / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_addr(kk, dp));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(acc_o[mt][2 * dp], pa[mt][kk], b[0], b[1]);
                    mma_16816<T>(acc_o[mt][2 * dp + 1], pa[mt][kk], b[2], b[3]);
                }
            }
        }
    }

    // One KV block. MASK: element-wise masking (diagonal, window edge, or the seqlen_k tail). FIRST: no rescale.
    template <bool MASK, bool FIRST>
    __device__ __forceinline__ void step(int n) {
        if (FIRST) {
            cp_async_wait<1>();  // Q and K[n] have landed; V[n], issued by the prologue, may still fly
            __syncthreads();
        } else {
            cp_async_wait<0>();
            __syncthreads();  // K[n] has landed, and every warp is done reading V[n+1]
            load_kv(sV, v_gmem, p.v_row_stride, p.v_batch_stride, n);
        }
        if (FIRST && Traits::Q_IN_REGS) {  // Q landed with K[n]
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(q_frag[mt][ks], q_addr(warp_row0 / 16 + mt, ks));
        }

        const bool dropping = DROPOUT && p.dropout_threshold < (int)Dropout::LEVELS;
        u32 kept[MT][(4 * NT + 31) / 32];  // dropout's keep bits, drawn before the scores take their registers
        if (dropping) {
            const Dropout dropout = Dropout::of(p, blockIdx.z * p.nheads + blockIdx.y);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                dropout.keep_rows<NT>(kept[mt], (row0 + warp_row0) / 16 + mt, n * BN / 16, lane);
        }
        float s[MT][NT][4];
        qk(s);
        int row = row0 + warp_row0, col = n * BN;
        if (SCORE_MOD) mod.apply(s, row, col, lane);
        if (MASK) mask.apply(s, row, col, lane);
        softmax.template update<FIRST, MASK>(s, acc_o, p.scale_log2);
        if (dropping) {  // after the row sums took every probability, before P V
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Dropout::drop<NT>(s[mt], kept[mt]);
        }
        u32 pa[MT][BN / 16][4];
        to_a_fragments(s, pa);

        cp_async_wait<0>();
        __syncthreads();  // V[n] has landed, and every warp is done reading K[n]
        if (n > n_min) load_kv(sK, k_gmem, p.k_row_stride, p.k_batch_stride, n - 1);
        pv(pa);
    }

    __device__ __forceinline__ void epilogue(char* smem, int h) {
        const SeqInfo seq(p, blockIdx.z);  // read again rather than held in registers through the main loop
        cp_async_wait<0>();
        __syncthreads();  // Q's shared memory is free for staging O
        float lse[MT][2];
        softmax.finalize(acc_o, p.scale_log2, lse);
        if (DROPOUT && p.dropout_threshold < (int)Dropout::LEVELS) {  // the kept probabilities' scale
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= p.dropout_scale;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2) {
                    int r = warp_row0 + mt * 16 + lane / 4 + 8 * h2;
                    *reinterpret_cast<u32*>(smem + QTile::offset(r, dt) + (lane % 4) * 4) =
                        pack2<T>(acc_o[mt][dt][2 * h2], acc_o[mt][dt][2 * h2 + 1]);
                }
        __syncthreads();  // through shared memory so that global stores are 16 bytes wide and coalesced
        u16* o_gmem = p.o + seq.q_offset(p.o_batch_stride, p.o_row_stride, row0) + (i64)h * p.o_head_stride;
        QCopy::store(o_gmem, p.o_row_stride, sQ, seq.seqlen_q - row0, p.headdim, tid);

        if (p.lse != nullptr && lane % 4 == 0) {
            float* lse_row = p.lse + seq.q_offset(p.lse_batch_stride, 1) + (i64)h * p.lse_head_stride;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2) {
                    int r = row0 + warp_row0 + mt * 16 + lane / 4 + 8 * h2;
                    if (r < seq.seqlen_q) lse_row[r] = lse[mt][h2];
                }
        }
    }

    __device__ __forceinline__ void run(char* smem) {
        const int m_block = BAND ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // band: longest rows first
        const int h = blockIdx.y, h_kv = h / p.heads_per_kv;
        SeqInfo seq(p, blockIdx.z);
        if (p.cu_seqlens_q != nullptr) seq.seqlen_k = SeqInfo::bounded_seqlen_k(p, seq.seqlen_k, blockIdx.z);
        row0 = m_block * BM;
        if (row0 >= seq.seqlen_q) return;  // a packed sequence shorter than the longest: the whole CTA leaves
        tid = threadIdx.x;
        lane = tid % 32;
        warp_row0 = (tid / 32) * Traits::ROWS_PER_WARP;
        sQ = smem_u32(smem);
        sK = sQ + QTile::BYTES;
        sV = sK + KVTile::BYTES;
        q_addr = LdmatrixAddr<QTile>(sQ, lane % 16, lane / 16);
        k_addr = LdmatrixAddr<KVTile>(sK, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
        v_addr = LdmatrixAddr<KVTile>(sV, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
        const int k_begin = p.block_table != nullptr ? 0 : seq.k_begin;  // paged: page 0, row 0 of the KV head
        k_gmem = p.k + SeqInfo::offset(k_begin, p.k_batch_stride, p.k_row_stride, 0) + (i64)h_kv * p.k_head_stride;
        v_gmem = p.v + SeqInfo::offset(k_begin, p.v_batch_stride, p.v_row_stride, 0) + (i64)h_kv * p.v_head_stride;
        mask = Mask<BAND>{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
        if (SCORE_MOD) {
            float slope = p.alibi != nullptr ? p.alibi[(i64)blockIdx.z * p.alibi_batch_stride + h] : 0.f;
            mod = ScoreMod{p.mod_scale, p.softcap, slope, seq.seqlen_k - seq.seqlen_q};
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
        softmax.reset();

        // ---- prologue: Q and the last visible K block ----
        const BlockRange range = block_range<BM, BN, BAND>(mask, row0);
        n_min = range.n_min;
        int n = range.n_max - 1;
        if (n >= n_min) {
            const u16* q_gmem = p.q + seq.q_offset(p.q_batch_stride, p.q_row_stride, row0) + (i64)h * p.q_head_stride;
            QCopy::load_async(sQ, q_gmem, p.q_row_stride, seq.seqlen_q - row0, p.headdim, tid);
            load_kv(sK, k_gmem, p.k_row_stride, p.k_batch_stride, n);  // one group: Q and K[n]
            load_kv(sV, v_gmem, p.v_row_stride, p.v_batch_stride, n);  // a second: V[n] is needed after softmax

            // ---- main loop, downwards: masked diagonal blocks, unmasked interior, masked window edge ----
            if (n > range.full_hi || n < range.full_lo)
                step<true, true>(n);
            else
                step<false, true>(n);
            for (--n; n >= n_min && n > range.full_hi; --n) step<true, false>(n);
            for (; n >= n_min && n >= range.full_lo; --n) step<false, false>(n);
            if (BAND)  // without a band, the unmasked run reaches block 0
                for (; n >= n_min; --n) step<true, false>(n);
        }
        // ---- epilogue: normalize, stage O through shared memory, write O and lse ----
        epilogue(smem, h);
    }
};

template <class T, int D, int BM, int BN, int WARPS, bool Q_IN_REGS, bool BAND, bool SCORE_MOD, bool DROPOUT>
__global__ void __launch_bounds__(WARPS * 32) fwd_kernel(const __grid_constant__ FwdParams p) {
    extern __shared__ __align__(1024) char smem[];
    FwdBlock<FwdTraits<T, D, BM, BN, WARPS, Q_IN_REGS>, BAND, SCORE_MOD, DROPOUT> block(p);
    block.run(smem);
}

}  // namespace cuflash

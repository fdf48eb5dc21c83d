// Which keys a query row may see, and which KV blocks of a query block need element-wise masking.
//
// Bottom-right aligned band: query i sees key j iff  j < seqlen_k  and
//     i + diag - left <= j <= i + diag + right,   diag = seqlen_k - seqlen_q,  -1 = unbounded side.
// Causal is the band (-1, 0). Blocks strictly inside the band and below seqlen_k run unmasked.
#pragma once
#include "softmax.cuh"

namespace cuflash {

template <bool BAND>
struct Mask {
    int seqlen_k, diag, left, right;

    // Sets invisible scores to -inf. row0/col0: first row/column of this warp's fragment tile.
    // Per row, the visible columns form one interval [lo, hi) relative to the thread's first column, so each
    // element costs two compares against compile-time offsets.
    template <int MT, int NT>
    __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int row0, int col0, int lane) const {
        const int col_lane = col0 + 2 * (lane % 4);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) apply_row(s[mt], h, row0 + mt * 16 + lane / 4 + 8 * h, col_lane);
    }

    // Masks the h-th row of a thread's 16-row fragment tile, holding query `row`; col_lane: the thread's first
    // column. (Decode packs several heads into one tile, so its rows are not consecutive queries.)
    template <int NT>
    __device__ __forceinline__ void apply_row(float (&s)[NT][4], int h, int row, int col_lane) const {
        int hi = seqlen_k - col_lane;
        if (BAND && right >= 0) hi = min(hi, row + diag + right + 1 - col_lane);
        if (BAND && left >= 0) {  // (a uniform branch: a window's left edge costs a second compare per element)
            const int lo = max(-col_lane, row + diag - left - col_lane);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + e;  // column offset from the thread's first column
                    if (c < lo || c >= hi) s[nt][2 * h + e] = NEG_INF;
                }
            return;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (nt * 8 + e >= hi) s[nt][2 * h + e] = NEG_INF;
    }

    // The band's right edge across a warp's 16 rows (first query warp_row0) in a block of 8 NT keys from col0, where
    // that edge meets the rows on a 16-column boundary of the block (the causal diagonal of equal-length sequences in
    // tiles a multiple of 16): the warp's mask is then one of NT / 2 shapes known at compile time, so the columns
    // right of the rows' 16 x 16 square are set to -inf without a compare, those left of it are not touched, and
    // only the square's 8 elements per thread are compared. Returns false, masking nothing, elsewhere (a left edge,
    // another offset, keys past seqlen_k in the block): apply_row's general mask then. (A warp-uniform branch.)
    template <int NT>
    __device__ __forceinline__ bool apply_diagonal(float (&s)[NT][4], int warp_row0, int col0, int lane) const {
        if (!BAND || left >= 0 || right < 0) return false;
        const int offset = warp_row0 + diag + right - col0;  // the block column the edge meets the warp's first row at
        if ((offset & 15) != 0 || offset < 0 || offset >= NT * 8 || col0 + NT * 8 > seqlen_k) return false;
        diagonal_in<NT, 0, NT / 2>(s, offset / 16, lane);
        return true;
    }

    // Bisection over the square's position POS (in 16-column steps) for apply_diagonal.
    template <int NT, int LO, int HI>
    __device__ __forceinline__ static void diagonal_in(float (&s)[NT][4], int pos, int lane) {
        if constexpr (HI - LO == 1) {
            diagonal_at<NT, LO>(s, lane);
        } else {
            constexpr int MID = (LO + HI) / 2;
            if (pos < MID) diagonal_in<NT, LO, MID>(s, pos, lane);
            else diagonal_in<NT, MID, HI>(s, pos, lane);
        }
    }

    // The square at columns 16 POS .. 16 POS + 15: row lane / 4 + 8 h of the square sees its column 8 j + 2 (lane %
    // 4) + e iff that is at most the row; 8-column groups past the square see nothing.
    template <int NT, int POS>
    __device__ __forceinline__ static void diagonal_at(float (&s)[NT][4], int lane) {
        const int t = lane / 4 - 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (8 * j + e - 8 * h > t) s[2 * POS + j][2 * h + e] = NEG_INF;
#pragma unroll
        for (int nt = 2 * POS + 2; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = NEG_INF;
    }

    // The same mask on S^T (rows are keys, columns queries), as the backward computes it. Per key row j the
    // visible queries form [j - diag - right, j - diag + left]; keys past seqlen_k see nothing.
    template <int MT, int NT>
    __device__ __forceinline__ void apply_transposed(float (&s)[MT][NT][4], int row0, int col0, int lane) const {
        const int col_lane = col0 + 2 * (lane % 4);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int key = row0 + mt * 16 + lane / 4 + 8 * h;
                int lo = -col_lane, hi = key < seqlen_k ? 0x3fffffff : lo;
                if (BAND) {
                    if (right >= 0) lo = max(lo, key - diag - right - col_lane);
                    if (left >= 0) hi = min(hi, key - diag + left + 1 - col_lane);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = nt * 8 + e;
                        if (c < lo || c >= hi) s[mt][nt][2 * h + e] = NEG_INF;
                    }
            }
    }
};

// KV blocks [n_min, n_max) can hold visible keys for query rows [row0, row0 + BM); blocks in [full_lo, full_hi]
// need no masking at all. Iterating downwards from n_max - 1: masked blocks near the diagonal, an unmasked run,
// then masked blocks at the left edge of a sliding window.
struct BlockRange {
    int n_min, n_max, full_lo, full_hi;
};

template <int BM, int BN, bool BAND>
__device__ __forceinline__ BlockRange block_range(const Mask<BAND>& mask, int row0) {
    return block_range<BN>(mask, row0, row0 + BM - 1);
}

// The same for query rows [row0, last_row].
template <int BN, bool BAND>
__device__ __forceinline__ BlockRange block_range(const Mask<BAND>& mask, int row0, int last_row) {
    BlockRange r;
    r.n_min = 0;
    r.n_max = ceil_div(mask.seqlen_k, BN);
    r.full_lo = 0;
    r.full_hi = mask.seqlen_k / BN - 1;  // the last partial block is masked by the seqlen_k bound
    if (BAND) {
        if (mask.right >= 0) {
            r.n_max = min(r.n_max, floor_div(last_row + mask.diag + mask.right, BN) + 1);
            r.full_hi = min(r.full_hi, floor_div(row0 + mask.diag + mask.right + 1, BN) - 1);
        }
        if (mask.left >= 0) {
            r.n_min = max(0, floor_div(row0 + mask.diag - mask.left, BN));
            r.full_lo = ceil_div(last_row + mask.diag - mask.left, BN);
        }
    }
    return r;
}

}  // namespace cuflash

// Dropout on attention probabilities, regenerated wherever it is needed (no mask in memory): element (b, h, i, j) --
// query row i, key j of sequence b, head h -- is kept when its 16-bit draw from Philox 4x32-10 is below
// `threshold`. cuflash.reference.dropout_keep defines the draws; in short, the 16 x 16 tile of rows 16R.., keys
// 16C.. splits into 32 sets of 8 elements, rows {2a, 2a + 1, 2a + 8, 2a + 9} x keys {k, k + 8} (a in 0..3, k in
// 0..7), and one Philox call (counter C, R, 32 (b nheads + h) + 8a + k, offset) gives a set its eight draws. In the
// backward's transposed accumulator layout (rows = keys; mma.sync's C fragment) a thread holds exactly one set per
// 16 x 16 tile: one call. In the forward's (rows = queries; also each warp's rows of a wgmma accumulator) a thread
// holds half of two sets, which it shares with the thread four lanes away: each draws one and passes the other's
// half over (one shuffle), so the forward too costs one call per 8 elements.
#pragma once
#include "types.cuh"

namespace cuflash {

struct Dropout {
    u32 key0, key1;  // the seed's low word; its high word ^ the offset's high word
    u32 word2;       // 32 (b nheads + h)
    u32 offset;      // the offset's low word
    u32 threshold;   // a draw below it keeps its element

    // seed and offset as the parameter structs hold them (i64 fields: their 64 bits)
    __device__ __forceinline__ Dropout(i64 seed, i64 offset_, int bh, int threshold_)
        : key0((u32)seed), key1((u32)((unsigned long long)seed >> 32) ^ (u32)((unsigned long long)offset_ >> 32)),
          word2(32u * (u32)bh), offset((u32)offset_), threshold((u32)threshold_) {}

    // The generator of a parameter struct (FwdParams, BwdParams): its dropout_state words where set, else its
    // dropout_seed and dropout_offset.
    template <class Params>
    static __device__ __forceinline__ Dropout of(const Params& p, int bh) {
        const i64 seed = p.dropout_state != nullptr ? __ldg(p.dropout_state) : p.dropout_seed;
        const i64 offset = p.dropout_state != nullptr ? __ldg(p.dropout_state + 1) : p.dropout_offset;
        return Dropout(seed, offset, bh, p.dropout_threshold);
    }

    // Philox 4x32-10 of counter c under (key0, key1).
    __device__ __forceinline__ uint4 philox(uint4 c) const {
        u32 k0 = key0, k1 = key1;
#pragma unroll
        for (int r = 0; r < 10; ++r) {
            const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
            const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
            c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        return c;
    }

    // The eight draws of set (R, C, a, k) of this (b, h): draw v is the low (v even) or high half of word v / 2.
    // Draw v of the set is element (row 2a + 8 (v / 4) + (v / 2) % 2, key k + 8 (v % 2)) of the tile.
    __device__ __forceinline__ uint4 set(int R, int C, int a, int k) const {
        return philox(make_uint4((u32)C, (u32)R, word2 + 8u * a + k, offset));
    }
    __device__ __forceinline__ bool keep(const uint4& w, int v) const {
        const u32 word = v < 4 ? (v < 2 ? w.x : w.y) : (v < 6 ? w.z : w.w);
        return ((v % 2 ? word >> 16 : word) & 0xFFFFu) < threshold;
    }
    // The keep bits of a set: bit v for draw v.
    __device__ __forceinline__ u32 keep_bits(const uint4& w) const {
        u32 bits = 0;
#pragma unroll
        for (int v = 0; v < 8; ++v) bits |= (u32)keep(w, v) << v;
        return bits;
    }

    // Rows = queries (the forward): the keep bits of a warp's 16 rows from query row16 16 on, x NT 8-key tiles from
    // key key16 16 on (NT even): bit 4 nt + e of words[0..] for element [nt][e]. The thread (g = lane / 4,
    // c = lane % 4) holds rows {g, g + 8} x keys {2c, 2c + 1, 2c + 8, 2c + 9} of each 16 x 16 tile: draws
    // 2 (g % 2) + {0, 1, 4, 5} of sets (a = g / 2, k = 2c) and (a, 2c + 1). It draws set k = 2c + g % 2 and swaps
    // half of it with lane ^ 4 (g ^ 1), which draws the other. All 32 lanes call it together (the shuffle). Drawn
    // before the scores exist, so that the generator's registers and the scores' are never live together.
    template <int NT>
    __device__ __forceinline__ void keep_rows(u32 (&words)[(4 * NT + 31) / 32], int row16, int key16,
                                              int lane) const {
        static_assert(NT % 2 == 0, "pairs of 8-key tiles");
        constexpr int W = (4 * NT + 31) / 32;
        const int g = lane / 4, odd = g % 2;
        // First every set's eight bits, byte m of mine[] for tile m; then one shuffle per word of them.
        u32 mine[W], other[W];
#pragma unroll
        for (int i = 0; i < W; ++i) mine[i] = 0;
#pragma unroll
        for (int m = 0; m < NT / 2; ++m) {
            asm volatile("" ::: "memory");  // one set at a time: the generator's rounds are not interleaved
            mine[m / 4] |= keep_bits(set(row16, key16 + m, g / 2, 2 * (lane % 4) + odd)) << (8 * (m % 4));
        }
#pragma unroll
        for (int i = 0; i < W; ++i) {
            other[i] = __shfl_xor_sync(0xFFFFFFFFu, mine[i], 4);  // sets k = 2c + 1 - g % 2, from lane ^ 4
            words[i] = 0;
        }
        // This thread's rows are draws 2 (g % 2) + {0, 1, 4, 5} of either set: after the shift, bit
        // 4 (e / 2) + ch of x[e % 2] is the element of key 8 ch + 2c + e % 2, row g + 8 (e / 2).
#pragma unroll
        for (int i = 0; i < W; ++i) {
            const u32 x0 = (odd ? other[i] : mine[i]) >> (2 * odd), x1 = (odd ? mine[i] : other[i]) >> (2 * odd);
#pragma unroll
            for (int m = 0; m < 4 && 4 * i + m < NT / 2; ++m)
#pragma unroll
                for (int ch = 0; ch < 2; ++ch)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        words[i] |= (((e % 2 ? x1 : x0) >> (8 * m + 4 * (e / 2) + ch)) & 1u) << (8 * m + 4 * ch + e);
        }
    }

    // s[nt][e] = 0 where keep_rows' bit says the element is dropped.
    template <int NT>
    static __device__ __forceinline__ void drop(float (&s)[NT][4], const u32 (&words)[(4 * NT + 31) / 32]) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int bit = 4 * nt + e;
                if (!((words[bit / 32] >> (bit % 32)) & 1u)) s[nt][e] = 0.f;
            }
    }

    // Rows = keys (the backward's S^T): a warp's 16 keys from key key16 16 on, x NT 8-query tiles from query row
    // query16 16 on (NT even); bit (nt, e) of the result set where element [nt][e] is kept (NT <= 8). The thread
    // (g = lane / 4, c = lane % 4) holds keys {g, g + 8} x queries {2c, 2c + 1, 2c + 8, 2c + 9} of each 16 x 16
    // tile: set (a = c, k = g), whole.
    template <int NT>
    __device__ __forceinline__ u32 keep_mask_cols(int key16, int query16, int lane) const {
        static_assert(NT % 2 == 0 && NT <= 8, "pairs of 8-query tiles, 32 bits");
        u32 bits = 0;
#pragma unroll
        for (int m = 0; m < NT / 2; ++m) {
            const u32 set_bits = keep_bits(set(query16 + m, key16, lane % 4, lane / 4));
#pragma unroll
            for (int ch = 0; ch < 2; ++ch)
#pragma unroll
                for (int e = 0; e < 4; ++e)  // key g + 8 (e / 2), query 8 ch + 2c + e % 2: draw 4 ch + 2 (e % 2) + e / 2
                    if ((set_bits >> (4 * ch + 2 * (e % 2) + e / 2)) & 1u) bits |= 1u << ((2 * m + ch) * 4 + e);
        }
        return bits;
    }
};

}  // namespace cuflash

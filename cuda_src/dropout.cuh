// Dropout on attention probabilities, regenerated wherever it is needed (no mask in memory): element (b, h, i, j) --
// query row i, key j of sequence b, head h -- is kept when its draw, a byte of Philox 4x32-10's output, is below
// `threshold`. cuflash.reference.dropout_keep defines the draws; in short, the 16 x 16 tile of rows 16R.., keys
// 16C.. splits into 32 sets of 8 elements, rows {2a, 2a + 1, 2a + 8, 2a + 9} x keys {k, k + 8} (a in 0..3, k in
// 0..7), and one Philox call (counter C, R, 16 (b nheads + h) + 4a + t, offset) gives the pair of sets k = 2t,
// 2t + 1 its sixteen draws. Both accumulator layouts share each call between a thread (g = lane / 4, c = lane % 4)
// and the thread four lanes away (g ^ 1):
//  - rows = keys (the backward's transposed accumulators; mma.sync's C fragment): a thread holds set (a = c, k = g)
//    of every tile, its neighbour the other set of the pair;
//  - rows = queries (the forward's; also each warp's rows of a wgmma accumulator): a thread holds rows g and g + 8
//    of both sets of pair (a = g / 2, t = c), its neighbour rows g ^ 1 and (g ^ 1) + 8.
// Of every two tiles each of the two threads draws one call, and they swap the keep bits (one shuffle): one call
// per 16 elements in either layout.
#pragma once
#include "types.cuh"

namespace cuflash {

struct Dropout {
    u32 key0, key1;  // the seed's low word; its high word ^ the offset's high word
    u32 word2;       // 16 (b nheads + h)
    u32 offset;      // the offset's low word
    u32 threshold;   // a draw below it keeps its element (1 .. LEVELS)

    static constexpr u32 LEVELS = 256;  // the draws are bytes; a threshold of LEVELS keeps every element

    // seed and offset as the parameter structs hold them (i64 fields: their 64 bits)
    __device__ __forceinline__ Dropout(i64 seed, i64 offset_, int bh, int threshold_)
        : key0((u32)seed), key1((u32)((unsigned long long)seed >> 32) ^ (u32)((unsigned long long)offset_ >> 32)),
          word2(16u * (u32)bh), offset((u32)offset_), threshold((u32)threshold_) {}

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

    // The sixteen draws of pair (R, C, a, t) of this (b, h): set s of the pair (k = 2t + s) takes words 2s and
    // 2s + 1, draw u of the set is byte u % 4 of word 2s + u / 4, and draw u is element (row 2a + 8 (u / 4) + u % 2,
    // key k + 8 ((u / 2) % 2)) of the tile.
    __device__ __forceinline__ uint4 pair(int R, int C, int a, int t) const {
        return philox(make_uint4((u32)C, (u32)R, word2 + 4u * a + t, offset));
    }
    // The keep bits of a pair: bit 8 s + u for draw u of set s. Each word's bytes at or above the threshold carry out
    // of their byte when 256 - threshold is added to them, the even and the odd bytes two at a time.
    __device__ __forceinline__ u32 keep_bits(const uint4& w) const {
        const u32 add = (LEVELS - threshold) * 0x00010001u;
        const u32 words[4] = {w.x, w.y, w.z, w.w};
        u32 dropped = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 even = (words[q] & 0x00FF00FFu) + add, odd = ((words[q] >> 8) & 0x00FF00FFu) + add;
            u32 d = ((even >> 8) & 0x00010001u) | ((odd >> 7) & 0x00020002u);  // bytes 0, 1, 2, 3: bits 0, 1, 16, 17
            dropped |= ((d | (d >> 14)) & 0xFu) << (4 * q);
        }
        return ~dropped & 0xFFFFu;
    }

    // The pair bits (keep_bits) of this thread's T tiles along one axis, pair (a, t) of each: tiles R0 .. R0 + T - 1
    // of key tile C0 (ALONG_ROWS), or key tiles C0 .. C0 + T - 1 of R0. Of tiles 2j and 2j + 1 this thread draws
    // tile 2j + odd and lane ^ 4 the other, and they swap the bits (one shuffle per two pairs of tiles); a last odd
    // tile each draws itself. out[x / 2] holds tile x's sixteen bits at 16 (x % 2).
    template <int T, bool ALONG_ROWS>
    __device__ __forceinline__ void shared_pairs(u32 (&out)[(T + 1) / 2], int R0, int C0, int a, int t,
                                                 int odd) const {
        constexpr int PAIRS = T / 2, PACKED = (PAIRS + 1) / 2;
        u32 mine[PACKED > 0 ? PACKED : 1];
#pragma unroll
        for (int i = 0; i < PACKED; ++i) mine[i] = 0;
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int x = 2 * j + odd;
            mine[j / 2] |= keep_bits(pair(ALONG_ROWS ? R0 + x : R0, ALONG_ROWS ? C0 : C0 + x, a, t)) << (16 * (j % 2));
        }
#pragma unroll
        for (int i = 0; i < PACKED; ++i) {
            const u32 other = __shfl_xor_sync(0xFFFFFFFFu, mine[i], 4);  // the other tile of each pair, from g ^ 1
#pragma unroll
            for (int h = 0; h < 2 && 2 * i + h < PAIRS; ++h) {  // pair j = 2i + h: tiles 2j (drawn by odd 0), 2j + 1
                const u32 lo = ((odd ? other : mine[i]) >> (16 * h)) & 0xFFFFu;
                const u32 hi = ((odd ? mine[i] : other) >> (16 * h)) & 0xFFFFu;
                out[2 * i + h] = lo | hi << 16;
            }
        }
        if constexpr (T % 2 == 1) {
            out[T / 2] = keep_bits(pair(ALONG_ROWS ? R0 + T - 1 : R0, ALONG_ROWS ? C0 : C0 + T - 1, a, t));
        }
    }

    // Rows = queries (the forward): the keep bits of a warp's 16 rows from query row16 16 on, x NT 8-key tiles from
    // key key16 16 on (NT even): bit 4 nt + e of words[0..] for element [nt][e] (row g + 8 (e / 2), key
    // 8 nt + 2c + e % 2). That element is draw 4 (e / 2) + 2 ch + g % 2 (ch = nt % 2) of set e % 2 of pair (a = g / 2,
    // t = c) of its tile. All 32 lanes call it together (the shuffle). Drawn before the scores exist where the
    // kernel allows, so that the generator's registers and the scores' are not live together.
    template <int NT>
    __device__ __forceinline__ void keep_rows(u32 (&words)[(4 * NT + 31) / 32], int row16, int key16,
                                              int lane) const {
        static_assert(NT % 2 == 0, "pairs of 8-key tiles");
        constexpr int T = NT / 2;  // 16-key tiles
        const int g = lane / 4, odd = g % 2;
        u32 bits[(T + 1) / 2];
        shared_pairs<T, false>(bits, row16, key16, g / 2, lane % 4, odd);
#pragma unroll
        for (int i = 0; i < (4 * NT + 31) / 32; ++i) words[i] = 0;
#pragma unroll
        for (int m = 0; m < T; ++m) {
            // after the shift, bit 8 (e % 2) + 4 (e / 2) + 2 ch of x is element [2m + ch][e]
            const u32 x = (bits[m / 2] >> (16 * (m % 2) + odd)) & 0xFFFFu;
            u32 byte = 0;
#pragma unroll
            for (int ch = 0; ch < 2; ++ch)
#pragma unroll
                for (int e = 0; e < 4; ++e) byte |= ((x >> (8 * (e % 2) + 4 * (e / 2) + 2 * ch)) & 1u) << (4 * ch + e);
            words[m / 4] |= byte << (8 * (m % 4));
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

    // prmt's sign mode (which __byte_perm leaves out): a selector nibble of 8 + i replicates bit 7 of byte i of
    // (hi:lo) over the result's byte.
    static __device__ __forceinline__ u32 sign_bytes(u32 lo, u32 hi, u32 selector) {
#ifdef __CUDA_ARCH__
        u32 r;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(selector));
        return r;
#else  // the same on the host (tests/dropout_warp.cpp)
        const unsigned long long both = (unsigned long long)hi << 32 | lo;
        u32 r = 0;
        for (int i = 0; i < 4; ++i) {
            const u32 nibble = (selector >> (4 * i)) & 0xFu, byte = (u32)(both >> (8 * (nibble & 7u))) & 0xFFu;
            r |= ((nibble & 8u) ? ((byte & 0x80u) ? 0xFFu : 0u) : byte) << (8 * i);
        }
        return r;
#endif
    }

    // Rows = queries, applied to P packed as the A fragments of O += P V (sm90::a_fragment: a[2 ch + rh] holds row
    // g + 8 rh, keys 16 kk + 8 ch + 2c (low half) and + 1 (high half)): the dropped elements of a warp's 16 rows from
    // query row row16 16 on, x KT 16-key tiles from key16 on, set to 0. Of tiles 2j and 2j + 1 this thread draws
    // tile 2j + odd and lane ^ 4 the other (one call per 16 elements); a last odd tile each draws itself.
    //  - A word's bytes odd and odd + 2 (ch = 0, 1) are this thread's draws, the others its neighbour's. Each pair
    //    goes to bits 7.. and 23.. (times 128), where adding (256 - threshold) 128 per 16-bit lane sets bit 15 or 31
    //    when the draw is at or above the threshold: dropped.
    //  - The four words' flags gather into one word by byte permutes: byte 2 ch + rh holds element (rh, ch)'s flag
    //    of set 0 at bit 7 and of set 1 at bit 6. The neighbour's word crosses in one shuffle.
    //  - A register's mask is one sign-replicating byte permute (0xFFFF per dropped half), applied by one AND.
    template <class Fragments>
    __device__ __forceinline__ void drop_fragments(Fragments& pa, int row16, int key16, int lane) const {
        constexpr int KT = sizeof(Fragments) / sizeof(pa[0]);
        static_assert(sizeof(pa[0]) == 16, "A fragments of 16-key tiles");
        const int g = lane / 4, odd = g % 2;
        const u32 add = ((LEVELS - threshold) << 7) * 0x00010001u;
        const u32 mine = odd ? 0x4341u : 0x4240u, theirs = odd ? 0x4240u : 0x4341u;  // bytes odd, odd + 2 to lanes
#pragma unroll
        for (int j = 0; j < (KT + 1) / 2; ++j) {
            const bool lone = 2 * j + 1 == KT;  // a last odd tile: each thread draws its own
            const uint4 w = pair(row16, key16 + 2 * j + (lone ? 0 : odd), g / 2, lane % 4);
            const u32 words[4] = {w.x, w.y, w.z, w.w};  // word 2 s + rh
            u32 m[4], t[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                m[q] = __byte_perm(words[q], 0, mine) * 128u + add;
                t[q] = __byte_perm(words[q], 0, theirs) * 128u + add;
            }
            // bytes (rh 0, ch 0), (1, 0), (0, 1), (1, 1): bit 15 (ch 0) and 31 (ch 1) of words rh and 2 + rh
            const u32 own = (__byte_perm(m[0], m[1], 0x7351) & 0x80808080u) |
                            ((__byte_perm(m[2], m[3], 0x7351) >> 1) & 0x40404040u);
            u32 flags[2] = {own, own};
            if (!lone) {
                const u32 sent = (__byte_perm(t[0], t[1], 0x7351) & 0x80808080u) |
                                 ((__byte_perm(t[2], t[3], 0x7351) >> 1) & 0x40404040u);
                const u32 got = __shfl_xor_sync(0xFFFFFFFFu, sent, 4);
                flags[0] = odd ? got : own;  // tile 2j
                flags[1] = odd ? own : got;  // tile 2j + 1
            }
#pragma unroll
            for (int x = 0; x < (lone ? 1 : 2); ++x) {
                const u32 set1 = flags[x] << 1;  // set 1's flags to bit 7
#pragma unroll
                for (int r = 0; r < 4; ++r) pa[2 * j + x][r] &= ~sign_bytes(flags[x], set1, 0xCC88u + 0x1111u * r);
            }
        }
    }

    // Rows = keys (the backward's S^T): a warp's 16 keys from key key16 16 on, x NT 8-query tiles from query row
    // query16 16 on (NT even); bit 4 nt + e of the result set where element [nt][e] (key g + 8 (e / 2), query
    // 8 nt + 2c + e % 2) is kept (NT <= 8). That element is draw 4 ch + e (ch = nt % 2) of set g % 2 of pair
    // (a = c, t = g / 2): a tile's eight bits are its set's, in order. All 32 lanes call it together.
    template <int NT>
    __device__ __forceinline__ u32 keep_mask_cols(int key16, int query16, int lane) const {
        static_assert(NT % 2 == 0 && NT <= 8, "pairs of 8-query tiles, 32 bits");
        constexpr int T = NT / 2;  // 16-query tiles
        const int g = lane / 4, odd = g % 2;
        u32 bits[(T + 1) / 2];
        shared_pairs<T, true>(bits, query16, key16, lane % 4, g / 2, odd);
        u32 kept = 0;
#pragma unroll
        for (int m = 0; m < T; ++m) kept |= ((bits[m / 2] >> (16 * (m % 2) + 8 * odd)) & 0xFFu) << (8 * m);
        return kept;
    }
};

}  // namespace cuflash

// FP8 (e4m3) forward attention on Hopper (sm_90a): TMA loads and wgmma with k = 32.
//
// Q, K, V (batch, seqlen, heads, d), or packed sequences (total, heads, d) with cu_seqlens (seqlen.cuh), in e4m3; O
// bf16 and lse float32. FP8 wgmma takes B K-major, and for P V the keys are K: each V block is transposed in shared
// memory (transpose) into V^T, D rows of the block's 128 keys, with the keys of each 32-key chunk in the order
// that lets P's e4m3 fragments pack straight from the S accumulators: for O += P V (wgmma A from registers, k = 32)
// a thread's register a[0] holds keys 4c .. 4c + 3 (c = lane % 4) of its row, while the accumulators of S give it
// keys 2c, 2c + 1, 2c + 8, 2c + 9 of each 16. So slot s of a chunk holds key 16 (s / 16) + {2c, 2c + 1, 2c + 8,
// 2c + 9}[s % 4], c = (s % 16) / 4, and the sum over the chunk's keys is the same.
// One CTA: 64 WGS query rows of one head, as WGS consumer warpgroups of 64 rows (2, or 3 in the simple form, which
// has the registers for it), and a producer warpgroup: its thread 0 loads Q once and K and V blocks of BN = 128 keys
// (K into a ring of STAGES slots, V into a ring of VS staging slots), its warps 1-3 transpose each V block into the V^T
// slot beside its K. VT_PASS: V^T comes transposed, in that key order, from fp8_transpose_v (fwd_fp8_aux.cu, a pass
// before the kernel that forward_fp8.py launches for long rows, where it costs less than the transposes in the
// kernel), one TMA box a block loaded with K. Per block, in each consumer warpgroup:
//     S  = Q K^T                     wgmma m64n128k32 ss (both K-major)
//     mask, online softmax in fp32 (scores scaled by softmax_scale q_descale k_descale)
//     P  = e4m3(256 exp2(S - max))   four floats per register (pack_e4m3x4)
//     P V                            wgmma m64n128k32 rs (B = V^T, keys contiguous); with PV_SUMS m64n72k32 at d 64,
//                                    m64n136k32 at d 128
//     O = O alpha + P V              in fp32 (fold: each block's P V in an accumulator of its own)
// each waited for; or (PIPE) with each block's softmax under the last block's P V. The consumer warpgroups run free of
// each other (no ping-pong turns: at FP8 rates the softmax, not the GEMMs, sets the pace, and turns only made each
// warpgroup wait for the other's); a third one keeps the tensor cores busy while two compute softmaxes. O leaves
// divided by the row sums and by 256, times v_descale, through a staging tile and TMA stores (store).
// The row sums: with PV_SUMS (forward_fp8.py FwdFp8Spec.quantized_sums says where), those of the e4m3 P, added
// up by O += P V itself. Each V^T slot then has 8 more rows, written once by the consumers and never by the
// transpose: a row of ones (0x38), whose column of O is the row sum (rescaled with O), and seven of zeros, so the
// softmax spends no FADD per probability.
// Else those of the fp32 P, added up in the softmax. Descales: one per tensor, or one per (sequence, KV head)
// (flash-attn 3's (batch, nheads_k)), the query heads of a KV head sharing q_descale's.
#include "sm90.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "seqlen.cuh"

namespace cuflash {

struct FwdFp8Params {
    sm90::TmaMap q;   // u8 (d, heads, seqlen_q, batch), box (128, 1, BM, 1): 128 columns (bytes) of BM rows;
                      // packed: (d, heads, total_q), box (128, 1, BM)
    sm90::TmaMap k;   // u8 (d, heads_k, seqlen_k, batch), box (128, 1, 128, 1); packed: (d, heads_k, total_k)
    sm90::TmaMap v;   // as k; VT_PASS: V^T (keys, d, heads_k, batch) from fp8_transpose_v, box (128, D, 1, 1)
    sm90::TmaMap o;   // bf16 (d, heads, seqlen_q, batch), box (64, 1, 16, 1): one warp's rows of a 64-column panel;
                      // packed: (d, heads, total_q), box (64, 1, 16)
    u16* o_ptr;       // the same, (batch, seqlen_q, heads, headdim), packed (total_q, heads, headdim)
    float* lse;       // (batch, heads, seqlen_q) contiguous, packed (heads, total_q), or nullptr
    const float* q_descale;  // each nullptr (1), one value, or (batch, heads_k) contiguous (descale_batch_stride)
    const float* k_descale;
    const float* v_descale;
    const int* cu_seqlens_q;  // packed sequences (seqlen.cuh), or nullptr for a padded batch
    const int* cu_seqlens_k;
    i64 o_batch_stride, o_row_stride, o_head_stride;  // packed: the row stride is the batch stride (seqlen.cuh)
    int descale_batch_stride;  // 0: one value per tensor; else heads_k
    int seqlen_q, seqlen_k;    // padded: the lengths; packed: their maxima
    int rows_q, rows_k;        // packed: total_q, total_k, the bounds of sequences read from cu_seqlens
    int nheads, heads_per_kv, window_left, window_right, headdim;
    float scale_log2;  // softmax_scale log2(e); the kernel multiplies in q_descale k_descale
};
static_assert(sizeof(FwdFp8Params) == 640, "FwdFp8Params no longer matches cuflash/ops/forward_fp8.py");

template <int D, bool BAND, bool PIPE, int WGS, bool VT_PASS, bool PV_SUMS>
struct FwdFp8 {
    // A block's 128 keys are one 128-byte swizzle span of each V^T row. (FA3's FP8 d 128 tile of 224 keys does not
    // fit beside the per-block P V accumulator below: docs/perf-notes.md, "FP8 224-key blocks".) VS V blocks wait
    // in staging slots for their transpose.
    static constexpr int BM = 64 * WGS, BN = 128, STAGES = D == 256 ? 2 : 4, VS = 2, THREADS = 128 * (WGS + 1);
    // each thread's registers after setmaxnreg, inside the CTA's pool (sm90::register_pool: 64,512 for two consumer
    // warpgroups, 65,536 for three), the producer warpgroup (TMA and the transposes) keeping the rest
    static constexpr int CONSUMER_REGS = WGS == 2 ? 240 : 160, PRODUCER_REGS = WGS == 2 ? 24 : 32;
    // the producer's warps 1-3 transpose V, in units of 16 keys by 32 bytes of the head dim (transpose)
    static constexpr int TRANSPOSERS = 3;
    // P times 2^8 before e4m3, added in exp2's exponent: probabilities down to 2^-14 stay normal. The row sum carries
    // the same factor, so O / sum needs no correction, and the lse subtracts 8 (softmax.cuh).
    static constexpr int LOG2_P = 8;
    // Each row's max and sum in CHAINS independent chains where that pays (A/B, docs/perf-notes.md): d 64, whose
    // GEMMs are shortest beside the softmax.
    static constexpr int CHAINS = D == 64 ? 4 : 1;
    // 128-byte panels of a Q or K row (TMA boxes of 128 columns; at d 64 one, its second half TMA's zero fill)
    static constexpr int PANELS = D / 128 > 0 ? D / 128 : 1;
    static constexpr u32 Q_PANEL = BM * 128, K_PANEL = BN * 128;
    // PV_SUMS, the row sums on the tensor cores (P V as m64n72k32 at d 64, m64n136k32 at d 128), where
    // FwdFp8Spec.quantized_sums (forward_fp8.py) takes them. V^T: D rows of 128 keys (TMA's), and with PV_SUMS a
    // swizzle atom of 8 rows: ones, then zeros.
    static constexpr int SUM_ROWS = PV_SUMS ? 8 : 0;
    static constexpr u32 Q_BYTES = PANELS * Q_PANEL, K_BYTES = PANELS * K_PANEL, V_BYTES = (D + SUM_ROWS) * 128;
    static constexpr u32 V_LOADED = D * 128;  // what VT_PASS's TMA box writes of a V^T slot (not the sum rows)
    // P V in N chunks of the head dim: 128 columns (64 at d 64), each with the sum column (PV_SUMS)
    static constexpr int NCH = D == 64 ? 64 : 128, CHUNKS = D / NCH, PV_COLS = NCH + SUM_ROWS;
    // P V's accumulator holds one block's product (one chunk's), from zero, which fold() adds to O in fp32. FP8
    // wgmma adds into its accumulator with fewer bits than fp32 (docs/fp8.md): one accumulator for a whole row
    // would lose the small terms of long rows (O 25% low at 16k keys when V's values share an offset).
    using PvAcc = float[1][PV_COLS / 8][4];
    // O's staging tile for its TMA stores (store): D / 64 panels of BM rows of 64 bf16 columns, 128-byte swizzle.
    // It shares its bytes with V's staging slots (K's layout): a warpgroup stores O after the last block's V^T, and
    // every V block has been transposed by then.
    static constexpr int O_PANELS = D / 64;
    static constexpr u32 O_PANEL = BM * 128, O_BYTES = O_PANELS * O_PANEL;
    static constexpr u32 OV_BYTES = O_BYTES > VS * K_BYTES || VT_PASS ? O_BYTES : VS * K_BYTES;
    // shared memory from the 1024-aligned base: Q, the K ring, the V^T ring, O's staging tile or V's staging slots,
    // then the mbarriers
    static constexpr u32 OFF_K = Q_BYTES, OFF_V = OFF_K + STAGES * K_BYTES, OFF_O = OFF_V + STAGES * V_BYTES;
    static constexpr u32 OFF_BAR = OFF_O + OV_BYTES;
    static constexpr u32 SMEM_BYTES = OFF_BAR + 8 * (1 + 3 * STAGES + 2 * VS) + 1024;
    static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128 and 256");
    static_assert(SMEM_BYTES <= 227 * 1024, "the SM's shared memory per block");
    static_assert(V_BYTES % 1024 == 0 && K_BYTES % 1024 == 0, "tiles of whole swizzle atoms");
    static_assert(128 * PRODUCER_REGS + 128 * WGS * CONSUMER_REGS == sm90::register_pool(THREADS),
                  "the register split fills the CTA's pool");
    static_assert(!PIPE || CHUNKS == 1, "the pipelined form keeps one P V accumulator beside the scores");
    static_assert(!PV_SUMS || D <= 128, "row sums on the tensor cores: P V as m64n72k32 or m64n136k32");
    static_assert(WGS == 2 || (WGS == 3 && !PIPE && D <= 128),
                  "three consumer warpgroups (160 registers) fit the simple form's scores, P V and O up to d 128");

    const FwdFp8Params& p;
    int tid, wg, warp, lane;
    u32 base;
    int row0, h, h_kv, b;
    int q_begin, k_begin, seqlen_q;  // this sequence (SeqInfo, bounded by rows_q / rows_k when packed)
    bool packed;
    Mask<BAND> mask;
    OnlineSoftmax<1> softmax;
    float acc_o[1][(D + SUM_ROWS) / 8][4];  // PV_SUMS: column D is the row sum, D + 1 .. D + 7 zero

    __device__ __forceinline__ explicit FwdFp8(const FwdFp8Params& params) : p(params) {}

    // Barriers: Q's; per ring slot, K loaded (full), V^T written (vt_full), both read (empty, by the consumers); per
    // staging slot, V loaded (vs_full) and read by the transposes (vs_empty).
    __device__ __forceinline__ u32 q_full() const { return base + OFF_BAR; }
    __device__ __forceinline__ u32 full(int slot) const { return base + OFF_BAR + 8 * (1 + slot); }
    __device__ __forceinline__ u32 empty(int slot) const { return base + OFF_BAR + 8 * (1 + STAGES + slot); }
    __device__ __forceinline__ u32 vt_full(int slot) const { return base + OFF_BAR + 8 * (1 + 2 * STAGES + slot); }
    __device__ __forceinline__ u32 vs_full(int s) const { return base + OFF_BAR + 8 * (1 + 3 * STAGES + s); }
    __device__ __forceinline__ u32 vs_empty(int s) const { return base + OFF_BAR + 8 * (1 + 3 * STAGES + VS + s); }

    // A consumer warpgroup without rows: each block's slot handed back as the others use it, so that the ring runs on.
    // Its arrival for block t follows block t's V^T (VT_PASS: block t's loads), which is written only once the slot's
    // use by block t - STAGES is complete: the arrival counts toward block t's phase of `empty`.
    __device__ __forceinline__ void pass_blocks(int count) const {
        for (int t = 0; t < count; ++t) {
            if constexpr (VT_PASS) sm90::mbar_wait(full(t % STAGES), (t / STAGES) & 1);
            else wait_vt(t);
            sm90::mbar_arrive(empty(t % STAGES));
        }
    }

    // The producer thread: Q, then K and V of the tile's blocks n_max - 1 down to n_min, K's slot once the consumers
    // have emptied it, V's staging slot once the transposes have read it.
    __device__ __forceinline__ void produce(const BlockRange& range, int count) const {
        sm90::mbar_arrive_expect_tx(q_full(), Q_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            sm90::tma_load_rows(base + pn * Q_PANEL, &p.q, packed, pn * 128, h, q_begin, row0, b, q_full());
        for (int t = 0; t < count; ++t) {
            const int slot = t % STAGES, s = t % VS, n = range.n_max - 1 - t;
            if (t >= STAGES) sm90::mbar_wait(empty(slot), ((t / STAGES) & 1) ^ 1);
            if constexpr (VT_PASS) {  // K, and V^T's box, on one barrier
                load_block(base + OFF_K + slot * K_BYTES, &p.k, n, full(slot), K_BYTES + V_LOADED);
                sm90::tma_load_4d(base + OFF_V + slot * V_BYTES, &p.v, n * BN, 0, h_kv, b, full(slot));
                continue;
            }
            load_block(base + OFF_K + slot * K_BYTES, &p.k, n, full(slot), K_BYTES);
            if (t >= VS) sm90::mbar_wait(vs_empty(s), ((t / VS) & 1) ^ 1);
            load_block(base + OFF_O + s * K_BYTES, &p.v, n, vs_full(s), K_BYTES);
        }
    }

    // Block t's V^T in its slot: written by the transposes (VT_PASS: loaded with K, on `full`).
    __device__ __forceinline__ void wait_vt(int t) const {
        if constexpr (!VT_PASS) sm90::mbar_wait(vt_full(t % STAGES), (t / STAGES) & 1);
    }

    // Block n's rows of K or V (PANELS boxes of 128 columns, K_BYTES) into `dst`, completing on `bar` after `bytes`.
    __device__ __forceinline__ void load_block(u32 dst, const sm90::TmaMap* map, int n, u32 bar, u32 bytes) const {
        sm90::mbar_arrive_expect_tx(bar, bytes);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
            sm90::tma_load_rows(dst + pn * K_PANEL, map, packed, pn * 128, h_kv, k_begin, n * BN, b, bar);
    }

    // A transposing warp (w of TRANSPOSERS): its share of each block's units, V's staging slot to the V^T slot beside
    // K's once the consumers have emptied it. `first_keys`: the keys of the walk's first block (the highest) inside
    // the sequence. A packed sequence's last block has the next sequence's keys past the end: the transposing warps
    // set those rows of V to zeros before they read any (P is 0 there, and 0 times a NaN would not be); a padded
    // batch's arrive as TMA's zero fill.
    //
    // Unit u: keys 16 g .. 16 g + 15 (g = u % 8) by head-dim bytes 32 q .. 32 q + 31 (q = u / 8), from V's staging
    // slot (rows of keys, K's layout) into the V^T slot (rows of the head dim). One ldmatrix.trans of four 8 x 8
    // matrices of byte pairs: lanes 8 m .. 8 m + 7 address keys 8 (m % 2) + .. of 16-byte chunk 2 q + m / 2 of their
    // 128-byte panel, and thread (j, c) = (lane / 4, lane % 4) receives in r[m] the pairs (bytes 2 j, 2 j + 1 of the
    // chunk) of keys 2 c and 2 c + 1 of those 8. Bytes 0 and 2 of r[0] and r[1] (r[2] and r[3] for the second chunk,
    // h = 1) are then V^T row 32 q + 16 h + 2 j's keys 2 c, 2 c + 1, 2 c + 8, 2 c + 9, which are slots 4 c .. 4 c + 3
    // of the chunk's order (the top), 4 bytes at 16 g + 4 c of the row; bytes 1 and 3 are row 32 q + 16 h + 2 j + 1's.
    // One stmatrix of four 8 x 8 matrices of byte pairs writes them: matrix 2 h + s has row j's 16 bytes from lanes
    // 4 j .. 4 j + 3, V^T row 32 q + 16 h + 2 j + (s ^ (j >= 4)), so that each matrix's 8 rows have 8 residues mod 8:
    // 32 banks through the swizzle (odd_first, j >= 4, picks a lane's row of the pair).
    __device__ __forceinline__ void transpose(int count, int first_keys, u32 w) const {
        const u32 m = lane / 8, i = lane % 8;
        const bool odd_first = lane >= 16;
        // The lane's offsets within a unit, the swizzle's XOR with the row residue folded in (bits 4-6, which the
        // unit's chunk then XORs): the producer warpgroup has 24 registers at two consumer warpgroups. st_at: row i of
        // stmatrix's matrix m.
        const u32 ld_at = (8 * (m % 2) + i) * 128 + (((m / 2) ^ i) << 4);
        const u32 row = 16 * (m / 2) + 2 * i + ((m % 2) ^ (i >= 4)), st_at = row * 128 + ((row % 8) << 4);
        if (first_keys < BN) {  // a packed sequence's last block: whole rows past its keys to zeros
            sm90::mbar_wait(vs_full(0), 0);
#pragma unroll 1
            for (u32 x = w * 32 + lane; x < (BN - first_keys) * PANELS * 8u; x += TRANSPOSERS * 32)
                st_shared_zero16(base + OFF_O + (x / 8 % PANELS) * K_PANEL + (first_keys + x / (8 * PANELS)) * 128 +
                                 (x % 8) * 16);
            sm90::named_sync(1, TRANSPOSERS * 32);
        }
        for (int t = 0; t < count; ++t) {
            const int slot = t % STAGES, s = t % VS;
            const u32 src = base + OFF_O + s * K_BYTES, dst = base + OFF_V + slot * V_BYTES;
            sm90::mbar_wait(vs_full(s), (t / VS) & 1);
            if (t >= STAGES) sm90::mbar_wait(empty(slot), ((t / STAGES) & 1) ^ 1);
            if constexpr (PRODUCER_REGS >= 32) transpose_groups(src, dst, w, ld_at, st_at, odd_first);
            else transpose_units(src, dst, w, ld_at, st_at, odd_first);
            // generic-proxy stores (V^T, and the zeros of V that TMA overwrites next), then read by the async proxy.
            // Every lane arrives for its own reads and stores (an arrival releases only its thread's accesses, and
            // racecheck holds the consumers' O staging stores, in V's staging bytes, to that).
            sm90::fence_proxy_async();
            sm90::mbar_arrive(vs_empty(s));
            sm90::mbar_arrive(vt_full(slot));
        }
    }

    // One block's transposes by a warp, in units of 16 keys (g) by 32 bytes of the head dim (q), with the lane's
    // offsets of transpose. With 32 registers (three consumer warpgroups): the warp's key groups
    // g = w, w + 3, ..., each over every q unrolled, so that the stores' offsets are constants. With 24: units
    // u = w, w + 3, ... one at a time.
    __device__ __forceinline__ void transpose_groups(u32 src, u32 dst, u32 w, u32 ld_at, u32 st_at,
                                                     bool odd_first) const {
#pragma unroll 1
        for (u32 g = w; g < BN / 16; g += TRANSPOSERS) {
            const u32 ld = src + g * 2048, st = dst + (st_at ^ (g << 4));
#pragma unroll
            for (int q = 0; q < D / 32; ++q)
                transpose_unit(ld + (q / 4) * K_PANEL + (ld_at ^ ((2 * (q % 4)) << 4)), st + q * 4096, odd_first);
        }
    }
    __device__ __forceinline__ void transpose_units(u32 src, u32 dst, u32 w, u32 ld_at, u32 st_at,
                                                    bool odd_first) const {
#pragma unroll 1
        for (u32 u = w; u < (BN / 16) * (D / 32); u += TRANSPOSERS) {
            const u32 g = u % 8, q = u / 8;
            transpose_unit(src + (q / 4) * K_PANEL + g * 2048 + (ld_at ^ ((2 * (q % 4)) << 4)),
                           dst + q * 4096 + (st_at ^ (g << 4)), odd_first);
        }
    }
    // One unit: the ldmatrix.trans at `from`, its V^T rows' bytes by one stmatrix at `to`.
    __device__ __forceinline__ static void transpose_unit(u32 from, u32 to, bool odd_first) {
        u32 r[4];
        ldmatrix_x4_trans(r, from);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 even = __byte_perm(r[2 * h], r[2 * h + 1], 0x6420u);  // row 2 j's bytes
            const u32 odd = __byte_perm(r[2 * h], r[2 * h + 1], 0x7531u);   // row 2 j + 1's
            r[2 * h] = odd_first ? odd : even;
            r[2 * h + 1] = odd_first ? even : odd;
        }
        sm90::stmatrix_x4(to, r[0], r[1], r[2], r[3]);
    }

    // S of this warpgroup's 64 rows against the block in `slot`.
    __device__ __forceinline__ void issue_s(float (&sc)[1][BN / 8][4], int slot) const {
#pragma unroll
        for (int ks = 0; ks < D / 32; ++ks) {
            const u32 at = (ks / 4) * Q_PANEL + (ks % 4) * 32;
            const auto a = sm90::smem_desc(base + wg * 64 * 128 + at);
            const auto k = sm90::smem_desc(base + OFF_K + slot * K_BYTES + (ks / 4) * K_PANEL + (ks % 4) * 32);
            sm90::wgmma_m64n128k32_e4m3_ss(*reinterpret_cast<float(*)[64]>(&sc[0][0][0]), a, k, ks > 0);
        }
        sm90::wgmma_commit();
    }

    // P (in sc, fp32, relative to the row max) times 256 as e4m3 A fragments, 32 keys each (see the top).
    __device__ __forceinline__ static void fragments(const float (&s)[BN / 8][4], u32 (&pa)[BN / 32][4]) {
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
            const int j = 4 * kk;
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // a[r]: rows + 8 (r % 2), keys + 16 (r / 2)
                const int jj = j + 2 * (r / 2), e = 2 * (r % 2);
                pa[kk][r] = sm90::pack_e4m3x4(s[jj][e], s[jj][e + 1], s[jj + 1][e], s[jj + 1][e + 1]);
            }
        }
    }

    // acc = P V over the block in `slot`, columns c NCH .. of the head dim (B = V^T, K-major: D rows of the block's
    // 128 keys), from zero.
    __device__ __forceinline__ void issue_pv(const u32 (&pa)[BN / 32][4], int slot, PvAcc& acc, int c) {
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
            const auto desc = sm90::smem_desc(base + OFF_V + slot * V_BYTES + c * NCH * 128 + kk * 32);
            if constexpr (PV_SUMS && D == 128)
                sm90::wgmma_m64n136k32_e4m3_rs(*reinterpret_cast<float(*)[68]>(&acc[0][0][0]), pa[kk], desc, kk > 0);
            else if constexpr (PV_SUMS)
                sm90::wgmma_m64n72k32_e4m3_rs(*reinterpret_cast<float(*)[36]>(&acc[0][0][0]), pa[kk], desc, kk > 0);
            else
                sm90::wgmma_m64n128k32_e4m3_rs(*reinterpret_cast<float(*)[64]>(&acc[0][0][0]), pa[kk], desc, kk > 0);
        }
        sm90::wgmma_commit();
    }

    // O's columns c NCH .. = O alpha + acc: O rescaled to the block's row max, plus the block's P V, in fp32.
    __device__ __forceinline__ void fold(const PvAcc& acc, const float (&alpha)[1][2], int c) {
#pragma unroll
        for (int dt = 0; dt < PV_COLS / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                acc_o[0][c * (NCH / 8) + dt][e] = fmaf(acc_o[0][c * (NCH / 8) + dt][e], alpha[0][e / 2], acc[0][dt][e]);
    }

    // Block t of the walk (key block n): S, mask, softmax, P V (a chunk of the head dim at a time), each waited for
    // and folded into O; the slot handed back.
    template <bool MASKED, bool FIRST>
    __device__ __forceinline__ void step(int n, int t, float scale_log2) {
        const int slot = t % STAGES;
        sm90::mbar_wait(full(slot), (t / STAGES) & 1);
        float sc[1][BN / 8][4], alpha[1][2];
        sm90::wgmma_fence();
        issue_s(sc, slot);
        sm90::wgmma_wait<0>();
        probabilities<MASKED, FIRST>(sc, n, scale_log2, alpha);
        u32 pa[BN / 32][4];
        fragments(sc[0], pa);
        PvAcc acc;
        wait_vt(t);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            sm90::wgmma_fence();
            issue_pv(pa, slot, acc, c);
            sm90::wgmma_wait<0>();
            fold(acc, alpha, c);
        }
        sm90::mbar_arrive(empty(slot));
    }

    // Block n's scores to probabilities in place (mask, online softmax); alpha: O's factor before this block.
    template <bool MASKED, bool FIRST>
    __device__ __forceinline__ void probabilities(float (&sc)[1][BN / 8][4], int n, float scale_log2,
                                                  float (&alpha)[1][2]) {
        if (MASKED) {
            const int r = row0 + wg * 64 + warp * 16 + lane / 4, col_lane = n * BN + 2 * (lane % 4);
            mask.apply_row(sc[0], 0, r, col_lane);
            mask.apply_row(sc[0], 1, r + 8, col_lane);
        }
        softmax.template update_scores<FIRST, MASKED, CHAINS, LOG2_P, !PV_SUMS>(sc, scale_log2, alpha);
    }
    template <bool FIRST>
    __device__ __forceinline__ void probabilities_of(const BlockRange& range, int t, float (&sc)[1][BN / 8][4],
                                                     float scale_log2, float (&alpha)[1][2]) {
        const int n = range.n_max - 1 - t;
        if (sm90::warp_uniform(n > range.full_hi || n < range.full_lo))
            probabilities<true, FIRST>(sc, n, scale_log2, alpha);
        else probabilities<false, FIRST>(sc, n, scale_log2, alpha);
    }

    // PIPE: S of block t and O += P V of block t - 1 are issued together, and block t's softmax runs while P V still
    // computes (software pipelining, as fwd_sm90_mainloop.cuh's).
    // O is folded one block behind the softmax: alpha_pv is the factor of the block whose P V is in flight.
    __device__ __forceinline__ void consume_pipelined(const BlockRange& range, int count, float scale_log2) {
        float sc[1][BN / 8][4], alpha[1][2], alpha_pv[1][2];
        u32 pa[BN / 32][4];
        PvAcc acc;
        sm90::mbar_wait(full(0), 0);
        sm90::wgmma_fence();
        issue_s(sc, 0);
        sm90::wgmma_wait<0>();
        probabilities_of<true>(range, 0, sc, scale_log2, alpha_pv);
        fragments(sc[0], pa);
        for (int t = 1; t < count; ++t) {
            const int slot = t % STAGES, prev = (t - 1) % STAGES;
            sm90::mbar_wait(full(slot), (t / STAGES) & 1);
            wait_vt(t - 1);
            sm90::wgmma_fence();
            issue_s(sc, slot);
            issue_pv(pa, prev, acc, 0);
            sm90::wgmma_wait<1>();  // S of block t (groups complete in order)
            probabilities_of<false>(range, t, sc, scale_log2, alpha);
            sm90::wgmma_wait<0>();  // and P V of block t - 1
            sm90::mbar_arrive(empty(prev));
            fold(acc, alpha_pv, 0);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) alpha_pv[0][hh] = alpha[0][hh];
            fragments(sc[0], pa);
        }
        const int last = (count - 1) % STAGES;
        wait_vt(count - 1);
        sm90::wgmma_fence();
        issue_pv(pa, last, acc, 0);
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(empty(last));
        fold(acc, alpha_pv, 0);
    }

    // O / (row sum) v_descale in bf16, and lse. O leaves through the staging tile and TMA stores, except a packed
    // sequence's tile whose rows run past the sequence (a box would write into the next one): 4-byte stores from
    // registers there.
    __device__ __forceinline__ void store(float scale_log2, float v_scale) {
        float lse[1][2];
        if constexpr (PV_SUMS) {  // a quad's row sum: column D in lane 4i, the zeros of D + 2, D + 4, D + 6 beside it
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) softmax.row_sum[0][hh] = acc_o[0][D / 8][2 * hh];
        }
        softmax.template finalize<LOG2_P>(acc_o, scale_log2, lse);
        const int wg_row0 = row0 + wg * 64;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wg_row0 + warp * 16 + lane / 4 + 8 * hh;
            // lse: (batch, heads, seqlen_q), packed (heads, total_q)
            if (p.lse != nullptr && lane % 4 == 0 && r < seqlen_q) {
                const i64 at = packed ? (i64)h * p.rows_q + q_begin + r : ((i64)b * p.nheads + h) * p.seqlen_q + r;
                p.lse[at] = lse[0][hh];
            }
        }
        if (!packed || wg_row0 + 64 <= seqlen_q) {
            store_staged(wg_row0, v_scale);
            return;
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wg_row0 + warp * 16 + lane / 4 + 8 * hh;
            if (r >= seqlen_q) continue;
            u16* o_row = p.o_ptr + SeqInfo::offset(q_begin, p.o_batch_stride, p.o_row_stride, r) + h * p.o_head_stride;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                const int col = 8 * dt + 2 * (lane % 4);
                if (col < p.headdim)
                    *reinterpret_cast<u32*>(o_row + col) =
                        pack2<bf16_t>(acc_o[0][dt][2 * hh] * v_scale, acc_o[0][dt][2 * hh + 1] * v_scale);
            }
        }
    }

    // This warp's 16 rows of O into its rows of the staging tile (sm90::stage_warp_rows), then out by TMA, a box of
    // 16 rows per 64-column panel issued by the warp's lane 0 (the warps finish at different times: no barrier across
    // the warpgroup). Rows past a padded sequence's end and columns past the head dim fall outside the map. The
    // copies have read the tile before the CTA ends.
    __device__ __forceinline__ void store_staged(int wg_row0, float v_scale) {
        const u32 rows = base + OFF_O + (wg * 64 + warp * 16) * 128;  // this warp's rows of panel 0
        sm90::stage_warp_rows<O_PANELS>(rows, O_PANEL, lane, [&](int dt, int hh) {
            return pack2<bf16_t>(acc_o[0][dt][2 * hh] * v_scale, acc_o[0][dt][2 * hh + 1] * v_scale);
        });
        if (lane == 0) {
#pragma unroll
            for (int pn = 0; pn < O_PANELS; ++pn)
                sm90::tma_store_rows(&p.o, packed, pn * 64, h, q_begin, wg_row0 + warp * 16, b, rows + pn * O_PANEL);
            sm90::bulk_commit();
            sm90::bulk_wait_read<0>();
        }
    }

    __device__ __forceinline__ float descale(const float* x) const {
        return x == nullptr ? 1.f : x[p.descale_batch_stride ? b * p.descale_batch_stride + h_kv : 0];
    }

    __device__ __forceinline__ void run(char* smem) {
        tid = threadIdx.x;
        base = (smem_u32(smem) + 1023) & ~1023u;
        row0 = (BAND ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;  // under a band the longest tiles first
        h = blockIdx.y;
        b = blockIdx.z;
        h_kv = h / p.heads_per_kv;
        SeqInfo seq(p, b);
        packed = p.cu_seqlens_q != nullptr;
        if (packed) {  // cu_seqlens come from device memory: sequences stay inside q's and k's rows
            seq.q_begin = min(max(seq.q_begin, 0), p.rows_q);
            seq.k_begin = min(max(seq.k_begin, 0), p.rows_k);
            seq.seqlen_q = min(seq.seqlen_q, p.rows_q - seq.q_begin);
            seq.seqlen_k = max(min(seq.seqlen_k, p.rows_k - seq.k_begin), 0);
        }
        q_begin = seq.q_begin;
        k_begin = seq.k_begin;
        seqlen_q = seq.seqlen_q;
        if (row0 >= seqlen_q) return;  // a tile past this sequence's rows (the grid covers the longest)
        mask = Mask<BAND>{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
        const BlockRange range = block_range<BM, BN, BAND>(mask, row0);
        const int count = sm90::warp_uniform(max(range.n_max - range.n_min, 0));
        if constexpr (PV_SUMS) {  // V^T boxes' rows D .. D + 7: row D ones (unswizzled: row 0 of an atom), then zeros
            for (int i = tid; i < STAGES * 1024 / 16; i += THREADS) {
                const int word = i % 64 < 8 ? 0x38383838 : 0;
                st_shared_i4(base + OFF_V + (i / 64) * V_BYTES + D * 128 + (i % 64) * 16, word, word, word, word);
            }
            sm90::fence_proxy_async();  // generic-proxy stores, read by wgmma (async proxy)
        }
        if (tid == 0) {
            sm90::mbar_init(q_full(), 1);
            for (int s = 0; s < STAGES; ++s) {
                sm90::mbar_init(full(s), 1);
                sm90::mbar_init(empty(s), 128 * WGS);
                sm90::mbar_init(vt_full(s), 32 * TRANSPOSERS);  // every transposing thread's arrival
            }
            for (int s = 0; s < VS; ++s) {
                sm90::mbar_init(vs_full(s), 1);
                sm90::mbar_init(vs_empty(s), 32 * TRANSPOSERS);
            }
            sm90::mbar_fence_init();
        }
        __syncthreads();
        if (__shfl_sync(0xffffffff, tid / 128, 0) == 0) {  // the producer (a role ptxas sees is warp-uniform)
            sm90::regs_dealloc<PRODUCER_REGS>();
            const int w = sm90::warp_uniform(tid / 32);
            if (tid == 0 && count > 0) {
                produce(range, count);
            } else if (!VT_PASS && w > 0 && count > 0) {
                lane = tid % 32;
                transpose(count, packed ? min(seq.seqlen_k - (range.n_max - 1) * BN, BN) : BN, (u32)w - 1);
            }
            return;
        }
        sm90::regs_alloc<CONSUMER_REGS>();
        wg = sm90::warp_uniform(tid / 128 - 1);
        warp = (tid / 32) % 4;
        lane = tid % 32;
        if (row0 + wg * 64 >= seqlen_q) {  // a warpgroup of rows past the sequence's (the tile's last): no work
            pass_blocks(count);
            return;
        }
        const float scale_log2 = p.scale_log2 * descale(p.q_descale) * descale(p.k_descale);
        softmax.reset();
#pragma unroll
        for (int dt = 0; dt < (D + SUM_ROWS) / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
        if (count > 0) sm90::mbar_wait(q_full(), 0);
        if (PIPE && count > 0) {
            consume_pipelined(range, count, scale_log2);
        } else if (count > 0) {
            for (int t = 0; t < count; ++t) {
                const int n = range.n_max - 1 - t;
                const bool masked = sm90::warp_uniform(n > range.full_hi || n < range.full_lo);
                if (t == 0) {
                    if (masked) step<true, true>(n, t, scale_log2);
                    else step<false, true>(n, t, scale_log2);
                } else {
                    if (masked) step<true, false>(n, t, scale_log2);
                    else step<false, false>(n, t, scale_log2);
                }
            }
        }
        store(scale_log2, descale(p.v_descale));
    }
};

template <int D, bool BAND, bool PIPE, int WGS, bool VT_PASS, bool PV_SUMS>
__global__ void __launch_bounds__(128 * (WGS + 1), 1) fwd_fp8_sm90_kernel(const __grid_constant__ FwdFp8Params p) {
    extern __shared__ __align__(1024) char smem[];
    FwdFp8<D, BAND, PIPE, WGS, VT_PASS, PV_SUMS> block(p);
    block.run(smem);
}

template <int D, bool BAND, bool PIPE, int WGS, bool VT_PASS, bool PV_SUMS>
__device__ const unsigned fwd_fp8_sm90_smem_bytes = FwdFp8<D, BAND, PIPE, WGS, VT_PASS, PV_SUMS>::SMEM_BYTES;

}  // namespace cuflash

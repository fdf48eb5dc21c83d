// The Hopper backward's layout (bwd_sm90.cu): its kernel parameters, its named barriers, and its shared memory as one
// struct per head-dim family, whose offsetof the kernel addresses its tiles by.
#pragma once
#include "sm90.cuh"
#include "params.cuh"

namespace cuflash {

struct BwdSm90Params {
    sm90::TmaMap q;     // (d, heads, seqlen_q, batch) padded or (d, heads, total_q) packed, box (64, 1, BM[, 1])
    sm90::TmaMap k;     // (d, heads_k, seqlen_k, batch) or (d, heads_k, total_k), box (64, 1, 128[, 1])
    sm90::TmaMap v;
    sm90::TmaMap dout;  // like q
    sm90::TmaMap dq;    // dq_accum, fp32 (d, heads, rows of all sequences, slices), box (32, 1, 64, 1)
    BwdParams p;        // the portable kernel's parameters (its q, k, v, dout pointers unused here)
};

// Named barriers (0 is __syncthreads).
enum class BwdBarrier : int {
    Warpgroup0 = 1,  // Warpgroup0 + wg: warpgroup wg's own 128 threads (its dS^T stores, lockstep)
    Warpgroup1 = 2,
    DqOrder = 3,  // deterministic add_dq_red: warpgroup 0's reductions before warpgroup 1's (256 threads)
    // The warp-specialized kernel (BwdSm90::WS), over the consumer warpgroups wg = 0, 1:
    DsReady = 5,  // both consumers' dS^T of the step stored (256 threads)
    DsFree0 = 6,  // DsFree0 + wg: the other consumer's dQ has read the last step's dS^T (it arrives, wg waits; 256)
    DsFree1 = 7,
    DqFull0 = 8,  // DqFull0 + wg: consumer wg's dQ staging tile stored (its 128 threads arrive, the dQ warp waits; 160)
    DqFull1 = 9,
};
static_assert(int(BwdBarrier::Warpgroup1) == int(BwdBarrier::Warpgroup0) + 1, "one barrier per warpgroup, by index");
static_assert(int(BwdBarrier::DsFree1) == int(BwdBarrier::DsFree0) + 1 &&
              int(BwdBarrier::DqFull1) == int(BwdBarrier::DqFull0) + 1, "one barrier per consumer, by index");

// The end of the shared memory: with dQ added by TMA (TMA_DQ), its staging buffers, per step parity and warpgroup a
// 64 x 64 fp32 tile as two boxes of 32 columns (64 lines of 128 bytes, 128-byte swizzle); then the mbarriers: K/V
// full, and Q/dO full per buffer; the warp-specialized kernel's (BwdSm90::WS) Q/dO empty per buffer, K/V empty,
// and dQ staging free.
template <bool TMA_DQ> struct BwdSm90Tail {
    alignas(1024) float dq[2][2][2][64][32];
    unsigned long long kv_full, qd_full[2], qd_empty[2], kv_empty, dq_empty;
};
template <> struct BwdSm90Tail<false> {  // dQ by vector reductions (never warp-specialized): the mbarriers only
    alignas(1024) unsigned long long kv_full;
    unsigned long long qd_full[2];
};

// The shared memory of a CTA from its first 1024-byte boundary, as laid out; the kernel's offsets are offsetof this.
// Tiles are 64-column panels (128-byte rows, 128-byte swizzle) of 16-bit elements, each 1024-aligned (the swizzle
// atom of TMA and wgmma).
template <int D, int BM, bool TMA_DQ> struct BwdSm90Smem {
    static constexpr int BN = 128;
    unsigned char k[BN * D * 2], v[BN * D * 2];          // this CTA's keys and values, resident per key block
    unsigned char q[2][BM * D * 2], dout[2][BM * D * 2];  // Q and dO of a step, double-buffered by step parity
    unsigned char ds[BM / 64][BN * 128];                  // dS^T: all keys x 64 queries per panel
    float rows[2][3][BM];  // per Q/dO buffer: lse_log2, D and the fixed-point dQ scale
    BwdSm90Tail<TMA_DQ> tail;
};

// d = 256 (BwdSm90::DSPLIT): 64 keys per CTA, Q double-buffered, dO single (its next load waits for the step's dV),
// P^T beside dS^T, one dQ staging tile per warpgroup (its two 64-column panels go through it in turn), and the
// mbarriers: K/V full, Q full per buffer, dO full.
template <int BM> struct BwdSm90SplitTail {
    alignas(1024) float dq[2][2][64][32];
    unsigned long long kv_full, qd_full[2], do_full;
    unsigned long long qd_empty[2], kv_empty, do_empty, dq_empty[2];  // warp-specialized (BwdSm90::WS)
};
static_assert(offsetof(BwdSm90SplitTail<64>, do_full) == offsetof(BwdSm90SplitTail<64>, qd_full) + 16,
              "dO's mbarrier right after Q's two (BwdSm90::OFF_DO_BAR)");
template <int BM, bool TMA_DQ> struct BwdSm90Smem<256, BM, TMA_DQ> {
    static constexpr int BN = 64, D = 256;
    unsigned char k[BN * D * 2], v[BN * D * 2];
    unsigned char q[2][BM * D * 2], dout[1][BM * D * 2];
    unsigned char ds[BM / 64][BN * 128];  // dS^T: 64 keys x 64 queries
    unsigned char pt[BN * 128];           // P^T, the same
    float rows[2][3][BM];  // per Q buffer
    BwdSm90SplitTail<BM> tail;
};

}  // namespace cuflash

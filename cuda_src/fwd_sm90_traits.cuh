// The Hopper forward's configuration (fwd_sm90.cu): its kernel parameters, the constants and choices that follow
// from the template parameters, the shared-memory layout (SharedStorage), the named barriers, and the per-thread
// state every part of the kernel shares (FwdSm90State).
#pragma once
#include "sm90.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "seqlen.cuh"
#include "dropout.cuh"

namespace cuflash {

// ------------------------------------------------------------------------------------------- parameters

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
    const i64* dropout_state;  // as in FwdParams (params.cuh): the dropout generator in device memory, or nullptr
    i64 dropout_seed, dropout_offset;  // the dropout generator (dropout.cuh); set per call
    const int* block_table;  // PAGED kernels: (batch, max_pages) pages of each sequence's keys; k, v page pools
    const int* seqused_k;    // PAGED kernels: each sequence's key count in place of cu_seqlens_k's, or nullptr
    i64 o_batch_stride, o_row_stride, o_head_stride;  // packed: the row stride is the batch stride (seqlen.cuh)
    i64 lse_batch_stride, lse_head_stride, alibi_batch_stride;
    int seqlen_q, seqlen_k, nheads, heads_per_kv;      // packed: the maximum lengths
    int window_left, window_right;
    float scale_log2;      // log2(e) in score-mod kernels (scores leave ScoreMod in natural-log units)
    float mod_scale, softcap;  // score-mod kernels: see score_mod.cuh and plan.forward_scales
    int dropout_threshold;     // DROPOUT kernels: draws (bytes) below it keep their element; 256: no dropout
    float dropout_scale;       // 256 / dropout_threshold
    int batch;             // sequences (the persistent kernel walks query blocks x heads x batch itself)
    int o_tma;             // warp-specialized kernels: O leaves through shared memory and TMA stores (epilogue)
    // The persistent kernel's walk (FwdSm90Scheduler::tile_of; plan.sm90_walk_chunk): under a band, chunks of
    // `chunk` (sequence, head) pairs (`chunk_last` in the last one); the divisions a tile index takes, by query
    // blocks, heads, tiles per chunk, pairs per chunk and in the last chunk
    int chunk, chunk_last;
    FastDiv by_m_blocks, by_heads, by_chunk_tiles, by_chunk, by_chunk_last;
    // PAGED kernels: block_table's row stride, the pools' geometry (k, v: (num_pages, page_size, heads_k, d)), and
    // the rows of one TMA box of K or V, a divisor of page_size and of BN (so that no box straddles two pages)
    int block_table_stride, page_size, num_pages, max_pages, page_box;
    int headdim;  // the call's head dim, at most D: the columns past it are TMA's zero fill, and are not stored
};
// The layout cuflash/hopper.py PARAMS_DTYPE writes (NVRTC 13.0, the device's, has no offsetof: only the size is
// asserted).
static_assert(sizeof(FwdSm90Params) == 768, "FwdSm90Params no longer matches cuflash/ops/forward_sm90.py");

// ----------------------------------------------------------------------------------------- named barriers

// The CTA's named barriers (bar.sync ids; 0 is __syncthreads).
enum class FwdSm90Barrier : int {
    // PINGPONG: warpgroup w's turn to issue its GEMMs is barrier Turn0 + w (Turn1 for the second)
    Turn0 = 1,
    Turn1 = 2,
    // SPLIT: warpgroups 1 and 2 have left their O, max and sum for warpgroup 0 (MergeWritten), which has read them
    // (MergeRead)
    MergeWritten = 6,
    MergeRead = 7,
};
__device__ __forceinline__ void named_sync(FwdSm90Barrier id, int threads) { sm90::named_sync((int)id, threads); }
__device__ __forceinline__ void named_arrive(FwdSm90Barrier id, int threads) {
    sm90::named_arrive((int)id, threads);
}
// Warpgroup w's turn barrier (w = 0, 1).
__device__ __forceinline__ FwdSm90Barrier turn_barrier(int w) {
    return (FwdSm90Barrier)((int)FwdSm90Barrier::Turn0 + w);
}

// ---------------------------------------------------------------------------------- shared-memory regions

// The regions of SharedStorage. C++17 has no zero-length member, so each region a kernel may lack is a base of
// SharedStorage that is empty (no bytes) when absent; the regions lie in the order of the bases.
namespace fwd_sm90 {
typedef unsigned long long Mbarrier;

// A tile of BYTES (a whole number of 1024-byte swizzle atoms: TMA's and wgmma's 128-byte swizzle needs each 64-column
// panel on a 1024-byte boundary).
template <u32 BYTES> struct TileBytes {
    unsigned char bytes[BYTES];
    static_assert(BYTES % 1024 == 0, "whole 1024-byte swizzle atoms");
};

// Q's tile and the K/V ring: STAGES slots of K and of V.
template <u32 Q_BYTES, u32 KV_BYTES, int STAGES> struct OperandTiles {
    TileBytes<Q_BYTES> q;
    TileBytes<KV_BYTES> k[STAGES];
    TileBytes<KV_BYTES> v[STAGES];
};
// The persistent kernel's own staging tile for O (epilogue), where it fits.
template <u32 Q_BYTES, bool PRESENT> struct OStagingTile {
    TileBytes<Q_BYTES> o;
};
template <u32 Q_BYTES> struct OStagingTile<Q_BYTES, false> {};
// The persistent kernel's further Q tiles, where they fit: Q tile qb > 0 is q_more[qb - 1].
template <u32 Q_BYTES, int N> struct MoreQTiles {
    TileBytes<Q_BYTES> q_more[N];
};
template <u32 Q_BYTES> struct MoreQTiles<Q_BYTES, 0> {};
// Each Q tile's "full" barrier (its TMA bytes are in), and each ring slot's "full" and "empty" barriers per half (K:
// half 0, V: half 1): K is handed back once S = Q K^T is done, V once O += P V is.
template <int Q_BUFS, int STAGES> struct RingBarriers {
    Mbarrier q_full[Q_BUFS];
    Mbarrier full[2][STAGES];
    Mbarrier empty[2][STAGES];
};
// The persistent kernel: each Q tile's "empty" barrier (every consumer thread is done with it).
template <int N> struct QEmptyBarriers {
    Mbarrier q_empty[N];
};
template <> struct QEmptyBarriers<0> {};
// SPLIT: the max and sum of each row of warpgroups 1 .. N (FwdSm90Mainloop::split_leave).
template <int N> struct SplitMerge {
    float merge[N][64][2];
};
template <> struct SplitMerge<0> {};
// An entry of the tile ring (FwdSm90Scheduler::hand_tile): have, row0, b, h | q_begin, k_begin, seqlen_q, seqlen_k |
// the block range | the ALiBi slope; read as 16-byte words.
struct alignas(16) TileEntry {
    int head[4], seq[4], blocks[4];
    float slope;
    int unused[3];
};
// The tile ring (the OVERLAP_TILES kernels): N entries, each with a "full" barrier (written) and an "empty" one
// (read by every consumer).
template <int N> struct TileRing {
    Mbarrier tile_full[N];
    Mbarrier tile_empty[N];
    TileEntry entry[N];
};
template <> struct TileRing<0> {};

// The regions in address order (the bases of an empty region take no bytes).
template <u32 Q_BYTES, u32 KV_BYTES, int STAGES, bool O_TILE, int Q_BUFS, bool PERSISTENT, int MERGE_WGS, int SLOTS>
struct SharedStorage : OperandTiles<Q_BYTES, KV_BYTES, STAGES>, OStagingTile<Q_BYTES, O_TILE>,
                       MoreQTiles<Q_BYTES, Q_BUFS - 1>, RingBarriers<Q_BUFS, STAGES>,
                       QEmptyBarriers<PERSISTENT ? Q_BUFS : 0>, SplitMerge<MERGE_WGS>, TileRing<SLOTS> {};
}  // namespace fwd_sm90

// --------------------------------------------------------------------------------------------------- traits

// What the template parameters decide: tile sizes, thread roles, which parts a kernel has, and its shared memory.
//  T: bf16_t / half_t; D: head dim (64, 128, 256); BN: keys per block (64, 80, 128, 176); BAND: a causal or local mask;
//  STAGES: K/V ring slots; WGS: consumer warpgroups of 64 query rows; WS: warp-specialized (a producer warpgroup);
//  SCORE_MOD: softcap / ALiBi; PINGPONG: the consumer warpgroups take turns issuing GEMMs; PERSISTENT: one CTA per
//  SM walks the tiles; SPLIT_TILES: tiles whose rows fit in 64 are worked by all three consumer warpgroups;
//  DROPOUT: dropout on the probabilities (dropout.cuh), where the call asks for it; PAGED: a packed batch's keys
//  from page pools (block_table), lockstep kernels only.
template <class T_, int D_, int BN_, bool BAND_, int STAGES_, int WGS_, bool WS_, bool SCORE_MOD_, bool PINGPONG_,
          bool PERSISTENT_, bool SPLIT_TILES_, bool DROPOUT_ = false, bool PAGED_ = false>
struct FwdSm90Traits {
    using T = T_;
    static constexpr int D = D_, BN = BN_, STAGES = STAGES_, WGS = WGS_;
    static constexpr bool BAND = BAND_, WS = WS_, SCORE_MOD = SCORE_MOD_, PINGPONG = PINGPONG_,
                          PERSISTENT = PERSISTENT_, SPLIT = SPLIT_TILES_, DROPOUT = DROPOUT_, PAGED = PAGED_;
    // dropout indexes a warp's rows by warp_row0(), which a split tile's warpgroups 1 and 2 do not follow
    static_assert(!(DROPOUT && SPLIT), "no dropout in the split-tile kernel");
    // the tail of a sequence's last V block is zeroed between the lockstep kernel's CTA barriers (FwdSm90::run)
    static_assert(!(PAGED && WS), "paged keys in the lockstep kernel only");

    static constexpr int BM = 64 * WGS, PANELS = D / 64;  // WGS consumer warpgroups of 64 query rows each
    static constexpr int THREADS = 128 * (WGS + (WS ? 1 : 0)), CONSUMER0 = WS ? 128 : 0;  // consumers: CONSUMER0 ..
    static constexpr int CONSUMERS = THREADS - CONSUMER0;
    // setmaxnreg after the split: the producer keeps 24 registers, the consumers share the rest of the CTA's pool
    // (sm90::register_pool: 240 each for two warpgroups, 160 for three)
    static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = WGS == 2 ? 240 : 160;
    static constexpr u32 Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
    static constexpr u32 Q_PANEL = BM * 128, KV_PANEL = BN * 128;  // bytes of one 64-column panel

    // The shared memory of a choice of O staging tile and Q tiles (tiles and barriers, without the tile ring and the
    // merge area), and the budget: the SM's shared memory per block, less room to align the start to 1024.
    template <bool O_TILE, int Q_BUFS>
    using Layout = fwd_sm90::SharedStorage<Q_BYTES, KV_BYTES, STAGES, O_TILE, Q_BUFS, PERSISTENT, 0, 0>;
    static constexpr u32 LIMIT = 227 * 1024 - 1024;
    // O_TILE: the persistent kernel's own staging tile for the epilogue's TMA stores, where it fits (else O is
    // staged in Q's tile, which the next tile's Q then waits for). Q_BUFS: where they fit too, the persistent
    // kernel's second Q tile (at d 64 a second and a third): tiles take them in turn, so the next tile's Q loads
    // while this one computes (with three, while the one before ends too: a causal tile of a block or two hands its
    // Q tile back only a block or two before the next needs one).
    static constexpr bool O_TILE = PERSISTENT && sizeof(Layout<true, 1>) <= LIMIT;
    static constexpr int Q_BUFS = O_TILE && D == 64 && sizeof(Layout<true, 3>) <= LIMIT ? 3
                                  : O_TILE && sizeof(Layout<true, 2>) <= LIMIT          ? 2
                                                                                        : 1;
    // OVERLAP_TILES: the persistent kernel with more than one Q tile at d 64 and two consumer warpgroups overlaps
    // consecutive tiles (FwdSm90::consume_overlapped): the next tile's first S = Q K^T and softmax run while
    // this tile's last O += P V computes. That kernel also
    //  - hands a tile's Q back once the tile's last S = Q K^T is done (FwdSm90Mainloop::s_done), not after its
    //    epilogue, so that the producer loads a later tile's Q sooner (the overlapped step needs it a block earlier);
    //  - has the producer hand each tile to the consumers through a ring in shared memory (FwdSm90Scheduler::
    //    hand_tile), where the consumers would run the walk's arithmetic themselves between two tiles;
    //  - makes each tile's block range and the thread's warp index values ptxas can see are warp-uniform (and not
    //    the ring position, whose shuffles cost more than they save there: FwdSm90State::uniform), so that the
    //    branches of the step and every wgmma descriptor stay on the uniform datapath.
    // With two Q tiles at d 128 it is slower, and with three consumer warpgroups the next tile's S does not fit in
    // 160 registers beside P and O (docs/perf-notes.md).
    static constexpr bool OVERLAP_TILES = PERSISTENT && Q_BUFS >= 2 && D == 64 && WGS == 2;
    static constexpr int TILE_SLOTS = OVERLAP_TILES ? 8 : 0;  // the tile ring's entries
    // SPLIT (FwdSm90Mainloop::consume_split): its merge area holds the max and sum of warpgroups 1 and 2's rows.
    static constexpr int MERGE_WGS = SPLIT ? WGS - 1 : 0;
    using SharedStorage = fwd_sm90::SharedStorage<Q_BYTES, KV_BYTES, STAGES, O_TILE, Q_BUFS, PERSISTENT, MERGE_WGS,
                                                  TILE_SLOTS>;
    // The dynamic shared memory a launch requests: the layout and room to align its start to 1024 (exported to the
    // launcher as fwd_sm90_smem_bytes, fwd_sm90.cu).
    static constexpr u32 SMEM_BYTES = sizeof(SharedStorage) + 1024;

    // Masked blocks where a band's right edge meets each warp's rows on a 16-column boundary take the mask's
    // per-warp shapes (Mask::apply_diagonal), except with three consumer warpgroups, whose 160 registers the shapes
    // overflow (spills at d 64).
    static constexpr bool DIAGONAL = WGS == 2;
    // A tile's first block whose right half no row of a warpgroup sees runs its softmax over the left half only
    // (FwdSm90Mainloop::first_probabilities). Not in the OVERLAP_TILES kernel, where it is slower: its warpgroups
    // then run different copies of the first block's step at once.
    static constexpr bool LEFT_HALF = BN == 128 && !OVERLAP_TILES;
    // O += P V: where the head dim has an even number of 64-column panels one m64n128k16 covers two of them (P's
    // fragment read once for both), else one m64n64k16 per panel.
    static constexpr bool PV_N128 = PANELS % 2 == 0;

    static_assert(D % 64 == 0, "whole 64-column panels");
    static_assert(BN == 64 || BN == 80 || BN == 128 || BN == 176,
                  "S = Q K^T is one wgmma m64n64, n80, n128 or n176 per k16 step");
    static_assert(STAGES >= 2 && (WS || STAGES == 2), "the lockstep version refills after a CTA barrier: 2 slots");
    static_assert(WS || !PINGPONG, "ping-pong schedules the warp-specialized consumers");
    static_assert(WGS == 2 || (WGS == 3 && WS && !PINGPONG), "three consumer warpgroups: warp-specialized, no turns");
    static_assert(!WS || 128 * PRODUCER_REGS + 128 * WGS * CONSUMER_REGS <= sm90::register_pool(THREADS),
                  "the warp-specialized register split exceeds the CTA's pool");
    static_assert(WS || !PERSISTENT, "the persistent kernel is the warp-specialized one");
    static_assert(Q_BUFS == 1 || O_TILE, "O is staged in Q's tile only with one Q tile");
    static_assert(!SPLIT || (PERSISTENT && WGS == 3 && O_TILE && D == 64 && STAGES > WGS),
                  "split tiles: the persistent kernel with three consumer warpgroups, d 64, its own O tile");
    static_assert(!(SPLIT && OVERLAP_TILES), "the merge area and the tile ring are never in one kernel");
    static_assert(sizeof(fwd_sm90::TileEntry) == 64, "a tile ring entry is four 16-byte words");
    // The tiles are whole swizzle atoms laid out first, so each starts on a 1024-byte boundary of the aligned base.
    static_assert(sizeof(fwd_sm90::OperandTiles<Q_BYTES, KV_BYTES, STAGES>) == Q_BYTES + 2 * STAGES * KV_BYTES,
                  "the operand tiles are packed");
    static_assert(SMEM_BYTES <= 227 * 1024, "the SM's shared memory per block");
};

// --------------------------------------------------------------------------------------------------- state

// Shared memory seen from a thread: the 1024-aligned base address of SharedStorage and the address of each region
// and its elements. A region's offset is its place in the struct (the difference of two addresses in it, which the
// compiler folds to a constant: NVRTC has no offsetof); its elements follow at their size apart.
template <class Tr>
struct FwdSm90Smem {
    using Storage = typename Tr::SharedStorage;
    static constexpr u32 BARRIER = sizeof(fwd_sm90::Mbarrier), ENTRY = sizeof(fwd_sm90::TileEntry);
    u32 base;
    const Storage* layout;  // any address: only offsets within it are taken

    __device__ __forceinline__ void init(char* smem) {
        base = (smem_u32(smem) + 1023) & ~1023u;
        layout = reinterpret_cast<const Storage*>(smem);
    }
    // The offset of a region (a member of SharedStorage) from the base
    __device__ __forceinline__ u32 offset(const void* region) const {
        return (u32)(reinterpret_cast<const char*>(region) - reinterpret_cast<const char*>(layout));
    }

    // Q tile qb (0 .. Q_BUFS - 1): the first, then those of q_more
    __device__ __forceinline__ u32 q_tile(int qb) const {
        return base + (qb ? q_more_offset() + (qb - 1) * Tr::Q_BYTES : 0);
    }
    __device__ __forceinline__ u32 q_more_offset() const {
        if constexpr (Tr::Q_BUFS > 1) return offset(layout->q_more);
        else return offset(layout->q_full);  // (where they would begin; qb is 0)
    }
    // Ring slot `slot`'s K (half 0) or V (half 1), from the base and as an address
    __device__ __forceinline__ u32 kv_offset(int slot, int half) const {
        return (half ? offset(layout->v) : offset(layout->k)) + slot * Tr::KV_BYTES;
    }
    __device__ __forceinline__ u32 kv_tile(int slot, int half) const { return base + kv_offset(slot, half); }
    // The staging tile of O: the persistent kernel's own (O_TILE), else Q's first
    __device__ __forceinline__ u32 o_tile() const {
        if constexpr (Tr::O_TILE) return base + offset(&layout->o);
        else return base;
    }
    __device__ __forceinline__ u32 q_full(int qb) const { return base + offset(layout->q_full) + BARRIER * qb; }
    __device__ __forceinline__ u32 q_empty(int qb) const { return base + offset(layout->q_empty) + BARRIER * qb; }
    __device__ __forceinline__ u32 full(int slot, int half) const {
        return base + offset(layout->full) + BARRIER * (half * Tr::STAGES + slot);
    }
    __device__ __forceinline__ u32 empty(int slot, int half) const {
        return base + offset(layout->empty) + BARRIER * (half * Tr::STAGES + slot);
    }
    __device__ __forceinline__ u32 tile_full(int i) const { return base + offset(layout->tile_full) + BARRIER * i; }
    __device__ __forceinline__ u32 tile_empty(int i) const { return base + offset(layout->tile_empty) + BARRIER * i; }
    // Entry i of the tile ring, and its words (TileEntry's members)
    __device__ __forceinline__ u32 tile_entry(int i) const { return base + offset(layout->entry) + ENTRY * i; }
    template <class M> __device__ __forceinline__ u32 tile_entry(int i, M fwd_sm90::TileEntry::*word) const {
        const fwd_sm90::TileEntry& e = layout->entry[0];
        return tile_entry(i) + (u32)(reinterpret_cast<const char*>(&(e.*word)) - reinterpret_cast<const char*>(&e));
    }
    // The max and sum of row `row` of warpgroup w (1, 2)
    __device__ __forceinline__ u32 merge_row(int w, int row) const {
        if constexpr (Tr::MERGE_WGS > 0)
            return base + offset(layout->merge) + ((w - 1) * 64 + row) * (u32)sizeof(layout->merge[0][0]);
        else return base;  // (no merge area: never called)
    }
};

// A tile's rows and sequence (what the epilogue reads of it) and the Q tile it uses.
struct FwdSm90TileRows {
    int row0, b, h, q_begin, seqlen_q, qb;
};

// The current tile: its rows (row0 ..), sequence b, head h (and K/V head h_kv), where the sequence's rows start
// (seqlen.cuh), its lengths as the mask holds them, the score mod, and the Q tile qb it uses (0 .. Q_BUFS - 1).
template <bool BAND>
struct FwdSm90Tile {
    int qb = 0;
    int row0, b, h, h_kv;
    int q_begin, k_begin, seqlen_q;
    Mask<BAND> mask;
    ScoreMod mod;  // softcap / ALiBi (SCORE_MOD kernels)

    __device__ __forceinline__ FwdSm90TileRows rows() const { return {row0, b, h, q_begin, seqlen_q, qb}; }
    __device__ __forceinline__ void set_rows(const FwdSm90TileRows& t) {
        row0 = t.row0;
        b = t.b;
        h = t.h;
        q_begin = t.q_begin;
        seqlen_q = t.seqlen_q;
        qb = t.qb;
    }
};

// What every part of the kernel (scheduler, producer, main loop, epilogue) shares: the parameters, this thread's
// place, shared memory, the current tile, and the consumers' accumulators.
template <class Tr>
struct FwdSm90State {
    const FwdSm90Params& p;
    int tid, wg, warp, lane;  // wg: consumer warpgroup (0 .. WGS - 1); warp: within the warpgroup
    FwdSm90Smem<Tr> smem;
    FwdSm90Tile<Tr::BAND> tile;
    OnlineSoftmax<1> softmax;
    // O's accumulators: per 64-column panel the 32 of one wgmma m64n64; viewed whole, the [rows][8-col tiles][4]
    // layout softmax.cuh rescales and normalizes
    float acc_o[1][Tr::PANELS * 8][4];

    __device__ __forceinline__ explicit FwdSm90State(const FwdSm90Params& params) : p(params) {}

    __device__ __forceinline__ void start(char* smem_bytes) {
        tid = threadIdx.x;
        // consumers 0 .. WGS - 1 (producer threads never use it)
        wg = sm90::warp_uniform((tid - Tr::CONSUMER0) / 128);  // (uniform() would skip it in the OVERLAP_TILES kernel)
        warp = Tr::OVERLAP_TILES ? sm90::warp_uniform((tid / 32) % 4) : (tid / 32) % 4;
        lane = tid % 32;
        smem.init(smem_bytes);
    }

    // A value every lane of the warp holds, made one ptxas can see as such (sm90::warp_uniform), so that the ring
    // position and the wgmma descriptors stay on the uniform datapath. Not in the OVERLAP_TILES kernel, where the
    // shuffles cost more than they saved (it makes its tiles' values uniform instead).
    __device__ __forceinline__ static int uniform(int x) { return Tr::OVERLAP_TILES ? x : sm90::warp_uniform(x); }

    // The role as a value the compiler can see is warp-uniform (a shuffle from lane 0): a branch on tid alone looks
    // divergent to ptxas, which then serializes every wgmma behind it (C7520).
    __device__ __forceinline__ bool is_producer() const { return __shfl_sync(0xffffffff, tid / 128, 0) == 0; }

    // The first row of this warp's 16 (of the tile's rows)
    __device__ __forceinline__ int warp_row0() const { return tile.row0 + wg * 64 + warp * 16; }

    __device__ __forceinline__ void zero_o() {
#pragma unroll
        for (int dt = 0; dt < Tr::PANELS * 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    }
    __device__ __forceinline__ void reset_accumulators() {
        zero_o();
        softmax.reset();
    }
    // O's 32 accumulators of 64-column panel pn
    __device__ __forceinline__ float (&panel(int pn))[32] {
        return *reinterpret_cast<float(*)[32]>(&acc_o[0][pn * 8][0]);
    }
};

// Ring position i (counted from 0 over the CTA's key blocks): its slot, and the parity of the slot's fill that holds
// it (unsigned: no sign fix-ups in the division)
template <int STAGES> __device__ __forceinline__ int slot_of(int i) { return (int)((u32)i % STAGES); }
template <int STAGES> __device__ __forceinline__ u32 pass_of(int i) { return ((u32)i / STAGES) & 1; }

// The key blocks of a tile. Rows that see no key can have n_max < n_min (a causal mask's rows above a bottom-right
// diagonal): none. Producer and consumers must agree, or the producer's ring position runs ahead of theirs.
__device__ __forceinline__ int block_count(const BlockRange& range) { return max(range.n_max - range.n_min, 0); }

}  // namespace cuflash

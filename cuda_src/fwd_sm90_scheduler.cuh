// The Hopper forward's tile scheduler (fwd_sm90.cu): which tile (query block, head, sequence) a CTA works on. The
// grid kernels take theirs from blockIdx; the persistent kernel's CTAs walk the tiles, and in the OVERLAP_TILES
// kernel the producer hands each tile to the consumers through a ring in shared memory.
#pragma once
#include "fwd_sm90_traits.cuh"

namespace cuflash {

template <class Tr>
struct FwdSm90Scheduler {
    static constexpr bool BAND = Tr::BAND, SCORE_MOD = Tr::SCORE_MOD;
    FwdSm90State<Tr>& s;

    // Query block m_block of head `head` in sequence `batch` as this thread's tile: its rows, sequence, mask, score
    // mod and key-block range. False when a packed sequence shorter than the longest has no rows there.
    __device__ __forceinline__ bool begin_tile(int m_block, int head, int batch, BlockRange& range) {
        const FwdSm90Params& p = s.p;
        FwdSm90Tile<BAND>& t = s.tile;
        t.h = head;
        t.b = batch;
        t.h_kv = t.h / p.heads_per_kv;
        t.row0 = m_block * Tr::BM;
        const SeqInfo seq(p, t.b);
        if (t.row0 >= seq.seqlen_q) return false;
        t.q_begin = seq.q_begin;
        t.k_begin = seq.k_begin;
        t.seqlen_q = seq.seqlen_q;
        const int seqlen_k = Tr::PAGED ? SeqInfo::bounded_seqlen_k(p, seq.seqlen_k, t.b) : seq.seqlen_k;
        t.mask = Mask<BAND>{seqlen_k, seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
        if (SCORE_MOD)
            t.mod = ScoreMod{p.mod_scale, p.softcap,
                             p.alibi != nullptr ? p.alibi[(i64)t.b * p.alibi_batch_stride + t.h] : 0.f,
                             seqlen_k - seq.seqlen_q};
        range = block_range<Tr::BM, Tr::BN, BAND>(t.mask, t.row0);
        return true;
    }

    // The grid kernels: one tile per CTA, grid (query blocks, heads, batch); under a band the longest (last) query
    // blocks first.
    __device__ __forceinline__ bool grid_tile(BlockRange& range) {
        return begin_tile(BAND ? gridDim.x - 1 - blockIdx.x : blockIdx.x, blockIdx.y, blockIdx.z, range);
    }

    // The persistent kernel: gridDim.x CTAs (one per SM) walk the tiles in rounds of gridDim.x. The tiles are ordered
    // as the grid of the other kernels: query blocks fastest (longest first under a band), then heads, then
    // sequences, so the tiles running at once are the query blocks of a few heads, which share those heads' K and V
    // in L2. CTA x takes tile x of each round; with a band every other round backwards (gridDim.x - 1 - x): the tiles
    // of a head differ in length, and a plain stride would give a CTA the same query block of every head when
    // gridDim.x is a multiple of the query blocks (all the longest to some CTAs), where the snake pairs a long tile
    // with a short one. Producer and consumers each run their own copy of the walk: code both roles share would keep
    // ptxas from honouring setmaxnreg (C7507).
    __device__ __forceinline__ static int walk(int round) {
        return round * gridDim.x + (BAND && (round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    }

    // Tile idx of the walk: its query block level m (0: the first; under a band the last query block, the longest
    // tile) and its (sequence, head) pair. Without a band each pair's query blocks in turn. Under a band, chunks of
    // p.chunk pairs, each walked level by level (every pair's longest tile, then every pair's next one ...): with
    // p.chunk a divisor of the CTA count each round takes tiles of one length, where the pair-by-pair order leaves
    // the busiest CTA a whole tile above the mean (plan.sm90_walk_chunk).
    __device__ __forceinline__ bool tile_of(int idx, int m_blocks, BlockRange& range) {
        const FwdSm90Params& p = s.p;
        int m, pair;
        if constexpr (BAND) {
            const int chunk = p.by_chunk_tiles.div(idx), within = idx - chunk * p.chunk * m_blocks;
            const int first = chunk * p.chunk;
            const bool last = first + p.chunk > p.nheads * p.batch;  // the last chunk may hold fewer pairs
            m = (last ? p.by_chunk_last : p.by_chunk).div(within);
            pair = first + within - m * (last ? p.chunk_last : p.chunk);
        } else {
            pair = p.by_m_blocks.div(idx);
            m = idx - pair * m_blocks;
            if (Tr::SPLIT && (u32)(p.seqlen_q % Tr::BM - 1) < 64u) {
                // Where the last query block is a split tile: the pair's query blocks rotated by the round of its
                // first tile. Where m_blocks divides the CTA count, CTA x would otherwise take query block
                // x % m_blocks in every round (all the split tiles to a few CTAs); rotated, each CTA takes every
                // query block in turn.
                const int rot = (int)((u32)(pair * m_blocks) / gridDim.x);
                m += rot - p.by_m_blocks.div(rot) * m_blocks;
                if (m >= m_blocks) m -= m_blocks;
            }
        }
        const int batch = p.by_heads.div(pair);
        return begin_tile(BAND ? m_blocks - 1 - m : m, pair - batch * p.nheads, batch, range);
    }

    // OVERLAP_TILES: `have` and the tile's block range made warp-uniform.
    __device__ __forceinline__ static bool uniform_tile(bool have, BlockRange& range) {
        if constexpr (!Tr::OVERLAP_TILES) return have;
        range.n_min = sm90::warp_uniform(range.n_min);
        range.n_max = sm90::warp_uniform(range.n_max);
        range.full_lo = sm90::warp_uniform(range.full_lo);
        range.full_hi = sm90::warp_uniform(range.full_hi);
        return sm90::warp_uniform(have);
    }

    // The tile ring's length as a divisor (1 in the kernels without one, which never call what follows).
    static constexpr int RING = Tr::TILE_SLOTS > 0 ? Tr::TILE_SLOTS : 1;

    // OVERLAP_TILES, the producer: the handed-th tile with rows of its walk (this thread's tile, begin_tile's state),
    // or with have false the walk's end, into the tile ring once every consumer has read what that entry held last.
    // The consumers read three 16-byte words where they would run the walk's arithmetic themselves (about 150
    // instructions a warp between a tile's last block and the next tile's first GEMMs).
    __device__ __forceinline__ void hand_tile(int handed, bool have, const BlockRange& range) {
        const FwdSm90Tile<BAND>& t = s.tile;
        const int slot = handed % RING;
        if (handed >= RING) sm90::mbar_wait(s.smem.tile_empty(slot), (handed / RING - 1) & 1);
        using fwd_sm90::TileEntry;
        st_shared_i4(s.smem.tile_entry(slot, &TileEntry::head), have, t.row0, t.b, t.h);
        if (have) {
            st_shared_i4(s.smem.tile_entry(slot, &TileEntry::seq), t.q_begin, t.k_begin, t.seqlen_q, t.mask.seqlen_k);
            st_shared_i4(s.smem.tile_entry(slot, &TileEntry::blocks), range.n_min, range.n_max, range.full_lo,
                         range.full_hi);
            if (SCORE_MOD) st_shared(s.smem.tile_entry(slot, &TileEntry::slope), __float_as_uint(t.mod.slope));
        }
        sm90::mbar_arrive(s.smem.tile_full(slot));  // (a release: the entry's stores are seen by whoever waits on it)
    }

    // OVERLAP_TILES, the consumers: the taken-th entry of the tile ring as this thread's tile (begin_tile's state);
    // false at the walk's end.
    __device__ __forceinline__ bool take_tile(int taken, BlockRange& range) {
        const FwdSm90Params& p = s.p;
        FwdSm90Tile<BAND>& t = s.tile;
        const int slot = taken % RING;
        sm90::mbar_wait(s.smem.tile_full(slot), (taken / RING) & 1);
        using fwd_sm90::TileEntry;
        int head[4], seq[4], blocks[4];
        ld_shared_i4(head, s.smem.tile_entry(slot, &TileEntry::head));
        ld_shared_i4(seq, s.smem.tile_entry(slot, &TileEntry::seq));
        ld_shared_i4(blocks, s.smem.tile_entry(slot, &TileEntry::blocks));
        const float slope =
            SCORE_MOD ? __uint_as_float(ld_shared_u32(s.smem.tile_entry(slot, &TileEntry::slope))) : 0.f;
        sm90::mbar_arrive(s.smem.tile_empty(slot));  // (a release: the loads above are done with the entry)
        t.row0 = head[1];
        t.b = head[2];
        t.h = head[3];
        t.q_begin = seq[0];
        t.k_begin = seq[1];
        t.seqlen_q = seq[2];
        t.mask = Mask<BAND>{seq[3], seq[3] - seq[2], p.window_left, p.window_right};
        if (SCORE_MOD) t.mod = ScoreMod{p.mod_scale, p.softcap, slope, seq[3] - seq[2]};
        range = {blocks[0], blocks[1], blocks[2], blocks[3]};
        return head[0] != 0;
    }
};

}  // namespace cuflash

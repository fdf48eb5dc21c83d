// Forward attention on Hopper (sm_90a): TMA loads and wgmma.
//
// Grid (query blocks, heads, batch), or one CTA per SM walking the tiles (PERSISTENT); a CTA owns BM = 64 WGS query
// rows as WGS consumer warpgroups of 64 rows each (two; three at d = 64, FA3's 192-row tile), sharing K/V tiles
// that TMA brings into a ring of STAGES slots. The kernel is assembled from parts, each in its own header:
//  - fwd_sm90_traits.cuh     the parameters, what the template parameters decide, the shared-memory layout
//                            (SharedStorage), the named barriers and the state the parts share;
//  - fwd_sm90_scheduler.cuh  which tile a CTA works on: the grid's, the persistent walk, the tile ring;
//  - fwd_sm90_producer.cuh   the loads: Q and the K/V ring by TMA;
//  - fwd_sm90_mainloop.cuh   the consumers' loops: S = Q K^T, mask and online softmax, O += P V;
//  - fwd_sm90_epilogue.cuh   O and lse out.
// Two ways to feed the ring (template flag WS):
//  - WS = false (lockstep): thread 0 of the consumers issues the copies; after each block a CTA barrier, then the
//    freed slot is refilled. The two warpgroups run in lockstep.
//  - WS = true (warp-specialized): a further warpgroup is the producer; one of its threads issues Q and then every
//    K/V block as soon as the slot is free, which each slot's "empty" mbarriers tell. No CTA barrier in the loop: the
//    consumer warpgroups drift apart, so one's softmax overlaps the other's GEMMs, and the copies run STAGES - 1
//    blocks ahead. The producer gives its registers to the consumers (setmaxnreg).
// Head dims D = 64, 128 and 256, and the multiples of 8 below each down to the one before (from 40 at D = 64): the
// TMA boxes zero-fill the columns past the call's head dim (p.headdim) and O's stores leave them out. Softcap and
// ALiBi (SCORE_MOD, score_mod.cuh, before the mask as in fwd.cu); padded batches and packed sequences (seqlen.cuh;
// 3-D tensor maps over the tokens), whose keys may come from page pools (PAGED, lockstep only:
// fwd_sm90_producer.cuh). Other head dims stay on fwd.cu.
#include "fwd_sm90_traits.cuh"
#include "fwd_sm90_scheduler.cuh"
#include "fwd_sm90_producer.cuh"
#include "fwd_sm90_mainloop.cuh"
#include "fwd_sm90_epilogue.cuh"

namespace cuflash {

template <class T, int D, int BN, bool BAND, int STAGES, int WGS, bool WS, bool SCORE_MOD, bool PINGPONG,
          bool PERSISTENT, bool SPLIT_TILES = false, bool DROPOUT = false, bool PAGED = false>
struct FwdSm90 {
    using Tr = FwdSm90Traits<T, D, BN, BAND, STAGES, WGS, WS, SCORE_MOD, PINGPONG, PERSISTENT, SPLIT_TILES, DROPOUT,
                             PAGED>;
    static constexpr u32 SMEM_BYTES = Tr::SMEM_BYTES;

    FwdSm90State<Tr> s;
    // The parts, each a view of the state (made where used: an object that held them with references to its own
    // state would keep that state in local memory)
    __device__ __forceinline__ FwdSm90Scheduler<Tr> scheduler() { return {s}; }
    __device__ __forceinline__ FwdSm90Producer<Tr> producer() { return {s}; }
    __device__ __forceinline__ FwdSm90Mainloop<Tr> mainloop() { return {s}; }
    __device__ __forceinline__ FwdSm90Epilogue<Tr> epilogue() { return {s}; }

    __device__ __forceinline__ explicit FwdSm90(const FwdSm90Params& params) : s(params) {}

    __device__ __forceinline__ void init_barriers() {
        if (s.tid == 0) {
            for (int i = 0; i < 2 * STAGES; ++i) {
                sm90::mbar_init(s.smem.full(i % STAGES, i / STAGES), 1);
                sm90::mbar_init(s.smem.empty(i % STAGES, i / STAGES), Tr::CONSUMERS);
            }
            for (int qb = 0; qb < Tr::Q_BUFS; ++qb) {
                sm90::mbar_init(s.smem.q_full(qb), 1);
                if constexpr (PERSISTENT) sm90::mbar_init(s.smem.q_empty(qb), Tr::CONSUMERS);
            }
            if constexpr (Tr::TILE_SLOTS > 0)
                for (int i = 0; i < Tr::TILE_SLOTS; ++i) {
                    sm90::mbar_init(s.smem.tile_full(i), 1);
                    sm90::mbar_init(s.smem.tile_empty(i), Tr::CONSUMERS);
                }
            sm90::mbar_fence_init();
        }
        __syncthreads();  // the last CTA-wide barrier of the warp-specialized kernel
    }

    // One tile per CTA: grid (query blocks, heads, batch).
    __device__ __forceinline__ void run(char* smem) {
        s.start(smem);
        BlockRange range;
        bool has_rows = scheduler().grid_tile(range);
        // (not in the lockstep kernel, where the shuffle makes ptxas serialize the wgmma: C7520)
        if (WS) has_rows = s.uniform(has_rows);
        if (!has_rows) return;
        s.reset_accumulators();
        const int count = s.uniform(block_count(range));  // walked from n_max - 1 down
        init_barriers();
        if constexpr (WS) {
            if (s.is_producer()) {  // producer warpgroup: one thread moves the data
                sm90::regs_dealloc<Tr::PRODUCER_REGS>();
                if (s.tid == 0 && count > 0) producer().produce(range, count, 0, 0);
                return;
            }
            sm90::regs_alloc<Tr::CONSUMER_REGS>();
            if (count > 0) {
                sm90::mbar_wait(s.smem.q_full(0), 0);
                mainloop().consume_pipelined(range, count, 0);
            }
        } else if (count > 0) {
            const bool issuer = PAGED ? s.tid < 32 : s.tid == 0;  // (paged blocks: warp 0, fwd_sm90_producer.cuh)
            if (issuer) {
                if (s.tid == 0) producer().issue_q();
                for (int i = 0; i < 2 && i < count; ++i) producer().issue_kv(range.n_max - 1 - i, i);
            }
            sm90::mbar_wait(s.smem.q_full(0), 0);
            if constexpr (PAGED) zero_v_tail(range.n_max - 1);
            for (int t = 0; t < count; ++t) {
                const int n = range.n_max - 1 - t;
                const bool masked = n > range.full_hi || n < range.full_lo;
                if (t == 0) {
                    if (masked) mainloop().template step<true, true>(n, t);
                    else mainloop().template step<false, true>(n, t);
                } else {
                    if (masked) mainloop().template step<true, false>(n, t);
                    else mainloop().template step<false, false>(n, t);
                }
                __syncthreads();  // both warpgroups are done with this slot
                if (issuer && t + 2 < count) producer().issue_kv(range.n_max - 1 - t - 2, t % 2);
            }
        }
        epilogue().store(count > 0);
    }

    // PAGED (lockstep): V rows past the sequence's keys in the walk's first block n (ring slot 0) set to zero. The
    // boxes wholly past them arrive as zeros, but the rest of the box that holds the last key comes from the
    // sequence's last page, which may hold anything there (NaN included), and P = 0 times NaN is NaN. Every thread
    // waits for the block's V, zeroes its share of the rows, and fences, so that the wgmma (the async proxy) reads
    // the zeros once the CTA barrier is passed.
    __device__ __forceinline__ void zero_v_tail(int n) {
        const int valid = max(s.tile.mask.seqlen_k - n * BN, 0);
        if (valid >= BN) return;
        sm90::mbar_wait(s.smem.full(0, 1), 0);
        const u32 v = s.smem.kv_tile(0, 1);
        constexpr int CHUNKS = Tr::PANELS * 8;  // 16-byte chunks of a row (a swizzle permutes them within it)
        for (int i = s.tid; i < (BN - valid) * CHUNKS; i += Tr::THREADS) {
            const int row = valid + i / CHUNKS, pn = i % CHUNKS / 8, c = i % 8;
            st_shared_zero16(v + pn * Tr::KV_PANEL + row * 128 + c * 16);
        }
        sm90::fence_proxy_async();
        __syncthreads();
    }

    // The persistent consumers with OVERLAP_TILES: when the next tile has key blocks, its first S = Q K^T is issued
    // beside this tile's last O += P V (its Q is in another Q tile), and its softmax runs while that P V computes;
    // then this tile's epilogue, and the next tile goes on from its second block. Without it every tile begins with
    // an S and a softmax that nothing overlaps and ends with a P V that nothing overlaps.
    // PINGPONG: the joined issue is one turn of each warpgroup, in place of the last P V's turn and the next tile's
    // first S's; each side gives up one wait and one hand-over, so the turns stay balanced. A tile that starts on
    // its own (the first, or one after a tile that ended on its own) starts as consume_pipelined does.
    __device__ __forceinline__ void consume_overlapped() {
        float sc[1][BN / 8][4], alpha[1][2];
        u32 pa[BN / 16][4];
        int it = 0, loaded = 0, taken = 0;
        bool started = false;  // the current tile's first block is done (by the tile before's end)
        BlockRange range;
        bool have = scheduler().uniform_tile(scheduler().take_tile(taken++, range), range);
        while (have) {
            const int count = block_count(range);
            if (count == 0) {  // rows that see no key: O = 0, lse = -inf
                s.reset_accumulators();
                epilogue().store(false);
                have = scheduler().uniform_tile(scheduler().take_tile(taken++, range), range);
                continue;
            }
            if (!started) {
                mainloop().wait_q(loaded);
                s.reset_accumulators();
                mainloop().first_turn();
                mainloop().first_block(range, count, it, sc, alpha, pa);
            }
            mainloop().middle_blocks(range, count, it, sc, alpha, pa);
            const int last = it + count - 1;
            it += count;
            ++loaded;
            const FwdSm90TileRows done = s.tile.rows();
            BlockRange next;
            have = scheduler().uniform_tile(scheduler().take_tile(taken++, next), next);
            const int next_count = have ? block_count(next) : 0;
            started = next_count > 0;
            if (started) {
                mainloop().wait_q(loaded);
                const int slot = slot_of<STAGES>(it), prev = slot_of<STAGES>(last);
                sm90::mbar_wait(s.smem.full(slot, 0), pass_of<STAGES>(it));
                sm90::mbar_wait(s.smem.full(prev, 1), pass_of<STAGES>(last));
                mainloop().issue_s_pv(sc, pa, slot, prev);
                sm90::wgmma_wait<1>();  // the next tile's S is in
                sm90::mbar_arrive(s.smem.empty(slot, 0));
                mainloop().s_done(0, next_count);
                const OnlineSoftmax<1> done_softmax = s.softmax;
                s.softmax.reset();
                mainloop().first_probabilities(next, sc, alpha);
                sm90::wgmma_wait<0>();  // and this tile's last P V
                sm90::mbar_arrive(s.smem.empty(prev, 1));
                epilogue().store_done(done, done_softmax);
                s.zero_o();
                mainloop().pack(sc, pa, next.n_max - 1);
            } else {
                mainloop().last_pv(pa, last);
                epilogue().store_done(done, s.softmax);
            }
            range = next;
        }
    }

    // Persistent (warp-specialized): the ring and Q's barriers carry on from tile to tile, so the producer loads the
    // next tile while the consumers finish the last one.
    __device__ __forceinline__ void run_persistent(char* smem) {
        s.start(smem);
        init_barriers();
        const FwdSm90Params& p = s.p;
        const int m_blocks = (p.seqlen_q + Tr::BM - 1) / Tr::BM, tiles = m_blocks * p.nheads * p.batch;
        int it = 0, loaded = 0;  // ring position, tiles with key blocks so far
        if (s.is_producer()) {
            sm90::regs_dealloc<Tr::PRODUCER_REGS>();
            if (s.tid != 0) return;
            int handed = 0;
            for (int round = 0, idx; (idx = scheduler().walk(round)) < tiles; ++round) {
                BlockRange range;
                if (!scheduler().tile_of(idx, m_blocks, range)) continue;
                if constexpr (Tr::OVERLAP_TILES) scheduler().hand_tile(handed++, true, range);
                const int count = block_count(range);
                if (count == 0) continue;
                producer().produce(range, count, it, loaded);
                it += count;
                ++loaded;
            }
            if constexpr (Tr::OVERLAP_TILES) scheduler().hand_tile(handed, false, BlockRange{});
            return;
        }
        sm90::regs_alloc<Tr::CONSUMER_REGS>();
        if constexpr (Tr::OVERLAP_TILES) {
            consume_overlapped();
        } else {
            for (int round = 0, idx; (idx = scheduler().walk(round)) < tiles; ++round) {
                BlockRange range;
                if (!s.uniform(scheduler().tile_of(idx, m_blocks, range))) continue;
                const int count = s.uniform(block_count(range));
                const bool split = mainloop().split_tile(count);
                if (split) s.tile.row0 -= s.wg * 64;  // every warpgroup takes the tile's first 64 rows
                s.reset_accumulators();
                if (count > 0) {
                    mainloop().wait_q(loaded);
                    if (split) mainloop().consume_split(range, count, it);
                    else mainloop().consume_pipelined(range, count, it);
                    it += count;
                    ++loaded;
                }
                if (split && s.wg > 0) {
                    mainloop().split_leave();
                    continue;
                }
                if (split) mainloop().split_merge();
                epilogue().store(count > 0);
            }
        }
        epilogue().drain();
    }
};

template <class T, int D, int BN, int STAGES, int WGS, bool BAND, bool WS, bool SCORE_MOD, bool PINGPONG,
          bool PERSISTENT, bool SPLIT_TILES, bool DROPOUT, bool PAGED>
__global__ void __launch_bounds__(128 * (WGS + (WS ? 1 : 0)), 1)
    fwd_sm90_kernel(const __grid_constant__ FwdSm90Params p) {
    extern __shared__ __align__(1024) char smem[];
    FwdSm90<T, D, BN, BAND, STAGES, WGS, WS, SCORE_MOD, PINGPONG, PERSISTENT, SPLIT_TILES, DROPOUT, PAGED> block(p);
    if constexpr (PERSISTENT) block.run_persistent(smem);
    else block.run(smem);
}

// The dynamic shared memory (bytes) a launch of fwd_sm90_kernel with the same template arguments requests: the
// launcher reads it from the compiled module (name expression "&cuflash::fwd_sm90_smem_bytes<...>").
template <class T, int D, int BN, int STAGES, int WGS, bool BAND, bool WS, bool SCORE_MOD, bool PINGPONG,
          bool PERSISTENT, bool SPLIT_TILES, bool DROPOUT, bool PAGED>
__device__ const unsigned fwd_sm90_smem_bytes =
    FwdSm90<T, D, BN, BAND, STAGES, WGS, WS, SCORE_MOD, PINGPONG, PERSISTENT, SPLIT_TILES, DROPOUT,
            PAGED>::SMEM_BYTES;

}  // namespace cuflash

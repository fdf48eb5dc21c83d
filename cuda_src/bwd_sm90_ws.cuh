// The Hopper backward, warp-specialized (BwdSm90::WS: d = 128 and 256, and d = 64 with 128 query rows; the class in
// bwd_sm90_block.cuh). At d = 256 (DSPLIT) dO has one tile, loaded once both consumers' dV of the step before is done
// (do_empty), and each consumer's staging tile carries its two dQ panels in turn (dq_empty per consumer). At d = 64
// with 128 rows (ROW_SPLIT) each consumer's tile holds its 64 rows of dQ, and each rows thread stores two rows.
// 384 threads: warpgroup 0 produces, warpgroups 1 and 2 consume (as wg 0 and 1, their tid counted from 0).
//  - Thread 0 loads by TMA: a key block's K and V once the consumers are done with the last one's (kv_empty), and a
//    step's Q and dO once the consumers have handed its buffer back (qd_empty).
//  - Warps 1-2, a thread per query row of a step (per two at BM = 128): the step's rows (lse, D, the fixed point's
//    dQ scale), into the same buffer once it is handed back. The 64 and thread 0 arrive on the buffer's qd_full,
//    which also counts the copies' bytes.
//  - Warp 3, the dQ warp: for each step and consumer, waits until the consumer's staging tile is stored
//    (DqFull0 + wg), and its lane 0 adds the tile to dq_accum by TMA; once the step before's additions have read
//    their tiles out, it hands that staging buffer back (dq_empty; at d = 256 each panel's tile once it is read out).
// The consumers run BwdSm90::step with no CTA barrier: a step waits for its buffer (qd_full), the two consumers meet
// to exchange dS^T halves (DsReady) and to free dS^T's tile (DsFree0 + wg), and every thread hands the buffer back
// (qd_empty) once its products are done.
#pragma once
#include "bwd_sm90_block.cuh"
#include "bwd_sm90_dq.cuh"

namespace cuflash {

template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::run_ws(char* smem) {
    static_assert(OFF_DQ + offsetof(Tail, dq_empty) + sizeof(Tail::dq_empty) + 1024 == SMEM_BYTES && TMA_DQ &&
                      BM % 64 == 0,
                  "SMEM_BYTES ends at its last mbarrier; dQ by TMA; 64 or 128 query rows (BM / 64 a rows thread)");
    static_assert(128 * PRODUCER_REGS + (THREADS - 128) * CONSUMER_REGS <= sm90::register_pool(THREADS),
                  "the register split exceeds the CTA's pool");
    tid = threadIdx.x;
    base = (smem_u32(smem) + 1023) & ~1023u;
    h_kv = blockIdx.y;
    b = blockIdx.z;
    const SeqInfo seq(p, b);  // (the producer reads the starts where it needs them: it has 24 registers)
    mask = Mask<BAND>{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const int m_blocks = ceil_div(seq.seqlen_q, BM);
    if (tid == 0) {
        sm90::mbar_init(kv_bar(), 1);
        sm90::mbar_init(kv_empty(), 256);  // every consumer thread's arrival (each read the buffer: racecheck)
        for (int i = 0; i < 2; ++i) {
            sm90::mbar_init(qd_bar(i), 64 + 1);  // the 64 rows threads' (BM / 64 rows each) and the copies'
            sm90::mbar_init(qd_empty(i), 256);
            if (DSPLIT || i == 0) sm90::mbar_init(dq_empty(i), 1);  // DSPLIT: one per consumer
        }
        if constexpr (DSPLIT) {
            sm90::mbar_init(do_bar(), 1);
            sm90::mbar_init(do_empty(), 256);
        }
        sm90::mbar_fence_init();
    }
    __syncthreads();  // the kernel's only CTA barrier
    if (sm90::warp_uniform(tid / 128) == 0) {
        sm90::regs_dealloc<PRODUCER_REGS>();
        const int w = sm90::warp_uniform(tid / 32);
        if (w == 0) {
            if (tid == 0) produce_loads(m_blocks);
        } else if (w < 3) {
            tid -= 32;  // the row
            produce_rows(smem, m_blocks, seq.seqlen_q);
        } else {
            produce_dq(m_blocks);
        }
        return;
    }
    sm90::regs_alloc<CONSUMER_REGS>();
    tid -= 128;
    wg = uniform(tid / 128);
    consume(smem, m_blocks, seq.seqlen_q);
}

// Thread 0: the TMA loads.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::produce_loads(int m_blocks) {
    // Every key block completes one phase of kv_full (its loads, or a bare arrival where it has no steps) and one of
    // kv_empty (the consumers' hand-back), so that key block i's phase parity is `backwards` (i % 2) and the
    // consumers keep no counter of key blocks beside the step loop.
    int tt = 0;  // steps so far (the buffers' phases)
    bool first = true;
    walk_key_blocks(m_blocks, mask.diag, [&](int m_min, int m_count, int steps) {
        k_begin = SeqInfo::k_begin_of(p, b);
        q_begin = SeqInfo::q_begin_of(p, b);
        if (!first) sm90::mbar_wait(kv_empty(), !backwards);  // the key block before's hand-back
        first = false;
        if (steps == 0) {
            sm90::mbar_arrive(kv_bar());
            return;
        }
        sm90::mbar_arrive_expect_tx(kv_bar(), 2 * KV_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn) {
            load_box(base + pn * K_PANEL, &P.k, pn * 64, h_kv, k_begin, n_key0, kv_bar());
            load_box(base + OFF_V + pn * K_PANEL, &P.v, pn * 64, h_kv, k_begin, n_key0, kv_bar());
        }
        for (int t = 0; t < steps; ++t, ++tt) {
            if (tt >= 2) sm90::mbar_wait(qd_empty(tt % 2), (tt / 2 - 1) & 1);  // step tt - 2 handed it back
            if constexpr (DSPLIT) {  // Q into its buffer; dO into the one tile once step tt - 1's dV has read it
                load_q(t, tt, m_min, m_count);
                if (tt >= 1) sm90::mbar_wait(do_empty(), (tt - 1) & 1);
                load_do(t, m_min, m_count);
            } else {
                load_step(t, tt, m_min, m_count);  // one arrival, announcing the copies' bytes
            }
        }
    });
}

// Warps 1-2 (tid: the row): the rows of each step.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::produce_rows(char* smem,
                                                                                                 int m_blocks,
                                                                                                 int seqlen_q) {
    int tt = 0;
    walk_key_blocks(m_blocks, mask.diag, [&](int m_min, int m_count, int steps) {
        q_begin = SeqInfo::q_begin_of(p, b);
        for (int t = 0; t < steps; ++t, ++tt) {
            float3 rows[BM / 64];  // rows tid + 64 i, in flight during the wait
            const int row0 = tid;
#pragma unroll
            for (int i = 0; i < BM / 64; ++i) {
                tid = row0 + 64 * i;
                rows[i] = fetch_rows(t, m_min, m_count, seqlen_q);
            }
            if (tt >= 2) sm90::mbar_wait(qd_empty(tt % 2), (tt / 2 - 1) & 1);
#pragma unroll
            for (int i = 0; i < BM / 64; ++i) {
                tid = row0 + 64 * i;
                store_rows(smem, tt, rows[i]);
            }
            tid = row0;
            sm90::mbar_arrive(qd_bar(tt % 2));
        }
    });
}

// The dQ warp (warp 3).
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::produce_dq(int m_blocks) {
    const bool issuer = tid % 32 == 0;
    const bool ordered = !FIXED && p.deterministic == DQ_ORDERED;  // (its map: rows of a sequence, then batch)
    const int slice = ordered ? b : !FIXED && p.deterministic == 1 ? blockIdx.x : 0;
    int tt = 0;
    walk_key_blocks(m_blocks, mask.diag, [&](int m_min, int m_count, int steps) {
        for (int t = 0; t < steps; ++t, ++tt) {
            int h, m;
            step_of(t, m_min, m_count, h, m);
            // rows of all sequences: padded, sequence b starts at row b seqlen_q; packed, at cu_seqlens_q[b];
            // ordered, the rows of sequence b (slice b)
            const int row = (ordered ? 0 : p.cu_seqlens_q != nullptr ? SeqInfo::q_begin_of(p, b) : b * p.seqlen_q) +
                            m * BM;
            // lane 0: a staging tile's two boxes added at (column col, row row + r0); in slices (deterministic
            // mode 1) a key block's first addition waits for the last one's, which may add to the same rows
            const auto add_tile = [&](u32 tile, int col, int r0, bool first, bool store) {
                if (!FIXED && p.deterministic == 1 && t == 0 && first) sm90::bulk_wait<0>();
#pragma unroll
                for (int box = 0; box < 2; ++box) {
                    if (store) sm90::tma_store_4d(&P.dq, col + box * 32, h, row + r0, slice, tile + box * DQ_BOX);
                    else sm90::tma_reduce_add_4d(&P.dq, col + box * 32, h, row + r0, slice, tile + box * DQ_BOX);
                }
            };
            // (bwd_sm90_dq.cuh) ordered mode: this step's turn at its query block, whose tiles the step adds whole
            const int rank = ordered && issuer ? dq_rank(m, m_blocks) : 0;
            if constexpr (DSPLIT) {
                // consumer c's tile holds its panels 2 c and 2 c + 1 in turn: each read out before it is handed back
                const bool store = issuer && ordered && dq_turn(h, m, rank);
#pragma unroll
                for (int pl = 0; pl < 2; ++pl)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        sm90::named_sync<160>(int(BwdBarrier::DqFull0) + c);
                        if (issuer) {
                            add_tile(base + OFF_DQ + c * DQ_TILE, (2 * c + pl) * 64, 0, pl == 0 && c == 0, store);
                            sm90::bulk_commit();
                            sm90::bulk_wait_read<0>();
                            sm90::mbar_arrive(dq_empty(c));
                        }
                    }
                if (issuer && ordered) dq_pass(h, m, rank);
            } else {
                // the step's two tiles are the whole query block
                const bool store = issuer && (ordered ? dq_turn(h, m, rank) : dq_ticket(h, m));
#pragma unroll
                for (int c = 0; c < 2; ++c) {  // consumer c's tile: ROW_SPLIT, dQ's rows 64 c ..; else columns 64 c ..
                    sm90::named_sync<160>(int(BwdBarrier::DqFull0) + c);
                    if (issuer)
                        add_tile(base + OFF_DQ + (tt % 2) * 2 * DQ_TILE + c * DQ_TILE, ROW_SPLIT ? 0 : c * 64,
                                 ROW_SPLIT ? c * 64 : 0, c == 0, store);
                }
                if (issuer) {
                    sm90::bulk_commit();
                    if (ordered || store) dq_pass(h, m, rank);  // (a ticket's stores: rank 0)
                    else sm90::bulk_wait_read<1>();  // step tt - 1's tiles are read out: step tt + 1 may store there
                    sm90::mbar_arrive(dq_empty());
                }
            }
        }
    });
    if (issuer) sm90::bulk_wait<0>();  // every addition made before the CTA's shared memory goes
}

// The consumers: the key blocks' steps, then dK and dV.
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ __forceinline__ void BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::consume(char* smem, int m_blocks,
                                                                                            int seqlen_q) {
    int tt = 0;
    HeldPanel held;  // HOLD_DQ: the step before's second dQ panel (step_split)
    walk_key_blocks(m_blocks, mask.diag, [&](int m_min, int m_count, int steps) {
#pragma unroll
        for (int dt = 0; dt < WG_PANELS * 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;
        if (steps > 0) {
            sm90::mbar_wait(kv_bar(), backwards);  // (produce_loads: a phase per key block)
            for (int t = 0; t < steps; ++t, ++tt) {
                if constexpr (DSPLIT) step_split(smem, t, tt, m_min, m_count, held);
                else step(smem, t, tt, m_min, m_count, seqlen_q);
            }
            if constexpr (HOLD_DQ) stage_held(held, tt - 1);
        }
        sm90::mbar_arrive(kv_empty());  // this thread's products are done with K and V
        store_dkdv(mask.seqlen_k);
    });
}

}  // namespace cuflash

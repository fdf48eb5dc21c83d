// Kernel parameter structs. Python builds the same layout as a NumPy structured scalar (cuflash/plan.py,
// FWD_PARAMS_DTYPE); the field order here and there must match: 8-byte fields first, then 4-byte ones.
#pragma once
#include "types.cuh"

namespace cuflash {

struct FwdParams {
    const u16* q;          // (batch, seqlen_q, nheads, headdim) or packed (total_q, nheads, headdim); any strides,
                           // last dim contiguous
    const u16* k;          // (batch, seqlen_k, nheads_k, headdim)
    const u16* v;          // (batch, seqlen_k, nheads_k, headdim)
    u16* o;                // (batch, seqlen_q, nheads, headdim)
    float* lse;            // (batch, nheads, seqlen_q), natural log, rows contiguous; nullptr: not written
    const float* alibi;    // slopes, (nheads,) or (batch, nheads); nullptr: no ALiBi
    const int* cu_seqlens_q;  // packed sequences (seqlen.cuh): (batch + 1,) row offsets into q, o, lse; nullptr: padded
    const int* cu_seqlens_k;  // (batch + 1,) row offsets into k, v (set together with cu_seqlens_q)
    const int* block_table;   // packed only: k, v are page pools (num_pages, page_size, nheads_k, headdim), and key
                              // p of sequence b is row p % page_size of page block_table[b, p / page_size]
                              // (kv_rows, FwdBlock); nullptr: k, v rows as above
    const int* seqused_k;     // packed only: (batch,) keys of sequence b, instead of cu_seqlens_k's difference
    i64 dropout_seed, dropout_offset;  // the dropout mask's generator (dropout.cuh; 64-bit words); set per call
    const i64* dropout_state;  // nullptr, or (seed, offset) in device memory, read instead of the two above (a
                               // generator state the host does not know: JAX's keys under jit)
    i64 q_batch_stride, q_row_stride, q_head_stride;  // strides in elements; packed: batch stride = row stride
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 lse_batch_stride, lse_head_stride;  // padded (nheads * seqlen_q, seqlen_q);
                                            // packed (nheads, total_q): (1, total_q)
    i64 alibi_batch_stride;  // 0 when the slopes are shared by the batch
    i64 block_table_stride;  // elements between rows of block_table (k/v batch stride: between pages)
    int seqlen_q, seqlen_k;    // padded: the lengths; packed: max_seqlen_q, max_seqlen_k (the grid's size only)
    int page_size, num_pages, max_pages;  // paged (block_table): page rows, pages in the pool, block_table columns
    int nheads, heads_per_kv;  // query heads; query heads per KV head (GQA group size)
    int headdim;               // real head dim (<= the compiled one; the rest is zero padding)
    int window_left, window_right;  // -1: unbounded; causal is (-1, 0)
    int dropout_threshold;          // draws (bytes) below it keep their element; 256: no dropout
    float dropout_scale;            // 256 / dropout_threshold: the kept probabilities' scale
    float scale_log2;  // multiplies raw scores inside exp2: softmax_scale*log2(e), or log2(e) if scores are pre-modded
    float mod_scale;   // score-mod kernels: s = q.k * mod_scale (softmax_scale, or softmax_scale / softcap)
    float softcap;     // score-mod kernels: s = softcap * tanh(s) when > 0
};

}  // namespace cuflash

namespace cuflash {

// Backward main kernel (cuda_src/bwd.cu). Layout mirrored by cuflash/plan.py BWD_PARAMS_DTYPE.
struct BwdParams {
    const u16* q;          // (batch, seqlen_q, nheads, headdim)
    const u16* k;          // (batch, seqlen_k, nheads_k, headdim)
    const u16* v;
    const u16* dout;       // like q
    u16* dk;               // like k
    u16* dv;               // like v
    float* dq_accum;       // fp32 (slices, batch, seqlen_q, nheads, headdim), or (slices, total_q, ...) packed
    const float* lse_log2; // (batch, nheads, seqlen_q) or (nheads, total_q): lse * log2(e); +inf: row sees no key
    const float* dsum;     // like lse_log2: rowsum(dO * O)
    const float* alibi;    // as in FwdParams
    const int* cu_seqlens_q;  // as in FwdParams
    const int* cu_seqlens_k;
    const float* dq_scale;  // deterministic mode 2 (fixed point, fixed_dq.cuh): dQ scale per row, like lse_log2
    const unsigned* kv_bound; // mode 2: (nheads_k, 2) max |K| and max row norm of V, as float bits (not read here)
    i64 dropout_seed, dropout_offset;  // the forward's dropout (FwdParams); set per call
    const i64* dropout_state;          // as in FwdParams
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    i64 lse_batch_stride, lse_head_stride;  // of lse_log2 and dsum, as in FwdParams
    i64 dq_batch_stride;   // of dq_accum: seqlen_q * nheads * headdim; packed: the row stride, nheads * headdim
    i64 alibi_batch_stride;
    i64 dq_slice_stride;   // elements between dq_accum slices
    int batch, seqlen_q, seqlen_k;  // packed: seqlen_q, seqlen_k are the maxima
    int nheads, heads_per_kv, headdim;
    int window_left, window_right;
    int deterministic;     // 0: every CTA adds into slice 0; 1: CTA x adds into slice x only; 2: every CTA adds
                           // int32 fixed point into slice 0 (the Hopper kernel only; fixed_dq.cuh); DQ_ORDERED:
                           // every CTA adds into slice 0 in a fixed order per query block (BwdSm90::dq_turn)
    int dropout_threshold;  // as in FwdParams (the portable kernel only)
    int dq_first_store;    // > 0 (the Hopper kernel's dQ warp, a padded batch, one accumulator): the query blocks per
                           // (sequence, head); each whole block's first addition is a store (BwdSm90::dq_ticket),
                           // so the preprocess zeroes only the rest of dq_accum; 0: every addition adds
    float dropout_scale;
    float scale_log2, mod_scale, softcap, softmax_scale;
};

// Backward preprocessing (cuda_src/bwd_aux.cu): one row per warp.
struct BwdPreParams {
    const u16* out;        // (batch, seqlen_q, nheads, headdim)
    const u16* dout;
    const float* lse;      // (batch, nheads, seqlen_q), natural log
    float* dsum;           // (batch, nheads, seqlen_q)
    float* lse_log2;       // (batch, nheads, seqlen_q)
    float* dq_accum;       // (slices, batch, seqlen_q, nheads, headdim), zeroed here
    float* dq_scale;       // fixed point: |dO| per row, like dsum, then (bwd_fixed_scale) the row's dQ scale
    unsigned* kv_bound;    // fixed point: (nheads_k, 2), zeroed by bwd_preprocess, maxima taken by bwd_kv_bound
    const u16* k;          // fixed point: (kv_batch, seqlen_k, nheads_k, headdim), read by bwd_kv_bound
    const u16* v;
    const int* cu_seqlens_q;  // packed sequences (else nullptr): rows of q past cu_seqlens_q[sequences] and of k, v
    const int* cu_seqlens_k;  // past cu_seqlens_k[sequences] belong to none, and are read as zeros
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 dq_slice_stride;   // elements per slice
    int batch, seqlen_q, nheads, headdim;
    int lanes;             // threads per row: a power of two, 16 bytes each per pass (cuflash.plan.bwd_pre_lanes)
    int slices;
    int fixed_point;       // 1: deterministic mode 2 (fixed_dq.cuh): row norms and K/V bounds too
    int kv_batch, seqlen_k, nheads_k;  // bwd_kv_bound's rows (packed: 1, total_k)
    int sequences;         // packed: the number of sequences (cu_seqlens' length - 1)
    int first_store_rows;  // > 0: the main kernel stores the first addition to each whole block of this many rows
                           // (BwdParams::dq_first_store): the preprocess zeroes its tickets and ready flags, and of
                           // dq_accum only rows in a partial last block or that see no key (lse -inf)
    float softmax_scale;   // fixed point: bwd_fixed_scale's bounds
};

// BwdParams::dq_first_store's counters, right after dq_accum's first slice: a ticket per (sequence, head, query
// block), block index (b nheads + h) blocks + m, then as many ready flags. The preprocess zeroes both; the main
// kernel's dQ warp takes tickets and sets flags (BwdSm90::dq_ticket).
// BwdParams::deterministic: the Hopper kernel's dQ warp adds to each query block in turn, in a fixed order of the key
// blocks (BwdSm90::dq_rank), so that its fp32 sums do not depend on timing
constexpr int DQ_ORDERED = 3;

struct DqStoreCounters {
    int* tickets;
    i64 count;  // batch x nheads x blocks
    __device__ __forceinline__ DqStoreCounters(float* dq_accum, i64 slice_stride, int batch, int nheads, int blocks)
        : tickets(reinterpret_cast<int*>(dq_accum + slice_stride)), count((i64)batch * nheads * blocks) {}
    __device__ __forceinline__ int* ticket(i64 block) const { return tickets + block; }
    __device__ __forceinline__ int* ready(i64 block) const { return tickets + count + block; }
};

// dQ: sum of the fp32 slices, cast to the output dtype (contiguous (batch, seqlen_q, nheads, headdim)); in fixed
// point, the one int32 slice divided by each row's scale (fixed_dq.cuh).
struct BwdConvertParams {
    const float* dq_accum;
    u16* dq;
    const float* dq_scale;  // fixed point: as in BwdParams
    i64 slice_stride;      // elements per slice = number of dq elements
    int slices;
    int fixed_point, seqlen_q, nheads, headdim;  // fixed point: rows as bwd_preprocess's
};

}  // namespace cuflash

namespace cuflash {

// Decode against a KV cache (cuda_src/decode.cu, decode_aux.cu). Layout mirrored by cuflash/ops/decode.py
// PARAMS_DTYPE. Batch row b attends to cache positions [0, len_b), len_b = cache_seqlens[b] (or cache_len) +
// seqlen_new_k; the new keys were appended at [len_b - seqlen_new_k, len_b) first. Values read from device memory
// (cache_seqlens, cache_batch_idx, block_table, cache_leftpad) are bounded in the kernels (kvcache.cuh, CacheView).
struct DecodeParams {
    const u16* q;              // (batch, seqlen_q, nheads, headdim)
    const u16* k_cache;        // (batch_cache, max_len, nheads_k, headdim), or pages (num_pages, page_size, ...)
    const u16* v_cache;
    const u16* k_new;          // (batch, seqlen_new_k, nheads_k, headdim) to append, or nullptr
    const u16* v_new;
    u16* o;                    // (batch, seqlen_q, nheads, headdim)
    float* lse;                // (batch, nheads, seqlen_q) contiguous, or nullptr
    float* o_partial;          // num_splits > 1: fp32 (splits, batch, nheads, seqlen_q, headdim), contiguous
    float* lse_partial;        // num_splits > 1: (splits, batch, nheads, seqlen_q)
    const int* cache_seqlens;  // (batch,), or nullptr: every row holds cache_len
    const int* cache_batch_idx;  // (batch,) cache row of each batch row, or nullptr: row b
    const int* block_table;    // (batch, max_pages) page indices, or nullptr: contiguous cache
    const float* alibi;        // as in FwdParams
    int* split_counters;       // num_splits > 1: one zeroed int32 per row tile; the TMA decode kernel merges the
                               // splits (the last to finish, which resets it to 0), or nullptr: decode_combine does
    const u16* rotary_cos;     // (seqlen_ro, rotary_dim / 2) contiguous, or nullptr: no rotary embedding
    const u16* rotary_sin;
    const int* cache_leftpad;  // (batch,): row b's keys start at this cache position, or nullptr: 0
    u16* q_rot;                // rotary: q rotated by decode_append, contiguous (batch, seqlen_q, nheads, headdim),
                               // which the decode kernels read instead of q
    const float* k_descale;    // e4m3 cache: K's dequantization factor at b * descale_batch_stride + h_kv *
    const float* v_descale;    // descale_head_stride (both 0: one per tensor), or nullptr: 1
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;  // batch stride = page stride when paged
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 kn_batch_stride, kn_row_stride, kn_head_stride;
    i64 vn_batch_stride, vn_row_stride, vn_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 alibi_batch_stride;
    i64 block_table_stride;    // elements between rows of block_table
    int batch, seqlen_q, seqlen_new_k, cache_len;
    int nheads, heads_per_kv, headdim;
    int page_size;             // paged only
    int window_left, window_right;
    int num_splits;            // KV splits per (batch, KV head, row tile); 1 writes o and lse directly
    int kv_evict_first;        // TMA kernel: K/V copies marked evict_first in L2 (plan.DECODE_TMA)
    int cache_capacity;        // keys a row's cache holds: max_len, or max_pages * page_size
    int cache_rows;            // batch_cache (contiguous), or num_pages (paged)
    int rotary_dim;            // elements of a row rotated (a multiple of 16), 0: none
    int rotary_interleaved;    // pairs (2j, 2j + 1); else (j, j + rotary_dim / 2)
    int rotary_q_per_row;      // query i at position cache_seqlens[b] + i (causal or local), else cache_seqlens[b]
    int seqlen_ro;             // rows of rotary_cos / rotary_sin
    int cache_fp8;             // the caches (and k_new, v_new) hold e4m3 bytes; q and o stay 16-bit
    int descale_batch_stride, descale_head_stride;
    float scale_log2, mod_scale, softcap;
};

}  // namespace cuflash

// Where a batch row's keys and values live in a KV cache: one row of a contiguous cache tensor (optionally
// remapped by cache_batch_idx), or pages of a pool listed in the row's block-table entry. Any page size that is a
// multiple of 16: a 16-row piece of a KV block never straddles two pages.
#pragma once
#include "params.cuh"

namespace cuflash {

struct CacheView {
    const u16* k;        // contiguous: K of (cache row, position 0, KV head); paged: K of (page 0, row 0, KV head)
    const u16* v;
    const int* pages;    // the row's block-table entry; nullptr: contiguous
    i64 k_page_stride, v_page_stride, k_row_stride, v_row_stride;
    int page_size, pool;  // pool: pages in the pool (paged)
    bool valid;           // contiguous: the batch row's cache row (cache_batch_idx) is one of the cache's rows

    __device__ __forceinline__ CacheView(const DecodeParams& p, int b, int h_kv) {
        pages = p.block_table != nullptr ? p.block_table + (i64)b * p.block_table_stride : nullptr;
        i64 row = pages != nullptr ? 0 : (p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b);
        valid = row >= 0 && row < p.cache_rows;
        if (!valid) row = 0;
        k = p.k_cache + row * p.k_batch_stride + (i64)h_kv * p.k_head_stride;
        v = p.v_cache + row * p.v_batch_stride + (i64)h_kv * p.v_head_stride;
        k_page_stride = p.k_batch_stride;
        v_page_stride = p.v_batch_stride;
        k_row_stride = p.k_row_stride;
        v_row_stride = p.v_row_stride;
        page_size = p.page_size;
        pool = p.cache_rows;
    }

    // The pool page that holds position `pos` (paged; pos < the row's capacity, so its slot is in the row's
    // block-table entry), or -1 where the entry names no page of the pool: nothing there is read or written.
    __device__ __forceinline__ int page_of(int pos) const {
        const int page = pages[pos / page_size];
        return page >= 0 && page < pool ? page : -1;
    }

    // Element offsets of cache position `pos` from `k` and `v`; false where it has no place in the cache (page_of).
    // Paged: one (cached) load of the page index.
    __device__ __forceinline__ bool locate(int pos, i64& k_off, i64& v_off) const {
        if (pages != nullptr) {
            const int page = page_of(pos), row = pos % page_size;
            k_off = (i64)max(page, 0) * k_page_stride + row * k_row_stride;
            v_off = (i64)max(page, 0) * v_page_stride + row * v_row_stride;
            return page >= 0;
        }
        k_off = (i64)pos * k_row_stride;
        v_off = (i64)pos * v_row_stride;
        return true;
    }
};

// Keys already in batch row b's cache (cache_seqlens[b], or cache_len), before this call's append. Read from device
// memory, so not checked on the host: the kernels bound what they do with it (cache_length, decode_append).
__device__ __forceinline__ int cached_keys(const DecodeParams& p, int b) {
    return p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_len;
}

// Keys batch row b attends to: its cached keys plus the keys this call appends, at most the row's capacity (the keys
// past it are not appended); none where the cached count is negative or the row's cache row is not in the cache.
__device__ __forceinline__ int cache_length(const DecodeParams& p, int b, bool valid) {
    const int cached = cached_keys(p, b);
    return valid && cached >= 0 ? (int)min((i64)cached + p.seqlen_new_k, (i64)p.cache_capacity) : 0;
}

}  // namespace cuflash

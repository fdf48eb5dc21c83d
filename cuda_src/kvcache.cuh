// Where a batch row's keys and values live in a KV cache: one row of a contiguous cache tensor (optionally
// remapped by cache_batch_idx), or pages of a pool listed in the row's block-table entry, from position
// cache_leftpad[b] on. Values read from device memory (cache_seqlens, cache_batch_idx, block_table, cache_leftpad)
// are bounded here: a row never reaches outside its own cache row or pages. E is the cache's element: u16 (fp16,
// bf16) or u8 (e4m3); strides and offsets count elements.
#pragma once
#include "params.cuh"

namespace cuflash {

template <class E = u16>
struct CacheView {
    const E* k;          // contiguous: K of (cache row, position 0, KV head); paged: K of (page 0, row 0, KV head)
    const E* v;
    const int* pages;    // the row's block-table entry; nullptr: contiguous
    i64 k_page_stride, v_page_stride, k_row_stride, v_row_stride;
    int page_size, pool;  // pool: pages in the pool (paged)
    int start;            // cache_leftpad[b]: the row's position 0 is this position of its cache
    int cached;           // keys already in the row (from `start`), before the call's append; 0 where not valid
    int capacity;         // keys the row can hold (from `start`)
    bool valid;           // the row has a place in the cache: its cache row exists, 0 <= start <= cache_seqlens[b]

    __device__ __forceinline__ CacheView(const DecodeParams& p, int b, int h_kv) {
        pages = p.block_table != nullptr ? p.block_table + (i64)b * p.block_table_stride : nullptr;
        i64 row = pages != nullptr ? 0 : (p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b);
        const int seqlen = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_len;
        start = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
        valid = row >= 0 && row < p.cache_rows && start >= 0 && start <= seqlen;
        if (!valid) row = 0, start = 0;
        cached = valid ? seqlen - start : 0;  // an invalid row appends nothing: no position is below length() = 0
        capacity = p.cache_capacity - start;
        k = reinterpret_cast<const E*>(p.k_cache) + row * p.k_batch_stride + (i64)h_kv * p.k_head_stride;
        v = reinterpret_cast<const E*>(p.v_cache) + row * p.v_batch_stride + (i64)h_kv * p.v_head_stride;
        k_page_stride = p.k_batch_stride;
        v_page_stride = p.v_batch_stride;
        k_row_stride = p.k_row_stride;
        v_row_stride = p.v_row_stride;
        page_size = p.page_size;
        pool = p.cache_rows;
    }

    // Keys the row attends to: its cached keys plus the `new_k` this call appends, at most its capacity (the keys
    // past it are not appended); none where the row has no place in the cache.
    __device__ __forceinline__ int length(int new_k) const {
        return valid ? (int)max((i64)0, min((i64)cached + new_k, (i64)capacity)) : 0;
    }

    // The pool page that holds the row's position `pos` (paged; pos < capacity, so its slot is in the row's
    // block-table entry), or -1 where the entry names no page of the pool: nothing there is read or written.
    __device__ __forceinline__ int page_of(int pos) const {
        const int page = pages[(pos + start) / page_size];
        return page >= 0 && page < pool ? page : -1;
    }

    // Element offsets of the row's position `pos` from `k` and `v`; false where it has no place in the cache
    // (page_of). Paged: one (cached) load of the page index.
    __device__ __forceinline__ bool locate(int pos, i64& k_off, i64& v_off) const {
        if (pages != nullptr) {
            const int page = page_of(pos), row = (pos + start) % page_size;
            k_off = (i64)max(page, 0) * k_page_stride + row * k_row_stride;
            v_off = (i64)max(page, 0) * v_page_stride + row * v_row_stride;
            return page >= 0;
        }
        k_off = (i64)(pos + start) * k_row_stride;
        v_off = (i64)(pos + start) * v_row_stride;
        return true;
    }
};

}  // namespace cuflash

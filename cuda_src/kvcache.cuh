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
    int page_size;

    __device__ __forceinline__ CacheView(const DecodeParams& p, int b, int h_kv) {
        pages = p.block_table != nullptr ? p.block_table + (i64)b * p.block_table_stride : nullptr;
        const i64 row = pages != nullptr ? 0 : (p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b);
        k = p.k_cache + row * p.k_batch_stride + (i64)h_kv * p.k_head_stride;
        v = p.v_cache + row * p.v_batch_stride + (i64)h_kv * p.v_head_stride;
        k_page_stride = p.k_batch_stride;
        v_page_stride = p.v_batch_stride;
        k_row_stride = p.k_row_stride;
        v_row_stride = p.v_row_stride;
        page_size = p.page_size;
    }

    // Element offsets of cache position `pos` from `k` and `v`. Paged: one (cached) load of the page index.
    __device__ __forceinline__ void locate(int pos, i64& k_off, i64& v_off) const {
        if (pages != nullptr) {
            const int slot = pos / page_size, row = pos - slot * page_size;
            const i64 page = pages[slot];
            k_off = page * k_page_stride + row * k_row_stride;
            v_off = page * v_page_stride + row * v_row_stride;
        } else {
            k_off = (i64)pos * k_row_stride;
            v_off = (i64)pos * v_row_stride;
        }
    }
};

// Keys batch row b attends to: its cached length plus the keys appended by this call.
__device__ __forceinline__ int cache_length(const DecodeParams& p, int b) {
    return (p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_len) + p.seqlen_new_k;
}

}  // namespace cuflash

// Shared-memory tiles of 16-bit elements, rows x DP columns, and their global -> shared loads.
//
// Layout: the columns are cut into panels of 64 elements (128 bytes); a panel stores its rows one after another,
// 128 bytes each, and inside a row the eight 16-byte chunks are XOR-swizzled with (row % 8). Eight consecutive rows
// at the same logical chunk therefore hit eight different bank groups: ldmatrix and the epilogue's stores run free of
// bank conflicts. (The same 8 x 64 atom is what Hopper's 128-byte swizzle expects.)
#pragma once
#include "mma.cuh"

namespace cuflash {

template <int ROWS, int DP>
struct SmemTile {
    static_assert(DP % 64 == 0, "tiles are made of whole 64-column panels");
    static constexpr int BYTES = ROWS * DP * 2;
    static constexpr int PANEL_BYTES = ROWS * 128;

    // Byte offset of 16-byte chunk `chunk` (8 elements) of row `row`.
    static __device__ __forceinline__ u32 offset(int row, int chunk) {
        return (chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
    }
};

// A thread's ldmatrix addresses into a tile, for 16 x 16 pieces: piece (rows 16*i.., chunks 2*j, 2*j+1).
// The thread's row inside a piece (`row`, < 16) and chunk (`chunk_lo`, 0 or 1) are fixed by its lane, and the
// swizzle of chunk 2*j + chunk_lo against row % 8 only depends on j % 4. Keeping one base per j % 4 turns every
// address into base + compile-time constant, which ptxas folds into the instruction (no per-piece registers).
template <class Tile>
struct LdmatrixAddr {
    u32 base[4];

    __device__ __forceinline__ LdmatrixAddr(u32 tile, int row, int chunk_lo) {
#pragma unroll
        for (int j = 0; j < 4; ++j) base[j] = tile + row * 128 + (((2 * j) ^ chunk_lo ^ (row & 7)) << 4);
    }
    __device__ __forceinline__ u32 operator()(int i, int j) const {
        return base[j & 3] + (j >> 2) * Tile::PANEL_BYTES + i * 16 * 128;
    }
};

// Global <-> shared copies of a ROWS x D tile (D <= DP real columns), in 16-byte chunks. Eight consecutive threads
// cover one 128-byte panel row (coalesced); thread t keeps chunk t % 8 of every panel and rows t / 8 + k * THREADS / 8,
// so its swizzled shared offsets are one base plus constants and its global pointer simply advances.
template <int ROWS, int D, int DP, int THREADS>
struct TileCopy {
    static constexpr int ROW_STEP = THREADS / 8;
    static constexpr int PANELS = DP / 64;
    static_assert(ROWS % ROW_STEP == 0, "every thread copies the same number of rows");

    // Issues cp.async; rows >= rows_valid and columns >= d_valid are zero-filled, so padding never carries
    // garbage into the math (0 * NaN = NaN).
    static __device__ __forceinline__ void load_async(u32 smem, const u16* gmem, i64 row_stride, int rows_valid,
                                                      int d_valid, int tid) {
        const int row = tid / 8, chunk = tid % 8;
        const u32 dst = smem + SmemTile<ROWS, DP>::offset(row, chunk);
        const u16* src = gmem + row * row_stride + chunk * 8;
        const i64 src_step = ROW_STEP * row_stride;
#pragma unroll
        for (int r = 0; r < ROWS; r += ROW_STEP, src += src_step) {
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn) {
                int col = pn * 64 + chunk * 8;
                if (col < D) {  // a half panel (D = 32, 96, ...) leaves its upper chunks unused
                    bool valid = row + r < rows_valid && col < d_valid;
                    cp_async_16(dst + pn * SmemTile<ROWS, DP>::PANEL_BYTES + r * 128, valid ? src + pn * 64 : gmem,
                                valid);
                }
            }
        }
    }

    // Like load_async, for rows that lie anywhere: row r comes from row_ptr(r), or is zero-filled where that is
    // nullptr (decode gathers KV cache pages and the query rows of several heads). `any` is some valid address,
    // given to zero-filling copies that read nothing.
    template <class RowPtr>
    static __device__ __forceinline__ void load_rows_async(u32 smem, const RowPtr& row_ptr, int d_valid,
                                                           const u16* any, int tid) {
        const int row = tid / 8, chunk = tid % 8;
        const u32 dst = smem + SmemTile<ROWS, DP>::offset(row, chunk);
#pragma unroll
        for (int r = 0; r < ROWS; r += ROW_STEP) {
            const u16* src = row_ptr(row + r);
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn) {
                int col = pn * 64 + chunk * 8;
                if (col < D) {
                    bool valid = src != nullptr && col < d_valid;
                    cp_async_16(dst + pn * SmemTile<ROWS, DP>::PANEL_BYTES + r * 128, valid ? src + col : any,
                                valid);
                }
            }
        }
    }

    // Copies shared -> global, rows < rows_valid and columns < d_valid only.
    static __device__ __forceinline__ void store(u16* gmem, i64 row_stride, u32 smem, int rows_valid, int d_valid,
                                                 int tid) {
        const int row = tid / 8, chunk = tid % 8;
        const u32 src = smem + SmemTile<ROWS, DP>::offset(row, chunk);
        u16* dst = gmem + row * row_stride + chunk * 8;
        const i64 dst_step = ROW_STEP * row_stride;
#pragma unroll
        for (int r = 0; r < ROWS; r += ROW_STEP, dst += dst_step) {
#pragma unroll
            for (int pn = 0; pn < PANELS; ++pn) {
                int col = pn * 64 + chunk * 8;
                if (col < D && row + r < rows_valid && col < d_valid) {
                    uint4 val;
                    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                                 : "r"(src + pn * SmemTile<ROWS, DP>::PANEL_BYTES + r * 128));
                    *reinterpret_cast<uint4*>(dst + pn * 64) = val;
                }
            }
        }
    }
};

// Tiles of 64-byte rows (32 16-bit columns: an e4m3 K or V row at d = 64), dense: rows one after another, the four
// 16-byte chunks of a row XOR-swizzled with (row / 2) % 4 (Hopper's 64-byte swizzle), so that eight consecutive rows
// at the same logical chunk hit eight different bank groups. NarrowLdmatrixAddr and NarrowTileCopy are its
// LdmatrixAddr and TileCopy.
template <int ROWS>
struct NarrowTile {
    static constexpr int BYTES = ROWS * 64;

    static __device__ __forceinline__ u32 offset(int row, int chunk) {
        return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
    }
};

// Piece (rows 16*i.., chunks 2*j, 2*j + 1), j < 2: a base per j, the swizzle being the same for rows 16 apart.
struct NarrowLdmatrixAddr {
    u32 base[2];

    __device__ __forceinline__ NarrowLdmatrixAddr(u32 tile, int row, int chunk_lo) {
#pragma unroll
        for (int j = 0; j < 2; ++j) base[j] = tile + row * 64 + (((2 * j + chunk_lo) ^ ((row >> 1) & 3)) << 4);
    }
    __device__ __forceinline__ u32 operator()(int i, int j) const { return base[j] + i * 16 * 64; }
};

// Global -> shared copies of a ROWS x 32-column NarrowTile: four consecutive threads cover a row (64 bytes).
template <int ROWS, int THREADS>
struct NarrowTileCopy {
    static constexpr int ROW_STEP = THREADS / 4;
    static_assert(ROWS % ROW_STEP == 0, "every thread copies the same number of rows");

    // As TileCopy::load_rows_async: row r from row_ptr(r), zero-filled where that is nullptr or past d_valid.
    template <class RowPtr>
    static __device__ __forceinline__ void load_rows_async(u32 smem, const RowPtr& row_ptr, int d_valid,
                                                           const u16* any, int tid) {
        const int row = tid / 4, chunk = tid % 4;
        const u32 dst = smem + NarrowTile<ROWS>::offset(row, chunk);
#pragma unroll
        for (int r = 0; r < ROWS; r += ROW_STEP) {  // r is a multiple of 8: the swizzle of row + r is row's
            const u16* src = row_ptr(row + r);
            const bool valid = src != nullptr && chunk * 8 < d_valid;
            cp_async_16(dst + r * 64, valid ? src + chunk * 8 : any, valid);
        }
    }
};

}  // namespace cuflash

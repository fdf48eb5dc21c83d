// Self-tests of the Hopper primitives (sm90.cuh), one warpgroup each, checked by tests/gpu/test_sm90.py:
//   sm90_gemm_selftest: C[64 x 64] = A[64 x K] B[64 x K]^T, A and B by TMA (128-byte swizzle), wgmma from shared
//                       memory, both K-major -- the S = Q K^T step of the Hopper forward;
//   sm90_pv_selftest:   C[64 x 64] = A[64 x K] B[K x 64], A in registers (mma.sync A fragments), B MN-major by
//                       TMA -- the O += P V step.
#include "sm90.cuh"
#include "mma.cuh"

namespace cuflash {

struct Sm90SelftestParams {
    sm90::TmaMap a;  // gemm: A (64 rows, K columns), K contiguous; box 64 x 64
    sm90::TmaMap b;  // gemm: B (64 rows, K columns), K contiguous; pv: B (K rows, 64 columns); box 64 x 64
    const u16* a_rows;  // pv: A (64, K) row-major, read straight into registers
    float* c;        // C: (64, 64) row-major
    int k_tiles;     // K / 64
};
static_assert(sizeof(Sm90SelftestParams) == 320, "Sm90SelftestParams no longer matches tests/sm90_selftest.py");

// C's fragments to global memory (the mma.sync C layout of each warp's 16 rows).
__device__ __forceinline__ void store_c(float* c, const float (&d)[32], int warp, int lane) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * warp + lane / 4 + 8 * h, col = 8 * j + 2 * (lane % 4);
            c[row * 64 + col] = d[4 * j + 2 * h];
            c[row * 64 + col + 1] = d[4 * j + 2 * h + 1];
        }
}

template <class T>
__global__ void __launch_bounds__(128) sm90_gemm_selftest(const __grid_constant__ Sm90SelftestParams p) {
    extern __shared__ __align__(1024) char smem[];
    constexpr u32 TILE_BYTES = 64 * 64 * 2;
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;  // swizzled panels start on 1024-byte boundaries
    const u32 s_a = base, s_b = base + TILE_BYTES, bar = base + 2 * TILE_BYTES;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (tid == 0) {
        sm90::mbar_init(bar, 1);
        sm90::mbar_fence_init();
    }
    __syncthreads();

    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    for (int kt = 0; kt < p.k_tiles; ++kt) {
        if (tid == 0) {
            sm90::mbar_arrive_expect_tx(bar, 2 * TILE_BYTES);
            sm90::tma_load_2d(s_a, &p.a, kt * 64, 0, bar);
            sm90::tma_load_2d(s_b, &p.b, kt * 64, 0, bar);
        }
        sm90::mbar_wait(bar, kt & 1);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            sm90::wgmma_m64n64k16_ss<T>(d, sm90::smem_desc(s_a + ks * 32), sm90::smem_desc(s_b + ks * 32),
                                        kt > 0 || ks > 0);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        __syncthreads();  // every warp is done with the tiles before the next copy overwrites them
    }
    store_c(p.c, d, warp, lane);
}

template <class T>
__global__ void __launch_bounds__(128) sm90_pv_selftest(const __grid_constant__ Sm90SelftestParams p) {
    extern __shared__ __align__(1024) char smem[];
    constexpr u32 TILE_BYTES = 64 * 64 * 2;
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;
    const u32 s_b = base, bar = base + TILE_BYTES;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int k = p.k_tiles * 64;
    if (tid == 0) {
        sm90::mbar_init(bar, 1);
        sm90::mbar_fence_init();
    }
    __syncthreads();

    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
    for (int kt = 0; kt < p.k_tiles; ++kt) {
        if (tid == 0) {
            sm90::mbar_arrive_expect_tx(bar, TILE_BYTES);
            sm90::tma_load_2d(s_b, &p.b, 0, kt * 64, bar);  // 64 key rows x 64 columns
        }
        sm90::mbar_wait(bar, kt & 1);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const u16* a0 = p.a_rows + (i64)row * k + kt * 64 + ks * 16 + col;  // rows r, r + 8; cols c, c + 8
            u32 a[4];
            a[0] = *reinterpret_cast<const u32*>(a0);
            a[1] = *reinterpret_cast<const u32*>(a0 + 8 * k);
            a[2] = *reinterpret_cast<const u32*>(a0 + 8);
            a[3] = *reinterpret_cast<const u32*>(a0 + 8 * k + 8);
            sm90::wgmma_fence();
            sm90::wgmma_m64n64k16_rs<T>(d, a, sm90::smem_desc_mn(s_b + ks * 2048, 64 * 128), kt > 0 || ks > 0);
            sm90::wgmma_commit();
        }
        sm90::wgmma_wait<0>();
        __syncthreads();
    }
    store_c(p.c, d, warp, lane);
}

}  // namespace cuflash

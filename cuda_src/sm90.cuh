// Hopper (sm_90a) primitives as thin inline-PTX wrappers: mbarriers, named barriers, TMA tile loads and bulk
// reductions, shared-memory stores, wgmma with shared-memory matrix descriptors: the Hopper kernels reach these
// instructions through the wrappers here. sm90_selftest.cu checks the wgmma and TMA pieces against a host matmul.
//
// Conventions (PTX ISA 8.x, "Asynchronous warpgroup level matrix multiply"):
//  - tiles are K-major (the reduction dim contiguous), 16-bit, stored as 64-element (128-byte) panels with the
//    128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8). That is what TMA writes with
//    CU_TENSOR_MAP_SWIZZLE_128B and what SmemTile (tile.cuh) uses, so both paths share one layout;
//  - a panel's 8-row groups are 1024 bytes apart (descriptor stride byte offset), and the panel must start on a
//    1024-byte boundary; one k16 step is 32 bytes further along the row.
#pragma once
#include "types.cuh"
#include "mma.cuh"

namespace cuflash {
namespace sm90 {

// ---------------------------------------------------------------------------------------------------- mbarrier

__device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Makes initialized barriers visible to the async proxy (TMA) before anyone uses them; then __syncthreads().
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::); }

// One arrival that also announces `bytes` of transactions (the TMA copies that will complete on this barrier).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase with parity `phase` has completed (phases alternate 0, 1, 0, ...).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar), "r"(phase) : "memory");
}

// ------------------------------------------------------------------------------------------------------- TMA

// A CUtensorMap: 128 opaque bytes, built on the host (cuflash/tma.py) and passed inside a __grid_constant__
// kernel parameter, whose generic address the copies take.
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
};

// Copies the box at element coordinates (x = innermost, y) of `map` into shared memory at `dst`, completing
// `bytes` of transactions on barrier `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar) : "memory");
}

// The same for a 3-D map (x innermost): e.g. (head dim, heads, rows) of a (batch, seqlen, heads, d) tensor.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
}

// And 4-D: (head dim, heads, rows, batch) of a (batch, seqlen, heads, d) tensor with any strides.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, int x, int y, int z, int w, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar)
        : "memory");
}

// The same where `issue` is set (a predicate, not a branch: called by every lane of a warp that issues copies
// together, it keeps the warp converged).
__device__ __forceinline__ void tma_load_4d_if(bool issue, u32 dst, const TmaMap* map, int x, int y, int z, int w,
                                               u32 bar) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %7, 0;\n"
        "@p cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n}\n" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(w),
        "r"(bar), "r"((int)issue) : "memory");
}

// The same, with an L2 eviction policy (l2_policy_evict_first) for the lines the copy brings into L2.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, int x, int y, int z, int w, u32 bar,
                                            unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
        "%3, %4, %5}], [%6], %7;\n" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z),
        "r"(w), "r"(bar), "l"(policy) : "memory");
}

// An L2 policy for copies: evict_first marks the lines as the first to go, so that data read once (a decode's K/V
// stream) replaces itself instead of lines other work left in L2 (a dirty line costs a write-back to evict).
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// Adds the box at `src` in shared memory to the box at element coordinates (x innermost, y, z, w) of `map` in global
// memory, element by element (a bulk reduction in L2; fp32 maps add fp32), as part of the thread's current bulk
// group: bulk_commit closes the group, bulk_wait_read<N> waits until at most N groups still read shared memory,
// bulk_wait<N> until at most N are incomplete (their additions made).
__device__ __forceinline__ void tma_reduce_add_4d(const TmaMap* map, int x, int y, int z, int w, u32 src) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(src)
                 : "memory");
}
// Stores the box at `src` in shared memory to the box at element coordinates (x innermost, y, z[, w]) of `map`, as
// part of the thread's current bulk group (rows out of the map's bounds are not written).
__device__ __forceinline__ void tma_store_3d(const TmaMap* map, int x, int y, int z, u32 src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(src) : "memory");
}
__device__ __forceinline__ void tma_store_4d(const TmaMap* map, int x, int y, int z, int w, u32 src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared memory written by ordinary stores, read next by wgmma or TMA: each writer fences, then a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Global memory written by TMA in one CTA and read or added to next by another CTA's TMA: the writer waits for its
// copies, fences and releases; the reader acquires, then fences before its own copies.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void st_release(int* addr, int x) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(addr), "r"(x) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int* addr) {
    int x;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(x) : "l"(addr) : "memory");
    return x;
}

// One 32-bit store to shared memory, ordered with the asm around it (the fence and barrier that publish it).
__device__ __forceinline__ void st_shared_b32(u32 addr, u32 x) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}

// Two adjacent fp32 additions to global memory in one vector reduction (8-byte aligned; relaxed, gpu scope, as
// atomicAdd's).
__device__ __forceinline__ void red_add_v2(float* addr, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(x), "f"(y) : "memory");
}

// ------------------------------------------------------------------------------------------------------ wgmma

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled operand starting at `addr` (1024-aligned panel;
// advance by 32 bytes per k16 step): start address >> 4 in bits 0-13, leading byte offset (unused when swizzled,
// 1) in bits 16-29, stride byte offset 1024 >> 4 in bits 32-45, swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ unsigned long long smem_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// The same for an MN-major operand (B = V in O += P V: keys are K, the head dim is N and contiguous): 8-row K groups
// are 1024 bytes apart (stride byte offset), 64-element N panels `panel_bytes` apart (leading byte offset). Advance
// by 16 rows (2048 bytes) per k16 step.
__device__ __forceinline__ unsigned long long smem_desc_mn(u32 addr, u32 panel_bytes) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((panel_bytes >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) further on than `desc`'s: only the start address field
// (bits 0-13, the address >> 4) moves, and the add stays in it (shared memory ends below 256 KB). A kernel builds
// one descriptor per buffer and advances it, instead of rebuilding each one from its address (a mask, shifts and
// ors per wgmma, then two moves to uniform registers: about a sixth of a d = 64 forward step's instructions).
__device__ __forceinline__ unsigned long long desc_advance(unsigned long long desc, u32 bytes) {
    unsigned long long d;
    asm("mov.b64 %0, {%1, %2};\n" : "=l"(d) : "r"((u32)desc + (bytes >> 4)), "r"((u32)(desc >> 32)));
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// x as a value ptxas can see is the same in every lane (a shuffle from lane 0; the whole warp takes part). Values
// it cannot prove warp-uniform (loaded from memory, or computed inside a loop whose trip count it cannot prove
// uniform) live in per-thread registers: every wgmma descriptor built from them is then computed per thread and moved
// to uniform registers (R2UR) at each wgmma. A tile's block count and the like made uniform keep the ring position
// and the descriptors on the uniform datapath.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffff, x, 0); }

// Named CTA barriers (ids 1..15; 0 is __syncthreads) over `threads` threads: sync arrives and waits until that many
// have arrived, arrive only counts. Two warpgroups take turns with a pair of them (fwd_sm90.cu, PINGPONG).
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same with the thread count, and the id where it is fixed (a kernel's barrier enum), as immediates of the
// instruction rather than registers.
template <int THREADS> __device__ __forceinline__ void named_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS> __device__ __forceinline__ void named_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}
template <auto ID, int THREADS> __device__ __forceinline__ void named_sync() {
    static_assert(int(ID) >= 1 && int(ID) <= 15, "named barrier ids are 1..15");
    asm volatile("bar.sync %0, %1;\n" ::"n"(int(ID)), "n"(THREADS) : "memory");
}
template <auto ID, int THREADS> __device__ __forceinline__ void named_arrive() {
    static_assert(int(ID) >= 1 && int(ID) <= 15, "named barrier ids are 1..15");
    asm volatile("bar.arrive %0, %1;\n" ::"n"(int(ID)), "n"(THREADS) : "memory");
}

// The registers a CTA of `threads` threads starts with when one fits an SM (__launch_bounds__(threads, 1)): the
// per-thread budget, rounded down to the allocation unit of 8, times the threads (168 x 384 = 64,512 for three
// warpgroups, not the whole 65,536). setmaxnreg moves registers between warpgroups inside this pool only: a split that
// asks for more blocks in setmaxnreg.inc for ever.
__host__ __device__ constexpr int register_pool(int threads) {
    return (65536 / threads < 255 ? 65536 / threads : 255) / 8 * 8 * threads;
}

// Per-thread register budget of the executing warpgroup (all its threads, converged): a producer that only issues
// copies gives registers back, consumers take them (setmaxnreg; the kernel starts at the launch-bounds budget).
template <int N> __device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The wgmma wrappers. One asm template per operand form, the element type and the operand majorness spliced in
// as strings: TYPE "bf16" / "f16" (T::is_bf16), the instruction's trailing immediates (scale-a, scale-b and, for
// shared-memory operands, the transpose flags of A and B). accumulate = false overwrites D.
#define CUFLASH_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                        "+f"(d[i + 6]), "+f"(d[i + 7])
#define CUFLASH_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define CUFLASH_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
                    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
                    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
// D[64 x N] (+)= A B, both operands in shared memory (descriptors): DREGS / ACC_OPERANDS the N / 2 accumulators
// per thread, PRED the operand number of `accumulate`, AFTER the descriptors, predicate and immediates.
#define CUFLASH_WGMMA_SS(SHAPE, TYPE, DREGS, ACC_OPERANDS, PRED, AFTER)                                           \
    asm volatile("{\n"                                                                                            \
                 ".reg .pred acc;\n"                                                                              \
                 "setp.ne.b32 acc, " PRED ", 0;\n"                                                                \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DREGS AFTER ";\n"                \
                 "}\n"                                                                                            \
                 : ACC_OPERANDS                                                                                   \
                 : "l"(a_desc), "l"(b_desc), "r"((int)accumulate))
#define CUFLASH_ACC16 CUFLASH_ACC8(0), CUFLASH_ACC8(8)
#define CUFLASH_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
#define CUFLASH_ACC32 CUFLASH_ACC8(0), CUFLASH_ACC8(8), CUFLASH_ACC8(16), CUFLASH_ACC8(24)
#define CUFLASH_ACC64 CUFLASH_ACC32, CUFLASH_ACC8(32), CUFLASH_ACC8(40), CUFLASH_ACC8(48), CUFLASH_ACC8(56)
#define CUFLASH_ACC88 CUFLASH_ACC64, CUFLASH_ACC8(64), CUFLASH_ACC8(72), CUFLASH_ACC8(80)
#define CUFLASH_D88 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
                    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
                    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "            \
                    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "            \
                    "%80, %81, %82, %83, %84, %85, %86, %87}, "
#define CUFLASH_SS_N64(TYPE, TRANS) \
    CUFLASH_WGMMA_SS("m64n64k16", TYPE, CUFLASH_D32, CUFLASH_ACC32, "%34", "%32, %33, acc, 1, 1, " TRANS)
#define CUFLASH_SS_N32(TYPE) \
    CUFLASH_WGMMA_SS("m64n32k16", TYPE, CUFLASH_D16, CUFLASH_ACC16, "%18", "%16, %17, acc, 1, 1, 0, 0")
#define CUFLASH_SS_N128(TYPE) \
    CUFLASH_WGMMA_SS("m64n128k16", TYPE, CUFLASH_D64, CUFLASH_ACC64, "%66", "%64, %65, acc, 1, 1, 0, 0")
#define CUFLASH_ACC40 CUFLASH_ACC32, CUFLASH_ACC8(32)
#define CUFLASH_D40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
                    "%32, %33, %34, %35, %36, %37, %38, %39}, "
#define CUFLASH_SS_N80(TYPE) \
    CUFLASH_WGMMA_SS("m64n80k16", TYPE, CUFLASH_D40, CUFLASH_ACC40, "%42", "%40, %41, acc, 1, 1, 0, 0")
#define CUFLASH_SS_N176(TYPE) \
    CUFLASH_WGMMA_SS("m64n176k16", TYPE, CUFLASH_D88, CUFLASH_ACC88, "%90", "%88, %89, acc, 1, 1, 0, 0")

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B both K-major in shared memory, fp32 accumulators. Per thread
// (warp w of the warpgroup, lane l): d[4j + e] is row 16w + l/4 + 8(e/2), column 8j + 2(l%4) + e%2, the
// mma.sync C layout of each warp's 16 rows.
template <class T> __device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], unsigned long long a_desc,
                                                                      unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N64("bf16", "0, 0");
    else CUFLASH_SS_N64("f16", "0, 0");
}

// The same with both operands MN-major (smem_desc_mn; transpose flags set): A[64 x 16] stored K rows of 64
// contiguous M elements (the backward's dS, kept as dS^T rows of keys), B stored K rows of N contiguous elements.
template <class T> __device__ __forceinline__ void wgmma_m64n64k16_ss_mn(float (&d)[32], unsigned long long a_desc,
                                                                         unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N64("bf16", "1, 1");
    else CUFLASH_SS_N64("f16", "1, 1");
}

// A K-major, B MN-major (the backward at d = 256: dV += P^T dO and dK += dS^T Q with P^T and dS^T, rows of keys, in
// shared memory as K-major A, and dO, Q stored rows of queries with the head dim contiguous as B).
template <class T> __device__ __forceinline__ void wgmma_m64n64k16_ss_bmn(float (&d)[32], unsigned long long a_desc,
                                                                          unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N64("bf16", "0, 1");
    else CUFLASH_SS_N64("f16", "0, 1");
}

// The same as wgmma_m64n64k16_ss with N = 32 (S^T of 64 keys against 32 queries: half a warpgroup pair's 64):
// d[4j + e] for the 4 column groups j of 8.
template <class T> __device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], unsigned long long a_desc,
                                                                      unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N32("bf16");
    else CUFLASH_SS_N32("f16");
}

// The same as wgmma_m64n64k16_ss with N = 128 (S of a 128-key block): d[4j + e] for the 16 column groups j of 8.
// One instruction reads Q's 64 x 16 slice once for twice the columns of the n64 form, halving the shared-memory
// traffic of A per flop.
template <class T> __device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], unsigned long long a_desc,
                                                                       unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N128("bf16");
    else CUFLASH_SS_N128("f16");
}
// The same with N = 80 (S of an 80-key block, FA3's d = 256 tile): d[4j + e] for the 10 column groups j of 8.
template <class T> __device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], unsigned long long a_desc,
                                                                      unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N80("bf16");
    else CUFLASH_SS_N80("f16");
}
// The same with N = 176 (S of a 176-key block, FA3's d = 128 tile): d[4j + e] for the 22 column groups j of 8.
template <class T> __device__ __forceinline__ void wgmma_m64n176k16_ss(float (&d)[88], unsigned long long a_desc,
                                                                       unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_SS_N176("bf16");
    else CUFLASH_SS_N176("f16");
}
// e4m3 (the FP8 forward): S (+)= Q K^T of a 128-key block, k = 32, both operands K-major (wgmma takes no
// transpose of 8-bit types): d[4j + e] for the 16 column groups j of 8.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], unsigned long long a_desc,
                                                         unsigned long long b_desc, bool accumulate) {
    CUFLASH_WGMMA_SS("m64n128k32", "e4m3", CUFLASH_D64, CUFLASH_ACC64, "%66", "%64, %65, acc, 1, 1");
}
#undef CUFLASH_SS_N176
#undef CUFLASH_SS_N128
#undef CUFLASH_SS_N32
#undef CUFLASH_SS_N64
#undef CUFLASH_WGMMA_SS

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A from registers (per warp the mma.sync m16n8k16 A fragment of its 16
// rows: P straight from the S accumulators), B MN-major in shared memory (smem_desc_mn), fp32 accumulators.
// RS: DREGS / ACC_OPERANDS as in CUFLASH_WGMMA_SS, AFTER the A registers, descriptor, predicate and immediates.
#define CUFLASH_WGMMA_RS(SHAPE, TYPE, DREGS, ACC_OPERANDS, PRED, AFTER)                                           \
    asm volatile("{\n"                                                                                            \
                 ".reg .pred acc;\n"                                                                              \
                 "setp.ne.b32 acc, " PRED ", 0;\n"                                                                \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DREGS AFTER ";\n"                \
                 "}\n"                                                                                            \
                 : ACC_OPERANDS                                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"((int)accumulate))
#define CUFLASH_RS_N64(TYPE) \
    CUFLASH_WGMMA_RS("m64n64k16", TYPE, CUFLASH_D32, CUFLASH_ACC32, "%37", "{%32, %33, %34, %35}, %36, acc, 1, 1, 1")
#define CUFLASH_RS_N128(TYPE) \
    CUFLASH_WGMMA_RS("m64n128k16", TYPE, CUFLASH_D64, CUFLASH_ACC64, "%69", "{%64, %65, %66, %67}, %68, acc, 1, 1, 1")
template <class T> __device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4],
                                                                      unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_RS_N64("bf16");
    else CUFLASH_RS_N64("f16");
}
// The same with N = 128 (O += P V at d = 128: both 64-column panels of V, `panel_bytes` apart in smem_desc_mn's
// leading byte offset, in one instruction): d[4j + e] for the 16 column groups j of 8, the two n64 forms' d side by
// side. P's fragment is read once for both panels.
template <class T> __device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4],
                                                                       unsigned long long b_desc, bool accumulate) {
    if constexpr (T::is_bf16) CUFLASH_RS_N128("bf16");
    else CUFLASH_RS_N128("f16");
}
#undef CUFLASH_RS_N128

// e4m3 (the FP8 forward, fwd_fp8_sm90.cu): O (+)= P V over 32 keys, N = 128 columns of the head dim, B = V^T
// K-major (rows of the head dim, keys contiguous). The accumulators are laid out as in the 16-bit forms; A from
// registers is the m16n8k32 A fragment of each warp's 16 rows: a[0] row l/4, k 4(l%4) .. +3 (byte i: k + i), a[1]
// row + 8, a[2] and a[3] k + 16.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const u32 (&a)[4], unsigned long long b_desc,
                                                         bool accumulate) {
    CUFLASH_WGMMA_RS("m64n128k32", "e4m3", CUFLASH_D64, CUFLASH_ACC64, "%69", "{%64, %65, %66, %67}, %68, acc, 1, 1");
}
// N = 72: V^T's 64 rows of d 64 and a row of ones, so that column 64 of D adds up P's row (fwd_fp8_sm90.cu PV_SUMS).
#define CUFLASH_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define CUFLASH_ACC36 CUFLASH_ACC32, CUFLASH_ACC4(32)
#define CUFLASH_D36 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
                    "%32, %33, %34, %35}, "
__device__ __forceinline__ void wgmma_m64n72k32_e4m3_rs(float (&d)[36], const u32 (&a)[4], unsigned long long b_desc,
                                                        bool accumulate) {
    CUFLASH_WGMMA_RS("m64n72k32", "e4m3", CUFLASH_D36, CUFLASH_ACC36, "%41", "{%36, %37, %38, %39}, %40, acc, 1, 1");
}

// N = 136: d 128's V^T and the row of ones (PV_SUMS at d 128).
#define CUFLASH_ACC68 CUFLASH_ACC64, CUFLASH_ACC4(64)
#define CUFLASH_D68 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
                    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
                    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "            \
                    "%64, %65, %66, %67}, "
__device__ __forceinline__ void wgmma_m64n136k32_e4m3_rs(float (&d)[68], const u32 (&a)[4], unsigned long long b_desc,
                                                         bool accumulate) {
    CUFLASH_WGMMA_RS("m64n136k32", "e4m3", CUFLASH_D68, CUFLASH_ACC68, "%73", "{%68, %69, %70, %71}, %72, acc, 1, 1");
}

// Four floats -> one register of four e4m3 bytes, x0 in the lowest (round to nearest even, saturating at +-448).
__device__ __forceinline__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));  // (a: high byte, b: low)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | ((u32)hi << 16);
}
#undef CUFLASH_RS_N64
#undef CUFLASH_WGMMA_RS
#undef CUFLASH_ACC36
#undef CUFLASH_D36
#undef CUFLASH_ACC68
#undef CUFLASH_D68
#undef CUFLASH_ACC4
#undef CUFLASH_ACC88
#undef CUFLASH_D88
#undef CUFLASH_ACC64
#undef CUFLASH_ACC32
#undef CUFLASH_ACC16
#undef CUFLASH_D64
#undef CUFLASH_D16
#undef CUFLASH_D32
#undef CUFLASH_ACC8

// ------------------------------------------------------------------------------------- tile helpers

// Four 8x8 16-bit matrices to shared memory: lane l gives the address of row (l % 8) of matrix (l / 8), and in r[m]
// matrix m's row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 (the layout ldmatrix loads).
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// A TMA box of rows `row` .. of one sequence, from column `col` of head `head`: a 3-D map (d, heads, total) of packed
// sequences whose rows start at token `begin`, or a 4-D one (d, heads, seqlen, batch) of a padded batch (sequence
// `batch`). Rows past the tensor's end arrive as zeros and are not stored; rows past a packed sequence's end (the
// next sequence's) are the caller's to mask.
__device__ __forceinline__ void tma_load_rows(u32 dst, const TmaMap* map, bool packed, int col, int head, int begin,
                                              int row, int batch, u32 bar) {
    if (packed) tma_load_3d(dst, map, col, head, begin + row, bar);
    else tma_load_4d(dst, map, col, head, row, batch, bar);
}
__device__ __forceinline__ void tma_store_rows(const TmaMap* map, bool packed, int col, int head, int begin, int row,
                                               int batch, u32 src) {
    if (packed) tma_store_3d(map, col, head, begin + row, src);
    else tma_store_4d(map, col, head, row, batch, src);
}

// A warp's 16 rows of a 64-row tile, as 16-bit pairs (pair(j, hh): columns 8 j + 2 (lane % 4), + 1 of row
// lane / 4 + 8 hh, the accumulator layout), into `rows`, the warp's first row in a staging tile of PANELS 64-column
// panels `panel_bytes` apart, for TMA stores. Row r holds its 16-byte chunk c at chunk c ^ (r % 8) (the 128-byte
// swizzle; the warp's rows start at a multiple of 8 rows, 1024 bytes), so a store's 32 lanes hit 32 banks. After the
// proxy fence and __syncwarp at the end, the warp's TMA copies may read the rows.
template <int PANELS, class Pair>
__device__ __forceinline__ void stage_warp_rows(u32 rows, u32 panel_bytes, int lane, const Pair& pair) {
    const u32 row = rows + (lane / 4) * 128 + 4 * (lane % 4), swz = (lane / 4) * 16;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                st_shared(row + hh * 1024 + pn * panel_bytes + ((j * 16) ^ swz), pair(pn * 8 + j, hh));
    fence_proxy_async();
    __syncwarp();
}

// Scores (or probabilities) of keys 16 kk .. 16 kk + 15, fp32 in the accumulator layout of a warp's 16 rows
// (softmax.cuh), to 16 bits: the A fragment of a wgmma (or mma.sync m16n8k16) that takes them from registers.
template <class T, int NT>
__device__ __forceinline__ void a_fragment(const float (&s)[NT][4], int kk, u32 (&a)[4]) {
    a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
// All of them: one fragment per 16 keys.
template <class T, int NT>
__device__ __forceinline__ void a_fragments(const float (&s)[NT][4], u32 (&a)[NT / 2][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) a_fragment<T>(s, kk, a[kk]);
}

}  // namespace sm90
}  // namespace cuflash

// The FP8 forward's V^T (fwd_fp8_sm90.cu): V (batch, seqlen_k, heads_k, d) in e4m3, any strides with d contiguous,
// or packed (total_k, heads_k, d) with cu_seqlens_k (seqlen.cuh; seqlen_k then the longest sequence's length),
// to V^T (batch, heads_k, d, keys) contiguous, keys = seqlen_k rounded up to 32, with the keys of each 32-key chunk
// in the order P's e4m3 fragments take them: slot s holds key 16 (s / 16) + {2c, 2c + 1, 2c + 8, 2c + 9}[s % 4],
// c = (s % 16) / 4. Keys past seqlen_k are zeros (P is 0 there, and 0 times a NaN would not be).
// Grid (keys / 32, heads_k, batch), 128 threads: a chunk of 32 keys x d through shared memory.
#include "types.cuh"

namespace cuflash {

struct Fp8TransposeParams {
    const u8* v;
    u8* vt;
    const int* cu_seqlens_k;                          // packed sequences, or nullptr
    i64 v_batch_stride, v_row_stride, v_head_stride;  // bytes; packed: the row stride is the batch stride
    int seqlen_k, rows_k, keys, heads_k, headdim;     // rows_k: packed, total_k; headdim: a multiple of 16 up to 256
};

// The key a V^T slot of a 32-key chunk holds.
__device__ __forceinline__ int fp8_chunk_key(int s) {
    const int c = (s % 16) / 4, i = s % 4;
    return 16 * (s / 16) + 2 * c + (i & 1) + 8 * (i >> 1);
}

__global__ void __launch_bounds__(128) fp8_transpose_v(const __grid_constant__ Fp8TransposeParams p) {
    __shared__ __align__(16) u8 tile[32][256 + 16];  // (+16: rows on different banks)
    const int key0 = blockIdx.x * 32, h = blockIdx.y, b = blockIdx.z, d = p.headdim;
    int begin = b, seqlen_k = p.seqlen_k;
    if (p.cu_seqlens_k != nullptr) {  // from device memory: the sequence stays inside v's rows
        begin = min(max(p.cu_seqlens_k[b], 0), p.rows_k);
        seqlen_k = min(min(p.cu_seqlens_k[b + 1], p.rows_k) - begin, p.seqlen_k);
    }
    const u8* v = p.v + begin * p.v_batch_stride + h * p.v_head_stride;
    for (int i = threadIdx.x; i < 32 * (d / 16); i += 128) {
        const int r = i / (d / 16), c = 16 * (i % (d / 16));
        uint4 x = make_uint4(0, 0, 0, 0);
        if (key0 + r < seqlen_k) x = *reinterpret_cast<const uint4*>(v + (key0 + r) * p.v_row_stride + c);
        *reinterpret_cast<uint4*>(&tile[r][c]) = x;
    }
    __syncthreads();
    u8* vt = p.vt + ((i64)(b * p.heads_k + h) * d) * p.keys + key0;
    for (int i = threadIdx.x; i < d * 8; i += 128) {  // row j of V^T, slots 4 q .. 4 q + 3
        const int j = i / 8, q = i % 8;
        u32 word = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) word |= (u32)tile[fp8_chunk_key(4 * q + t)][j] << (8 * t);
        *reinterpret_cast<u32*>(vt + (i64)j * p.keys + 4 * q) = word;
    }
}

}  // namespace cuflash

// Rotary position embedding (RoPE) for decode_append: a row of the new keys or of the queries, rotated by the angles
// of its position. A pair of elements (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos), each product and sum
// rounded in fp32 (no fused multiply-add, so that a float32 evaluation elsewhere gives the same bits), then rounded
// once to the element type. The pairs of a row's first R = rotary_dim elements are (2j, 2j + 1) (interleaved) or
// (j, j + R / 2), j < R / 2, with angle j's cos and sin in column j of row `pos` of rotary_cos / rotary_sin.
#pragma once
#include "params.cuh"

namespace cuflash {

template <class T>
__device__ __forceinline__ void unpack(const u32* w, int n, float* f) {
#pragma unroll
    for (int i = 0; i < n; ++i) {
        f[2 * i] = to_float<T>((u16)(w[i] & 0xffff));
        f[2 * i + 1] = to_float<T>((u16)(w[i] >> 16));
    }
}

__device__ __forceinline__ float rotate_first(float x1, float x2, float c, float s) {
    return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
}
__device__ __forceinline__ float rotate_second(float x1, float x2, float c, float s) {
    return __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c));
}

// Chunk c (elements 8c .. 8c + 7) of row `src` to the same chunk of row `dst`, rotated for position `pos`. With the
// half split, chunk c < R / 16 writes its partner c + R / 16 too, and the partner's own call writes nothing. Chunks
// past R, and positions outside [0, seqlen_ro) (rows past the tables), are copied unrotated.
template <class T>
__device__ __forceinline__ void rotary_chunk(const DecodeParams& p, const u16* src, u16* dst, int c, int pos) {
    const int R = p.rotary_dim, partner = R / 16;
    const uint4 x = *reinterpret_cast<const uint4*>(src + c * 8);
    if (pos < 0 || pos >= p.seqlen_ro || c * 8 >= R) {
        *reinterpret_cast<uint4*>(dst + c * 8) = x;
        return;
    }
    if (!p.rotary_interleaved && c >= partner) return;  // written with chunk c - R / 16
    const u16* cos_row = p.rotary_cos + (i64)pos * (R / 2);
    const u16* sin_row = p.rotary_sin + (i64)pos * (R / 2);
    float a[8];
    unpack<T>(&x.x, 4, a);
    if (p.rotary_interleaved) {  // angles 4c .. 4c + 3 for the chunk's four pairs
        const uint2 cw = *reinterpret_cast<const uint2*>(cos_row + 4 * c);
        const uint2 sw = *reinterpret_cast<const uint2*>(sin_row + 4 * c);
        float cs[4], sn[4];
        unpack<T>(&cw.x, 2, cs);
        unpack<T>(&sw.x, 2, sn);
        float o[8];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            o[2 * m] = rotate_first(a[2 * m], a[2 * m + 1], cs[m], sn[m]);
            o[2 * m + 1] = rotate_second(a[2 * m], a[2 * m + 1], cs[m], sn[m]);
        }
        *reinterpret_cast<uint4*>(dst + c * 8) = make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]),
                                                            pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
        return;
    }
    // half split: element 8c + e pairs with 8 (c + R / 16) + e, angle 8c + e
    const uint4 y = *reinterpret_cast<const uint4*>(src + (c + partner) * 8);
    const uint4 cw = *reinterpret_cast<const uint4*>(cos_row + 8 * c);
    const uint4 sw = *reinterpret_cast<const uint4*>(sin_row + 8 * c);
    float b[8], cs[8], sn[8], o1[8], o2[8];
    unpack<T>(&y.x, 4, b);
    unpack<T>(&cw.x, 4, cs);
    unpack<T>(&sw.x, 4, sn);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        o1[e] = rotate_first(a[e], b[e], cs[e], sn[e]);
        o2[e] = rotate_second(a[e], b[e], cs[e], sn[e]);
    }
    *reinterpret_cast<uint4*>(dst + c * 8) = make_uint4(pack2<T>(o1[0], o1[1]), pack2<T>(o1[2], o1[3]),
                                                        pack2<T>(o1[4], o1[5]), pack2<T>(o1[6], o1[7]));
    *reinterpret_cast<uint4*>(dst + (c + partner) * 8) = make_uint4(pack2<T>(o2[0], o2[1]), pack2<T>(o2[2], o2[3]),
                                                                    pack2<T>(o2[4], o2[5]), pack2<T>(o2[6], o2[7]));
}

}  // namespace cuflash

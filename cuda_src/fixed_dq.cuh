// Deterministic dQ as int32 fixed point (the Hopper backward's mode 2). Every CTA adds its dQ tile, scaled to
// integers, into one int32 accumulator; integer additions give the same bits in any order, so the atomic mode's
// grid is deterministic with it, and there are no fp32 slices to zero, add to and sum.
//
// The scale is per row, from a bound on every partial sum of that row. dQ_i = c sum_j dS_ij K_j with
// dS_ij = P_ij (dP_ij - D_i) (times a score mod's derivative, at most 1 for softcap and ALiBi), so for any subset of
// keys, and for the whole row,
//     |sum_j dS_ij K_jd| <= max|K| sum_j P_ij |dP_ij - D_i| <= max|K| (|dO_i| max_j |V_j| + |D_i|)
// (sum_j P_ij = 1, |dP_ij| = |dO_i . V_j| <= |dO_i| |V_j|). bwd_preprocess stores |dO_i|, bwd_kv_bound the two
// maxima per KV head; the row's bound B_i maps to 2^30, which leaves a factor 2 for rounding. One unit is B_i / 2^30:
// about 1e-9 of the bound, far below the bf16/fp16 rounding of dQ itself.
#pragma once
#include "types.cuh"

namespace cuflash {

// B_i from the softmax scale times max |K|, and max |V_j|, of the row's KV head.
__device__ __forceinline__ float dq_row_bound(float scaled_kmax, float vmax, float dout_norm, float dsum) {
    return scaled_kmax * (dout_norm * vmax + fabsf(dsum));
}

// B_i: kv_bound holds (max |K|, max |V_j|) of the row's KV head as float bits.
__device__ __forceinline__ float dq_row_bound(float softmax_scale, const unsigned* kv_bound, float dout_norm,
                                              float dsum) {
    return dq_row_bound(softmax_scale * __uint_as_float(kv_bound[0]), __uint_as_float(kv_bound[1]), dout_norm, dsum);
}

// Integers per unit of dQ: 2^30 / B_i; 0 where the bound is infinite or NaN, or below 1e-30 (0 where dO_i = 0;
// rows whose every |dQ| is below 1e-30 get 0, where 2^30 / B_i would overflow fp32). The reciprocal is rcp.approx
// (within an ulp or so, and the same bits every run): an IEEE division's slow path is a call, whose registers spilled
// in the d 64 kernel; |dQ| x scale stays far below 2^31, and the convert's unit is B_i / 2^30 to 1e-7.
__device__ __forceinline__ float dq_fixed_scale(float bound) {
    float r;
    asm("rcp.approx.f32 %0, %1;\n" : "=f"(r) : "f"(bound));
    return bound >= 1e-30f && bound < __int_as_float(0x7f800000) ? 1073741824.f * r : 0.f;
}

// dQ per integer: B_i / 2^30 (NaN stays NaN, so NaN inputs give NaN as in the fp32 modes).
__device__ __forceinline__ float dq_fixed_unit(float bound) { return bound * (1.f / 1073741824.f); }

// Two fp32 values as int32 fixed point (round to nearest even; cvt saturates, and NaN becomes 0).
__device__ __forceinline__ void st_shared_fixed2(u32 addr, float x, float y, float scale) {
    asm volatile("{\n.reg .s32 a, b;\ncvt.rni.s32.f32 a, %1;\ncvt.rni.s32.f32 b, %2;\n"
                 "st.shared.v2.s32 [%0], {a, b};\n}\n" ::"r"(addr), "f"(x * scale), "f"(y * scale) : "memory");
}

}  // namespace cuflash

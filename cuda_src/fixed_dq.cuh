// Deterministic dQ as int32 fixed point (the Hopper backward's mode 2). Every CTA adds its dQ tile, scaled to
// integers, into one int32 accumulator; integer additions give the same bits in any order, so the atomic mode's
// grid is deterministic with it, and there are no fp32 slices to zero, add to and sum.
//
// The scale is per row, from a bound on every partial sum of that row. dQ_i = c sum_j dS_ij K_j with
// dS_ij = P_ij (dP_ij - D_i) (times a score mod's derivative, at most 1 for softcap and ALiBi), so for any subset of
// keys, and for the whole row,
//     |sum_j dS_ij K_jd| <= max|K| sum_j P_ij |dP_ij - D_i| <= max|K| (|dO_i| max_j |V_j| + |D_i|)
// (sum_j P_ij = 1, |dP_ij| = |dO_i . V_j| <= |dO_i| |V_j|). bwd_preprocess stores |dO_i|, bwd_kv_bound the two
// maxima per KV head, and bwd_fixed_scale each row's scale (about 2^30 / B_i) in place of |dO_i|: the row's bound
// maps to 2^30, which leaves a factor 2 for rounding. The main kernel multiplies by the scale, the convert divides by
// it, so a unit of a row is 1 / scale: about 1e-9 of the bound, far below the bf16/fp16 rounding of dQ itself.
#pragma once
#include "types.cuh"

namespace cuflash {

// B_i: kv_bound holds (max |K|, max |V_j|) of the row's KV head as float bits.
__device__ __forceinline__ float dq_row_bound(float softmax_scale, const unsigned* kv_bound, float dout_norm,
                                              float dsum) {
    return softmax_scale * __uint_as_float(kv_bound[0]) * (dout_norm * __uint_as_float(kv_bound[1]) + fabsf(dsum));
}

// Integers per unit of dQ: 2^30 / B_i. 0 below 2^-96, where 2^30 / B_i would near fp32's range (0 where dO_i = 0:
// those rows get dq = 0); NaN where the bound is infinite or NaN, so that the convert makes the row NaN (the main
// kernel's conversion turns NaN into 0), as the fp32 modes would.
__device__ __forceinline__ float dq_fixed_scale(float bound) {
    if (!(bound < __int_as_float(0x7f800000))) return __int_as_float(0x7fffffff);
    return bound >= 0x1p-96f ? __fdiv_rn(1073741824.f, bound) : 0.f;
}

// dQ per integer of a row with this scale: 0 for a scale of 0 (every integer is 0 there), NaN for NaN.
__device__ __forceinline__ float dq_fixed_unit(float scale) { return scale == 0.f ? 0.f : __fdiv_rn(1.f, scale); }

// Two fp32 values as int32 fixed point (round to nearest even; cvt saturates, and NaN becomes 0).
__device__ __forceinline__ void st_shared_fixed2(u32 addr, float x, float y, float scale) {
    asm volatile("{\n.reg .s32 a, b;\ncvt.rni.s32.f32 a, %1;\ncvt.rni.s32.f32 b, %2;\n"
                 "st.shared.v2.s32 [%0], {a, b};\n}\n" ::"r"(addr), "f"(x * scale), "f"(y * scale) : "memory");
}

}  // namespace cuflash

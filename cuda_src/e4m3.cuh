// e4m3 values widened to 16-bit floats by moving their bits: no conversion instruction, so any architecture.
//
// An e4m3 byte s.eeee.mmm placed in a 16-bit float as s.0..0eeee.mmm0..0 keeps its exponent field and mantissa,
// subnormals included, so the 16-bit value is the e4m3 value times a power of two fixed by the two exponent biases:
// 2^(7 - 127) in bf16, 2^(7 - 15) in fp16 (E4m3Widen::SCALE, which callers fold into their own scale factors).
// e4m3fn's one NaN encoding (s.1111.111) becomes a finite value.
#pragma once
#include "types.cuh"

namespace cuflash {

template <class T> struct E4m3Widen;
template <> struct E4m3Widen<bf16_t> {
    static constexpr int SHIFT = 4;  // e4m3's exponent field lands in the low 4 bits of bf16's 8-bit one
    static constexpr float INV_SCALE = 1.329227995784916e36f;  // 2^120
};
template <> struct E4m3Widen<half_t> {
    static constexpr int SHIFT = 7;  // ... in the low 4 bits of fp16's 5-bit one
    static constexpr float INV_SCALE = 256.f;  // 2^8
};

// Two e4m3 values at bytes 0 and 2 of x (the other bytes zero) -> two 16-bit floats of type T {byte 0, byte 2}.
template <class T>
__device__ __forceinline__ u32 widen_e4m3x2(u32 x) {
    return ((x & 0x007f007fu) << E4m3Widen<T>::SHIFT) | ((x & 0x00800080u) << 8);
}

// Bytes {0, 1} and {2, 3} of w widened to T pairs.
template <class T>
__device__ __forceinline__ void widen_e4m3x4(u32 w, u32& lo, u32& hi) {
    lo = widen_e4m3x2<T>(__byte_perm(w, 0u, 0x4140));
    hi = widen_e4m3x2<T>(__byte_perm(w, 0u, 0x4342));
}

// Bytes {0, 2} (even) and {1, 3} (odd) of w widened to T pairs.
template <class T>
__device__ __forceinline__ void widen_e4m3x4_interleaved(u32 w, u32& even, u32& odd) {
    even = widen_e4m3x2<T>(w & 0x00ff00ffu);
    odd = widen_e4m3x2<T>((w >> 8) & 0x00ff00ffu);
}

}  // namespace cuflash

// e4m3 bytes to fp16 pairs, for MMA operands read from an e4m3 tile.
//
// From sm_89 on, cvt.rn.f16x2.e4m3x2 converts two values in one instruction, exactly (every e4m3 value is an fp16
// one). Before it (sm_80) the bits move instead: an e4m3 byte s.eeee.mmm placed in fp16 as s.0eeee.mmm0000000 keeps
// its exponent field and mantissa, subnormals included, so the fp16 value is the e4m3 value times 2^(7 - 15);
// E4M3_F16_UNDO is the factor that undoes that, for callers to fold into their own scale factors. (On sm_80
// e4m3fn's NaN encoding becomes a finite value.)
#pragma once
#include "types.cuh"

namespace cuflash {

#if __CUDA_ARCH__ >= 890
constexpr float E4M3_F16_UNDO = 1.f;
#else
constexpr float E4M3_F16_UNDO = 256.f;
#endif

// Bytes {0, 1} and {2, 3} of w to fp16 pairs (byte 0 and byte 2 in the low halves).
__device__ __forceinline__ void e4m3x4_to_f16(u32 w, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi) : "r"(w));
#else
    const u32 a = __byte_perm(w, 0u, 0x4140), b = __byte_perm(w, 0u, 0x4342);  // 0x00BB00AA: a byte per half
    lo = ((a & 0x007f007fu) << 7) | ((a & 0x00800080u) << 8);
    hi = ((b & 0x007f007fu) << 7) | ((b & 0x00800080u) << 8);
#endif
}

// Bytes {0, 2} and {1, 3} of w to fp16 pairs (byte 0 and byte 1 in the low halves).
__device__ __forceinline__ void e4m3x4_to_f16_interleaved(u32 w, u32& even, u32& odd) {
    e4m3x4_to_f16(__byte_perm(w, 0u, 0x3120), even, odd);
}

}  // namespace cuflash

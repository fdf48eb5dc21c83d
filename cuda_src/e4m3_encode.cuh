// float -> e4m3fn (float8_e4m3fn) bits in integer operations, the same on every architecture (sm_80 has no cvt to
// e4m3): round to nearest even, saturating at +-448 as `cvt.rn.satfinite` does, NaN to NaN (0x7f with the sign).
// Self-contained, so that tests/e4m3_encode.cpp runs it on the host.
#pragma once

namespace cuflash {

__device__ __forceinline__ unsigned e4m3_from_float(float f) {
    const unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
    const float a = fabsf(f);
    if (!(a <= 448.f)) return sign | (a == a ? 0x7eu : 0x7fu);        // past 448, Inf too: 448; NaN stays NaN
    if (a < 0.015625f) return sign | (unsigned)__float2int_rn(a * 512.f);  // below 2^-6: subnormal steps of 2^-9
    unsigned bits = __float_as_uint(a);
    bits += 0x7ffffu + ((bits >> 20) & 1u);  // the 23-bit mantissa rounded to 3 bits, ties to even (may carry)
    return sign | (((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u);  // exponent rebiased from 127 to 7
}

}  // namespace cuflash

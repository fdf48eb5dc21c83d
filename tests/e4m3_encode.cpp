// cuda_src/e4m3_encode.cuh on the host: reads float32 bit patterns from stdin, writes one e4m3 byte per value to
// stdout; tests/test_quantize_cpu.py compares them with cuflash.reference's rounding (ml_dtypes).
#include <cmath>
#include <cstdio>
#include <cstring>

#define __device__
#define __forceinline__ inline
inline unsigned __float_as_uint(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    return x;
}
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // the default rounding: to nearest even

#include "e4m3_encode.cuh"

int main() {
    float f;
    while (std::fread(&f, 4, 1, stdin) == 1) std::putchar((int)cuflash::e4m3_from_float(f));
    return 0;
}

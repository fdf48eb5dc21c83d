// 16-bit element types handled as raw bits, so kernels need no CUDA headers (NVRTC compiles them standalone).
#pragma once

// offsetof without <cstddef>, which NVRTC does not have: the definition of its front end's own stddef.h (a constant
// expression, usable in static_assert and constexpr).
#ifndef offsetof
#define offsetof(type, member) ((unsigned long long)__INTADDR__(&(((type*)0)->member)))
#endif

namespace cuflash {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned char u8;

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Type selection without <type_traits>: Pick<C, A, B>::type is A if C, else B.
template <bool C, class A, class B> struct Pick { using type = A; };
template <class A, class B> struct Pick<false, A, B> { using type = B; };

struct half_t { static constexpr bool is_bf16 = false; };  // IEEE fp16
struct bf16_t { static constexpr bool is_bf16 = true; };   // bfloat16

// Two floats -> one register holding {lo, hi} as 16-bit values (round to nearest even).
template <class T> __device__ __forceinline__ u32 pack2(float lo, float hi);

template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <> __device__ __forceinline__ u32 pack2<half_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// One 16-bit value -> float.
template <class T> __device__ __forceinline__ float to_float(u16 x);

template <> __device__ __forceinline__ float to_float<bf16_t>(u16 x) {
    return __uint_as_float(((u32)x) << 16);
}

template <> __device__ __forceinline__ float to_float<half_t>(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// Programmatic dependent launch (sm_90; cuflash.launcher's `overlap`). A kernel launched as a dependent waits in
// pdl_wait until the kernel before it has finished and its writes are visible; the kernel before it may call
// pdl_launch_dependents to let the dependent's CTAs be scheduled already. Both are no-ops on a plain launch and
// before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
__device__ __forceinline__ int ceil_div(int a, int b) { return floor_div(a + b - 1, b); }

// Division by a divisor fixed for the kernel, by a multiply: with p = ceil(log2 d) and m = floor(2^32 (2^p - d) / d)
// + 1, x / d = (umulhi(x, m) + x) >> p for 0 <= x < 2^31 (Granlund and Montgomery's round-up method). The host
// computes m and p (cuflash/hopper.py fast_div); each quotient then costs three instructions instead of about twenty.
struct FastDiv {
    u32 mul, shift;
    __device__ __forceinline__ int div(int x) const { return (int)((__umulhi((u32)x, mul) + (u32)x) >> shift); }
};

}  // namespace cuflash

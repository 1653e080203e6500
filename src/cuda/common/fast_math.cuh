// 2^x and log2(x) with the MUFU instruction alone: the exponentials of every softmax (forward and
// backward, every kernel family) and the backward's log2 of P. Host builds (the emulated kernel
// tests) take the libm functions.
#pragma once

#include <cmath>

namespace flashattn::cuda {

// 2^x with the MUFU.EX2 instruction alone (exp2f adds range fix-ups for denormal results):
// 2^-inf = 0, and results below 2^-126 flush to 0, which a softmax numerator cannot notice
// next to the row's maximum term 2^0.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);  // host emulation (tests/gpu/test_sm80_emulated.cpp)
#endif
}

// log2(x) with the MUFU.LG2 instruction alone (log2f adds range fix-ups and a branch).
__device__ __forceinline__ float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return log2f(x);  // host emulation
#endif
}

}  // namespace flashattn::cuda

// fp32 -> 16-bit pair packing shared by the mma.sync kernels (sm80 forward / backward, decode):
// the A fragment of m16n8k16 holds two neighbouring columns in one register.
#pragma once

#include <cstdint>
#include <cutlass/numeric_types.h>
#if defined(__CUDACC__)
#include <cutlass/numeric_conversion.h>  // device intrinsics: nvcc only
#endif

namespace flashattn::cuda {

// Two floats as one register of 16-bit values (lo in the low half): one F2FP on the GPU, the
// element type's own rounding in host emulation (the emulated kernel tests).
template <class Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
#if defined(__CUDACC__)
  cutlass::Array<float, 2> p;
  p[0] = lo;
  p[1] = hi;
  const auto packed = cutlass::NumericArrayConverter<Element, float, 2>{}(p);
  return reinterpret_cast<const uint32_t&>(packed);
#else
  return uint32_t{Element(lo).raw()} | uint32_t{Element(hi).raw()} << 16;
#endif
}

}  // namespace flashattn::cuda

// Building blocks of the KV-cache decode kernels (decode_kernel.cuh, decode_mma_kernel.cuh): the
// 16-byte vectors a lane loads, cp.async with a plain-copy host version beside it (the emulated
// tests run the kernels on CPU threads), conversions, the rotary embedding of an appended key, and
// the programmatic-dependent-launch hooks.
#pragma once

#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "decode_params.hpp"

namespace flashattn::cuda::decode {

inline constexpr int kVec = 8;  // elements of one 16-byte load
// Keys a lane group takes per step, and the steps in flight (the pipeline's depth: the shared
// memory of kOneRowCtasPerSm CTAs fits an H100's SM).
inline constexpr int kKeysPerStep = 4;
inline constexpr int kOneRowStages = 3;

// A lane group holds one key row: the head-dim bucket's 16-byte vectors, one a lane.
template <int kHeadDim>
inline constexpr int kLanesPerKey = kHeadDim / kVec;
template <int kHeadDim>
inline constexpr int kKeysPerWarp = 32 / kLanesPerKey<kHeadDim>;

template <typename Element>
struct alignas(16) Vec {
  Element e[kVec];
};

template <typename Element>
__device__ __forceinline__ void to_float(const Vec<Element>& v, float (&f)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = static_cast<float>(v.e[i]);
}

// 16 bytes of a K or V row as loaded: 8 elements in 4 words, converted by bit operations (bf16)
// or the half-to-float instruction (fp16), not element by element through the 16-bit type.
struct alignas(16) Chunk {
  uint32_t w[4];
};

__device__ __forceinline__ float bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// cp.async: 16 bytes from global to shared memory without passing through registers, cached in
// L2 only (the cache is read once); invalid copies read nothing and write zeros.
__device__ __forceinline__ void copy_async(Chunk* dst, const void* src, bool valid) {
#ifdef __CUDA_ARCH__
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
  if (valid) {
    std::memcpy(dst, src, sizeof(Chunk));
  } else {
    *dst = Chunk{};
  }
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most `kPending` of this thread's committed groups are still in flight. (Every
// asm here clobbers "memory": the compiler must not move shared-memory reads across them.)
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

template <typename Element>
__device__ __forceinline__ void to_float(const Chunk& c, float (&f)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      f[2 * i] = bits_to_float(c.w[i] << 16);
      f[2 * i + 1] = bits_to_float(c.w[i] & 0xffff0000u);
    } else {
      f[2 * i] = static_cast<float>(Element::bitcast(static_cast<uint16_t>(c.w[i] & 0xffffu)));
      f[2 * i + 1] = static_cast<float>(Element::bitcast(static_cast<uint16_t>(c.w[i] >> 16)));
    }
  }
}

template <typename Element>
__device__ __forceinline__ float table_value(const RotaryParams& r, const void* table, int64_t stride, int64_t pos,
                                             int64_t pair) {
  const int64_t at = pos * stride + pair;
  return r.fp32_tables ? static_cast<const float*>(table)[at]
                       : static_cast<float>(static_cast<const Element*>(table)[at]);
}

// a * b + c * d with both products rounded, never fused (the compiler would contract one into
// an FMA): exactly what the CPU backend computes. Rotated values are rounded to the element
// type, where one fp32 ulp can flip a rounding; a flipped q element moved a GPU lse by 5e-4.
__device__ __forceinline__ float mul_add(float a, float b, float c, float d) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(__fmul_rn(a, b), __fmul_rn(c, d));
#else
  return a * b + c * d;
#endif
}

// x: the 8 features [c0, c0 + 8) of a row at `row` (element pointer to feature 0), rotated to
// position `pos` in fp32 (features past rotary.dim unchanged). Non-interleaved pairs read the
// partner features from memory (their 16-byte vector, since dim % 16 == 0).
template <typename Element>
__device__ __forceinline__ void rotate(const RotaryParams& r, const Element* row, int c0, int64_t pos,
                                       float (&x)[kVec]) {
  if (c0 >= r.dim) return;
  const int half = static_cast<int>(r.dim / 2);
  if (r.interleaved) {
#pragma unroll
    for (int i = 0; i < kVec; i += 2) {
      const int pair = (c0 + i) / 2;
      const float c = table_value<Element>(r, r.cos, r.cos_row_stride, pos, pair);
      const float s = table_value<Element>(r, r.sin, r.sin_row_stride, pos, pair);
      const float x1 = x[i], x2 = x[i + 1];
      x[i] = mul_add(x1, c, -x2, s);
      x[i + 1] = mul_add(x1, s, x2, c);
    }
    return;
  }
  const bool first_half = c0 < half;
  float partner[kVec];
  to_float(*reinterpret_cast<const Vec<Element>*>(row + (first_half ? c0 + half : c0 - half)), partner);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int pair = (first_half ? c0 : c0 - half) + i;
    const float c = table_value<Element>(r, r.cos, r.cos_row_stride, pos, pair);
    const float s = table_value<Element>(r, r.sin, r.sin_row_stride, pos, pair);
    // (x1, x2) -> (x1 c - x2 s, x1 s + x2 c): this lane holds x1 (first half) or x2.
    x[i] = first_half ? mul_add(x[i], c, -partner[i], s) : mul_add(partner[i], s, x[i], c);
  }
}

template <typename Element>
__device__ __forceinline__ Vec<Element> from_float(const float (&f)[kVec]) {
  Vec<Element> v;
#pragma unroll
  for (int i = 0; i < kVec; ++i) v.e[i] = static_cast<Element>(f[i]);
  return v;
}

// Programmatic dependent launch (sm90 on): the combine kernel is launched while the decode CTAs
// still run (it is let in once every decode CTA has started) and waits for their results at its
// start, so its launch latency hides behind them. Below sm90 both are no-ops and the launcher
// orders the kernels plainly.
__device__ __forceinline__ void let_dependent_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace flashattn::cuda::decode

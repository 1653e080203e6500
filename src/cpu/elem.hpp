// Element types of the CPU backend and the dtype -> type dispatch.
#pragma once

#include <cstdint>
#include <utility>

#include "../core/half.hpp"
#include "../problem.hpp"

namespace flashattn::cpu {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(Half h) { return core::fp16_to_float(h.bits); }
inline float to_float(BFloat16 h) { return core::bf16_to_float(h.bits); }
inline float to_float(float x) { return x; }
inline double to_float(double x) { return x; }

template <typename T>
inline T from_acc(double x);
template <>
inline Half from_acc<Half>(double x) {
  return {core::float_to_fp16(static_cast<float>(x))};
}
template <>
inline BFloat16 from_acc<BFloat16>(double x) {
  return {core::float_to_bf16(static_cast<float>(x))};
}
template <>
inline float from_acc<float>(double x) {
  return static_cast<float>(x);
}
template <>
inline double from_acc<double>(double x) {
  return x;
}

// Calls f(T{}) with T the storage type of `dtype`.
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      return f(Half{});
    case DType::kBFloat16:
      return f(BFloat16{});
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kInt32:
      break;
  }
  throw Error(ErrorCode::kInternal, "dispatch_dtype: not a value dtype");
}

// Typed pointer to row `row` (within batch entry b, head h) of an operand.
template <typename T>
inline T* row_ptr(const detail::Operand& op, int64_t b, int64_t row, int64_t h) {
  return static_cast<T*>(op.data) + op.offset(b, row, h);
}

}  // namespace flashattn::cpu

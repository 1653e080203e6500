// Element types of the CPU backend and the dtype -> type dispatch.
#pragma once

#include <cstdint>
#include <utility>

#include "../core/float8.hpp"
#include "../core/half.hpp"
#include "../problem.hpp"
#include "../tensor_checks.hpp"

namespace flashattn::cpu {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
// FP8 inputs (forward only): stored as given, dequantised by the tile and row loads.
struct Float8E4M3 {
  uint8_t bits;
};
struct Float8E5M2 {
  uint8_t bits;
};

inline float to_float(Half h) { return core::fp16_to_float(h.bits); }
inline float to_float(BFloat16 h) { return core::bf16_to_float(h.bits); }
inline float to_float(Float8E4M3 x) { return core::float8_to_float<core::E4M3Format>(x.bits); }
inline float to_float(Float8E5M2 x) { return core::float8_to_float<core::E5M2Format>(x.bits); }
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
// FP8: round to nearest even, saturating (core::float_to_float8); the quantisation of rows
// appended to an FP8 cache.
template <>
inline Float8E4M3 from_acc<Float8E4M3>(double x) {
  return {core::float_to_float8<core::E4M3Format>(static_cast<float>(x))};
}
template <>
inline Float8E5M2 from_acc<Float8E5M2>(double x) {
  return {core::float_to_float8<core::E5M2Format>(static_cast<float>(x))};
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
    case DType::kFloat8E4M3:  // FP8 inputs: dispatch_element_types
    case DType::kFloat8E5M2:
      break;
  }
  throw Error(ErrorCode::kInternal, "dispatch_dtype: not a value dtype");
}

// The storage types of one forward call's q, k / v and out: one type for all but FP8 inputs.
template <typename Q, typename KV, typename Out>
struct ElementTypes {
  using q = Q;
  using kv = KV;
  using out = Out;
};

// Calls f(ElementTypes<...>{}) for the types a validated forward problem holds: q, k, v and out
// of dtype; FP8 q, k and v with a 16-bit out; or 16-bit q and out over an FP8 cache.
template <typename F>
void dispatch_element_types(const detail::Problem& p, F&& f) {
  if (!detail::is_float8_dtype(p.kv_dtype)) {
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      f(ElementTypes<T, T, T>{});
    });
    return;
  }
  auto with_fp8 = [&](auto out_tag) {
    using Out = decltype(out_tag);
    auto with_kv = [&](auto kv_tag) {
      using KV = decltype(kv_tag);
      if (detail::is_float8_dtype(p.q_dtype)) {
        f(ElementTypes<KV, KV, Out>{});
      } else {
        f(ElementTypes<Out, KV, Out>{});
      }
    };
    if (p.kv_dtype == DType::kFloat8E4M3) {
      with_kv(Float8E4M3{});
    } else {
      with_kv(Float8E5M2{});
    }
  };
  if (p.dtype == DType::kBFloat16) {
    with_fp8(BFloat16{});
  } else if (p.dtype == DType::kFloat16) {
    with_fp8(Half{});
  } else {
    throw Error(ErrorCode::kInternal, "dispatch_element_types: FP8 inputs with a dtype other than 16-bit");
  }
}

// The one dequantisation step of FP8 inputs, for the flash path, the reference and the KV-cache
// decode alike: element x of row (b, h) of `op` stands for to_float(x) * dequantise_factor(op, b,
// h), the operand's descale factor of (b, h's KV head); 1 for other operands. The loads multiply
// it in with their own scale.
inline double dequantise_factor(const detail::Operand& op, int64_t b, int64_t h) { return op.descale.at(b, h); }

// Typed pointer to row `row` (within batch entry b, head h) of an operand.
template <typename T>
inline T* row_ptr(const detail::Operand& op, int64_t b, int64_t row, int64_t h) {
  return static_cast<T*>(op.data) + op.offset(b, row, h);
}

}  // namespace flashattn::cpu

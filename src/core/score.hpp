// Score modifications shared by every backend, applied to s = scale * q.k in this order:
// softcap (s = c * tanh(s / c)), then the ALiBi bias -slope * |i + sk - sq - j|.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.hpp"

namespace flashattn::core {

inline constexpr double kLog2e = 1.4426950408889634;
inline constexpr double kLn2 = 0.6931471805599453;  // 1 / kLog2e

template <typename T>
FA_HOST_DEVICE T softcap_apply(T s, T softcap) {
  return softcap * std::tanh(s / softcap);
}

// d(softcap(s))/ds expressed through the capped value: 1 - tanh^2.
template <typename T>
FA_HOST_DEVICE T softcap_grad(T capped, T softcap) {
  const T t = capped / softcap;
  return T(1) - t * t;
}

template <typename T>
FA_HOST_DEVICE T alibi_bias(T slope, int64_t i, int64_t j, int64_t seqlen_q, int64_t seqlen_k) {
  const int64_t dist = i + seqlen_k - seqlen_q - j;
  return -slope * static_cast<T>(dist < 0 ? -dist : dist);
}

}  // namespace flashattn::core

// The attention variant: one definition of each score modifier, its gradient and its runtime
// parameters, shared by every backend (the fp64 reference, the CPU flash path and the CUDA
// kernels, which call these functions in the exp2 domain). With raw = q.k, in this order:
//   scale:    s = softmax_scale * raw
//   softcap:  s = softcap * tanh(s / softcap)
//   ALiBi:    s += -slope[b, h] * |i + sk - sq - j|
//   mask:     s = -inf where core::Mask says key j is not visible to row i
//   sink:     every row's softmax gains the term exp(sink[h]): a logit with no value vector,
//             so LSE_i = log(exp(sink[h]) + sum_j exp(s_ij)) and the row's outputs sum P_ij < 1.
// docs/EXTENDING.md shows how a modifier is added.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

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

// The sink's share of a row: its (max, sum) before any key, in the domain of `sink` (exp2 for
// the flash paths' log2-scaled logits, natural for the reference). A sink of -inf is no sink:
// (-inf, 0), the state of a row that has seen nothing, so it changes no bit of any result.
template <typename T>
struct SinkStart {
  T max, sum;
};
template <typename T>
FA_HOST_DEVICE SinkStart<T> sink_start(T sink) {
  return sink == -std::numeric_limits<T>::infinity() ? SinkStart<T>{sink, T(0)} : SinkStart<T>{sink, T(1)};
}

// P_sink = exp(sink - lse): the probability row i gave to the sink (natural logs). The sink's
// gradient is d sink[h] = -sum over the rows i of head h of P_sink,i * D_i, D_i = dO_i . O_i
// (dO_i / d sink = -P_sink,i O_i); a sink of -inf has P_sink 0 and gradient 0 on every row.
template <typename T>
FA_HOST_DEVICE T sink_probability(T sink, T lse) {
  return sink == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(sink - lse);
}

// The runtime values of a call's variant, natural-log units, as validation builds them from
// the public options (the CUDA kernels take an exp2-domain copy, cuda/problem_params.cpp).
struct VariantParams {
  double scale = 1.0;    // softmax scale
  double softcap = 0.0;  // 0: off
  const float* alibi = nullptr;
  int64_t alibi_batch_stride = 0;  // 0 when slopes are [heads]
  int64_t alibi_head_stride = 1;
  const float* sink = nullptr;  // learnable sink logits [heads_q]; null: none
  int64_t sink_stride = 1;

  double alibi_slope(int64_t b, int64_t h) const {
    return alibi ? alibi[b * alibi_batch_stride + h * alibi_head_stride] : 0.0;
  }
  double sink_logit(int64_t h) const { return sink ? sink[h * sink_stride] : -std::numeric_limits<double>::infinity(); }
};

}  // namespace flashattn::core

// Online softmax in the exp2 domain (scores arrive multiplied by log2 e), shared by every
// backend: the rescale factor when a row's running max grows, the max to subtract, the final
// LSE, and the merge of two partial (max, sum) states (split-KV combines). A row that has seen
// no key has max = -inf and sum = 0; every function keeps that state NaN-free.
#pragma once

#include <cmath>
#include <limits>

#include "host_device.hpp"

namespace flashattn::core {

// The max to subtract before exp2: 0 while the row is still empty, so -inf - -inf never happens.
template <typename T>
FA_HOST_DEVICE T safe_max(T m) {
  return m == -std::numeric_limits<T>::infinity() ? T(0) : m;
}

// Factor for the accumulators when the running max moves from m_old to m_new >= m_old.
// An empty row's accumulators are zero: factor 0, never exp2(0 - m_new), which overflows to
// inf for very negative first scores (ALiBi far from the diagonal) and turns 0 * inf into NaN.
template <typename T>
FA_HOST_DEVICE T rescale_factor(T m_old, T m_new) {
  return m_old == -std::numeric_limits<T>::infinity() ? T(0) : std::exp2(m_old - m_new);
}

// Natural-log LSE from the running (max, sum) in the exp2 domain; -inf for an empty row, NaN
// for a row that met a NaN score (not -inf: that would mark it empty, and its gradients 0).
template <typename T>
FA_HOST_DEVICE T lse_natural(T max, T sum) {
  if (sum == T(0)) return -std::numeric_limits<T>::infinity();
  return (max + std::log2(sum)) / T(1.4426950408889634);
}

template <typename T>
struct SoftmaxState {
  T max = -std::numeric_limits<T>::infinity();  // running row max (log2 domain)
  T sum = 0;                                    // sum of exp2(s - max)

  // Moves to a new running max (>= max); returns the factor for the old accumulators.
  FA_HOST_DEVICE T rescale_to(T new_max) {
    const T factor = rescale_factor(max, new_max);
    sum *= factor;
    max = new_max;
    return factor;
  }

  FA_HOST_DEVICE T lse() const { return lse_natural(max, sum); }
};

// Merge of partial (max, sum) pairs: factors to apply to each partial's accumulator.
template <typename T>
FA_HOST_DEVICE SoftmaxState<T> merge(const SoftmaxState<T>& a, const SoftmaxState<T>& b, T* factor_a, T* factor_b) {
  SoftmaxState<T> m;
  m.max = a.max > b.max ? a.max : b.max;
  const T base = safe_max(m.max);
  *factor_a = a.sum == T(0) ? T(0) : std::exp2(a.max - base);
  *factor_b = b.sum == T(0) ? T(0) : std::exp2(b.max - base);
  m.sum = a.sum * *factor_a + b.sum * *factor_b;
  return m;
}

}  // namespace flashattn::core

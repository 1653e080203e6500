// Online-softmax state of one query row and the merge of two partial states (used by tiles
// within a pass and by split-KV combines). Works in the exp2 domain: scores arrive already
// multiplied by log2(e). A row that has seen no key has max = -inf and sum = 0; every
// operation keeps that state NaN-free.
#pragma once

#include <cmath>
#include <limits>

#include "host_device.hpp"

namespace flashattn::core {

template <typename T>
struct SoftmaxState {
  T max = -std::numeric_limits<T>::infinity();  // running row max (log2 domain)
  T sum = 0;                                    // sum of exp2(s - max)

  // The max to subtract: a finite stand-in while the row is still empty, so -inf - -inf
  // never happens.
  FA_HOST_DEVICE static T safe(T m) { return m == -std::numeric_limits<T>::infinity() ? T(0) : m; }

  // Moves to a new running max (>= max); returns the factor by which old accumulators must be
  // scaled. An empty row's accumulators are zero: factor 0, never exp2(0 - new_max), which
  // overflows to inf for very negative first scores (ALiBi far from the diagonal) and
  // turns 0 * inf into NaN.
  FA_HOST_DEVICE T rescale_to(T new_max) {
    const T factor = max == -std::numeric_limits<T>::infinity() ? T(0) : std::exp2(max - safe(new_max));
    sum *= factor;
    max = new_max;
    return factor;
  }

  // Natural-log LSE of the row; -inf for a row that saw no key.
  FA_HOST_DEVICE T lse_natural() const {
    if (sum == T(0)) return -std::numeric_limits<T>::infinity();
    return (max + std::log2(sum)) / T(1.4426950408889634);
  }
};

// Merge of partial (max, sum) pairs: factors to apply to each partial's accumulator.
template <typename T>
FA_HOST_DEVICE SoftmaxState<T> merge(const SoftmaxState<T>& a, const SoftmaxState<T>& b,
                                     T* factor_a, T* factor_b) {
  SoftmaxState<T> m;
  m.max = a.max > b.max ? a.max : b.max;
  const T base = SoftmaxState<T>::safe(m.max);
  *factor_a = a.sum == T(0) ? T(0) : std::exp2(a.max - base);
  *factor_b = b.sum == T(0) ? T(0) : std::exp2(b.max - base);
  m.sum = a.sum * *factor_a + b.sum * *factor_b;
  return m;
}

}  // namespace flashattn::core

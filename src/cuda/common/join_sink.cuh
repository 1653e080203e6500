// The learnable sink's join to a row's softmax state (core/variant.hpp's sink), for every CUDA
// kernel: the forwards' epilogues, the decode kernels' split 0 and the careful rows' recompute.
#pragma once

#include <cmath>

#include "fast_math.cuh"

namespace flashattn::cuda {

// A learnable sink joined to a row's final online-softmax state (max, sum over its keys; exp2
// domain, max possibly -inf for a row that saw no key): the sink is one more term of the sum,
// 2^(sink - max), with no value row. Returns the factor the row's O (accumulated against the old
// max) takes; max and sum become the row's with the sink. Joined once, after the key loop, so the
// loop's code is the same with or without a sink. A sink of -inf is no sink (core::sink_start):
// the row is left exactly as it is, factor 1.
__device__ __forceinline__ float join_sink(float& max, float& sum, float sink_log2) {
  if (sink_log2 == -INFINITY) return 1.0f;
  const float joined = fmaxf(max, sink_log2);
  const float factor = max == -INFINITY ? 0.0f : fast_exp2(max - joined);  // core::rescale_factor
  sum = sum * factor + fast_exp2(sink_log2 - joined);
  max = joined;
  return factor;
}

}  // namespace flashattn::cuda

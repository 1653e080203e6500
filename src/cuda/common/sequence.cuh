// Where a batch entry's rows and keys lie (dense, or a varlen sequence at its cu_seqlens offsets),
// read from the kernel parameters' cu_seqlens / seqused_k arrays one way for the sm80 forward and
// backward, the backward's row kernels and the sm90 forward.
#pragma once

#include <cstdint>

namespace flashattn::cuda {

// The rows and keys of one batch entry: dense entries share the lengths; a varlen sequence
// starts at its cu_seqlens offsets (rows of tensors whose batch stride is 0).
struct Sequence {
  int64_t q_start = 0, k_start = 0, seqlen_q = 0, seqlen_k = 0;
};
// `load` reads one int32 of the arrays (the sm90 kernel passes a volatile one).
struct PlainLoad {
  __device__ __forceinline__ int32_t operator()(const int32_t* x) const { return *x; }
};
template <class Params, class Load = PlainLoad>
__device__ __forceinline__ Sequence sequence(const Params& p, int b, Load load = {}) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, p.shape.seqlen_q, p.shape.seqlen_k};
  Sequence s;
  s.q_start = load(p.cu_seqlens_q + b);
  s.seqlen_q = load(p.cu_seqlens_q + b + 1) - s.q_start;
  s.k_start = load(p.cu_seqlens_k + b);
  s.seqlen_k = p.seqused_k != nullptr ? load(p.seqused_k + b) : load(p.cu_seqlens_k + b + 1) - s.k_start;
  return s;
}

}  // namespace flashattn::cuda

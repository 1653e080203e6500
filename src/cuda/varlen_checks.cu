#include "varlen_checks.cuh"

namespace flashattn::cuda::varlen {

cudaError_t launch_check(const VarlenCheckParams& p, cudaStream_t stream) {
  check_varlen_kernel<<<1, kCheckThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_fill(const FillParams& p, cudaStream_t stream) {
  // Enough CTAs for a large fill to stream at full bandwidth; when there is nothing to fill
  // (the usual case) they exit at once.
  constexpr int64_t kMaxBlocks = 512;
  int64_t elements = 0;
  for (int i = 0; i < p.count; ++i) {
    const int64_t e = p.targets[i].total * p.targets[i].heads * p.head_dim;
    elements = e > elements ? e : elements;
  }
  const int64_t blocks = (elements + kFillThreads - 1) / kFillThreads;
  fill_outside_sequences_kernel<<<static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks),
                                  kFillThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::varlen

// Host-side launch of the sm80 backward kernel for one (dtype, head-dim bucket, mask kind): grid
// (key tiles, heads_kv, batch), opt-in shared memory, the caller's stream. Included only by the
// generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "backward_kernel.cuh"
#include "backward_launch.hpp"

namespace flashattn::cuda::sm80 {

template <ElemType kElem, int kHeadDim, MaskKind kMask>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  using Traits = BackwardTraits<kElem, kHeadDim, kMask>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  auto* kernel = &backward_kernel<Traits, kMask>;
  if constexpr (kSmemBytes > Traits::kSmemDefaultLimit) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  // supports_backward() checked that these fit the grid limits.
  const dim3 grid(static_cast<unsigned>((params.fwd.shape.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN),
                  static_cast<unsigned>(params.fwd.shape.heads_kv), static_cast<unsigned>(params.fwd.shape.batch));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <ElemType kElem, int kHeadDim, MaskKind kMask>
int backward_smem_bytes() {
  return BackwardTraits<kElem, kHeadDim, kMask>::kSmemBytes;
}

}  // namespace flashattn::cuda::sm80

#define FLASHATTN_SM80_BACKWARD_INSTANCE(ELEM, HEAD_DIM, MASK)                                              \
  template cudaError_t flashattn::cuda::sm80::run_backward<flashattn::cuda::ElemType::ELEM, HEAD_DIM,      \
                                                           flashattn::cuda::MaskKind::MASK>(               \
      const flashattn::cuda::BackwardParams&, cudaStream_t);                                                \
  template int flashattn::cuda::sm80::backward_smem_bytes<flashattn::cuda::ElemType::ELEM, HEAD_DIM,       \
                                                          flashattn::cuda::MaskKind::MASK>();

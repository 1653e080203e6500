// Host-side launch of the FA1-order teaching kernel for one (dtype, head_dim): grid (query
// groups, heads, batch), opt-in shared memory above 48 KB, the caller's stream. Included only by
// the generated instantiation files (fa1_order.cmake).
#pragma once

#include <cuda_runtime.h>

#include "fa1_order_kernel.cuh"
#include "fa1_order_launch.hpp"

namespace flashattn::cuda::teaching {

template <ElemType kElem, int kHeadDim>
cudaError_t run_fa1_order(const Fa1Params& params, int batch, int q_groups, cudaStream_t stream) {
  using Traits = Fa1Traits<kElem, kHeadDim>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  auto* kernel = &fa1_order_kernel<Traits>;
  if constexpr (kSmemBytes > Traits::kSmemDefaultLimit) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(q_groups), static_cast<unsigned>(params.heads), static_cast<unsigned>(batch));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::teaching

#define FLASHATTN_FA1_ORDER_INSTANCE(ELEM, HEAD_DIM)                                                        \
  template cudaError_t flashattn::cuda::teaching::run_fa1_order<flashattn::cuda::ElemType::ELEM, HEAD_DIM>( \
      const flashattn::cuda::teaching::Fa1Params&, int, int, cudaStream_t);

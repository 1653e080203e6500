// Host-side launch of the sm90a forward kernel for one (dtype, head dim, mask kind): checks,
// TMA descriptors from the params' pointers and strides (CuTe's make_tma_copy, which encodes
// them through the driver entry point), grid (query tiles, heads_q, batch), opt-in shared
// memory. Included only by the instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "forward_kernel.cuh"
#include "forward_launch.hpp"

namespace flashattn::cuda::sm90 {

template <ElemType kElem, int kHeadDim, MaskKind kMask>
cudaError_t run_sm90_forward(const ForwardParams& params, cudaStream_t stream) {
  using namespace cute;
  using Traits = ForwardTraits<kElem, kHeadDim>;
  using Element = typename Traits::Element;
  static_assert(kMask != MaskKind::kMaskedDropout, "dropout is not in this draft");
  if (forward_unsupported_reason(params, static_cast<int>(sizeof(Element)), kHeadDim) != nullptr) {
    return cudaErrorNotSupported;
  }
  if (kMask == MaskKind::kNone && (params.window.left >= 0 || params.window.right >= 0)) {
    return cudaErrorInvalidValue;  // the caller picked the wrong kernel
  }
  const ShapeParams& s = params.shape;
  if (s.batch == 0 || s.seqlen_q == 0) return cudaSuccess;  // nothing to write

  KernelParams<Traits> kp{};
  kp.params = params;
  // A tensor map's extents must be >= 1: with seqlen_k = 0 no key tile is ever loaded, but the
  // K / V maps still need a valid shape.
  kp.shape_q = make_shape(static_cast<int32_t>(s.seqlen_q), Int<kHeadDim>{}, static_cast<int32_t>(s.heads_q),
                          static_cast<int32_t>(s.batch));
  kp.shape_kv = make_shape(static_cast<int32_t>(s.seqlen_k > 0 ? s.seqlen_k : 1), Int<kHeadDim>{},
                           static_cast<int32_t>(s.heads_kv), static_cast<int32_t>(s.batch));
  auto gmem_in = [&](const RowsIn& x, const typename Traits::ShapeRows& shape) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(x.data)), shape,
                       make_stride(x.row_stride, _1{}, x.head_stride, x.batch_stride));
  };
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.q, kp.shape_q), typename Traits::SmemLayoutQ{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.k, kp.shape_kv), take<0, 2>(typename Traits::SmemLayoutKV{}));
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.v, kp.shape_kv), take<0, 2>(typename Traits::SmemLayoutKV{}));
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(params.out.data)), kp.shape_q,
                          make_stride(params.out.row_stride, _1{}, params.out.head_stride, params.out.batch_stride));
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutO{});

  auto* kernel = &forward_kernel<Traits, kMask>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((s.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM),
                  static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::sm90

// The explicit instantiation of run_sm90_forward for one (dtype, head dim, mask kind).
#define FLASHATTN_SM90_FORWARD_INSTANCE(ELEM, HEAD_DIM, MASK)                                                   \
  template cudaError_t flashattn::cuda::sm90::run_sm90_forward<flashattn::cuda::ElemType::ELEM, HEAD_DIM,     \
                                                               flashattn::cuda::MaskKind::MASK>(              \
      const flashattn::cuda::ForwardParams&, cudaStream_t);

// Host-side launch of the sm90a forward kernel for one (dtype, head dim, mask kind): checks,
// TMA descriptors from the params' pointers and strides (CuTe's make_tma_copy, which encodes
// them through the driver entry point), the persistent grid, opt-in shared memory. Included
// only by the instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "forward_kernel.cuh"
#include "forward_launch.hpp"

namespace flashattn::cuda::sm90 {

// The CTAs of a launch over `tiles` work tiles. Without a mask every tile is the same work, and
// one CTA per SM walks them (persistent: no CTA launch or prologue per tile, and the next tile's
// K / V loads overlap this one's epilogue; against one CTA per tile on an H100, bf16: 1.02-1.04x
// at seqlen 1k, 0.99-1.02x from 2k). With a mask, tiles differ in work and one CTA per tile lets
// the hardware hand the next tile to whichever SM frees first: the static walk of a persistent
// grid left CTAs with unequal work and far apart in the tile order (L2), 0.67-0.99x of one CTA
// per tile for causal at 1k-16k (bench/results/gpu/forward-h100-grids-*).
// FLASHATTN_SM90_PERSISTENT (read on every call, for A/B runs): "0" one CTA per tile always,
// "1" the persistent grid always.
template <MaskKind kMask>
cudaError_t forward_grid(int64_t tiles, unsigned& ctas) {
  const char* v = std::getenv("FLASHATTN_SM90_PERSISTENT");
  const bool persistent = v != nullptr && (std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0)
                              ? v[0] == '1'
                              : kMask == MaskKind::kNone;
  if (!persistent) {
    ctas = static_cast<unsigned>(tiles);
    return cudaSuccess;
  }
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  ctas = static_cast<unsigned>(std::min<int64_t>(tiles, std::max(sms, 1)));
  return err;
}

template <ElemType kElem, int kHeadDim, MaskKind kMask>
cudaError_t run_sm90_forward(const ForwardParams& params, cudaStream_t stream) {
  using namespace cute;
  using Traits = ForwardTraits<kElem, kHeadDim>;
  using Element = typename Traits::Element;
  static_assert(Traits::kBlockM == kBlockRows, "forward_unsupported_reason counts tiles of kBlockRows");
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
  unsigned ctas = 0;
  err = forward_grid<kMask>((s.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM * s.heads_q * s.batch, ctas);
  if (err != cudaSuccess) return err;
  kernel<<<ctas, Traits::kNThreads, kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::sm90

// The explicit instantiation of run_sm90_forward for one (dtype, head dim, mask kind).
#define FLASHATTN_SM90_FORWARD_INSTANCE(ELEM, HEAD_DIM, MASK)                                                   \
  template cudaError_t flashattn::cuda::sm90::run_sm90_forward<flashattn::cuda::ElemType::ELEM, HEAD_DIM,     \
                                                               flashattn::cuda::MaskKind::MASK>(              \
      const flashattn::cuda::ForwardParams&, cudaStream_t);

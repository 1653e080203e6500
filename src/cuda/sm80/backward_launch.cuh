// Host-side launch of the sm80 backward kernel for one (dtype, head-dim bucket, mask kind, tuning
// target): grid (key tiles, heads_kv, batch), opt-in shared memory, the caller's stream. Included
// only by the generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "backward_kernel.cuh"
#include "backward_launch.hpp"

namespace flashattn::cuda::sm80 {

template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget, bool kSparse>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  if constexpr ((kTarget == TileTarget::kSm90 && (kSparse || !has_sm90_backward_tiles(kHeadDim, kMask))) ||
                (kSparse && kMask != MaskKind::kMasked)) {
    return cudaErrorInvalidDeviceFunction;  // no such kernel (and none in the registry)
  } else {
    using Traits = BackwardTraits<kElem, kHeadDim, kMask, kTarget>;
    constexpr int kSmemBytes = Traits::kSmemBytes;
    auto* kernel = &backward_kernel<Traits, kMask, kSparse>;
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
}

template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget, bool kSparse>
int backward_smem_bytes() {
  if constexpr ((kTarget == TileTarget::kSm90 && (kSparse || !has_sm90_backward_tiles(kHeadDim, kMask))) ||
                (kSparse && kMask != MaskKind::kMasked)) {
    return 0;  // no such kernel
  } else {
    return BackwardTraits<kElem, kHeadDim, kMask, kTarget>::kSmemBytes;
  }
}

}  // namespace flashattn::cuda::sm80

// The explicit instantiations for one (dtype, bucket, mask kind), used by the generated files:
// both tuning targets (the kSm90 one is empty unless tile_shapes.hpp gives it stages of its own)
// and the block-sparse kernel (empty but for the masked kind).
#define FLASHATTN_SM80_BACKWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, TARGET)                                        \
  template cudaError_t                                                                                            \
  flashattn::cuda::sm80::run_backward<flashattn::cuda::ElemType::ELEM, HEAD_DIM, flashattn::cuda::MaskKind::MASK, \
                                      flashattn::cuda::sm80::TileTarget::TARGET>(                                 \
      const flashattn::cuda::BackwardParams&, cudaStream_t);                                                      \
  template int flashattn::cuda::sm80::backward_smem_bytes<flashattn::cuda::ElemType::ELEM, HEAD_DIM,              \
                                                          flashattn::cuda::MaskKind::MASK,                        \
                                                          flashattn::cuda::sm80::TileTarget::TARGET, false>();
#define FLASHATTN_SM80_BACKWARD_INSTANCE(ELEM, HEAD_DIM, MASK)                                                    \
  FLASHATTN_SM80_BACKWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, kSm80)                                               \
  FLASHATTN_SM80_BACKWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, kSm90)                                               \
  template cudaError_t                                                                                            \
  flashattn::cuda::sm80::run_backward<flashattn::cuda::ElemType::ELEM, HEAD_DIM, flashattn::cuda::MaskKind::MASK, \
                                      flashattn::cuda::sm80::TileTarget::kSm80, true>(                            \
      const flashattn::cuda::BackwardParams&, cudaStream_t);                                                      \
  template int flashattn::cuda::sm80::backward_smem_bytes<flashattn::cuda::ElemType::ELEM, HEAD_DIM,              \
                                                          flashattn::cuda::MaskKind::MASK,                        \
                                                          flashattn::cuda::sm80::TileTarget::kSm80, true>();

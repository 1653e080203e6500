// Host-side launch of the sm80 forward kernel for one (dtype, head-dim bucket, mask kind, tuning
// target): grid (query tiles, heads_q, batch), opt-in shared memory above 48 KB, the caller's
// stream. Included only by the generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "forward_kernel.cuh"
#include "forward_launch.hpp"

namespace flashattn::cuda::sm80 {

template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget, bool kPaged, bool kSparse>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream) {
  if constexpr ((kTarget == TileTarget::kSm90 && (kPaged || kSparse || !has_sm90_tiles(kHeadDim, kMask))) ||
                (kPaged && kMask == MaskKind::kMaskedDropout) || (kSparse && (kPaged || kMask != MaskKind::kMasked))) {
    return cudaErrorInvalidDeviceFunction;  // no such kernel (and none in the registry)
  } else {
    using Traits = ForwardTraits<kElem, kHeadDim, kMask, kTarget, kSparse>;
    static_assert(Traits::kBlockM >= kMinBlockM, "the dispatcher's grid check assumes kMinBlockM");
    constexpr int kSmemBytes = Traits::kSmemBytes + (kPaged ? int(sizeof(PageSlots<Traits::kBlockN>)) : 0) +
                               (kSparse ? int(sizeof(SparseSlots)) : 0);
    auto* kernel = &forward_kernel<Traits, kMask, kPaged, kSparse>;
    if constexpr (kSmemBytes > Traits::kSmemDefaultLimit) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      if (err != cudaSuccess) return err;
    }
    // supports_forward() checked that these fit the grid limits.
    const dim3 grid(static_cast<unsigned>((params.shape.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM),
                    static_cast<unsigned>(params.shape.heads_q), static_cast<unsigned>(params.shape.batch));
    if constexpr (kMask != MaskKind::kMasked) {  // forward_cta: the launch order
      kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(params);
    } else {
      // The masked tile order's last group spans waves of the CTAs that run at once: the SMs x the
      // CTAs one holds (the kernel's occupancy, the same on every device of one architecture:
      // asked once).
      static const int per_sm = [&] {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Traits::kNThreads, kSmemBytes) != cudaSuccess) {
          cudaGetLastError();
        }
        return std::max(n, 1);
      }();
      int device = 0, sms = 0;
      cudaError_t err = cudaGetDevice(&device);
      if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      if (err != cudaSuccess) return err;
      ForwardParams p = params;
      const int64_t pairs = int64_t{grid.y} * grid.z;
      if (pairs * grid.x > INT32_MAX) {
        p.tile_group = 0;  // forward_cta's 32-bit order cannot index the grid: each pair's tiles in turn
      } else {
        p.tile_last_first = last_group_first(pairs, grid.x, params.tile_group, params.tile_tail_waves,
                                             int64_t{std::max(sms, 1)} * per_sm);
      }
      kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(p);
    }
    return cudaGetLastError();
  }
}

}  // namespace flashattn::cuda::sm80

// The explicit instantiations of run_forward for one (dtype, bucket, mask kind), used by the
// generated files: both tuning targets (the kSm90 one is empty unless tile_shapes.hpp gives it a
// shape of its own), the paged kernel (sm80-tuned; empty for dropout)
#define FLASHATTN_SM80_FORWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, TARGET, PAGED, SPARSE)                         \
  template cudaError_t                                                                                           \
  flashattn::cuda::sm80::run_forward<flashattn::cuda::ElemType::ELEM, HEAD_DIM, flashattn::cuda::MaskKind::MASK, \
                                     flashattn::cuda::sm80::TileTarget::TARGET, PAGED, SPARSE>(                  \
      const flashattn::cuda::ForwardParams&, cudaStream_t);
// ... and the block-sparse kernel (masked only; empty for the other kinds).
#define FLASHATTN_SM80_FORWARD_INSTANCE(ELEM, HEAD_DIM, MASK)                    \
  FLASHATTN_SM80_FORWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, kSm80, false, false) \
  FLASHATTN_SM80_FORWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, kSm90, false, false) \
  FLASHATTN_SM80_FORWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, kSm80, true, false)  \
  FLASHATTN_SM80_FORWARD_INSTANCE_FOR(ELEM, HEAD_DIM, MASK, kSm80, false, true)

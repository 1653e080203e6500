// Declaration of the sm80 forward launchers. Their definitions are explicit instantiations in
// the .cu files CMake generates from instantiate.cu.in (one per dtype x head-dim bucket), so the
// dispatcher compiles as plain C++ without CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.hpp"
#include "tile_shapes.hpp"

namespace flashattn::cuda::sm80 {

// Head-dim buckets of this kernel family (ascending); a head_dim is padded up to the next one.
// CMake's FLASHATTN_CUDA_HEAD_DIMS picks the subset a build compiles.
inline constexpr int kHeadDimBuckets[] = {32, 64, 96, 128, 160, 192, 224, 256};

// kPaged: K / V in pages of any size (ForwardParams::block_table), no dropout. kSparse: the key
// tiles of a block-sparse mask (ForwardParams::block_mask), the masked kernel, sm80 tiles.
template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget, bool kPaged = false, bool kSparse = false>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream);

}  // namespace flashattn::cuda::sm80

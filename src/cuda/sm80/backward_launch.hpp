// Declarations of the sm80 backward launchers: the main kernel per (dtype, head-dim bucket, mask
// kind, tuning target), explicit instantiations in the .cu files CMake generates from
// instantiate.cu.in, and the row kernels around it (backward_rows.cu). The dispatcher compiles as
// plain C++ without CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.hpp"
#include "tile_shapes.hpp"

namespace flashattn::cuda::sm80 {

// Grid (key tiles, heads_kv, batch). The scratch must hold prepared rows and zeroed dQ sums (and
// zeroed turn counters in deterministic mode). kSparse: the block-sparse kernel (kMasked, the
// kSm80 target), which reads params.block_cells (run_block_cells).
template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget, bool kSparse = false>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream);

// Shared memory of the main kernel, which the device must offer per block (opt-in).
template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget, bool kSparse = false>
int backward_smem_bytes();

// Before the main kernel: D and LSE2 into the scratch. After it: dQ from the scratch's sums.
cudaError_t run_backward_prepare(const BackwardParams& params, ElemType elem, cudaStream_t stream);
cudaError_t run_backward_convert_dq(const BackwardParams& params, ElemType elem, cudaStream_t stream);
// Between them, with a learnable sink's gradient wanted: d sink from the scratch's rows.
cudaError_t run_backward_sink_grad(const BackwardParams& params, cudaStream_t stream);
// Before the block-sparse kernel: params.block_cells (zeroed, then marked from fwd.block_mask's
// lists; core::fill_block_cells).
cudaError_t run_block_cells(const BackwardParams& params, cudaStream_t stream);

}  // namespace flashattn::cuda::sm80

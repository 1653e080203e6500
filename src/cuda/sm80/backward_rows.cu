// Launchers of the backward pass's row kernels (backward_rows.cuh) for both 16-bit dtypes.
#include <cuda_runtime.h>

#include "backward_launch.hpp"
#include "backward_rows.cuh"

namespace flashattn::cuda::sm80 {
namespace {

dim3 row_grid(const BackwardParams& p) {
  return dim3(static_cast<unsigned>((p.fwd.shape.seqlen_q + kBackwardRowPad - 1) / kBackwardRowPad),
              static_cast<unsigned>(p.fwd.shape.heads_q), static_cast<unsigned>(p.fwd.shape.batch));
}

}  // namespace

cudaError_t run_backward_prepare(const BackwardParams& params, ElemType elem, cudaStream_t stream) {
  if (elem == ElemType::kFloat16) {
    backward_prepare_kernel<cutlass::half_t><<<row_grid(params), kRowThreads, 0, stream>>>(params);
  } else {
    backward_prepare_kernel<cutlass::bfloat16_t><<<row_grid(params), kRowThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

cudaError_t run_backward_sink_grad(const BackwardParams& params, cudaStream_t stream) {
  backward_sink_grad_kernel<<<static_cast<unsigned>(params.fwd.shape.heads_q), kRowThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t run_block_cells(const BackwardParams& params, cudaStream_t stream) {
  const core::BlockCells& cells = params.block_cells;
  const cudaError_t err =
      cudaMemsetAsync(cells.data, 0, static_cast<size_t>(cells.size(params.fwd.shape.batch)) * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(cells.query_blocks), static_cast<unsigned>(cells.heads),
                  static_cast<unsigned>(params.fwd.shape.batch));
  block_cells_kernel<<<grid, kRowThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t run_backward_convert_dq(const BackwardParams& params, ElemType elem, cudaStream_t stream) {
  if (elem == ElemType::kFloat16) {
    backward_convert_dq_kernel<cutlass::half_t><<<row_grid(params), kRowThreads, 0, stream>>>(params);
  } else {
    backward_convert_dq_kernel<cutlass::bfloat16_t><<<row_grid(params), kRowThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::sm80

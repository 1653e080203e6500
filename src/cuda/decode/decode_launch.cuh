// The launch sequence shared by decode_fp16.cu and decode_bf16.cu.
#pragma once

#include <cuda_runtime.h>

#include "decode_kernel.cuh"
#include "decode_launch.hpp"
#include "decode_mma_kernel.cuh"
#include "decode_sink_tokens.cuh"

namespace flashattn::cuda::decode {

// Sink tokens: the rows' sink keys left of their window, after the decode and combine kernels.
template <class Element, int kMaxCols, bool kPaged>
__global__ void __launch_bounds__(kSinkTokenThreads, 1)
    decode_sink_tokens_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ float q_rows[kSinkTokenThreads / 32][kMaxCols * 32];
  decode_sink_tokens_block<Element, kMaxCols, kPaged>(p, q_rows);
}

template <class Element, int kMaxCols>
void launch_sink_tokens(const DecodeParams& p, dim3 grid, cudaStream_t s) {
  if (p.cache.paged()) {
    decode_sink_tokens_kernel<Element, kMaxCols, true><<<grid, kSinkTokenThreads, 0, s>>>(p);
  } else {
    decode_sink_tokens_kernel<Element, kMaxCols, false><<<grid, kSinkTokenThreads, 0, s>>>(p);
  }
}

// `kernel` on `grid` (CTAs of kThreads) with `smem` bytes of dynamic shared memory and, where
// given, one launch attribute.
template <class Kernel>
cudaError_t launch_with(Kernel kernel, dim3 grid, size_t smem, const cudaLaunchAttribute* attribute,
                        const DecodeParams& p, cudaStream_t s) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = s;
  config.attrs = const_cast<cudaLaunchAttribute*>(attribute);
  config.numAttrs = attribute != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// A decode kernel with its shared memory (over the 48 KiB a launch gets without asking); with
// `cluster`, the grid's x (the splits) is one thread-block cluster (decode_merge.cuh's
// merge_cluster).
template <class Kernel>
cudaError_t launch_decode(Kernel kernel, int smem, const DecodeParams& p, dim3 grid, bool cluster, cudaStream_t s) {
  const cudaError_t set = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (set != cudaSuccess) return set;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = grid.x;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return launch_with(kernel, grid, static_cast<size_t>(smem), cluster ? &attribute : nullptr, p, s);
}

template <typename Element, int kHeadDim, bool kPaged>
cudaError_t launch_kernel(const DecodeParams& p, dim3 grid, bool cluster, cudaStream_t s) {
  return launch_decode(decode_kernel<Element, kHeadDim, kPaged>, static_cast<int>(decode_smem_bytes<kHeadDim>), p, grid,
                       cluster, s);
}

template <typename Element, int kHeadDim, bool kPaged>
cudaError_t launch_mma_kernel(const DecodeParams& p, dim3 grid, bool cluster, cudaStream_t s) {
  return launch_decode(decode_mma_kernel<Element, kHeadDim, kPaged>, static_cast<int>(sizeof(MmaShared<kHeadDim>)), p,
                       grid, cluster, s);
}

// One CTA per query row; its shared memory is under the 48 KiB a launch gets without asking.
// With `overlap` it is a programmatic dependent launch (decode_blocks.cuh's
// wait_for_prerequisite_grid).
template <typename Element, int kHeadDim>
cudaError_t launch_combine(const DecodeParams& p, int64_t rows, bool overlap, cudaStream_t s) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return launch_with(combine_kernel<Element, kHeadDim>, dim3(static_cast<unsigned>(rows)),
                     sizeof(CombineShared<kHeadDim>), overlap ? &attribute : nullptr, p, s);
}

template <typename Element, int kHeadDim>
cudaError_t launch_rows(const DecodeParams& p, const DecodeLayout& l, dim3 grid, cudaStream_t s) {
  const bool paged = p.cache.paged(), cluster = l.cluster_merge;
  if (l.rows_per_cta == 1) {
    return paged ? launch_kernel<Element, kHeadDim, true>(p, grid, cluster, s)
                 : launch_kernel<Element, kHeadDim, false>(p, grid, cluster, s);
  }
  return paged ? launch_mma_kernel<Element, kHeadDim, true>(p, grid, cluster, s)
               : launch_mma_kernel<Element, kHeadDim, false>(p, grid, cluster, s);
}

template <typename Element>
int launch(const DecodeParams& p, const DecodeLayout& l, bool append, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const auto batch = static_cast<unsigned>(p.shape.batch);
  if (append && p.cache.seqlen_new > 0) {
    append_kernel<Element>
        <<<dim3(static_cast<unsigned>(p.cache.seqlen_new), static_cast<unsigned>(p.shape.heads_kv), batch), 32, 0, s>>>(
            p);
  }
  const dim3 grid(static_cast<unsigned>(l.num_splits), static_cast<unsigned>(p.shape.heads_kv * l.row_blocks), batch);
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.seqlen_q;
  const bool combine = l.num_splits > 1 && !l.cluster_merge && rows > 0;
  cudaError_t decoded = cudaSuccess, combined = cudaSuccess;
  switch (head_dim_bucket(p.shape.head_dim)) {
    case 64:
      decoded = launch_rows<Element, 64>(p, l, grid, s);
      if (combine && decoded == cudaSuccess) combined = launch_combine<Element, 64>(p, rows, l.overlap_combine, s);
      break;
    case 128:
      decoded = launch_rows<Element, 128>(p, l, grid, s);
      if (combine && decoded == cudaSuccess) combined = launch_combine<Element, 128>(p, rows, l.overlap_combine, s);
      break;
    default:
      decoded = launch_rows<Element, 256>(p, l, grid, s);
      if (combine && decoded == cudaSuccess) combined = launch_combine<Element, 256>(p, rows, l.overlap_combine, s);
      break;
  }
  if (p.window.sink_tokens > 0 && p.window.left >= 0 && decoded == cudaSuccess && combined == cudaSuccess) {
    const dim3 rows_grid(static_cast<unsigned>((p.shape.seqlen_q + kSinkTokenRows - 1) / kSinkTokenRows),
                         static_cast<unsigned>(p.shape.heads_q), batch);
    switch (head_dim_bucket(p.shape.head_dim)) {
      case 64:
        launch_sink_tokens<Element, 2>(p, rows_grid, s);
        break;
      case 128:
        launch_sink_tokens<Element, 4>(p, rows_grid, s);
        break;
      default:
        launch_sink_tokens<Element, 8>(p, rows_grid, s);
        break;
    }
  }
  const cudaError_t last = cudaGetLastError();  // (and clears an error the launches left)
  return static_cast<int>(decoded != cudaSuccess ? decoded : combined != cudaSuccess ? combined : last);
}

}  // namespace flashattn::cuda::decode

// The launch sequence shared by decode_fp16.cu and decode_bf16.cu.
#pragma once

#include <cuda_runtime.h>

#include "decode_kernel.cuh"
#include "decode_mma_kernel.cuh"
#include "decode_launch.hpp"

namespace flashattn::cuda::decode {

// The kernel with its shared memory (over the 48 KiB a launch gets without asking).
template <typename Element, int kHeadDim, int kRows, bool kPaged>
void launch_kernel(const DecodeParams& p, dim3 grid, cudaStream_t s) {
  constexpr int smem = static_cast<int>(decode_smem_bytes<kHeadDim, kRows>);
  const auto kernel = decode_kernel<Element, kHeadDim, kRows, kPaged>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return;
  kernel<<<grid, kThreads, smem, s>>>(p);
}

template <typename Element, int kHeadDim, bool kPaged>
void launch_mma_kernel(const DecodeParams& p, dim3 grid, cudaStream_t s) {
  constexpr int smem = static_cast<int>(sizeof(MmaShared<kHeadDim>));
  const auto kernel = decode_mma_kernel<Element, kHeadDim, kPaged>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return;
  kernel<<<grid, kThreads, smem, s>>>(p);
}

// One CTA per query row; its shared memory is under the 48 KiB a launch gets without asking.
// With `overlap` it is a programmatic dependent launch (decode_kernel.cuh's
// wait_for_prerequisite_grid).
template <typename Element, int kHeadDim>
cudaError_t launch_combine(const DecodeParams& p, int64_t rows, bool overlap, cudaStream_t s) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(rows));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = sizeof(CombineShared<kHeadDim>);
  config.stream = s;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  return cudaLaunchKernelEx(&config, combine_kernel<Element, kHeadDim>, p);
}

template <typename Element, int kHeadDim>
void launch_rows(const DecodeParams& p, const DecodeLayout& l, dim3 grid, cudaStream_t s) {
  const bool paged = p.cache.paged();
  if (l.rows_per_cta == 1) {
    paged ? launch_kernel<Element, kHeadDim, 1, true>(p, grid, s) : launch_kernel<Element, kHeadDim, 1, false>(p, grid, s);
  } else {
    paged ? launch_mma_kernel<Element, kHeadDim, true>(p, grid, s)
          : launch_mma_kernel<Element, kHeadDim, false>(p, grid, s);
  }
}

template <typename Element>
int launch(const DecodeParams& p, const DecodeLayout& l, bool append, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const auto batch = static_cast<unsigned>(p.shape.batch);
  if (append && p.cache.seqlen_new > 0) {
    append_kernel<Element><<<dim3(static_cast<unsigned>(p.cache.seqlen_new), static_cast<unsigned>(p.shape.heads_kv),
                                  batch),
                             32, 0, s>>>(p);
  }
  const dim3 grid(static_cast<unsigned>(l.num_splits), static_cast<unsigned>(p.shape.heads_kv * l.row_blocks), batch);
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.seqlen_q;
  const bool combine = l.num_splits > 1 && rows > 0;
  cudaError_t combined = cudaSuccess;
  switch (head_dim_bucket(p.shape.head_dim)) {
    case 64:
      launch_rows<Element, 64>(p, l, grid, s);
      if (combine) combined = launch_combine<Element, 64>(p, rows, l.overlap_combine, s);
      break;
    case 128:
      launch_rows<Element, 128>(p, l, grid, s);
      if (combine) combined = launch_combine<Element, 128>(p, rows, l.overlap_combine, s);
      break;
    default:
      launch_rows<Element, 256>(p, l, grid, s);
      if (combine) combined = launch_combine<Element, 256>(p, rows, l.overlap_combine, s);
      break;
  }
  const cudaError_t last = cudaGetLastError();
  return static_cast<int>(last != cudaSuccess ? last : combined);
}

}  // namespace flashattn::cuda::decode

// The launch sequence shared by decode_fp16.cu and decode_bf16.cu.
#pragma once

#include <cuda_runtime.h>

#include "decode_kernel.cuh"
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

template <typename Element, int kHeadDim, int kRows>
void launch_paging(const DecodeParams& p, dim3 grid, cudaStream_t s) {
  if (p.cache.paged()) {
    launch_kernel<Element, kHeadDim, kRows, true>(p, grid, s);
  } else {
    launch_kernel<Element, kHeadDim, kRows, false>(p, grid, s);
  }
}

template <typename Element, int kHeadDim>
void launch_rows(const DecodeParams& p, const DecodeLayout& l, dim3 grid, cudaStream_t s) {
  static_assert(kMaxRowsPerCta == 4);
  switch (l.rows_per_cta) {
    case 1: launch_paging<Element, kHeadDim, 1>(p, grid, s); break;
    case 2: launch_paging<Element, kHeadDim, 2>(p, grid, s); break;
    default: launch_paging<Element, kHeadDim, 4>(p, grid, s); break;
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
  switch (head_dim_bucket(p.shape.head_dim)) {
    case 64: launch_rows<Element, 64>(p, l, grid, s); break;
    case 128: launch_rows<Element, 128>(p, l, grid, s); break;
    default: launch_rows<Element, 256>(p, l, grid, s); break;
  }
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.seqlen_q;
  if (l.num_splits > 1 && rows > 0) {
    combine_kernel<Element><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, s>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace flashattn::cuda::decode

// Launchers of the sink-token pass (common/sink_tokens.cuh) for both 16-bit dtypes and the
// head-dim buckets of its per-lane columns.
#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include "common/sink_tokens.cuh"
#include "sink_tokens.hpp"

namespace flashattn::cuda {
namespace {

template <class Element, int kMaxCols>
__global__ void __launch_bounds__(kSinkTokenThreads, 1)
    forward_sink_tokens_kernel(const __grid_constant__ ForwardParams p) {
  forward_sink_tokens_block<Element, kMaxCols>(p);
}

template <class Element>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.shape.seqlen_q + kSinkTokenRows - 1) / kSinkTokenRows),
                  static_cast<unsigned>(p.shape.heads_q), static_cast<unsigned>(p.shape.batch));
  // A lane's columns lane + 32 t: head dims up to 64, 128, 256.
  if (p.shape.head_dim <= 64) {
    forward_sink_tokens_kernel<Element, 2><<<grid, kSinkTokenThreads, 0, stream>>>(p);
  } else if (p.shape.head_dim <= 128) {
    forward_sink_tokens_kernel<Element, 4><<<grid, kSinkTokenThreads, 0, stream>>>(p);
  } else if (p.shape.head_dim <= 256) {
    forward_sink_tokens_kernel<Element, 8><<<grid, kSinkTokenThreads, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <class Element, int kMaxCols>
__global__ void __launch_bounds__(kSinkTokenThreads, 1)
    backward_sink_tokens_dq_kernel(const __grid_constant__ BackwardParams p) {
  backward_sink_tokens_dq_block<Element, kMaxCols>(p);
}

template <class Element, int kMaxCols>
__global__ void __launch_bounds__(kSinkTokenThreads, 1)
    backward_sink_tokens_dkv_kernel(const __grid_constant__ BackwardParams p, const SinkTokenPartials partials) {
  __shared__ float staged[kSinkTokenThreads / 32][2][kMaxCols * 32];
  backward_sink_tokens_dkv_block<Element, kMaxCols>(p, partials, staged);
}

template <class Element>
__global__ void __launch_bounds__(kSinkTokenThreads, 1)
    backward_sink_tokens_reduce_kernel(const __grid_constant__ BackwardParams p, const SinkTokenPartials partials) {
  backward_sink_tokens_reduce_block<Element>(p, partials);
}

template <class Element, int kMaxCols>
cudaError_t launch_backward_columns(const BackwardParams& p, const SinkTokenPartials& partials, cudaStream_t stream) {
  const ShapeParams& s = p.fwd.shape;
  const dim3 rows(static_cast<unsigned>((s.seqlen_q + kSinkTokenRows - 1) / kSinkTokenRows),
                  static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  backward_sink_tokens_dq_kernel<Element, kMaxCols><<<rows, kSinkTokenThreads, 0, stream>>>(p);
  const dim3 chunks(static_cast<unsigned>(partials.chunks), static_cast<unsigned>(s.heads_kv * partials.keys),
                    static_cast<unsigned>(s.batch));
  backward_sink_tokens_dkv_kernel<Element, kMaxCols><<<chunks, kSinkTokenThreads, 0, stream>>>(p, partials);
  const dim3 keys(static_cast<unsigned>(s.heads_kv * partials.keys), static_cast<unsigned>(s.batch));
  backward_sink_tokens_reduce_kernel<Element><<<keys, kSinkTokenThreads, 0, stream>>>(p, partials);
  return cudaGetLastError();
}

template <class Element>
cudaError_t launch_backward(const BackwardParams& p, const SinkTokenPartials& partials, cudaStream_t stream) {
  const int64_t d = p.fwd.shape.head_dim;
  if (d <= 64) return launch_backward_columns<Element, 2>(p, partials, stream);
  if (d <= 128) return launch_backward_columns<Element, 4>(p, partials, stream);
  if (d <= 256) return launch_backward_columns<Element, 8>(p, partials, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t run_backward_sink_tokens(const BackwardParams& p, const SinkTokenLayout& layout, float* partials,
                                     ElemType elem, cudaStream_t stream) {
  if (p.fwd.shape.batch == 0 || layout.keys == 0 || layout.chunks == 0) return cudaSuccess;
  const SinkTokenPartials parts{partials, layout.keys, layout.chunks, layout.chunk_rows};
  return elem == ElemType::kFloat16 ? launch_backward<cutlass::half_t>(p, parts, stream)
                                    : launch_backward<cutlass::bfloat16_t>(p, parts, stream);
}

cudaError_t run_forward_sink_tokens(const ForwardParams& p, ElemType elem, cudaStream_t stream) {
  if (p.shape.batch == 0 || p.shape.seqlen_q == 0) return cudaSuccess;
  return elem == ElemType::kFloat16 ? launch_forward<cutlass::half_t>(p, stream)
                                    : launch_forward<cutlass::bfloat16_t>(p, stream);
}

}  // namespace flashattn::cuda

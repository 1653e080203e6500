// The sink-token pass (common/sink_tokens.cuh): after the attention kernels have run a call's
// window, it joins to each row the sink keys left of its window. The dispatcher compiles as
// plain C++ without CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include "params.hpp"

namespace flashattn::cuda {

// p.out and p.lse hold the window's result (p.lse: the caller's LSE, or a workspace one laid out
// alike); both become the result with the sink tokens. p.window.sink_tokens > 0 and
// p.window.left >= 0 (else no row has sink keys left of its window).
cudaError_t run_forward_sink_tokens(const ForwardParams& p, ElemType elem, cudaStream_t stream);

// The backward's sink-token terms, between the main kernel and the dQ convert kernel: dQ's sums
// in the scratch, and dK / dV (written by the main kernel) through fp32 partials in `partials`
// (sink_token_layout's bytes of the backward's workspace).
struct SinkTokenLayout {
  int64_t keys = 0, chunks = 0, chunk_rows = 0;
  size_t bytes = 0;  // the partials: [batch, heads_kv, keys, chunks, 2, head_dim] floats
};
// Chunks of at least 1024 (query head of the group, row) pairs, and of 8 per sink key, so that
// the partials (keys * chunks rows of 2 * head_dim floats per batch entry and kv head) stay
// within about a quarter of the dQ sums' size.
inline SinkTokenLayout sink_token_layout(const ShapeParams& shape, int64_t sink_tokens) {
  SinkTokenLayout l;
  l.keys = sink_tokens < shape.seqlen_k ? sink_tokens : shape.seqlen_k;
  const int64_t rows = shape.heads_q / shape.heads_kv * shape.seqlen_q;
  l.chunk_rows = 8 * l.keys > 1024 ? 8 * l.keys : 1024;
  l.chunks = (rows + l.chunk_rows - 1) / l.chunk_rows;
  l.bytes = static_cast<size_t>(shape.batch * shape.heads_kv * l.keys * l.chunks * 2 * shape.head_dim) * sizeof(float);
  return l;
}
cudaError_t run_backward_sink_tokens(const BackwardParams& p, const SinkTokenLayout& layout, float* partials,
                                     ElemType elem, cudaStream_t stream);

}  // namespace flashattn::cuda

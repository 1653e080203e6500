// The backward pass's row kernels around the main kernel (backward_kernel.cuh), per query row:
//   prepare: D = rowsum(dO * O) in fp32 and LSE2 = LSE * log2(e) (+inf for an empty row, whose
//            P is then exactly 0) into the scratch, padding rows included;
//   convert: dQ = softmax_scale * (the fp32 dQ sums) in the output dtype.
// With a learnable sink, one more kernel between them reduces the scratch rows of each head to
// d sink[h] = -sum_i 2^(sink - LSE2_i) D_i (core/variant.hpp), in a fixed order.
// Grid (query tiles of kBackwardRowPad rows, heads_q, batch), kRowThreads threads; both read
// and write whole rows in 16-byte chunks with neighbouring threads on neighbouring chunks.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "../../core/variant.hpp"
#include "../common/sequence.cuh"
#include "../params.hpp"
#include "tile_ops.cuh"

namespace flashattn::cuda::sm80 {

inline constexpr int kRowThreads = 256;
inline constexpr int kRowGroup = 8;  // threads per row in the prepare kernel (8 x 16 B = 128 B)

template <class Element>
struct Chunk16 {  // 8 16-bit elements: one 16-byte load or store
  static constexpr int kElems = 16 / int(sizeof(Element));
  alignas(16) Element x[kElems];
};

template <class Element>
__device__ __forceinline__ void backward_prepare_block(const BackwardParams& p) {
  const ForwardParams& fp = p.fwd;
  const int tid = static_cast<int>(threadIdx.x);
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const Sequence seq = sequence(fp, b);
  const int64_t m0 = int64_t{blockIdx.x} * kBackwardRowPad;
  if (m0 >= seq.seqlen_q) return;  // no tile of the main kernel reads these rows
  const int64_t scratch_row0 = h * p.scratch.rows + backward_row_base(fp.cu_seqlens_q, fp.shape.seqlen_q, b) + m0;
  constexpr int kElems = Chunk16<Element>::kElems;
  const int64_t chunks = fp.shape.head_dim / kElems;
  const int lane = tid % kRowGroup;
  // Rows in groups of kRowGroup threads; every thread of a warp runs the same iterations, so the
  // group's shuffles are warp-uniform.
  for (int r = tid / kRowGroup; r < kBackwardRowPad; r += kRowThreads / kRowGroup) {
    const int64_t i = m0 + r;
    const bool valid = i < seq.seqlen_q;
    float dot = 0.0f;
    if (valid) {
      const int64_t row = seq.q_start + i;
      const auto* o = static_cast<const Element*>(fp.out.data) + b * fp.out.batch_stride + h * fp.out.head_stride +
                      row * fp.out.row_stride;
      const auto* d_o = static_cast<const Element*>(p.dout.data) + b * p.dout.batch_stride + h * p.dout.head_stride +
                        row * p.dout.row_stride;
      for (int64_t c = lane; c < chunks; c += kRowGroup) {
        const auto oc = *reinterpret_cast<const Chunk16<Element>*>(o + c * kElems);
        const auto gc = *reinterpret_cast<const Chunk16<Element>*>(d_o + c * kElems);
        CUTE_UNROLL
        for (int e = 0; e < kElems; ++e) dot += static_cast<float>(oc.x[e]) * static_cast<float>(gc.x[e]);
      }
    }
    CUTE_UNROLL
    for (int offset = kRowGroup / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) {
      float lse2 = INFINITY;
      if (valid) {
        const float lse =
            fp.lse.data[b * fp.lse.batch_stride + h * fp.lse.head_stride + (seq.q_start + i) * fp.lse.row_stride];
        lse2 = lse == -INFINITY ? INFINITY : lse * static_cast<float>(core::kLog2e);
      }
      p.scratch.delta[scratch_row0 + r] = valid ? dot : 0.0f;
      p.scratch.lse2[scratch_row0 + r] = lse2;
    }
  }
}

// d sink of query head blockIdx.x, from the rows of every sequence the prepare kernel wrote
// (the scratch between sequences is never written): each thread sums a fixed stride of rows,
// the block adds the threads' sums in a fixed tree, so the result is the same bits on every
// run. A row whose P_sink underflows to 0 adds nothing (not 0 * a NaN D), as on the CPU.
template <int kThreads>
__device__ __forceinline__ void backward_sink_grad_block(const BackwardParams& p, float (&warp_sums)[kThreads / 32]) {
  const ForwardParams& fp = p.fwd;
  const int h = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
  const float sink = sink_log2(fp.score, h);
  float acc = 0.0f;
  for (int64_t b = 0; b < fp.shape.batch; ++b) {
    const int64_t row0 = h * p.scratch.rows + backward_row_base(fp.cu_seqlens_q, fp.shape.seqlen_q, b);
    const int64_t rows = sequence(fp, b).seqlen_q;
    for (int64_t r = tid; r < rows; r += kThreads) {
      const float p_sink = exp2f(sink - p.scratch.lse2[row0 + r]);
      if (p_sink != 0.0f) acc += p_sink * p.scratch.delta[row0 + r];
    }
  }
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (tid % 32 == 0) warp_sums[tid / 32] = acc;
  __syncthreads();
  if (tid == 0) {
    float total = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    // (+0 for a head without rows, as on the CPU; NaN, like every other output, after lengths
    // that failed their device check, which the kernels saw as empty sequences)
    const bool failed = p.length_verdict != nullptr && *p.length_verdict != 0;
    p.dsink[h * p.dsink_stride] = failed ? NAN : 0.0f - total;
  }
}

template <class Element>
__device__ __forceinline__ void backward_convert_dq_block(const BackwardParams& p) {
  const ForwardParams& fp = p.fwd;
  const int tid = static_cast<int>(threadIdx.x);
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const Sequence seq = sequence(fp, b);
  const int64_t m0 = int64_t{blockIdx.x} * kBackwardRowPad;
  if (m0 >= seq.seqlen_q) return;
  const int64_t rows = cute::min(int64_t{kBackwardRowPad}, seq.seqlen_q - m0);
  constexpr int kElems = Chunk16<Element>::kElems;
  const int64_t chunks = fp.shape.head_dim / kElems;
  const int64_t bucket = p.scratch.head_dim_bucket;
  // m0 and the row base are multiples of 8: the tile's sums start a block row of dq_sum_offset's
  // layout, where a chunk's kElems (8) columns are 4 contiguous even ones and 4 odd ones.
  static_assert(kElems == 8 && kBackwardRowPad % 8 == 0, "a chunk is one row of an 8 x 8 block of sums");
  const float* sums = p.scratch.dq_accum +
                      (h * p.scratch.rows + backward_row_base(fp.cu_seqlens_q, fp.shape.seqlen_q, b) + m0) * bucket;
  for (int64_t task = tid; task < rows * chunks; task += kRowThreads) {
    const int64_t r = task / chunks, c = task % chunks;
    // 16-byte aligned: the workspace and each 8 x 8 block are 256-byte aligned
    const float4 even = *reinterpret_cast<const float4*>(sums + dq_sum_offset(r, c * kElems, bucket));
    const float4 odd = *reinterpret_cast<const float4*>(sums + dq_sum_offset(r, c * kElems + 1, bucket));
    const float x[kElems] = {even.x, odd.x, even.y, odd.y, even.z, odd.z, even.w, odd.w};
    Chunk16<Element> out;
    CUTE_UNROLL
    for (int e = 0; e < kElems; ++e) out.x[e] = static_cast<Element>(x[e] * p.softmax_scale);
    auto* dq = static_cast<Element*>(p.dq.data) + b * p.dq.batch_stride + h * p.dq.head_stride +
               (seq.q_start + m0 + r) * p.dq.row_stride;
    *reinterpret_cast<Chunk16<Element>*>(dq + c * kElems) = out;
  }
}

// Block (qb, h, b) of the grid (query_blocks, heads_q, batch): the cells of (b, h, qb)'s listed key
// blocks (core::fill_block_cells), one list entry a thread.
__device__ __forceinline__ void block_cells_block(const BackwardParams& p) {
  core::fill_block_cells(p.fwd.block_mask, p.block_cells, blockIdx.z, blockIdx.y, blockIdx.x, threadIdx.x, kRowThreads);
}

template <class Element>
__global__ void __launch_bounds__(kRowThreads) backward_prepare_kernel(const __grid_constant__ BackwardParams p) {
  backward_prepare_block<Element>(p);
}

__global__ void __launch_bounds__(kRowThreads) backward_sink_grad_kernel(const __grid_constant__ BackwardParams p) {
  __shared__ float warp_sums[kRowThreads / 32];
  backward_sink_grad_block<kRowThreads>(p, warp_sums);
}

__global__ void __launch_bounds__(kRowThreads) block_cells_kernel(const __grid_constant__ BackwardParams p) {
  block_cells_block(p);
}

template <class Element>
__global__ void __launch_bounds__(kRowThreads) backward_convert_dq_kernel(const __grid_constant__ BackwardParams p) {
  backward_convert_dq_block<Element>(p);
}

}  // namespace flashattn::cuda::sm80

// Sink tokens in the KV-cache call: the decode kernels run the window alone, and this pass joins
// each query row's sink keys left of its window afterwards (common/sink_tokens.cuh's merge of two
// disjoint parts of one softmax). A sequence's key j is its cache position first + j (leftpad),
// read from its cache entry (cache_batch_idx) or through its block-table row; the query is the
// decode kernels' own, rotated to its position (and rounded to the element type) as they rotate it.
#pragma once

#include <cstdint>

#include "../../core/mask.hpp"
#include "../common/careful_rows.cuh"
#include "../common/sink_tokens.cuh"
#include "decode_blocks.cuh"
#include "decode_params.hpp"
#include "sequence_indices.cuh"

namespace flashattn::cuda::decode {

// Grid (row blocks of kSinkTokenRows, heads_q, batch), kSinkTokenThreads threads, after the
// decode (and combine) kernels, which wrote p.lse (the caller's, or a workspace one the backend
// lends them). `q_rows`: shared, [warps][head_dim bucket] floats, a warp's rotated query row.
template <class Element, int kMaxCols, bool kPaged>
__device__ __forceinline__ void decode_sink_tokens_block(const DecodeParams& p,
                                                         float (&q_rows)[kSinkTokenThreads / 32][kMaxCols * 32]) {
  const LseOut& lse = p.lse;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int64_t seqlen_q = p.shape.seqlen_q, m0 = int64_t{blockIdx.x} * kSinkTokenRows;
  if (m0 >= seqlen_q) return;
  const SequenceIndices seq = sequence_indices(p.cache, b);
  if (!sequence_indices_ok(p, seq)) return;  // the decode kernels reported it, and read nothing
  const int64_t seqlen_k = seq.used + p.cache.seqlen_new - seq.first;
  const core::SinkTokenMask mask({seqlen_q, seqlen_k, p.window.left, p.window.right}, p.window.sink_tokens);
  const int64_t rows = cute::min(int64_t{kSinkTokenRows}, seqlen_q - m0);
  const int64_t keys = mask.keys_left_of_window(m0 + rows - 1);  // the most of any row here
  if (keys == 0) return;
  const int64_t hk = h / p.group.divisor;
  CarefulRows r;
  const auto* k_head = static_cast<const Element*>(p.k.data) + hk * p.k.head_stride;
  const auto* v_head = static_cast<const Element*>(p.v.data) + hk * p.v.head_stride;
  if constexpr (kPaged) {
    r.table = p.cache.block_table + b * p.cache.block_table_stride;
    r.page = p.cache.page;
    r.k_block_stride = p.k.batch_stride;
    r.v_block_stride = p.v.batch_stride;
    r.key_offset = seq.first;
    // The pages of these keys, which the decode kernels may not have read: a bad entry is
    // recorded (IndexCheck::kDevice) and its rows left as the kernels wrote them.
    bool bad = false;
    for (int64_t col = seq.first / p.cache.page_size; col <= (seq.first + keys - 1) / p.cache.page_size; ++col) {
      bad |= !p.cache.entry_ok(r.table[col]);
    }
    if (bad) {
      report_block_fault(p, b, seq.first, seq.first + keys);
      return;
    }
  } else {
    k_head += seq.entry * p.k.batch_stride + seq.first * p.k.row_stride;
    v_head += seq.entry * p.v.batch_stride + seq.first * p.v.row_stride;
  }
  r.k = k_head;
  r.v = v_head;
  r.k_row_stride = p.k.row_stride;
  r.v_row_stride = p.v.row_stride;
  r.mask = mask;
  r.score = p.score;
  r.head_dim = static_cast<int>(p.shape.head_dim);
  r.alibi_slope_log2 = alibi_slope_log2_of(p.score, b, h);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t t = warp; t < rows; t += kSinkTokenThreads / 32) {
    const int64_t i = m0 + t;
    const int64_t n = mask.keys_left_of_window(i);
    if (n == 0) continue;
    // The query row, rotated to its position by the 16-byte chunk (a lane each) into shared memory.
    const auto* q_row =
        static_cast<const Element*>(p.q.data) + b * p.q.batch_stride + i * p.q.row_stride + h * p.q.head_stride;
    const int c0 = lane * kVec;
    if (c0 < r.head_dim) {
      float x[kVec];
      to_float(*reinterpret_cast<const Vec<Element>*>(q_row + c0), x);
      if (p.rotary.dim > 0) rotate(p.rotary, q_row, c0, seq.used + (p.rotary.per_row_q ? i : 0), x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) q_rows[warp][c0 + e] = static_cast<float>(static_cast<Element>(x[e]));
    }
    __syncwarp();
    float q[kMaxCols];
#pragma unroll
    for (int u = 0; u < kMaxCols; ++u) {
      const int c = lane + 32 * u;
      q[u] = c < r.head_dim ? q_rows[warp][c] : 0.0f;
    }
    __syncwarp();  // (the next row's chunks overwrite q_rows[warp])
    auto* out_row =
        static_cast<Element*>(p.out.data) + b * p.out.batch_stride + h * p.out.head_stride + i * p.out.row_stride;
    float* lse_at = lse.data + b * lse.batch_stride + h * lse.head_stride + i * lse.row_stride;
    join_sink_keys<Element, kMaxCols, kPaged>(r, i, n, q, out_row, lse_at, lane);
  }
}

}  // namespace flashattn::cuda::decode

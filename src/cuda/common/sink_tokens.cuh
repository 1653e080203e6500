// Sink tokens (core::SinkTokenMask: the first sink_tokens keys stay visible under a sliding
// window, as in StreamingLLM) on the GPU. The attention kernels run the window's mask alone,
// unchanged; a row pass then joins the sink keys each row sees left of its window
// (core::SinkTokenMask::keys_left_of_window): a few keys, scored and weighted key by key by one
// warp per row (careful_rows.cuh's reads and score), then merged with the window's result as two
// disjoint parts of one softmax, through their log-sum-exps. The key loops pay nothing, and one
// pass serves every forward family (sm80, sm90; dense, varlen, paged keys).
//
// The merge reads back the window's output in the output dtype, so a row with sink keys is
// rounded twice (at most one more unit in the last place than the kernels' own rounding); its
// LSE is exact to fp32.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../core/mask.hpp"
#include "../../core/variant.hpp"
#include "../params.hpp"
#include "careful_rows.cuh"
#include "fast_math.cuh"
#include "sequence.cuh"

namespace flashattn::cuda {

inline constexpr int kSinkTokenThreads = 128;  // a CTA of the pass: 4 warps, a row each at a time
inline constexpr int kSinkTokenRows = 64;      // rows of one CTA

// The softmax state of row i over its keys [0, n) (n > 0), each lane holding its columns lane +
// 32 t of the weighted value sum: max and sum in the exp2 domain, acc = sum_j p_j keep_j v_j.
// Dropout's keep-mask is the kernels' (core/philox.hpp); a term whose weight is 0 adds nothing
// (no 0 * NaN), as in careful_row_of.
template <class Element, int kMaxCols, bool kPaged>
__device__ __forceinline__ void sink_key_state(const CarefulRows& r, int64_t i, int64_t n, const float (&q)[kMaxCols],
                                               int lane, float& max, float& sum, float (&acc)[kMaxCols]) {
  auto score = [&](int64_t j) {
    const Element* k_row = careful_key<Element, kPaged>(r, r.k, r.k_row_stride, r.k_block_stride, j);
    return careful_score(r, careful_dot<Element>(q, k_row, r.head_dim, lane), i, j);
  };
  max = -INFINITY;
  for (int64_t j = 0; j < n; ++j) max = fmaxf(max, score(j));
  sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) acc[t] = 0.0f;
  if (max == -INFINITY) return;  // (only from infinite inputs) no term counts
  for (int64_t j = 0; j < n; ++j) {
    const float p = fast_exp2(score(j) - max);
    sum += p;
    const bool kept = r.dropout.threshold == 0 ||
                      core::dropout_keep(r.dropout.seed, r.dropout.offset, r.dropout_stream, i, j, r.dropout.threshold);
    if (p == 0.0f || !kept) continue;
    const Element* v_row = careful_key<Element, kPaged>(r, r.v, r.v_row_stride, r.v_block_stride, j);
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) {
      const int c = lane + 32 * t;
      if (c < r.head_dim) acc[t] += p * static_cast<float>(v_row[c]);
    }
  }
}

// Row i's output and LSE (natural log; -inf for a row that saw nothing), written by the
// attention kernels over the window, become the row's over the window and its n > 0 sink keys:
// LSE = log(e^LSE_window + e^LSE_sinks), O = O_window e^(LSE_window - LSE) + O_sinks e^(LSE_sinks
// - LSE), with O_sinks = keep_scale * acc / sum. q: the row's query as the kernels used it
// (this lane's columns).
template <class Element, int kMaxCols, bool kPaged>
__device__ __forceinline__ void join_sink_keys(const CarefulRows& r, int64_t i, int64_t n, const float (&q)[kMaxCols],
                                               Element* out_row, float* lse_at, int lane) {
  float max, sum, acc[kMaxCols];
  sink_key_state<Element, kMaxCols, kPaged>(r, i, n, q, lane, max, sum, acc);
  if (max == -INFINITY) return;
  const float lse_window = *lse_at;
  const float window2 = lse_window * static_cast<float>(core::kLog2e);  // -inf: the window saw nothing
  const float sinks2 = max + log2f(sum);                                // sum >= 1: max's own term
  const float top = fmaxf(window2, sinks2);
  const float lse2 = top + log2f(fast_exp2(window2 - top) + fast_exp2(sinks2 - top));
  const float window_factor = fast_exp2(window2 - lse2);
  const float sink_factor = r.dropout.keep_scale * fast_exp2(max - lse2);
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) {
    const int c = lane + 32 * t;
    if (c >= r.head_dim) continue;
    // (the window's part only where it has weight: an empty window's O is 0, and a row's NaN
    // stays in O through its LSE)
    const float window = window_factor != 0.0f ? static_cast<float>(out_row[c]) * window_factor : 0.0f;
    out_row[c] = static_cast<Element>(window + acc[t] * sink_factor);
  }
  __syncwarp();
  if (lane == 0) *lse_at = lse2 * static_cast<float>(core::kLn2);
}

// The pass over a forward call's rows: grid (row blocks of kSinkTokenRows, heads_q, batch),
// kSinkTokenThreads threads. p.lse is where the kernels wrote the LSE (the caller's, or a
// workspace one laid out alike that the backend lends them when the caller wants none).
template <class Element, int kMaxCols>
__device__ __forceinline__ void forward_sink_tokens_block(const ForwardParams& p) {
  const LseOut& lse = p.lse;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const Sequence seq = sequence(p, b);
  const int64_t m0 = int64_t{blockIdx.x} * kSinkTokenRows;
  if (m0 >= seq.seqlen_q) return;
  const core::SinkTokenMask mask({seq.seqlen_q, seq.seqlen_k, p.window.left, p.window.right}, p.window.sink_tokens);
  const int64_t h_kv = h / (p.shape.heads_q / p.shape.heads_kv);
  const CarefulRows r = careful_rows_of<Element>(p, b, h, h_kv, seq.q_start, seq.k_start, mask);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t rows = cute::min(int64_t{kSinkTokenRows}, seq.seqlen_q - m0);
  for (int64_t t = warp; t < rows; t += kSinkTokenThreads / 32) {
    const int64_t i = m0 + t;
    const int64_t n = mask.keys_left_of_window(i);
    if (n == 0) continue;
    auto* out_row = static_cast<Element*>(p.out.data) + b * p.out.batch_stride + h * p.out.head_stride +
                    (seq.q_start + i) * p.out.row_stride;
    float* lse_at = lse.data + b * lse.batch_stride + h * lse.head_stride + (seq.q_start + i) * lse.row_stride;
    float q[kMaxCols];
    careful_load(static_cast<const Element*>(r.q) + i * r.q_row_stride, r.head_dim, lane, q);
    if (p.block_table != nullptr) {
      join_sink_keys<Element, kMaxCols, true>(r, i, n, q, out_row, lse_at, lane);
    } else {
      join_sink_keys<Element, kMaxCols, false>(r, i, n, q, out_row, lse_at, lane);
    }
  }
}

// --- backward ------------------------------------------------------------------------------------
// The backward kernels run the window alone too; the pass adds the sink keys' terms with the
// call's LSE and D (the prepare kernel's scratch rows, which include every key):
//   P = 2^(score - LSE2), dP' = dO . v_j through the keep-mask and 1 / (1 - p),
//   dS = P (dP' - D) (1 - tanh^2 with softcap), all as backward_score.cuh's element pass;
//   dQ's sums += dS k_j (row by row: one warp owns a row's sums, no other writer);
//   dK_j += scale sum_i dS q_i, dV_j += sum_i P' dO_i over every row (and query head of the
//   group) that sees sink key j left of its window: partial sums per chunk of rows, then one
//   fixed-order sum per key (bitwise reproducible without atomics) added to the kernels' dK, dV.

// The sink-token pass's share of the backward scratch: per (batch entry, kv head, sink key,
// chunk of rows), the fp32 partial dK and dV rows.
struct SinkTokenPartials {
  float* data = nullptr;  // [batch, heads_kv, keys, chunks, 2, head_dim]
  int64_t keys = 0;       // sink keys with terms: min(sink_tokens, seqlen_k)
  int64_t chunks = 0;     // chunks of chunk_rows (query head of the group, row) pairs
  int64_t chunk_rows = 0;
  FA_HOST_DEVICE float* at(int64_t b, int64_t hk, int64_t heads_kv, int64_t j, int64_t chunk, int64_t head_dim) const {
    return data + (((b * heads_kv + hk) * keys + j) * chunks + chunk) * 2 * head_dim;
  }
};

// The backward's view of one (batch entry, query head) row i: D, LSE2, dO, q.
struct SinkTokenRow {
  float delta, lse2;
  const void* dout;
};

template <class Element>
__device__ __forceinline__ SinkTokenRow sink_token_row(const BackwardParams& p, int64_t b, int64_t h,
                                                       const Sequence& seq, int64_t i) {
  const int64_t at = h * p.scratch.rows + backward_row_base(p.fwd.cu_seqlens_q, p.fwd.shape.seqlen_q, b) + i;
  return {p.scratch.delta[at], p.scratch.lse2[at],
          static_cast<const Element*>(p.dout.data) + b * p.dout.batch_stride + h * p.dout.head_stride +
              (seq.q_start + i) * p.dout.row_stride};
}

// dS of (i, j) from the products q.k and dO.v, and P' (dV's weight); 0, 0 where P is 0 (an
// empty row, LSE2 = +inf; or an underflow), so that no 0 * NaN counts.
struct SinkTokenGrad {
  float ds, p_kept;
};
__device__ __forceinline__ SinkTokenGrad sink_token_grad(const CarefulRows& r, const SinkTokenRow& row, float qk,
                                                         float dov, int64_t i, int64_t j) {
  float t = 0.0f;
  const float p = fast_exp2(careful_score(r, qk, i, j, &t) - row.lse2);
  if (p == 0.0f) return {0.0f, 0.0f};
  const bool kept = r.dropout.threshold == 0 ||
                    core::dropout_keep(r.dropout.seed, r.dropout.offset, r.dropout_stream, i, j, r.dropout.threshold);
  const float dp = kept ? dov * r.dropout.keep_scale : 0.0f;
  const float grad_factor = softcap_grad_factor(r.score, t);
  return {p * (dp - row.delta) * grad_factor, kept ? p * r.dropout.keep_scale : 0.0f};
}

// dQ's sums of the sink keys left of each row's window: grid (row blocks of kSinkTokenRows,
// heads_q, batch), kSinkTokenThreads threads, a warp a row; between the main kernel and the
// convert kernel.
template <class Element, int kMaxCols>
__device__ __forceinline__ void backward_sink_tokens_dq_block(const BackwardParams& p) {
  const ForwardParams& f = p.fwd;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const Sequence seq = sequence(f, b);
  const int64_t m0 = int64_t{blockIdx.x} * kSinkTokenRows;
  if (m0 >= seq.seqlen_q) return;
  const core::SinkTokenMask mask({seq.seqlen_q, seq.seqlen_k, f.window.left, f.window.right}, f.window.sink_tokens);
  const int64_t hk = h / (f.shape.heads_q / f.shape.heads_kv);
  const CarefulRows r = careful_rows_of<Element>(f, b, h, hk, seq.q_start, seq.k_start, mask);
  const int64_t bucket = p.scratch.head_dim_bucket;
  float* sums =
      p.scratch.dq_accum + (h * p.scratch.rows + backward_row_base(f.cu_seqlens_q, f.shape.seqlen_q, b)) * bucket;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t rows = cute::min(int64_t{kSinkTokenRows}, seq.seqlen_q - m0);
  for (int64_t t = warp; t < rows; t += kSinkTokenThreads / 32) {
    const int64_t i = m0 + t;
    const int64_t n = mask.keys_left_of_window(i);
    if (n == 0) continue;
    const SinkTokenRow row = sink_token_row<Element>(p, b, h, seq, i);
    float q[kMaxCols], dout[kMaxCols], dq[kMaxCols] = {};
    careful_load(static_cast<const Element*>(r.q) + i * r.q_row_stride, r.head_dim, lane, q);
    careful_load(static_cast<const Element*>(row.dout), r.head_dim, lane, dout);
    for (int64_t j = 0; j < n; ++j) {
      const Element* k_row = careful_key<Element, false>(r, r.k, r.k_row_stride, 0, j);
      const Element* v_row = careful_key<Element, false>(r, r.v, r.v_row_stride, 0, j);
      const float qk = careful_dot<Element>(q, k_row, r.head_dim, lane);
      const SinkTokenGrad g = sink_token_grad(r, row, qk, careful_dot<Element>(dout, v_row, r.head_dim, lane), i, j);
      if (g.ds == 0.0f) continue;
#pragma unroll
      for (int u = 0; u < kMaxCols; ++u) {
        const int c = lane + 32 * u;
        if (c < r.head_dim) dq[u] += g.ds * static_cast<float>(k_row[c]);
      }
    }
#pragma unroll
    for (int u = 0; u < kMaxCols; ++u) {
      const int c = lane + 32 * u;
      if (c < r.head_dim) sums[dq_sum_offset(i, c, bucket)] += dq[u];
    }
  }
}

// The partial dK_j / scale and dV_j of one chunk of (query head of the group, row) pairs: grid
// (chunks, heads_kv * keys, batch), kSinkTokenThreads threads; each warp sums its rows, the
// warps' sums are added in a fixed order through `staged` (shared, [warps][2][kMaxCols * 32]).
// Every CTA writes its partial (zeros where it has no row), which the reduce kernel reads.
template <class Element, int kMaxCols>
__device__ __forceinline__ void backward_sink_tokens_dkv_block(
    const BackwardParams& p, const SinkTokenPartials& partials,
    float (&staged)[kSinkTokenThreads / 32][2][kMaxCols * 32]) {
  const ForwardParams& f = p.fwd;
  const int64_t chunk = blockIdx.x, b = blockIdx.z;
  const int64_t hk = blockIdx.y / partials.keys, j = blockIdx.y % partials.keys;
  const int64_t group = f.shape.heads_q / f.shape.heads_kv, max_sq = f.shape.seqlen_q;
  const Sequence seq = sequence(f, static_cast<int>(b));
  const core::SinkTokenMask mask({seq.seqlen_q, seq.seqlen_k, f.window.left, f.window.right}, f.window.sink_tokens);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  float dk[kMaxCols] = {}, dv[kMaxCols] = {};
  const int64_t first = chunk * partials.chunk_rows;
  const int64_t last = cute::min(first + partials.chunk_rows, group * max_sq);
  if (j < seq.seqlen_k) {
    float k[kMaxCols], v[kMaxCols];
    int64_t h = -1;
    CarefulRows r;
    for (int64_t at = first + warp; at < last; at += kSinkTokenThreads / 32) {
      const int64_t i = at % max_sq;
      if (i >= seq.seqlen_q || mask.keys_left_of_window(i) <= j) continue;
      if (h != hk * group + at / max_sq) {  // the rows of a chunk are of one or two query heads
        h = hk * group + at / max_sq;
        r = careful_rows_of<Element>(f, b, h, hk, seq.q_start, seq.k_start, mask);
        careful_load(careful_key<Element, false>(r, r.k, r.k_row_stride, 0, j), r.head_dim, lane, k);
        careful_load(careful_key<Element, false>(r, r.v, r.v_row_stride, 0, j), r.head_dim, lane, v);
      }
      const SinkTokenRow row = sink_token_row<Element>(p, b, h, seq, i);
      const auto* q_row = static_cast<const Element*>(r.q) + i * r.q_row_stride;
      const auto* dout_row = static_cast<const Element*>(row.dout);
      float qk = 0.0f, dov = 0.0f;
#pragma unroll
      for (int u = 0; u < kMaxCols; ++u) {
        const int c = lane + 32 * u;
        if (c < r.head_dim) {
          qk += static_cast<float>(q_row[c]) * k[u];
          dov += static_cast<float>(dout_row[c]) * v[u];
        }
      }
      const SinkTokenGrad g = sink_token_grad(r, row, careful_warp_sum(qk), careful_warp_sum(dov), i, j);
#pragma unroll
      for (int u = 0; u < kMaxCols; ++u) {
        const int c = lane + 32 * u;
        if (c < r.head_dim) {
          if (g.ds != 0.0f) dk[u] += g.ds * static_cast<float>(q_row[c]);
          if (g.p_kept != 0.0f) dv[u] += g.p_kept * static_cast<float>(dout_row[c]);
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kMaxCols; ++u) {
    staged[warp][0][lane + 32 * u] = dk[u];
    staged[warp][1][lane + 32 * u] = dv[u];
  }
  __syncthreads();
  float* out = partials.at(b, hk, f.shape.heads_kv, j, chunk, f.shape.head_dim);
  for (int64_t e = threadIdx.x; e < 2 * f.shape.head_dim; e += kSinkTokenThreads) {
    const int64_t which = e / f.shape.head_dim, c = e % f.shape.head_dim;
    float total = 0.0f;
    for (int w = 0; w < kSinkTokenThreads / 32; ++w) total += staged[w][which][c];
    out[e] = total;
  }
}

// dK_j += scale * (the chunks' partial sums, in chunk order), dV_j += theirs: grid (heads_kv *
// keys, batch), kSinkTokenThreads threads over the head dim's columns.
template <class Element>
__device__ __forceinline__ void backward_sink_tokens_reduce_block(const BackwardParams& p,
                                                                  const SinkTokenPartials& partials) {
  const ForwardParams& f = p.fwd;
  const int64_t b = blockIdx.y, hk = blockIdx.x / partials.keys, j = blockIdx.x % partials.keys;
  const Sequence seq = sequence(f, static_cast<int>(b));
  if (j >= seq.seqlen_k) return;
  const int64_t d = f.shape.head_dim, row = seq.k_start + j;
  auto* dk = static_cast<Element*>(p.dk.data) + b * p.dk.batch_stride + hk * p.dk.head_stride + row * p.dk.row_stride;
  auto* dv = static_cast<Element*>(p.dv.data) + b * p.dv.batch_stride + hk * p.dv.head_stride + row * p.dv.row_stride;
  for (int64_t c = threadIdx.x; c < d; c += kSinkTokenThreads) {
    float sum_k = 0.0f, sum_v = 0.0f;
    for (int64_t chunk = 0; chunk < partials.chunks; ++chunk) {
      const float* part = partials.at(b, hk, f.shape.heads_kv, j, chunk, d);
      sum_k += part[c];
      sum_v += part[d + c];
    }
    dk[c] = static_cast<Element>(static_cast<float>(dk[c]) + p.softmax_scale * sum_k);
    dv[c] = static_cast<Element>(static_cast<float>(dv[c]) + sum_v);
  }
}

}  // namespace flashattn::cuda

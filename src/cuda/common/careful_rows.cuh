// Output rows recomputed key by key, for the rare tile whose fast result holds a NaN.
//
// The forward kernels multiply whole tiles on tensor cores: a probability the mask set to 0
// times a NaN (or inf) value row is NaN, so a bad value in a key that only some rows of a tile
// see would reach the tile's other rows too. The rule (docs/CONVENTIONS.md, "NaN") is that a row's
// output depends only on the keys it sees (0 * inf is NaN too, so a NaN marks every such spread).
// A kernel whose output rows come out holding a NaN (rare: an input held inf or NaN) has one warp
// recompute each such row here, reading q, k and v from global memory and leaving out every term
// whose probability is 0, as the CPU backend's careful path does (src/cpu/nonfinite.hpp). The
// LSE needs no repair: it depends on q and k alone, whose masked products the kernels replace
// with -inf.
//
// The score is the kernels' (ScoreParams, exp2 domain: scale or softcap, ALiBi, core::Mask) and
// dropout the same Philox keep-mask (core/philox.hpp); sums are fp32. Kernel code only, inlined
// where it is called (a call would give the kernels a stack frame), with no operation that
// compiles to a subroutine (64-bit division, IEEE division, exp2f's range fix-ups): those calls
// made the Hopper kernels spill. The CPU tests run it with the CUDA built-ins emulated.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "../../core/fast_divmod.hpp"
#include "../../core/mask.hpp"
#include "../../core/philox.hpp"
#include "../../core/variant.hpp"
#include "../params.hpp"
#include "fast_math.cuh"
#include "join_sink.cuh"

namespace flashattn::cuda {

// One (batch entry, query head) as the recompute reads it: row i of q, key j of k / v (packed
// from k / v, or through the block table: key j is row j % page_size of block
// table[j / page_size], block_stride apart).
struct CarefulRows {
  const void* q = nullptr;  // row 0 of the sequence, this head
  int64_t q_row_stride = 0;
  const void* k = nullptr;  // key 0 of the sequence (paged: block 0), this kv head
  const void* v = nullptr;
  int64_t k_row_stride = 0, v_row_stride = 0;
  const int32_t* table = nullptr;  // this sequence's block_table row (paged keys)
  core::FastDivmod page;           // by page_size
  int64_t k_block_stride = 0, v_block_stride = 0;
  core::Mask mask;
  ScoreParams score;
  float alibi_slope_log2 = 0.0f;
  float sink_log2 = -INFINITY;  // the head's learnable sink (exp2 domain); -inf: none (or not this split's)
  DropoutParams dropout;
  uint64_t dropout_stream = 0;  // Philox's bh
  int head_dim = 0;
  // The decode kernels': paged key j at position key_offset + j of the table row (the cache's
  // leftpad), and only the keys [keys_begin, keys_end) of a row counted (a split's share).
  int64_t key_offset = 0;
  int64_t keys_begin = 0, keys_end = INT64_MAX;
};

// A warp's shuffle sum of x (every lane gets it).
__device__ __forceinline__ float careful_warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

template <class Element, bool kPaged>
__device__ __forceinline__ const Element* careful_key(const CarefulRows& r, const void* base, int64_t row_stride,
                                                      int64_t block_stride, int64_t j) {
  const auto* p = static_cast<const Element*>(base);
  if constexpr (!kPaged) {
    return p + j * row_stride;
  } else {
    uint32_t row = 0;  // (positions < 2^31: supports_forward, the decode dispatch)
    const uint32_t page = r.page.divmod(static_cast<uint32_t>(j + r.key_offset), &row);
    return p + int64_t{r.table[page]} * block_stride + int64_t{row} * row_stride;
  }
}

__device__ __forceinline__ float careful_divide(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);
#else
  return a / b;  // host emulation
#endif
}

// This lane's columns lane + 32 t of an Element row, as floats (0 past head_dim).
template <class Element, int kMaxCols>
__device__ __forceinline__ void careful_load(const Element* row, int head_dim, int lane, float (&x)[kMaxCols]) {
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) {
    const int c = lane + 32 * t;
    x[t] = c < head_dim ? static_cast<float>(row[c]) : 0.0f;
  }
}

// x . row over the warp (x: this lane's columns; every lane gets the sum).
template <class Element, int kMaxCols>
__device__ __forceinline__ float careful_dot(const float (&x)[kMaxCols], const Element* row, int head_dim, int lane) {
  float dot = 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) {
    const int c = lane + 32 * t;
    if (c < head_dim) dot += x[t] * static_cast<float>(row[c]);
  }
  return careful_warp_sum(dot);
}

// The exp2-domain score of (i, j) from the product q.k, as the kernels' score step computes it;
// *tanh_out gets the softcap's tanh (ScoreVariant::grad_factor's argument).
__device__ __forceinline__ float careful_score(const CarefulRows& r, float dot, int64_t i, int64_t j,
                                               float* tanh_out = nullptr) {
  const ScoreVariant variant{r.score, r.alibi_slope_log2};
  float s = variant.score(dot, tanh_out);
  if (variant.has_bias()) s = variant.with_bias(s, static_cast<float>(r.mask.diag(i) - j));
  return s;
}

// Row i's output (i within the sequence), computed by the 32 lanes of one warp, each holding the
// columns lane + 32 t (kMaxCols = kHeadDim / 32 rounded up): put(col, value) receives them,
// scaled as the kernels scale O (dropout's 1 / (1 - p) included). A row that sees no key gets 0.
// q_at(col) gives q's element (a float) where the kernel keeps q elsewhere than r.q (the decode
// kernels' rotated q); careful_row reads r.q. `sees(i, j)`: a mask beyond r.mask (a block-sparse
// one's), AllKeys where there is none.
struct AllKeys {
  __device__ __forceinline__ constexpr bool operator()(int64_t, int64_t) const { return true; }
};
template <class Element, int kMaxCols, bool kPaged, class QAt, class Put, class Sees = AllKeys>
__device__ __forceinline__ void careful_row_of(const CarefulRows& r, int64_t i, int lane, QAt&& q_at, Put&& put,
                                               Sees&& sees = {}) {
  float q[kMaxCols];
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) {
    const int c = lane + 32 * t;
    q[t] = c < r.head_dim ? q_at(c) : 0.0f;
  }
  // The exp2-domain score of key j, as the kernels' score_tile computes it.
  auto score = [&](int64_t j) {
    const Element* k_row = careful_key<Element, kPaged>(r, r.k, r.k_row_stride, r.k_block_stride, j);
    return careful_score(r, careful_dot<Element>(q, k_row, r.head_dim, lane), i, j);
  };
  const int64_t begin = cute::max(r.mask.key_begin(i), r.keys_begin);
  const int64_t end = cute::min(r.mask.key_end(i + 1), r.keys_end);
  float row_max = -INFINITY;
  for (int64_t j = begin; j < end; ++j) {
    if (r.mask.visible(i, j) && sees(i, j)) row_max = fmaxf(row_max, score(j));
  }
  float acc[kMaxCols] = {};
  float sum = 0.0f;
  if (row_max != -INFINITY) {
    for (int64_t j = begin; j < end; ++j) {
      if (!r.mask.visible(i, j) || !sees(i, j)) continue;
      const float p = fast_exp2(score(j) - row_max);
      sum += p;
      const bool kept = r.dropout.threshold == 0 || core::dropout_keep(r.dropout.seed, r.dropout.offset,
                                                                       r.dropout_stream, i, j, r.dropout.threshold);
      if (p == 0.0f || !kept) continue;  // no 0 * NaN from a term that does not count
      const Element* v_row = careful_key<Element, kPaged>(r, r.v, r.v_row_stride, r.v_block_stride, j);
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) {
        const int c = lane + 32 * t;
        if (c < r.head_dim) acc[t] += p * static_cast<float>(v_row[c]);
      }
    }
  }
  const float o_factor = join_sink(row_max, sum, r.sink_log2);  // the kernels' epilogue's
  const float scale = sum > 0.0f ? careful_divide(r.dropout.keep_scale, sum) * o_factor : 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) {
    const int c = lane + 32 * t;
    if (c < r.head_dim) put(c, acc[t] * scale);
  }
}

template <class Element, int kMaxCols, bool kPaged, class Put, class Sees = AllKeys>
__device__ __forceinline__ void careful_row(const CarefulRows& r, int64_t i, int lane, Put&& put, Sees&& sees = {}) {
  const auto* q_row = static_cast<const Element*>(r.q) + i * r.q_row_stride;
  careful_row_of<Element, kMaxCols, kPaged>(
      r, i, lane, [&](int c) { return static_cast<float>(q_row[c]); }, put, sees);
}

// The CarefulRows of (batch entry, query head -> kv head) of a forward call: the sequence starts
// at rows q_start / k_start of q / k (packed keys) or its keys are in the pages of its block_table
// row.
template <class Element>
__device__ __forceinline__ CarefulRows careful_rows_of(const ForwardParams& p, int64_t batch, int64_t head,
                                                       int64_t head_kv, int64_t q_start, int64_t k_start,
                                                       const core::Mask& mask) {
  CarefulRows r;
  r.q = static_cast<const Element*>(p.q.data) + batch * p.q.batch_stride + head * p.q.head_stride +
        q_start * p.q.row_stride;
  r.q_row_stride = p.q.row_stride;
  if (p.block_table != nullptr) {  // k / v: blocks [num_blocks, page_size, heads_kv, d]
    r.k = static_cast<const Element*>(p.k.data) + head_kv * p.k.head_stride;
    r.v = static_cast<const Element*>(p.v.data) + head_kv * p.v.head_stride;
    r.table = p.block_table + batch * p.block_table_stride;
    r.page = p.page;
    r.k_block_stride = p.k.batch_stride;
    r.v_block_stride = p.v.batch_stride;
  } else {
    r.k = static_cast<const Element*>(p.k.data) + batch * p.k.batch_stride + head_kv * p.k.head_stride +
          k_start * p.k.row_stride;
    r.v = static_cast<const Element*>(p.v.data) + batch * p.v.batch_stride + head_kv * p.v.head_stride +
          k_start * p.v.row_stride;
  }
  r.k_row_stride = p.k.row_stride;
  r.v_row_stride = p.v.row_stride;
  r.mask = mask;
  r.score = p.score;
  r.alibi_slope_log2 = alibi_slope_log2_of(p.score, batch, head);
  r.sink_log2 = sink_log2(p.score, head);
  r.dropout = p.dropout;  // (threshold 0 unless the call drops)
  r.dropout_stream = static_cast<uint64_t>(batch * p.shape.heads_q + head);
  r.head_dim = static_cast<int>(p.shape.head_dim);
  return r;
}

// Whether row r of an accumulator-shaped (row, col) fragment holds a NaN: the mark a spread
// 0 * NaN (or 0 * inf) leaves.
template <class Frag>
__device__ __forceinline__ bool fragment_row_has_nan(const Frag& rc, int r) {
  bool nan = false;
#pragma unroll
  for (int c = 0; c < decltype(cute::size<1>(rc))::value; ++c) {
    const float x = static_cast<float>(rc(r, c));
    nan |= x != x;
  }
  return nan;
}

// The repair of one warp's accumulator rows (the sm80 mma.sync and sm90 WGMMA layouts alike: a
// quad of lanes shares a row): every row r of quad q whose nan_row[r] is set in that quad is
// recomputed by the whole warp, row_of(r, q) giving its row in the tile, put(row, col, value)
// receiving the values. Rows at or past `rows_valid` are skipped. `sees`: careful_row_of's.
template <class Element, int kMaxCols, bool kPaged, int kRows, class RowOf, class Put, class Sees = AllKeys>
__device__ __forceinline__ void repair_nan_rows(const CarefulRows& rows, int64_t m0, int64_t rows_valid,
                                                const bool (&nan_row)[kRows], int lane, RowOf&& row_of, Put&& put,
                                                Sees&& sees = {}) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    for (int q = 0; q < 8; ++q) {
      if (!__any_sync(0xffffffffu, lane / 4 == q && nan_row[r])) continue;
      const int row = row_of(r, q);
      if (row >= rows_valid) continue;
      careful_row<Element, kMaxCols, kPaged>(
          rows, m0 + row, lane, [&](int c, float value) { put(row, c, value); }, sees);
    }
  }
}

}  // namespace flashattn::cuda

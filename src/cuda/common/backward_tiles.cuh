// The backward's walk over the tiles of one key tile, shared by the backward kernel families:
// which query tiles see its keys (the transpose of the forward's key-tile ranges, from core::Mask),
// which of them see every key (no per-element mask), and the order the steps take them.
#pragma once

#include <cute/tensor.hpp>

#include <climits>
#include <cstdint>

#include "../../core/mask.hpp"
#include "../params.hpp"

namespace flashattn::cuda {

// Rows of sequence b's keys that dK / dV cover: every key row of the sequence, including those
// past seqused_k (their gradients are 0).
template <class Params>
__device__ __forceinline__ int64_t key_rows(const Params& p, int b) {
  return p.cu_seqlens_k == nullptr ? p.shape.seqlen_k : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
}

// Query tiles [begin, end) with a row that sees a key of [n0, n1): core::Mask's transpose of the
// forward's key-tile range, so a tile pair is visited here exactly when the forward visits it.
struct TileRange {
  int begin = 0, end = 0;
};
template <MaskKind kMask, int kBlockM>
__device__ __forceinline__ TileRange query_tiles(const core::Mask& mask, int64_t n0, int64_t n1) {
  if (n1 <= n0 || mask.seqlen_q == 0) return {};
  int64_t row_begin = 0, row_end = mask.seqlen_q;
  if constexpr (kMask != MaskKind::kNone) {
    row_begin = mask.row_begin(n0);
    row_end = mask.row_end(n1);
  }
  if (row_end <= row_begin) return {};
  return {static_cast<int>(row_begin / kBlockM), static_cast<int>((row_end + kBlockM - 1) / kBlockM)};
}

// Query tiles whose rows all see every key of [n0, n1): their steps skip the per-element mask.
// Without a mask kind only keys past seqlen_k need it (rows past seqlen_q have LSE2 = +inf, so
// their P is 0 anyway).
template <MaskKind kMask, int kBlockM>
__device__ __forceinline__ TileRange unmasked_query_tiles(const core::Mask& mask, int64_t n0, int64_t n1) {
  if constexpr (kMask == MaskKind::kNone) {
    return n1 <= mask.seqlen_k ? TileRange{0, INT_MAX} : TileRange{};
  } else {
    const core::Mask::Rows rows = mask.rows_seeing_all(n0, n1);
    if (rows.end <= rows.begin) return {};
    return {static_cast<int>((rows.begin + kBlockM - 1) / kBlockM), static_cast<int>(rows.end / kBlockM)};
  }
}

// A step's query head and query tile. The CTA walks its GQA group's heads in turn, each over the
// query tiles [tiles_begin, tiles_end): two registers, advanced once per step (no division).
// Descending, as FlashAttention-2 walks them: every key tile of a query tile then reaches it at
// about the same step, which deterministic mode's in-order dQ turns need (ascending, causal key
// tile n waited on tiles that reached the query tile 2n steps later: 0.48-0.60x of the
// non-deterministic speed, against 0.77-0.78x descending).
struct StepPos {
  int head = 0, tile = 0;
  __device__ __forceinline__ static StepPos first(int head, int tiles_end) { return {head, tiles_end - 1}; }
  __device__ __forceinline__ StepPos next(int tiles_begin, int tiles_end) const {
    return tile > tiles_begin ? StepPos{head, tile - 1} : StepPos{head + 1, tiles_end - 1};
  }
};

// The first key tile the forward visits for query tile m0: with the key tiles of a query tile
// taking turns at its dQ in order, key tile n goes n - first.
template <MaskKind kMask, int kBlockN>
__device__ __forceinline__ int first_key_tile(const core::Mask& mask, int64_t m0) {
  if constexpr (kMask == MaskKind::kNone) {
    return 0;
  } else {
    return static_cast<int>(mask.key_begin(m0) / kBlockN);
  }
}

}  // namespace flashattn::cuda

// The backward's walk over the tiles of one key tile, shared by the backward kernel families:
// which query tiles see its keys (the transpose of the forward's key-tile ranges, from core::Mask),
// which of them see every key (no per-element mask), and the order the steps take them.
#pragma once

#include <cute/tensor.hpp>

#include <climits>
#include <cstdint>

#include "../../core/block_mask.hpp"
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

// A block-sparse mask's walk of one key tile (core::BlockCells, the block mask's transpose): the
// query tiles of [tiles_begin, tiles_end) (core::Mask's range) whose query block the step's
// head's cells do not hide, in StepPos's order (the heads of the GQA group in turn, tiles
// descending), hidden blocks skipped whole. The mask's blocks hold whole tiles (the dispatcher's
// rule): a query block is tiles_per_block query tiles, and the key tile lies in one key block.
struct SparseQueryTiles {
  const int32_t* cells = nullptr;  // the key block's row of head 0; head h's at + h * head_stride
  int64_t head_stride = 0;
  int tiles_per_block = 1;
  int head_end = 0;  // past the GQA group's last query head

  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ static SparseQueryTiles make(const BackwardParams& p, int batch, int n_block,
                                                          int head_kv) {
    const core::BlockMask& m = p.fwd.block_mask;
    const int group = static_cast<int>(p.fwd.shape.heads_q / p.fwd.shape.heads_kv);
    SparseQueryTiles w;
    w.cells = p.block_cells.row(batch, 0, n_block / static_cast<int>(m.block_n / kBlockN));  // (32-bit division)
    w.head_stride = p.block_cells.key_blocks * p.block_cells.query_blocks;
    w.tiles_per_block = static_cast<int>(m.block_m / kBlockM);
    w.head_end = (head_kv + 1) * group;
    return w;
  }
  // The cell of pos's query block (core::kCellHidden, kCellWhole, or 1 + its bits block).
  __device__ __forceinline__ int32_t cell(StepPos pos) const {
    return cells[pos.head * head_stride + pos.tile / tiles_per_block];
  }
  // The first position from pos on (pos itself included) that the walk visits; head == head_end
  // past the last.
  __device__ __forceinline__ StepPos visible_from(StepPos pos, int tiles_begin, int tiles_end) const {
    while (pos.head < head_end) {
      if (pos.tile < tiles_begin) {
        pos = {pos.head + 1, tiles_end - 1};
        continue;
      }
      if (cell(pos) != core::kCellHidden) return pos;
      pos.tile = pos.tile / tiles_per_block * tiles_per_block - 1;  // past the hidden block
    }
    return pos;
  }
  __device__ __forceinline__ StepPos next(StepPos pos, int tiles_begin, int tiles_end) const {
    return visible_from(pos.next(tiles_begin, tiles_end), tiles_begin, tiles_end);
  }
  // The walk's steps from `first` (a visible_from position) on.
  __device__ __forceinline__ int steps(StepPos first, int tiles_begin, int tiles_end) const {
    int n = 0;
    for (StepPos pos = first; pos.head < head_end; pos = next(pos, tiles_begin, tiles_end)) ++n;
    return n;
  }
};

// Deterministic mode under a block-sparse mask: key tile n_block's turn at query tile m0 of
// (batch b, query head h), the number of key tiles before it that visit the query tile: those of
// the query block's listed key blocks (partial and full) from core::Mask's first key tile on.
// (Every tile of a listed block in [first, n_block) visits it: core::Mask's key range of a query
// tile is contiguous and reaches n_block.)
template <MaskKind kMask, int kBlockN>
__device__ __forceinline__ int sparse_turn(const core::BlockMask& m, const core::Mask& mask, int64_t b, int64_t h,
                                           int64_t m0, int n_block) {
  const int first = first_key_tile<kMask, kBlockN>(mask, m0);
  const int64_t qb = m0 / m.block_m;
  const int per_block = static_cast<int>(m.block_n / kBlockN);
  const int64_t lists = m.index_at(b, h, qb);
  int turn = 0;
  auto count = [&](const int32_t* list, int64_t entries) {
    for (int64_t s = 0; s < entries; ++s) {
      const int lo = cute::max(first, list[s] * per_block), hi = cute::min(n_block, (list[s] + 1) * per_block);
      turn += cute::max(0, hi - lo);
    }
  };
  count(m.partial_index_data + lists, m.partial_count(b, h, qb));
  if (m.full_count_data != nullptr) count(m.full_index_data + lists, m.full_count(b, h, qb));
  return turn;
}

}  // namespace flashattn::cuda

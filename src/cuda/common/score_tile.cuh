// The forward's score step on a register tile: raw q.k products -> exp2-domain scores with the
// variant's score modifiers (scale, softcap, the position term: ScoreVariant, variant.hpp) and
// the mask (core::Mask) applied. Shared by the sm80 forward, the sm90 forward and the teaching kernel:
// their accumulators give a thread the same columns of a row (mask.cuh columns_before).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "../../core/mask.hpp"
#include "../params.hpp"
#include "mask.cuh"
#include "sparse_tiles.cuh"

namespace flashattn::cuda {

// Raw q.k products of one (query tile, key tile) -> exp2-domain scores (ScoreVariant), with
// -inf where core::Mask hides the key; with variant.raw() the products stay unscaled (the
// softmax folds the scale in) and only the mask is applied. `scores` and `coord` are (row, col)
// views of the same accumulator; m0 / n0 are the tile's first query row and key. Per row, the visible keys are
// core::Mask's key range of a one-row tile, [key_begin(i), key_end(i + 1)); the position term (ALiBi) is
// the variant's with_bias at the distance i + sk - sq - j, taken from the row's diagonal (in fp32).
// The mask costs a row a few integer operations and each element one select: the row's visible
// columns become a bit word (columns_before), which ptxas moves into predicates 7 at a time
// (R2P); compared key by key, an element took two compares and the select (an H200 trace: the
// first, masked, step's scoring ~850 cycles at d128 against ~130 unmasked). The position term has a loop
// of its own behind a uniform branch (inside the mask's loop, predicated, it cost every masked
// element two more issue slots without ALiBi).
// kBlockBits: a block-sparse mask's element bits join the mask where `block_bits` is given (the
// tile's row 0, words_per_row words a row: SparseKeyTiles::bits_of), one more AND on the word.
// Host-callable so tests/gpu/test_sm80_layouts.cu checks it against core::Mask without a GPU.
template <int kBlockN, bool kBlockBits = false, class Scores, class Coord>
CUTE_HOST_DEVICE void score_tile(Scores& scores, const Coord& coord, const ScoreVariant& variant,
                                 const core::Mask& mask, int64_t m0, int64_t n0, bool apply_mask,
                                 const uint32_t* block_bits = nullptr, int words_per_row = 0) {
  constexpr int kRows = decltype(cute::size<0>(scores))::value;
  constexpr int kCols = decltype(cute::size<1>(scores))::value;
  const ScoreParams& sp = variant.params;
  if (sp.raw_scores) {
    // scaled later, in RowSoftmax::update
  } else if (sp.softcap_log2 > 0.0f) {
    CUTE_UNROLL
    for (int e = 0; e < cute::size(scores); ++e) scores(e) = capped_score_log2(sp, softcap_tanh(sp, scores(e)));
  } else {
    CUTE_UNROLL
    for (int e = 0; e < cute::size(scores); ++e) scores(e) *= sp.scale_log2;
  }
  if (variant.has_bias()) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = m0 + cute::get<0>(coord(r, 0));
      const float dist0 = static_cast<float>(mask.diag(i) - n0 - cute::get<1>(coord(r, 0)));  // at col0
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int dc = (c / 2) * 8 + c % 2;
        scores(r, c) = variant.with_bias(scores(r, c), dist0 - static_cast<float>(dc));
      }
    }
  }
  if (!apply_mask) return;
  // The tile's limits for its row 0, relative to n0 and narrowed to 32 bits (clamped to
  // +-2^30: a row adds < 2^16 and the result is clamped into [0, kBlockN], so nothing changes):
  // row i sees the tile's keys [clamp(begin0 + i - m0), clamp(min(keys, end0 + i - m0))), the
  // begin only with a left window edge (skipped without one, it cost the d64 non-causal kernel
  // 8 bytes of stack).
  auto narrow = [](int64_t v) {
    return static_cast<int>(cute::max(int64_t{-(1 << 30)}, cute::min(int64_t{1 << 30}, v)));
  };
  const int64_t diag0 = mask.diag(m0) - n0;
  const bool left_edge = mask.window_left >= 0;
  const int keys = narrow(mask.seqlen_k - n0);
  const int begin0 = left_edge ? narrow(diag0 - mask.window_left) : 0;
  const int end0 = mask.window_right >= 0 ? narrow(diag0 + mask.window_right + 1) : 1 << 30;
  auto tile_col = [](int key) { return cute::max(0, cute::min(kBlockN, key)); };
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = cute::get<0>(coord(r, 0)), col0 = cute::get<1>(coord(r, 0));
    auto visible = columns_before<kCols>(tile_col(cute::min(keys, end0 + row)) - col0);
    if (left_edge) visible &= ~columns_before<kCols>(tile_col(begin0 + row) - col0);
    if constexpr (kBlockBits) {
      if (block_bits != nullptr) visible &= block_bits_columns<kCols>(block_bits + row * words_per_row, col0);
    }
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      if (((visible >> c) & 1) == 0) scores(r, c) = -INFINITY;
    }
  }
}

}  // namespace flashattn::cuda

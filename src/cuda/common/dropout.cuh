// Dropout's keep-mask (core/philox.hpp, the one definition of which elements are kept) applied to
// a register tile of P, one Philox call per 8 of a thread's keys. Shared by the sm80 and sm90
// forward kernels: both accumulators give a thread keys 2t, 2t + 1 of every 8-key block. The
// Hopper backward's transposed tiles (a key per row) take dropout_keep_transposed below.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../../core/philox.hpp"
#include "../params.hpp"

namespace flashattn::cuda {

// Dropout on one tile of P (core/philox.hpp's keep-mask). A thread's columns c .. c + 7
// (c % 8 == 0) are the keys j0 + {0, 1, 8, 9, 16, 17, 24, 25} with j0 % 32 < 8 (the accumulator
// gives it keys 2t, 2t + 1 of every 8-key block; the tile starts at a multiple of 32 keys): one
// group of the convention, one Philox call. Per row, the keep bits first, the calls
// unrolled kCallsInFlight deep (all of a tile's at once spilled beside the sm90 kernels' S, P and
// O), then applied. The 1 / (1 - p) factor is applied to O once, at the end.
template <int kCallsInFlight, class Scores, class Coord>
__device__ __forceinline__ void dropout_tile(Scores& p, const Coord& coord, const DropoutParams& dp, uint64_t bh,
                                             int64_t m0, int64_t n0) {
  constexpr int kCols = decltype(cute::size<1>(p))::value;
  static_assert(kCols % 8 == 0 && kCols <= 64, "whole groups of 8 columns; a row's keep bits in one uint64_t");
  CUTE_UNROLL
  for (int r = 0; r < decltype(cute::size<0>(p))::value; ++r) {
    const auto i = static_cast<uint32_t>(m0 + cute::get<0>(coord(r, 0)));
    uint64_t keep = 0;
#pragma unroll kCallsInFlight
    for (int c = 0; c < kCols; c += 8) {
      const int64_t j0 = n0 + cute::get<1>(coord(r, c));
      keep |= uint64_t{core::dropout_keep8(dp.seed, dp.offset, bh, i, j0, dp.threshold)} << c;
    }
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      if (((keep >> c) & 1) == 0) p(r, c) = 0.0f;
    }
  }
}

// The keep bits of a thread's part of a transposed tile (S^T: a key per accumulator row, a query
// per column, as the Hopper backward holds it), bit 2c + r for column c and row r. In a WGMMA
// accumulator a thread's two rows are keys k and k + 8 (k = 16 x warp + lane / 4 in its 64-row
// block, so both lie in one 32-key chunk with the same (k % 8) / 2): one group of core/philox.hpp's
// convention, one call per column, of which the thread uses 2 of 8 bits (words (k % 32) / 8 and
// + 1, half k % 2). Lane ^ 4 holds keys k ^ 1 and k ^ 1 + 8 of the same columns, the other half
// of the same two words: the pair splits the columns, each making the calls of every other
// column and passing the partner its 2 bits of each (one shuffle of 16 bits), so a thread makes
// one call per 4 of its elements. n0: the tile's first key (a multiple of 32); m0: its first
// query; coord(r, c) = (key, query) in the tile.
template <class Scores, class Coord>
__device__ __forceinline__ uint32_t dropout_keep_transposed(const Scores& st, const Coord& coord,
                                                            const DropoutParams& dp, uint64_t bh, int64_t m0,
                                                            int64_t n0) {
  constexpr int kCols = decltype(cute::size<1>(st))::value;
  static_assert(decltype(cute::size<0>(st))::value == 2, "a thread's rows: keys k and k + 8 of a WGMMA accumulator");
  static_assert(kCols % 2 == 0 && kCols <= 16, "column pairs; 2 bits a column in one uint32_t");
  const int key = cute::get<0>(coord(0, 0));
  const bool odd = (key & 1) != 0;    // which half of each word is this thread's
  const bool high = (key & 16) != 0;  // words 2 and 3 (keys 16..31 of the chunk), else 0 and 1
  const uint32_t group = core::dropout_group(n0 + key);
  const uint32_t threshold = dp.threshold, threshold_high = dp.threshold << 16;
  uint32_t keep = 0, partner = 0;
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 2) {
    // This thread's call serves column c + odd (the partner's, c + !odd).
    const int64_t query = m0 + (odd ? cute::get<1>(coord(0, c + 1)) : cute::get<1>(coord(0, c)));
    const core::Philox4 w = core::dropout_words(dp.seed, dp.offset, bh, static_cast<uint32_t>(query), group);
    const uint32_t w0 = high ? w.x[2] : w.x[0], w1 = high ? w.x[3] : w.x[1];  // keys k, k + 8
    const uint32_t low_bits = uint32_t{(w0 & 0xFFFFu) >= threshold} | uint32_t{(w1 & 0xFFFFu) >= threshold} << 1;
    const uint32_t high_bits = uint32_t{w0 >= threshold_high} | uint32_t{w1 >= threshold_high} << 1;
    const int own_col = c + (odd ? 1 : 0);
    keep |= (odd ? high_bits : low_bits) << (2 * own_col);
    partner |= (odd ? low_bits : high_bits) << c;  // 2 bits per column pair, at bit c
  }
  const uint32_t received = __shfl_xor_sync(0xFFFFFFFFu, partner, 4);
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 2) {
    const int other_col = c + (odd ? 0 : 1);
    keep |= ((received >> c) & 3u) << (2 * other_col);
  }
  return keep;
}

}  // namespace flashattn::cuda

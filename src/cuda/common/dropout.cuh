// Dropout's keep-mask (core/philox.hpp, the one definition of which elements are kept) applied to
// a register tile of P, one Philox call per 8 of a thread's keys. Shared by the sm80 and sm90
// forward kernels: both accumulators give a thread keys 2t, 2t + 1 of every 8-key block.
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

}  // namespace flashattn::cuda

// core::Mask (core/mask.hpp, the one definition of which keys a query row sees) applied to
// register tiles: make_mask builds it from a kernel's parameters and mask kind, and columns_before
// evaluates it without 64-bit arithmetic per element, a row's visible columns as a bit word, one
// select a score (the forwards' score_tile, sm80 and sm90). Shared so that every kernel family
// builds and applies the mask one way.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../core/mask.hpp"
#include "../params.hpp"

namespace flashattn::cuda {

// The mask of a kernel instantiation: kNone kernels only bound the keys by seqlen_k.
template <MaskKind kMask, class Params>
__device__ __forceinline__ core::Mask make_mask(const Params& p, int64_t seqlen_q, int64_t seqlen_k) {
  if constexpr (kMask == MaskKind::kNone) {
    return {seqlen_q, seqlen_k, -1, -1};  // only the seqlen_k bound
  } else {
    return {seqlen_q, seqlen_k, p.window.left, p.window.right};
  }
}

// The keys of a thread's accumulator row, relative to its first one (col0): columns 2t, 2t + 1
// of every 8-key block (the sm80 mma.sync and sm90 WGMMA accumulators alike), so element c sits
// at col0 + (c / 2) * 8 + c % 2. Bit c of columns_before<kCols>(x) is set where that offset is
// below x: the first 2 (x / 8) + min(x % 8, 2) of the row's kCols elements.
template <int kCols>
using ColumnBits = std::conditional_t<(kCols > 32), uint64_t, uint32_t>;
template <int kCols>
CUTE_HOST_DEVICE ColumnBits<kCols> columns_before(int x) {
  static_assert(kCols % 2 == 0 && kCols <= 64, "pairs of columns; a row's bits in one word");
  x = cute::max(x, 0);
  const int n = cute::min(2 * (x >> 3) + cute::min(x & 7, 2), kCols);
  using Bits = ColumnBits<kCols>;
  return n == kCols ? ~Bits{0} : static_cast<Bits>((Bits{1} << n) - 1);
}

}  // namespace flashattn::cuda

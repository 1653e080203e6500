// core::Mask (core/mask.hpp, the one definition of which keys a query row sees) applied to
// register tiles: make_mask builds it from a kernel's parameters and mask kind, and two tile forms
// evaluate it without 64-bit arithmetic per element: columns_before turns a row's visible columns
// into a bit word, one select a score (the forwards' score_tile, sm80 and sm90); TileMask holds a
// tile's limits in three 32-bit registers, two compares a score (the backward's element pass,
// backward_score.cuh). Shared so that every kernel family builds and applies the mask one way.
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

// core::Mask seen from one (query tile m0, key tile n0) in 32-bit tile coordinates: row r of the
// tile sees columns [max(0, begin0 + r), min(keys, end0 + r)). Clamping begin0 / end0 to
// [-kBlockM, kBlockN] keeps every column test exact (a row offset is < kBlockM) and needs three
// registers instead of core::Mask's four 64-bit values.
struct TileMask {
  int begin0 = 0, end0 = 0, keys = 0;
  float diag0 = 0.0f;  // diag(m0) - n0: distance() below

  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ static TileMask make(const core::Mask& mask, int64_t m0, int64_t n0) {
    auto clamp = [](int64_t x) {
      return static_cast<int>(cute::max(int64_t{-kBlockM}, cute::min(int64_t{kBlockN}, x)));
    };
    const int64_t d = mask.diag(m0) - n0;
    TileMask t;
    t.begin0 = mask.window_left >= 0 ? clamp(d - mask.window_left) : -kBlockM;
    t.end0 = mask.window_right >= 0 ? clamp(d + mask.window_right + 1) : kBlockN;
    t.keys = clamp(mask.seqlen_k - n0);
    t.diag0 = static_cast<float>(d);
    return t;
  }
  __device__ __forceinline__ int begin(int r) const { return cute::max(0, begin0 + r); }
  __device__ __forceinline__ int end(int r) const { return cute::min(keys, end0 + r); }
  // The distance diag(i) - j of (tile row, tile column), the argument of ScoreVariant::with_bias.
  __device__ __forceinline__ float distance(int r, int col) const { return diag0 + static_cast<float>(r - col); }
  static constexpr bool kHasBits = false;  // no element bits (SparseTileMask's)
};

// A tile under a block-sparse mask (core::BlockMask): TileMask's range, and where the tile's
// block has element bits, those: row r's words `words` apart from `bits` (the tile's row 0,
// column 0 at bit 0 of word 0). A default-made one (bits null) sees as TileMask does.
struct SparseTileMask : TileMask {
  static constexpr bool kHasBits = true;
  const uint32_t* bits = nullptr;
  int words = 0;

  // Whether the element bits show (tile row r, tile column col).
  __device__ __forceinline__ bool bit(int r, int col) const {
    return bits == nullptr || ((bits[r * words + col / 32] >> (col % 32)) & 1u) != 0;
  }
};

}  // namespace flashattn::cuda

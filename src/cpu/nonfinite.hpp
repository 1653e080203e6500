// Keeping inf and NaN where they belong: a NaN (or inf) input must reach exactly the outputs of
// the rows and keys that see it. The dense tile products multiply a masked element's 0 by
// whatever the other operand holds, and 0 * NaN is NaN, so a bad value in a row or key that is
// masked for part of a tile would spread to the whole tile. The CPU flash path computes a tile
// with the fast dense products; where its accumulators then hold a NaN (an input held inf or
// NaN: rare), it computes that tile again "carefully" with these helpers.
#pragma once

#include <cmath>
#include <cstdint>

namespace flashattn::cpu {

// Whether rows [0, rows) x columns [0, cols) of a tile (leading dim ld) hold a NaN: the mark a
// spread 0 * inf or 0 * NaN leaves in an accumulator.
template <typename Acc>
bool any_nan(const Acc* tile, int64_t rows, int64_t cols, int64_t ld) {
  int nan = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) nan |= tile[r * ld + c] != tile[r * ld + c];
  }
  return nan != 0;
}

// dst = src with every non-finite element 0 (n elements).
template <typename Acc>
void finite_copy(const Acc* src, Acc* dst, int64_t n) {
  for (int64_t e = 0; e < n; ++e) dst[e] = std::isfinite(src[e]) ? src[e] : Acc(0);
}

// C[M, N] (+)= At[K, M]^T B[K, N], like gemm_tn, without the terms whose At element is 0: a
// masked probability must not carry the NaN of the row it multiplies.
template <typename Acc>
void gemm_tn_skipping_zeros(int64_t M, int64_t N, int64_t K, const Acc* at, int64_t ldat, const Acc* b, int64_t ldb,
                            Acc* c, int64_t ldc, bool accumulate) {
  if (!accumulate) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) c[m * ldc + n] = Acc(0);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t m = 0; m < M; ++m) {
      const Acc a = at[k * ldat + m];
      if (a == Acc(0)) continue;
      for (int64_t n = 0; n < N; ++n) c[m * ldc + n] += a * b[k * ldb + n];
    }
  }
}

}  // namespace flashattn::cpu

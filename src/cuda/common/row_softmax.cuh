// The online softmax's row statistics on register tiles (RowSoftmax: running max in the exp2
// domain, moved lazily, per-thread row sums; core/softmax.hpp's rules, such as safe_max, applied
// to a thread's rows). Shared by the sm80 forward, the sm90 forward (which splits the update
// around its asynchronous GEMMs: update_deferred, update_stale) and the teaching kernel.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "../../core/softmax.hpp"
#include "../pack_pair.cuh"
#include "fast_math.cuh"
#include "fragment.cuh"

namespace flashattn::cuda {

// Online softmax over the rows one thread holds. `sum` is this thread's share of the row (its
// columns); the quad's shares are added once, at the end, since rescaling is linear. The running
// max is kept in the exp2 domain; `scale` maps the tile's scores into it (scale_log2 for raw
// scores, 1 for scores score_tile already scaled; always > 0, so max and scale commute) and is
// folded into the exponent: P = 2^(s * scale - max), one FFMA and one MUFU per score.
//
// The max is moved lazily: only when some row of the warp would see a score more than
// kRescaleThreshold above the max it subtracts (a warp vote, so the branch is uniform) are the
// max, the sums and O rescaled. Otherwise P keeps the older max, so P <= 2^kRescaleThreshold
// (far inside fp16 / bf16 range, same relative precision); O, sum and max stay consistent,
// so O / sum and LSE = max + log2(sum) are the same softmax. Past the first tiles a row's max
// rarely climbs by 2^8, which saves the kRows x head_dim multiplies of O per tile (as many
// instructions as the tile's HMMA at d128) and the rescale exponentials.
template <int kRows>
struct RowSoftmax {
  static constexpr float kRescaleThreshold = 8.0f;  // log2 of the largest P allowed
  static constexpr float kRescaleLimit = 256.0f;    // 2^kRescaleThreshold
  static_assert(kRescaleLimit == static_cast<float>(1 << static_cast<int>(kRescaleThreshold)));
  float max[kRows];
  float sum[kRows];

  __device__ __forceinline__ RowSoftmax() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      max[r] = -INFINITY;
      sum[r] = 0.0f;
    }
  }

  // scores (rows, cols) -> P in place; O's rows follow the max when it moves.
  template <class Scores, class AccO>
  __device__ __forceinline__ void update(Scores& scores, AccO& acc_o, float scale) {
    float new_max[kRows];
    if (climbs(scores, scale, new_max)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float factor = move_max(r, new_max[r]);
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(acc_o); ++c) acc_o(r, c) *= factor;
      }
    }
    exponentiate(scores, scale);
  }

  // update in two halves, for a kernel whose O is still being written by a GEMM when the scores
  // are ready (sm90): P and the sums now, and whether O must be rescaled by factor (later).
  // (between: called once the max is settled, before the exponentials; a tracing build's stamp.)
  struct Nothing {
    __device__ __forceinline__ void operator()() const {}
  };
  template <class Scores, class Between = Nothing>
  __device__ __forceinline__ bool update_deferred(Scores& scores, float scale, float (&factor)[kRows],
                                                  Between between = {}) {
    float new_max[kRows];
    const bool moved = climbs(scores, scale, new_max);
    if (moved) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) factor[r] = move_max(r, new_max[r]);
    }
    between();
    exponentiate(scores, scale);
    return moved;
  }

  // update_deferred with the exponentials taken against the current max, and no row max unless
  // it must move (sm90): P goes straight into p16 (pairs of 16-bit values in the fragment's
  // register order) and the sums take it (exponentiate_stale). When the max need not move
  // (returns false), max, P and the sums stand, as update_deferred would leave them. Else p16 is
  // void and this is update_deferred (P redone in place in scores; true when the max moved and
  // factor is set). (between: called after the exponentials; a tracing build's stamp.)
  template <class Element, class Scores, int kPairs, class Between = Nothing>
  __device__ __forceinline__ bool update_stale(Scores& scores, float scale, float (&factor)[kRows],
                                               uint32_t (&p16)[kPairs], Between between = {}) {
    constexpr auto layout = decltype(scores.layout()){};
    static_assert(decltype(cute::size(layout))::value == 2 * kPairs, "P in pairs of neighbouring columns");
    static_assert(layout(0, 1) == layout(0, 0) + 1, "a pair's columns are neighbours in the fragment");
    const bool stood = exponentiate_stale(
        scores, scale, [](bool p) { return warp_any(p); },
        [&](int r, int c, float lo, float hi) { p16[layout(r, c) / 2] = pack_pair<Element>(lo, hi); });
    between();
    return stood ? false : update_deferred(scores, scale, factor);
  }

  // update_stale for kernels with no registers for a second P: P in place in scores (fp32, as
  // update_deferred leaves it). Returns whether the max stood (P and sums set); when it did not,
  // the scores are gone: the caller computes them again and takes update_deferred. any: the vote
  // (a warp's, or a wider one where the caller's recomputation needs every warp of a warpgroup).
  template <class Scores, class Any>
  __device__ __forceinline__ bool update_stale_in_place(Scores& scores, float scale, Any any) {
    return exponentiate_stale(scores, scale, any, [&](int r, int c, float lo, float hi) {
      scores(r, c) = lo;
      scores(r, c + 1) = hi;
    });
  }

  // P = 2^(s * scale - max) against the current max, pair by pair into put(row, col, lo, hi), and
  // whether the max may stand, read off this tile's sums: a thread's share of a row's tile sum
  // bounds each of its P (P >= 0), so no share above kRescaleLimit (and no row without a max yet)
  // means every P is within the limit update_deferred keeps, with no max found. (A share past it
  // with no P past it, the max climbing less than the threshold on many keys at once, only costs
  // the fallback; NaN or Inf in P fails the test too.) any: the vote on "some thread needs the
  // fallback". Where the max stands the sums take the tile's; else nothing is kept.
  template <class Scores, class Any, class Put>
  __device__ __forceinline__ bool exponentiate_stale(const Scores& scores, float scale, Any any, Put put) {
    static_assert(decltype(cute::size<1>(scores))::value % 2 == 0, "P in pairs of neighbouring columns");
    float tile_sum[kRows];
    bool fallback = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float subtract = core::safe_max(max[r]);
      tile_sum[r] = 0.0f;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); c += 2) {
        const float lo = fast_exp2(fmaf(scores(r, c), scale, -subtract));
        const float hi = fast_exp2(fmaf(scores(r, c + 1), scale, -subtract));
        tile_sum[r] += lo;
        tile_sum[r] += hi;
        put(r, c, lo, hi);
      }
      fallback = fallback || max[r] == -INFINITY || !(tile_sum[r] <= kRescaleLimit);
    }
    if (any(fallback)) return false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) sum[r] += tile_sum[r];
    return true;
  }

  // The new row maxima with this tile's scores, and whether the max must move (warp-uniform).
  template <class Scores>
  __device__ __forceinline__ bool climbs(const Scores& scores, float scale, float (&new_max)[kRows]) const {
    bool climbed = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float tile_max = -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) tile_max = fmaxf(tile_max, scores(r, c));
      new_max[r] = fmaxf(max[r], quad_max(tile_max) * scale);
      // true when an empty row gets its first finite score (new_max - -inf = inf)
      climbed = climbed || new_max[r] - max[r] > kRescaleThreshold;
    }
    return warp_any(climbed);
  }

  // Moves row r's max and rescales its sum; returns the factor O's row r must be scaled by.
  __device__ __forceinline__ float move_max(int r, float new_max) {
    const float factor = max[r] == -INFINITY ? 0.0f : fast_exp2(max[r] - new_max);  // core::rescale_factor
    max[r] = new_max;
    sum[r] *= factor;
    return factor;
  }

  // scores -> P = 2^(s * scale - max) in place, added to the sums.
  template <class Scores>
  __device__ __forceinline__ void exponentiate(Scores& scores, float scale) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float subtract = core::safe_max(max[r]);
      float row_sum = sum[r];
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) {
        const float p = fast_exp2(fmaf(scores(r, c), scale, -subtract));
        scores(r, c) = p;
        row_sum += p;
      }
      sum[r] = row_sum;
    }
  }
};

}  // namespace flashattn::cuda

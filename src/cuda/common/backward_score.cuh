// The backward's element pass on register tiles: S and dP -> P and dS, applying the variant's
// score modifiers (ScoreVariant, variant.hpp), the mask (mask.cuh TileMask) and dropout
// (core/philox.hpp's keep-mask) as the forward did, in one pass or in two around the dP GEMM.
// Written for the sm80 backward; in the common layer, beside the forward's score step, so that a
// backward kernel of another family applies the same pass to its tiles (with dropout, a thread's
// columns c .. c + 3 must lie in one Philox group: see softmax_tile).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../core/philox.hpp"
#include "../params.hpp"
#include "dropout.cuh"
#include "fast_math.cuh"
#include "mask.cuh"

namespace flashattn::cuda {

// Calls f(std::true_type) or f(std::false_type) as `flag` says: a uniform runtime flag becomes a
// compile-time one, so the element loops below carry no per-element branch on it (the branches
// and their convergence points cost more than the arithmetic of these loops).
template <class F>
__device__ __forceinline__ void with_flag(bool flag, F&& f) {
  if (flag) {
    f(cute::true_type{});
  } else {
    f(cute::false_type{});
  }
}

// The tile's TileMask where the element loop uses it (the mask applied, or scores that are not
// raw: the position term needs the diagonal), else none: made only there, so the common path (raw scores,
// a fully visible tile) carries none of its 64-bit arithmetic.
template <bool kUsed, class MakeTileMask>
__device__ __forceinline__ auto tile_mask_if(const MakeTileMask& tile_mask) {
  if constexpr (kUsed) {
    return tile_mask();
  } else {
    return decltype(tile_mask()){};
  }
}

// One element's probability P = 2^(score - LSE2) from its raw q.k product (score as the forward's
// score_tile: the variant's score and position term; the mask is the caller's), and in
// grad_factor d(score)/d(q.k) / scale. kRaw: variant.raw().
template <bool kRaw>
__device__ __forceinline__ float probability(float qk, const ScoreVariant& variant, const TileMask& mask, int row,
                                             int col, float row_lse2, float& grad_factor) {
  if constexpr (kRaw) {
    return fast_exp2(fmaf(qk, variant.params.scale_log2, -row_lse2));
  } else {  // softcap and / or ALiBi: uniform branches, rare
    const ScoreParams& sp = variant.params;
    float score = qk * sp.scale_log2;
    if (sp.softcap_log2 > 0.0f) {
      const float t = softcap_tanh(sp, qk);
      score = capped_score_log2(sp, t);
      grad_factor = variant.grad_factor(t);
    }
    if (variant.has_bias()) score = variant.with_bias(score, mask.distance(row, col));
    return fast_exp2(score - row_lse2);
  }
}

// The element-wise work of one (query tile, key tile). Where S's and dP's accumulators fit the
// registers together (up to 32 each a thread), softmax_tile<.., kWithGrad = true> does it in one
// pass after both GEMMs: with dP already issued, the exponentials' MUFU instructions run while
// the tensor cores work on dP (issued between the two GEMMs they had the SM's special function
// units to themselves; sm80_backward_tuning.md). With 128 x 128 tiles (d <= 64) it takes two
// passes around dP = dO V^T, softmax_tile<.., false> then softmax_grad_tile, so that neither the
// score modifications nor dP's accumulators are live during the other's work.
//
// softmax_tile: the raw q.k products in `s` become P = 2^(score - LSE2) (score as the forward's
// score_tile: scale or softcap, ALiBi, mask). With kWithGrad, `s` becomes P as dV needs it
// (dropped elements 0, kept ones over 1 - p) and dP in `dp` becomes dS = P (dP' - D), dP' being
// dP through the keep-mask and 1 / (1 - p), times d(score)/d(q.k) / scale = 1 - tanh^2 with
// softcap (the scale is applied to dQ and dK once, at the end). Without it, a dropped element's
// P is stored negated: its sign carries the keep-mask (the forward's Philox words) to the second
// pass, and `dp` is not touched.
template <bool kDropout, bool kWithGrad, class Scores, class Coord, class MakeTileMask>
__device__ __forceinline__ void softmax_tile(Scores& s, Scores& dp, const Coord& coord, const float* lse2,
                                             const float* delta, const ScoreVariant& variant,
                                             const MakeTileMask& tile_mask, int64_t m0, int64_t n0, bool apply_mask,
                                             const DropoutParams& dropout, uint64_t bh) {
  with_flag(variant.raw(), [&](auto raw) {
    with_flag(apply_mask, [&](auto masked) {
      const auto mask = tile_mask_if < decltype(masked)::value || !decltype(raw)::value > (tile_mask);
      CUTE_UNROLL
      for (int r = 0; r < cute::size<0>(s); ++r) {
        const int row = cute::get<0>(coord(r, 0));
        const float row_lse2 = lse2[row];
        [[maybe_unused]] const float row_delta = kWithGrad ? delta[row] : 0.0f;
        const int visible_begin = mask.begin(row), visible_end = mask.end(row);
        // Dropout: columns c .. c + 3 (c % 4 == 0) are one group of core/philox.hpp's convention,
        // one Philox call: in the sm80 backward's accumulators, keys 2t, 2t + 1 of two 8-key blocks
        // 16 apart in one 32-key chunk (a warp's blocks of the tile; the tile starts at a multiple
        // of 32).
        static_assert(!kDropout || decltype(cute::size<1>(s))::value % 4 == 0, "dropout: a thread's columns in fours");
        [[maybe_unused]] core::Philox4 words{};
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s); c += 2) {
          if constexpr (kDropout) {
            if (c % 4 == 0) {
              words = core::dropout_words(dropout.seed, dropout.offset, bh, static_cast<uint32_t>(m0 + row),
                                          core::dropout_group(n0 + cute::get<1>(coord(r, c))));
            }
          }
          CUTE_UNROLL
          for (int e = c; e < c + 2; ++e) {
            const int col = cute::get<1>(coord(r, e));
            [[maybe_unused]] float grad_factor = 1.0f;  // used with kWithGrad
            float p = probability<decltype(raw)::value>(s(r, e), variant, mask, row, col, row_lse2, grad_factor);
            bool visible = col >= visible_begin && col < visible_end;
            if constexpr (std::decay_t<decltype(mask)>::kHasBits) visible = visible && mask.bit(row, col);
            if constexpr (decltype(masked)::value) p = visible ? p : 0.0f;
            [[maybe_unused]] bool keep = true;
            if constexpr (kDropout) keep = core::dropout_bits(words, n0 + col) >= dropout.threshold;
            if constexpr (kWithGrad) {
              const float dp_kept = keep ? (kDropout ? dp(r, e) * dropout.keep_scale : dp(r, e)) : 0.0f;
              s(r, e) = keep ? (kDropout ? p * dropout.keep_scale : p) : 0.0f;
              // A masked dS is 0, not 0 * NaN: a NaN dP (a bad value row of a key the row does not
              // see) or D must not reach dQ (or dK) through it (docs/CONVENTIONS.md, "NaN").
              const float ds = p * (dp_kept - row_delta) * grad_factor;
              dp(r, e) = !decltype(masked)::value || visible ? ds : 0.0f;
            } else {
              s(r, e) = keep ? p : -p;
            }
          }
        }
      }
    });
  });
}

// softmax_grad_tile: with dP = dO.v in `dp`, dp becomes dS = P (dP - D) (dP through the keep-mask
// and 1 / (1 - p) with dropout), times d(score)/d(q.k) / scale = 1 - tanh^2 with softcap (the
// scale is applied to dQ and dK once, at the end); `s` becomes P as dV needs it (dropped elements
// 0, kept ones over 1 - p). tanh is recovered from P itself, score = log2(P) + LSE2, rather than
// kept in registers through the dP GEMM; where P = 0, dS = 0 whatever the factor. In a masked
// step (apply_mask) a masked dS is 0, as softmax_tile makes it.
template <bool kDropout, class Scores, class Coord, class MakeTileMask>
__device__ __forceinline__ void softmax_grad_tile(Scores& s, Scores& dp, const Coord& coord, const float* lse2,
                                                  const float* delta, const ScoreVariant& variant,
                                                  const MakeTileMask& tile_mask, float keep_scale, bool apply_mask) {
  with_flag(variant.params.softcap_log2 > 0.0f, [&](auto softcap) {
    with_flag(apply_mask, [&](auto masked) {
      const auto mask = tile_mask_if < decltype(softcap)::value || decltype(masked)::value > (tile_mask);
      CUTE_UNROLL
      for (int r = 0; r < cute::size<0>(s); ++r) {
        const int row = cute::get<0>(coord(r, 0));
        const float row_delta = delta[row];
        [[maybe_unused]] const int visible_begin = mask.begin(row), visible_end = mask.end(row);
        CUTE_UNROLL
        for (int e = 0; e < cute::size<1>(s); ++e) {
          const float p_signed = s(r, e);
          const float p = kDropout ? fabsf(p_signed) : p_signed;
          float dp_true = dp(r, e), p_out = p;
          if constexpr (kDropout) {
            const bool keep = !signbit(p_signed);
            dp_true = keep ? dp_true * keep_scale : 0.0f;
            p_out = keep ? p * keep_scale : 0.0f;
          }
          float grad_factor = 1.0f;
          if constexpr (decltype(softcap)::value) {
            float score = fast_log2(p) + lse2[row];  // -inf where P = 0: the factor is then unused
            if (variant.has_bias()) score = variant.without_bias(score, mask.distance(row, cute::get<1>(coord(r, e))));
            grad_factor = p > 0.0f ? variant.capped_grad_factor(score) : 0.0f;
          }
          s(r, e) = p_out;
          const float ds = p * (dp_true - row_delta) * grad_factor;
          if constexpr (decltype(masked)::value) {  // a masked dS is 0, not 0 * NaN (see softmax_tile)
            const int col = cute::get<1>(coord(r, e));
            bool visible = col >= visible_begin && col < visible_end;
            if constexpr (std::decay_t<decltype(mask)>::kHasBits) visible = visible && mask.bit(row, col);
            dp(r, e) = visible ? ds : 0.0f;
          } else {
            dp(r, e) = ds;
          }
        }
      }
    });
  });
}

// The same pass on transposed tiles (S^T and dP^T: a key per accumulator row, a query per column,
// as the Hopper backward computes them), in one pass after both GEMMs: `st` becomes P^T as dV
// needs it (with dropout, dropped elements 0 and kept ones over 1 - p) and `dpt` dS^T = P^T (dP^T'
// - D) times the softcap factor, dP^T' being dP^T through the keep-mask and 1 / (1 - p). `coord`
// gives (key, query) in the tile, whose first query and key are m0 and n0; LSE2 and D are per
// column. The keep bits come first, for the whole tile (dropout.cuh dropout_keep_transposed: a
// Philox group runs along one query's keys, which this layout spreads over the lanes). A masked
// dS is left 0 * (dP - D), not forced to 0 as softmax_tile does: the select spilled the Hopper
// kernel's softcap / ALiBi variant (docs/CONVENTIONS.md, "NaN", states what this leaves).
// `raw`: variant.raw() as a compile-time flag (the Hopper backward has a kernel for each).
template <bool kDropout, class Raw, class Scores, class Coord, class MakeTileMask>
__device__ __forceinline__ void softmax_grad_tile_transposed(Raw raw, Scores& st, Scores& dpt, const Coord& coord,
                                                             const float* lse2, const float* delta,
                                                             const ScoreVariant& variant, const MakeTileMask& tile_mask,
                                                             bool apply_mask, const DropoutParams& dropout, uint64_t bh,
                                                             int64_t m0, int64_t n0) {
  [[maybe_unused]] uint32_t keep = 0;
  if constexpr (kDropout) keep = dropout_keep_transposed(st, coord, dropout, bh, m0, n0);
  with_flag(apply_mask, [&](auto masked) {
    const TileMask mask = tile_mask_if < decltype(masked)::value || !decltype(raw)::value > (tile_mask);
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(st); ++c) {
      const int query = cute::get<1>(coord(0, c));
      const float query_lse2 = lse2[query], query_delta = delta[query];
      const int visible_begin = mask.begin(query), visible_end = mask.end(query);
      CUTE_UNROLL
      for (int r = 0; r < cute::size<0>(st); ++r) {
        const int key = cute::get<0>(coord(r, c));
        float grad_factor = 1.0f;
        float p = probability<decltype(raw)::value>(st(r, c), variant, mask, query, key, query_lse2, grad_factor);
        if constexpr (decltype(masked)::value) p = key >= visible_begin && key < visible_end ? p : 0.0f;
        if constexpr (kDropout) {
          const bool kept = ((keep >> (2 * c + r)) & 1u) != 0;
          const float dp_kept = kept ? dpt(r, c) * dropout.keep_scale : 0.0f;
          st(r, c) = kept ? p * dropout.keep_scale : 0.0f;
          dpt(r, c) = p * (dp_kept - query_delta) * grad_factor;
        } else {
          st(r, c) = p;
          dpt(r, c) = p * (dpt(r, c) - query_delta) * grad_factor;
        }
      }
    }
  });
}

}  // namespace flashattn::cuda

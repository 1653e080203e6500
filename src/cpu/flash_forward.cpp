// CPU FlashAttention-2 forward: outer loop over query tiles (the parallel work items, one per
// (batch, head, q-tile)), inner loop over the key/value tiles the mask lets them see, online
// softmax in the exp2 domain, O normalised and written once. Extra memory is O(tile) per thread.
//
// Per key tile:  S^T = K Q^T  ->  mods/mask  ->  running max, P^T = 2^(S^T - max), row sums
//                ->  O = O * factor + (P^T)^T V.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/softmax.hpp"
#include "backend.hpp"
#include "nonfinite.hpp"
#include "tiles.hpp"

namespace flashattn::cpu {
namespace {

using detail::Problem;
using detail::SeqInfo;

struct WorkItem {
  int64_t b, h, m_block;
};

std::vector<WorkItem> query_tiles(const Problem& p) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t blocks = (detail::seq_info(p, b).seqlen_q + kBlockM - 1) / kBlockM;
    for (int64_t h = 0; h < p.heads_q; ++h) {
      for (int64_t m = 0; m < blocks; ++m) items.push_back({b, h, m});
    }
  }
  return items;
}

// Per-thread tiles. Acc is float, or double for fp64 inputs and the precise mode. Q and K are
// d_pad wide (q's head_dim padded), V and O dv_pad (v's).
template <typename Acc>
struct ForwardScratch {
  int64_t d_pad, dv_pad;
  Scratch<Acc> qt, k, v, st, o, o_comp, pv;
  std::vector<Acc> row_max, row_sum, sum_comp, tile_sum, new_max, factor, sub;

  ForwardScratch(int64_t d_pad_, int64_t dv_pad_)
      : d_pad(d_pad_),
        dv_pad(dv_pad_),
        qt(d_pad * kBlockM),
        k(kBlockN * d_pad),
        v(kBlockN * dv_pad),
        st(kBlockN * kBlockM),
        o(kBlockM * dv_pad),
        o_comp(kBlockM * dv_pad),
        pv(kBlockM * dv_pad),
        row_max(kBlockM),
        row_sum(kBlockM),
        sum_comp(kBlockM),
        tile_sum(kBlockM),
        new_max(kBlockM),
        factor(kBlockM),
        sub(kBlockM) {}
};

// Neumaier-compensated sum += x.
template <typename Acc>
inline void add_compensated(Acc& sum, Acc& comp, Acc x) {
  const Acc t = sum + x;
  comp += std::abs(sum) >= std::abs(x) ? (sum - t) + x : (x - t) + sum;
  sum = t;
}

// careful: products without the zero (masked) terms, for a tile whose inputs hold inf or NaN.
// Types: the storage types of q, k / v and out (ElementTypes; FP8 inputs are dequantised by the
// tile loads).
template <typename Types, typename Acc>
void forward_tile(const Problem& p, const WorkItem& w, ForwardScratch<Acc>& sc, bool precise, bool careful = false) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  const SeqInfo si = detail::seq_info(p, w.b);
  const int64_t d = p.head_dim, dp = sc.d_pad, d_v = p.head_dim_v, dvp = sc.dv_pad;
  const int64_t i0 = w.m_block * kBlockM;
  const int64_t rows = std::min(kBlockM, si.seqlen_q - i0);
  const int64_t rows_pad = round_up(rows, kTileAlign);
  const int64_t hk = w.h / p.group_size();
  const ScoreMod<Acc> mod(p, si, w.b, w.h);
  const uint64_t bh = static_cast<uint64_t>(w.b * p.heads_q + w.h);
  Acc* o = sc.o.get();
  Acc* st = sc.st.get();

  load_tile_transposed<typename Types::q, Acc>(p.q, w.b, si.q_start + i0, rows, rows_pad, w.h, d, dp, mod.q_scale(),
                                               sc.qt.get(), rows_pad);
  std::fill(o, o + rows_pad * dvp, Acc(0));
  if (precise) std::fill(sc.o_comp.get(), sc.o_comp.get() + rows_pad * dvp, Acc(0));
  // Padding rows start empty (max -inf, sum 0) whatever the sink, so they stay NaN-free.
  const core::SinkStart<Acc> start = mod.row_start();
  std::fill(sc.row_max.begin(), sc.row_max.end(), kNegInf);
  std::fill(sc.row_sum.begin(), sc.row_sum.end(), Acc(0));
  std::fill(sc.row_max.begin(), sc.row_max.begin() + rows, start.max);
  std::fill(sc.row_sum.begin(), sc.row_sum.begin() + rows, start.sum);
  std::fill(sc.sum_comp.begin(), sc.sum_comp.end(), Acc(0));

  for_each_key_tile(mod, i0, i0 + rows, [&](int64_t j0) {
    const int64_t keys = std::min(kBlockN, si.seqlen_k - j0);
    const int64_t keys_pad = round_up(keys, kTileAlign);
    load_tile<typename Types::kv, Acc>(p.k, w.b, si.k_start + j0, keys, keys_pad, hk, d, Acc(1), sc.k.get(), dp);
    load_tile<typename Types::kv, Acc>(p.v, w.b, si.k_start + j0, keys, keys_pad, hk, d_v, Acc(1), sc.v.get(), dvp);

    gemm(keys_pad, rows_pad, dp, sc.k.get(), dp, sc.qt.get(), rows_pad, st, rows_pad, false);
    mod.apply(st, KeysByQueries{rows_pad}, i0, rows, rows_pad, j0, keys, keys_pad);

    // Online softmax, one column per query row.
    std::copy(sc.row_max.begin(), sc.row_max.begin() + rows_pad, sc.new_max.begin());
    column_max(st, rows_pad, keys_pad, rows_pad, sc.new_max.data());
    for (int64_t r = 0; r < rows_pad; ++r) {
      sc.factor[r] = core::rescale_factor(sc.row_max[r], sc.new_max[r]);
      sc.sub[r] = core::safe_max(sc.new_max[r]);
      sc.row_max[r] = sc.new_max[r];
      sc.row_sum[r] *= sc.factor[r];
      sc.sum_comp[r] *= sc.factor[r];
    }
    scale_rows(o, dvp, rows_pad, dvp, sc.factor.data());
    if (precise) scale_rows(sc.o_comp.get(), dvp, rows_pad, dvp, sc.factor.data());
    // Row sums: per tile from zero, then a compensated add into the running sum, so contexts
    // of millions of keys keep the LSE accurate (a plain fp32 running sum drifts by ~1e-4).
    std::fill(sc.tile_sum.begin(), sc.tile_sum.begin() + rows_pad, Acc(0));
    exp2_columns(st, rows_pad, keys_pad, rows_pad, sc.sub.data(), sc.tile_sum.data());
    for (int64_t r = 0; r < rows; ++r) add_compensated(sc.row_sum[r], sc.sum_comp[r], sc.tile_sum[r]);
    if (p.dropout.enabled()) apply_dropout(p.dropout, bh, i0, rows, j0, keys, st, KeysByQueries{rows_pad});

    if (precise) {
      if (careful) {
        gemm_tn_skipping_zeros(rows_pad, dvp, keys_pad, st, rows_pad, sc.v.get(), dvp, sc.pv.get(), dvp, false);
      } else {
        gemm_tn(rows_pad, dvp, keys_pad, st, rows_pad, sc.v.get(), dvp, sc.pv.get(), dvp, false);
      }
      for (int64_t e = 0; e < rows * dvp; ++e) add_compensated(o[e], sc.o_comp.get()[e], sc.pv.get()[e]);
    } else if (careful) {
      gemm_tn_skipping_zeros(rows_pad, dvp, keys_pad, st, rows_pad, sc.v.get(), dvp, o, dvp, true);
    } else {
      gemm_tn(rows_pad, dvp, keys_pad, st, rows_pad, sc.v.get(), dvp, o, dvp, true);
    }
  });
  // A NaN in O: a V row held inf or NaN, which 0 * NaN may have carried into rows that do not see
  // its key. Redone carefully, it reaches exactly the rows that do (nonfinite.hpp).
  if (!careful && any_nan(o, rows, d_v, dvp)) return forward_tile<Types, Acc>(p, w, sc, precise, true);

  // Normalise: O = acc / sum (dropout's 1/(1-p) is already in P); empty rows give 0 and LSE
  // -inf, or the sink's logit with one.
  for (int64_t r = 0; r < rows; ++r) {
    const Acc sum = sc.row_sum[r] + sc.sum_comp[r];
    if (precise) {
      for (int64_t c = 0; c < d_v; ++c) o[r * dvp + c] += sc.o_comp.get()[r * dvp + c];
    }
    sc.factor[r] = sum > Acc(0) ? Acc(1) / sum : Acc(0);
    if (p.lse.data) {
      *row_ptr<float>(p.lse, w.b, si.q_start + i0 + r, w.h) = static_cast<float>(core::lse_natural(sc.row_max[r], sum));
    }
  }
  scale_rows(o, dvp, rows, dvp, sc.factor.data());
  store_tile<typename Types::out, Acc>(p.out, w.b, si.q_start + i0, rows, w.h, d_v, o, dvp, Acc(1));
}

template <typename Types, typename Acc>
void run_forward(const Problem& p, bool precise) {
  const std::vector<WorkItem> items = query_tiles(p);
  const int64_t d_pad = round_up(p.head_dim, kTileAlign), dv_pad = round_up(p.head_dim_v, kTileAlign);
  parallel_items(
      static_cast<int64_t>(items.size()), [&] { return ForwardScratch<Acc>(d_pad, dv_pad); },
      [&](ForwardScratch<Acc>& scratch, int64_t t) { forward_tile<Types, Acc>(p, items[t], scratch, precise); });
}

}  // namespace

void flash_forward(const Problem& p) {
  dispatch_element_types(p, [&](auto types) {
    using Types = decltype(types);
    if constexpr (std::is_same_v<typename Types::q, double>) {
      run_forward<Types, double>(p, true);
    } else if (p.precise) {
      run_forward<Types, double>(p, true);
    } else {
      run_forward<Types, float>(p, false);
    }
  });
}

}  // namespace flashattn::cpu

// CPU FlashAttention backward: recomputes P from the saved LSE (no O(N^2) storage) with
// D = rowsum(dO * O). Three parallel, race-free passes, so the result is bitwise deterministic
// without atomics:
//   rows:  per (batch, head, q-tile): D and the LSE to subtract, into O(N) buffers, and the
//          tile's share of the learnable sink's gradient;
//   dQ:    per (batch, head, q-tile), over its key tiles:         S, dP -> dQ     (3 GEMMs);
//   dK dV: per (batch, kv-head, k-tile), over the query tiles of every head of its GQA group,
//          in a fixed order:                                      S, dP -> dK, dV (4 GEMMs).
// 7 tile GEMMs per tile pair instead of the 5 of one pass with atomic dQ accumulation; on a CPU
// the atomics would cost more than the recomputation. Each pass loads its fixed operands once
// per work item in the layout its GEMMs want: the dQ pass keeps score tiles transposed
// [keys, queries] (Q^T, dO^T fixed), the dK/dV pass untransposed [queries, keys] (K^T, V^T fixed).
//
// The LSE arrives in fp32. With fp64 accumulators (fp64 inputs, precise mode) that would cap
// the gradients' accuracy near 1e-7, so the rows pass then re-derives each row's LSE at full
// precision (one more sweep of S over the keys), and takes it where it agrees with the given one.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../core/softmax.hpp"
#include "backend.hpp"
#include "nonfinite.hpp"
#include "tiles.hpp"

namespace flashattn::cpu {
namespace {

using detail::Problem;
using detail::SeqInfo;
constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename Acc>
struct BackwardScratch {
  int64_t d_pad, dv_pad;  // q's and k's head_dim padded; v's (and dO's)
  // Query side [kBlockM, d_pad] (Q times q_scale): Q^T and dO^T (dQ pass, rows pass) or Q and
  // dO (dK/dV pass), dO dv_pad wide; the dQ accumulator.
  Scratch<Acc> q, dout, dq;
  // Key side [kBlockN, d_pad]: K and V (dQ pass) or K^T and V^T (dK/dV pass), V dv_pad wide;
  // dK, dV (dv_pad).
  Scratch<Acc> k, v, dk, dv;
  // Score-shaped tiles: S -> P, dP -> dS, raw products (softcap).
  Scratch<Acc> p, ds, raw;
  std::vector<Acc> row_max, row_sum, new_max, sub;  // rows pass, fp64 refinement

  BackwardScratch(int64_t d_pad_, int64_t dv_pad_)
      : d_pad(d_pad_),
        dv_pad(dv_pad_),
        q(kBlockM * d_pad),
        dout(kBlockM * dv_pad),
        dq(kBlockM * d_pad),
        k(kBlockN * d_pad),
        v(kBlockN * dv_pad),
        dk(kBlockN * d_pad),
        dv(kBlockN * dv_pad),
        p(kBlockN * kBlockM),
        ds(kBlockN * kBlockM),
        raw(kBlockN * kBlockM),
        row_max(kBlockM),
        row_sum(kBlockM),
        new_max(kBlockM),
        sub(kBlockM) {}
};

// D = rowsum(dO * O) and the LSE to subtract (log2 domain; +inf for an empty row, so its P is
// exactly 0) of every query row, written by the rows pass and read by the other two.
template <typename Acc>
struct RowStats {
  std::vector<Acc> delta, lse2;
  int64_t max_rows = 0;

  explicit RowStats(const Problem& p) {
    for (int64_t b = 0; b < p.batch; ++b) max_rows = std::max(max_rows, detail::seq_info(p, b).seqlen_q);
    delta.assign(static_cast<size_t>(p.batch * p.heads_q * max_rows), 0);
    lse2.assign(delta.size(), 0);
  }
  int64_t base(const Problem& p, int64_t b, int64_t h) const { return (b * p.heads_q + h) * max_rows; }
};

// Geometry of the (q-tile, k-tile) pair being recomputed.
struct TilePair {
  int64_t i0 = 0, rows = 0, rows_pad = 0;
  int64_t j0 = 0, keys = 0, keys_pad = 0;

  void set_rows(int64_t i, int64_t seqlen_q) {
    i0 = i;
    rows = std::min(kBlockM, seqlen_q - i);
    rows_pad = round_up(rows, kTileAlign);
  }
  void set_keys(int64_t j, int64_t seqlen_k) {
    j0 = j;
    keys = std::min(kBlockN, seqlen_k - j);
    keys_pad = round_up(keys, kTileAlign);
  }
};

// Softcap: dS *= d(softcap)/d(raw) = 1 - tanh(raw)^2 (the bias of ALiBi is constant).
template <typename Acc>
void softcap_grad(const ScoreMod<Acc>& mod, const Acc* raw, Acc* ds, int64_t n) {
  if (mod.softcap <= 0.0) return;
  for (int64_t e = 0; e < n; ++e) {
    const Acc th = std::tanh(raw[e]);
    ds[e] *= Acc(1) - th * th;
  }
}

// Careful tiles: P and dS are 0 outside the mask. A row whose forward met a NaN has LSE NaN (or
// its D = dO.O is NaN): exp2(s - lse) and dS = P (dP - D) are then NaN for every element, and a
// bad V or dO makes dP NaN for masked elements too. Zeroed, the NaN reaches exactly the keys the
// row sees (their dK and dV) and the row's own dQ (nonfinite.hpp).
template <typename Acc, typename Layout>
void zero_outside_mask(const ScoreMod<Acc>& mod, const TilePair& t, Layout at, Acc* pt, Acc* dst) {
  for (int64_t r = 0; r < t.rows_pad; ++r) {
    for (int64_t k = 0; k < t.keys_pad; ++k) {
      if (r < t.rows && k < t.keys && mod.visible(t.i0 + r, t.j0 + k)) continue;
      pt[at.index(r, k)] = Acc(0);
      dst[at.index(r, k)] = Acc(0);
    }
  }
}

// ---- rows pass ------------------------------------------------------------------------------

// Online (max, sum) over every visible key: the row LSE at Acc precision (log2 domain).
template <typename T, typename Acc>
void refine_lse(const Problem& p, const SeqInfo& si, int64_t b, int64_t hk, const ScoreMod<Acc>& mod, TilePair t,
                BackwardScratch<Acc>& sc, Acc* lse2) {
  const int64_t d = p.head_dim, dp = sc.d_pad;
  const core::SinkStart<Acc> start = mod.row_start();
  std::fill(sc.row_max.begin(), sc.row_max.end(), start.max);
  std::fill(sc.row_sum.begin(), sc.row_sum.end(), start.sum);
  for_each_key_tile(mod, t.i0, t.i0 + t.rows, [&](int64_t j) {
    t.set_keys(j, si.seqlen_k);
    load_tile<T, Acc>(p.k, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d, Acc(1), sc.k.get(), dp);
    Acc* st = sc.p.get();
    gemm(t.keys_pad, t.rows_pad, dp, sc.k.get(), dp, sc.q.get(), t.rows_pad, st, t.rows_pad, false);
    mod.apply(st, KeysByQueries{t.rows_pad}, t.i0, t.rows, t.rows_pad, t.j0, t.keys, t.keys_pad);
    std::copy(sc.row_max.begin(), sc.row_max.begin() + t.rows_pad, sc.new_max.begin());
    column_max(st, t.rows_pad, t.keys_pad, t.rows_pad, sc.new_max.data());
    for (int64_t r = 0; r < t.rows_pad; ++r) {
      sc.row_sum[r] *= core::rescale_factor(sc.row_max[r], sc.new_max[r]);
      sc.row_max[r] = sc.new_max[r];
      sc.sub[r] = core::safe_max(sc.new_max[r]);
    }
    exp2_columns(st, t.rows_pad, t.keys_pad, t.rows_pad, sc.sub.data(), sc.row_sum.data());
  });
  for (int64_t r = 0; r < t.rows; ++r) {
    lse2[r] = core::lse_natural(sc.row_max[r], sc.row_sum[r]) * static_cast<Acc>(core::kLog2e);
  }
}

// Returns the tile's share of the sink's gradient, -sum over its rows of P_sink * D.
template <typename T, typename Acc>
double rows_tile(const Problem& p, int64_t b, int64_t h, int64_t m_block, bool refine, RowStats<Acc>& stats,
                 BackwardScratch<Acc>& sc) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, d_v = p.head_dim_v, row0 = si.q_start + m_block * kBlockM;
  TilePair t;
  t.set_rows(m_block * kBlockM, si.seqlen_q);
  Acc* delta = stats.delta.data() + stats.base(p, b, h) + t.i0;
  Acc* lse2 = stats.lse2.data() + stats.base(p, b, h) + t.i0;
  for (int64_t r = 0; r < t.rows; ++r) {
    const T* o = row_ptr<T>(p.out, b, row0 + r, h);
    const T* g = row_ptr<T>(p.dout, b, row0 + r, h);
    Acc dot = 0;
    for (int64_t c = 0; c < d_v; ++c) dot += static_cast<Acc>(to_float(g[c])) * static_cast<Acc>(to_float(o[c]));
    delta[r] = dot;
    lse2[r] = static_cast<Acc>(*row_ptr<float>(p.lse, b, row0 + r, h) * core::kLog2e);
  }
  if (refine) {
    const ScoreMod<Acc> mod(p, si, b, h);
    load_tile_transposed<T, Acc>(p.q, b, row0, t.rows, t.rows_pad, h, d, sc.d_pad, mod.q_scale(), sc.q.get(),
                                 t.rows_pad);
    Acc refined[kBlockM];
    refine_lse<T, Acc>(p, si, b, h / p.group_size(), mod, t, sc, refined);
    // The refined LSE replaces the given one only where they agree to the given one's fp32
    // rounding: a caller may pass another LSE on purpose (the whole row's, when these keys are
    // one block of a longer row, as context parallelism does), and the backward must take it.
    for (int64_t r = 0; r < t.rows; ++r) {
      const Acc tolerance = Acc(8) * std::numeric_limits<float>::epsilon() * std::max(Acc(1), std::abs(lse2[r]));
      if (refined[r] == lse2[r] || std::abs(refined[r] - lse2[r]) <= tolerance) lse2[r] = refined[r];
    }
  }
  double dsink = 0.0;
  const double sink = p.score.sink_logit(h);
  for (int64_t r = 0; r < t.rows; ++r) {
    const double p_sink = core::sink_probability(sink, static_cast<double>(lse2[r]) * core::kLn2);
    if (p_sink != 0.0) dsink -= p_sink * static_cast<double>(delta[r]);
    if (lse2[r] == -std::numeric_limits<Acc>::infinity()) lse2[r] = static_cast<Acc>(kInf);
  }
  return dsink;
}

// ---- dQ pass: score tiles [keys, queries] ---------------------------------------------------

// careful: for a tile whose inputs hold inf or NaN (see the end), P and dS confined to the mask,
// and a non-finite K entering dQ as 0 (it reaches the rows that see its key through their dS).
template <typename T, typename Acc>
void dq_tile(const Problem& p, int64_t b, int64_t h, int64_t m_block, const RowStats<Acc>& stats,
             BackwardScratch<Acc>& sc, bool careful = false) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, dp = sc.d_pad, d_v = p.head_dim_v, dvp = sc.dv_pad;
  const ScoreMod<Acc> mod(p, si, b, h);
  const int64_t hk = h / p.group_size();
  const uint64_t bh = static_cast<uint64_t>(b * p.heads_q + h);
  TilePair t;
  t.set_rows(m_block * kBlockM, si.seqlen_q);
  const int64_t row0 = si.q_start + t.i0, ld = t.rows_pad;
  load_tile_transposed<T, Acc>(p.q, b, row0, t.rows, t.rows_pad, h, d, dp, mod.q_scale(), sc.q.get(), ld);
  load_tile_transposed<T, Acc>(p.dout, b, row0, t.rows, t.rows_pad, h, d_v, dvp, Acc(1), sc.dout.get(), ld);
  // Per-query vectors; padding rows get D 0 and LSE +inf (P = 0).
  std::vector<Acc> delta(static_cast<size_t>(ld), 0), lse2(static_cast<size_t>(ld), static_cast<Acc>(kInf));
  std::copy_n(stats.delta.data() + stats.base(p, b, h) + t.i0, t.rows, delta.begin());
  std::copy_n(stats.lse2.data() + stats.base(p, b, h) + t.i0, t.rows, lse2.begin());
  Acc* dq = sc.dq.get();
  std::fill(dq, dq + ld * dp, Acc(0));
  const KeysByQueries at{ld};
  for_each_key_tile(mod, t.i0, t.i0 + t.rows, [&](int64_t j) {
    t.set_keys(j, si.seqlen_k);
    load_tile<T, Acc>(p.k, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d, Acc(1), sc.k.get(), dp);
    load_tile<T, Acc>(p.v, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d_v, Acc(1), sc.v.get(), dvp);
    Acc* pt = sc.p.get();
    Acc* dst = sc.ds.get();
    gemm(t.keys_pad, ld, dp, sc.k.get(), dp, sc.q.get(), ld, pt, ld, false);  // S^T = K Q^T
    if (mod.softcap > 0.0) std::copy(pt, pt + t.keys_pad * ld, sc.raw.get());
    mod.apply(pt, at, t.i0, t.rows, t.rows_pad, t.j0, t.keys, t.keys_pad);
    exp2_columns<Acc>(pt, ld, t.keys_pad, ld, lse2.data(), nullptr);
    gemm(t.keys_pad, ld, dvp, sc.v.get(), dvp, sc.dout.get(), ld, dst, ld, false);  // dP^T = V dO^T
    // dP of the undropped P is keep * dO.V; dS = P * (dP - D) with the undropped P.
    if (p.dropout.enabled()) apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.keys, dst, at);
    ds_columns(pt, dst, ld, t.keys_pad, ld, delta.data());
    softcap_grad(mod, sc.raw.get(), dst, t.keys_pad * ld);
    if (careful) {
      zero_outside_mask(mod, t, at, pt, dst);
      finite_copy(sc.k.get(), sc.k.get(), t.keys_pad * dp);
    }
    gemm_tn(ld, dp, t.keys_pad, dst, ld, sc.k.get(), dp, dq, dp, true);  // dQ += dS K
  });
  if (!careful && any_nan(dq, t.rows, d, dp)) return dq_tile<T, Acc>(p, b, h, m_block, stats, sc, true);
  // dL/d(q.k) = dS * scale.
  store_tile<T, Acc>(p.dq, b, row0, t.rows, h, d, dq, dp, static_cast<Acc>(mod.scale));
}

// ---- dK/dV pass: score tiles [queries, keys] ------------------------------------------------

// careful: as dq_tile's, with dV multiplied without the zero (masked) P terms, since a bad dO
// reaches dV only through P, and a non-finite Q entering dK as 0.
template <typename T, typename Acc>
void dkdv_tile(const Problem& p, int64_t b, int64_t hk, int64_t n_block, const RowStats<Acc>& stats,
               BackwardScratch<Acc>& sc, bool careful = false) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, dp = sc.d_pad, d_v = p.head_dim_v, dvp = sc.dv_pad;
  TilePair t;
  t.set_keys(n_block * kBlockN, si.seqlen_k);
  const int64_t ld = t.keys_pad;
  load_tile_transposed<T, Acc>(p.k, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d, dp, Acc(1), sc.k.get(), ld);
  load_tile_transposed<T, Acc>(p.v, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d_v, dvp, Acc(1), sc.v.get(), ld);
  std::fill(sc.dk.get(), sc.dk.get() + ld * dp, Acc(0));
  std::fill(sc.dv.get(), sc.dv.get() + ld * dvp, Acc(0));
  const QueriesByKeys at{ld};
  std::vector<Acc> delta(kBlockM), lse2(kBlockM);
  Acc dk_factor = 0;
  for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    const ScoreMod<Acc> mod(p, si, b, h);
    const uint64_t bh = static_cast<uint64_t>(b * p.heads_q + h);
    dk_factor = static_cast<Acc>(mod.scale / mod.q_scale());  // the Q tile holds q * q_scale
    const int64_t row_end = mod.mask.row_end(t.j0, t.j0 + t.keys);
    for (int64_t i = mod.mask.row_begin(t.j0) / kBlockM * kBlockM; i < row_end; i += kBlockM) {
      t.set_rows(i, si.seqlen_q);
      if (mod.block_range(t.i0, t.i0 + t.rows, t.j0, t.j0 + t.keys) == core::BlockMask::Cell::kHidden) continue;
      const int64_t row0 = si.q_start + t.i0;
      load_tile<T, Acc>(p.q, b, row0, t.rows, t.rows_pad, h, d, mod.q_scale(), sc.q.get(), dp);
      load_tile<T, Acc>(p.dout, b, row0, t.rows, t.rows_pad, h, d_v, Acc(1), sc.dout.get(), dvp);
      std::fill(delta.begin(), delta.end(), Acc(0));
      std::fill(lse2.begin(), lse2.end(), static_cast<Acc>(kInf));
      std::copy_n(stats.delta.data() + stats.base(p, b, h) + t.i0, t.rows, delta.begin());
      std::copy_n(stats.lse2.data() + stats.base(p, b, h) + t.i0, t.rows, lse2.begin());
      Acc* pm = sc.p.get();
      Acc* dsm = sc.ds.get();
      gemm(t.rows_pad, ld, dp, sc.q.get(), dp, sc.k.get(), ld, pm, ld, false);  // S = Q K^T
      if (mod.softcap > 0.0) std::copy(pm, pm + t.rows_pad * ld, sc.raw.get());
      mod.apply(pm, at, t.i0, t.rows, t.rows_pad, t.j0, t.keys, t.keys_pad);
      exp2_rows<Acc>(pm, ld, t.rows_pad, ld, lse2.data());
      gemm(t.rows_pad, ld, dvp, sc.dout.get(), dvp, sc.v.get(), ld, dsm, ld, false);  // dP = dO V^T
      if (p.dropout.enabled()) apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.keys, dsm, at);
      ds_rows(pm, dsm, ld, t.rows_pad, ld, delta.data());
      softcap_grad(mod, sc.raw.get(), dsm, t.rows_pad * ld);
      if (careful) zero_outside_mask(mod, t, at, pm, dsm);
      // dV uses the dropped P: the P that multiplied V in the forward.
      if (p.dropout.enabled()) apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.keys, pm, at);
      if (careful) {
        gemm_tn_skipping_zeros(ld, dvp, t.rows_pad, pm, ld, sc.dout.get(), dvp, sc.dv.get(), dvp, true);
        finite_copy(sc.q.get(), sc.q.get(), t.rows_pad * dp);
      } else {
        gemm_tn(ld, dvp, t.rows_pad, pm, ld, sc.dout.get(), dvp, sc.dv.get(), dvp, true);  // dV += P^T dO
      }
      gemm_tn(ld, dp, t.rows_pad, dsm, ld, sc.q.get(), dp, sc.dk.get(), dp, true);  // dK += dS^T Q
    }
  }
  // A NaN in dK / dV: an input held inf or NaN, which 0 * NaN may have carried to keys its row
  // does not see. Redone carefully, it reaches exactly the keys that are seen (nonfinite.hpp).
  if (!careful && (any_nan(sc.dk.get(), t.keys, d, dp) || any_nan(sc.dv.get(), t.keys, d_v, dvp))) {
    return dkdv_tile<T, Acc>(p, b, hk, n_block, stats, sc, true);
  }
  store_tile<T, Acc>(p.dk, b, si.k_start + t.j0, t.keys, hk, d, sc.dk.get(), dp, dk_factor);
  store_tile<T, Acc>(p.dv, b, si.k_start + t.j0, t.keys, hk, d_v, sc.dv.get(), dvp, Acc(1));
}

struct Item {
  int64_t b, head, block;
};

// (batch, head, block) items with `block_rows` rows per block over the q or k length.
std::vector<Item> items(const Problem& p, int64_t heads, bool over_keys, int64_t block_rows) {
  std::vector<Item> out;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo si = detail::seq_info(p, b);
    const int64_t len = over_keys ? si.seqlen_k : si.seqlen_q;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t blk = 0; blk * block_rows < len; ++blk) out.push_back({b, h, blk});
    }
  }
  return out;
}

template <typename T, typename Acc>
void run_backward(const Problem& p) {
  const int64_t d_pad = round_up(p.head_dim, kTileAlign), dv_pad = round_up(p.head_dim_v, kTileAlign);
  auto make = [&] { return BackwardScratch<Acc>(d_pad, dv_pad); };
  RowStats<Acc> stats(p);
  const bool refine = std::is_same_v<Acc, double>;
  const std::vector<Item> q_items = items(p, p.heads_q, false, kBlockM);
  const auto nq = static_cast<int64_t>(q_items.size());
  std::vector<double> dsink(static_cast<size_t>(nq));
  parallel_items(nq, make, [&](BackwardScratch<Acc>& sc, int64_t i) {
    dsink[i] = rows_tile<T, Acc>(p, q_items[i].b, q_items[i].head, q_items[i].block, refine, stats, sc);
  });
  if (p.dsink) {  // the tiles' shares summed per head in item order: deterministic
    std::vector<double> per_head(static_cast<size_t>(p.heads_q), 0.0);
    for (int64_t i = 0; i < nq; ++i) per_head[q_items[i].head] += dsink[i];
    for (int64_t h = 0; h < p.heads_q; ++h) p.dsink[h * p.dsink_stride] = static_cast<float>(per_head[h]);
  }
  parallel_items(nq, make, [&](BackwardScratch<Acc>& sc, int64_t i) {
    dq_tile<T, Acc>(p, q_items[i].b, q_items[i].head, q_items[i].block, stats, sc);
  });
  const std::vector<Item> k_items = items(p, p.heads_kv, true, kBlockN);
  parallel_items(static_cast<int64_t>(k_items.size()), make, [&](BackwardScratch<Acc>& sc, int64_t i) {
    dkdv_tile<T, Acc>(p, k_items[i].b, k_items[i].head, k_items[i].block, stats, sc);
  });
}

}  // namespace

void flash_backward(const Problem& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, double>) {
      run_backward<T, double>(p);
    } else if (p.precise) {
      run_backward<T, double>(p);
    } else {
      run_backward<T, float>(p);
    }
  });
}

}  // namespace flashattn::cpu

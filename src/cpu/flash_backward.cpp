// CPU FlashAttention backward: recomputes P from the saved LSE (no O(N^2) storage) with
// D = rowsum(dO * O). Two passes, each fully parallel and race-free, so the result is bitwise
// deterministic without atomics:
//   pass 1, one work item per (batch, head, q-tile):     S, dP       -> dQ    (3 tile GEMMs)
//   pass 2, one work item per (batch, kv-head, k-tile):  S, dP       -> dK, dV (4 tile GEMMs),
//           summing the query heads of a GQA group in a fixed order.
// 7 tile GEMMs per (q-tile, k-tile) instead of the 5 of one pass with atomic dQ accumulation;
// on a CPU the atomics would cost more than the recomputation.
//
// The LSE arrives in fp32. With fp64 accumulators (fp64 inputs, precise mode) that would cap
// the gradients' accuracy near 1e-7, so pass 1 first re-derives each row's LSE at full
// precision (one more S GEMM) and hands it to pass 2 through an O(N) buffer.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../core/softmax.hpp"
#include "backend.hpp"
#include "tiles.hpp"

namespace flashattn::cpu {
namespace {

using detail::Problem;
using detail::SeqInfo;

template <typename Acc>
struct BackwardScratch {
  int64_t d_pad;
  // Query side: Q^T and dO^T [d_pad, kBlockM] (Q times q_scale); Q and dO [kBlockM, d_pad]
  // (pass 2) or dQ (pass 1); per-row D and the LSE (log2 domain) to subtract.
  Scratch<Acc> qt, dot, q, dout, dq;
  std::vector<Acc> delta, lse2, row_max, row_sum;
  // Key side [kBlockN, d_pad]: K, V, and the dK / dV accumulators (pass 2).
  Scratch<Acc> k, v, dk, dv;
  // Transposed tiles [kBlockN, kBlockM]: S^T -> P^T, dP^T -> dS^T, raw products (softcap).
  Scratch<Acc> pt, dst, raw;

  explicit BackwardScratch(int64_t d_pad_)
      : d_pad(d_pad_),
        qt(d_pad * kBlockM),
        dot(d_pad * kBlockM),
        q(kBlockM * d_pad),
        dout(kBlockM * d_pad),
        dq(kBlockM * d_pad),
        delta(kBlockM),
        lse2(kBlockM),
        row_max(kBlockM),
        row_sum(kBlockM),
        k(kBlockN * d_pad),
        v(kBlockN * d_pad),
        dk(kBlockN * d_pad),
        dv(kBlockN * d_pad),
        pt(kBlockN * kBlockM),
        dst(kBlockN * kBlockM),
        raw(kBlockN * kBlockM) {}
};

// Geometry of the (q-tile, k-tile) pair being recomputed.
struct TilePair {
  int64_t i0 = 0, rows = 0, rows_pad = 0;
  int64_t j0 = 0, keys = 0, keys_pad = 0;
};

// Full-precision LSE (log2 domain) of every query row, filled by pass 1 when Acc is double.
template <typename Acc>
struct RefinedLse {
  std::vector<Acc> values;
  int64_t max_rows = 0;
  Acc* row(const Problem& p, int64_t b, int64_t h) {
    return values.data() + (b * p.heads_q + h) * max_rows;
  }
};

template <typename T, typename Acc>
void load_key_side(const Problem& p, const SeqInfo& si, int64_t b, int64_t hk, const TilePair& t,
                   BackwardScratch<Acc>& sc) {
  const int64_t d = p.head_dim, dp = sc.d_pad;
  load_tile<T, Acc>(p.k, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d, Acc(1), sc.k.get(), dp);
  load_tile<T, Acc>(p.v, b, si.k_start + t.j0, t.keys, t.keys_pad, hk, d, Acc(1), sc.v.get(), dp);
}

// Loads Q^T, dO^T (and Q, dO row-major for pass 2) of rows t.i0.. of head h; D = rowsum(dO * O)
// and the LSE to subtract (+inf for empty and padding rows, so their P is exactly 0).
template <typename T, typename Acc>
void load_query_side(const Problem& p, const SeqInfo& si, int64_t b, int64_t h, const TilePair& t,
                     Acc q_scale, bool row_major, const Acc* refined_lse2,
                     BackwardScratch<Acc>& sc) {
  const int64_t d = p.head_dim, dp = sc.d_pad, row0 = si.q_start + t.i0;
  load_tile_transposed<T, Acc>(p.q, b, row0, t.rows, t.rows_pad, h, d, dp, q_scale, sc.qt.get(), t.rows_pad);
  load_tile_transposed<T, Acc>(p.dout, b, row0, t.rows, t.rows_pad, h, d, dp, Acc(1), sc.dot.get(), t.rows_pad);
  if (row_major) {
    load_tile<T, Acc>(p.q, b, row0, t.rows, t.rows_pad, h, d, q_scale, sc.q.get(), dp);
    load_tile<T, Acc>(p.dout, b, row0, t.rows, t.rows_pad, h, d, Acc(1), sc.dout.get(), dp);
  }
  for (int64_t r = 0; r < t.rows_pad; ++r) {
    sc.delta[r] = 0;
    sc.lse2[r] = std::numeric_limits<Acc>::infinity();
    if (r >= t.rows) continue;
    const T* o = row_ptr<T>(p.out, b, row0 + r, h);
    const T* g = row_ptr<T>(p.dout, b, row0 + r, h);
    Acc dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += static_cast<Acc>(to_float(g[c])) * static_cast<Acc>(to_float(o[c]));
    sc.delta[r] = dot;
    const Acc lse2 = refined_lse2 ? refined_lse2[t.i0 + r]
                                  : static_cast<Acc>(*row_ptr<float>(p.lse, b, row0 + r, h) * core::kLog2e);
    if (lse2 != -std::numeric_limits<Acc>::infinity()) sc.lse2[r] = lse2;
  }
}

// S^T = K Q^T with mods and mask applied (raw products kept for the softcap gradient).
template <typename Acc>
void scores(const ScoreMod<Acc>& mod, const TilePair& t, BackwardScratch<Acc>& sc) {
  Acc* st = sc.pt.get();
  gemm(t.keys_pad, t.rows_pad, sc.d_pad, sc.k.get(), sc.d_pad, sc.qt.get(), t.rows_pad, st, t.rows_pad, false);
  if (mod.softcap > 0.0) std::copy(st, st + t.keys_pad * t.rows_pad, sc.raw.get());
  mod.apply(st, t.rows_pad, t.i0, t.rows, t.rows_pad, t.j0, t.keys, t.keys_pad);
}

// P^T (sc.pt, with dropout applied when `dropped`: the P that multiplied V) and
// dS'^T = P^T * (dP^T - D) * dsoftcap (sc.dst) for one tile pair.
template <typename Acc>
void recompute_ds(const Problem& p, const ScoreMod<Acc>& mod, uint64_t bh, const TilePair& t,
                  bool dropped, BackwardScratch<Acc>& sc) {
  const int64_t ld = t.rows_pad;
  scores(mod, t, sc);
  Acc* pt = sc.pt.get();
  Acc* dst = sc.dst.get();
  exp2_columns<Acc>(pt, ld, t.keys_pad, t.rows_pad, sc.lse2.data(), nullptr);
  gemm(t.keys_pad, t.rows_pad, sc.d_pad, sc.v.get(), sc.d_pad, sc.dot.get(), ld, dst, ld, false);
  // dP of the undropped P is keep * dO.V; dS uses the undropped P, dV the dropped one.
  if (p.dropout.enabled()) apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.keys, dst, ld);
  ds_columns(pt, dst, ld, t.keys_pad, t.rows_pad, sc.delta.data());
  if (mod.softcap > 0.0) {
    for (int64_t e = 0; e < t.keys * ld; ++e) {
      const Acc th = std::tanh(sc.raw.get()[e]);
      dst[e] *= Acc(1) - th * th;
    }
  }
  if (dropped && p.dropout.enabled()) apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.keys, pt, ld);
}

// Online (max, sum) over all visible keys: the row LSE at Acc precision (log2 domain).
template <typename T, typename Acc>
void refine_lse(const Problem& p, const SeqInfo& si, int64_t b, int64_t hk, const ScoreMod<Acc>& mod,
                TilePair t, BackwardScratch<Acc>& sc, Acc* out) {
  std::fill(sc.row_max.begin(), sc.row_max.end(), -std::numeric_limits<Acc>::infinity());
  std::fill(sc.row_sum.begin(), sc.row_sum.end(), Acc(0));
  std::vector<Acc> new_max(static_cast<size_t>(t.rows_pad)), sub(static_cast<size_t>(t.rows_pad));
  const int64_t key_end = mod.mask.key_end(t.i0 + t.rows);
  for (t.j0 = mod.mask.key_begin(t.i0) / kBlockN * kBlockN; t.j0 < key_end; t.j0 += kBlockN) {
    t.keys = std::min(kBlockN, si.seqlen_k - t.j0);
    t.keys_pad = round_up(t.keys, kTileAlign);
    load_key_side<T, Acc>(p, si, b, hk, t, sc);
    scores(mod, t, sc);
    std::copy(sc.row_max.begin(), sc.row_max.begin() + t.rows_pad, new_max.begin());
    column_max(sc.pt.get(), t.rows_pad, t.keys_pad, t.rows_pad, new_max.data());
    for (int64_t r = 0; r < t.rows_pad; ++r) {
      sc.row_sum[r] *= core::rescale_factor(sc.row_max[r], new_max[r]);
      sc.row_max[r] = new_max[r];
      sub[r] = core::safe_max(new_max[r]);
    }
    exp2_columns(sc.pt.get(), t.rows_pad, t.keys_pad, t.rows_pad, sub.data(), sc.row_sum.data());
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    out[t.i0 + r] = core::lse_natural(sc.row_max[r], sc.row_sum[r]) * static_cast<Acc>(core::kLog2e);
  }
}

template <typename T, typename Acc>
void dq_tile(const Problem& p, int64_t b, int64_t h, int64_t m_block, RefinedLse<Acc>* refined,
             BackwardScratch<Acc>& sc) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, dp = sc.d_pad;
  const ScoreMod<Acc> mod(p, si, b, h);
  const int64_t hk = h / p.group_size();
  const uint64_t bh = static_cast<uint64_t>(b * p.heads_q + h);
  TilePair t;
  t.i0 = m_block * kBlockM;
  t.rows = std::min(kBlockM, si.seqlen_q - t.i0);
  t.rows_pad = round_up(t.rows, kTileAlign);
  const Acc* lse_row = nullptr;
  if (refined) {
    load_query_side<T, Acc>(p, si, b, h, t, mod.q_scale(), false, nullptr, sc);
    refine_lse<T, Acc>(p, si, b, hk, mod, t, sc, refined->row(p, b, h));
    lse_row = refined->row(p, b, h);
  }
  load_query_side<T, Acc>(p, si, b, h, t, mod.q_scale(), false, lse_row, sc);
  Acc* dq = sc.dq.get();
  std::fill(dq, dq + t.rows_pad * dp, Acc(0));
  const int64_t key_end = mod.mask.key_end(t.i0 + t.rows);
  for (t.j0 = mod.mask.key_begin(t.i0) / kBlockN * kBlockN; t.j0 < key_end; t.j0 += kBlockN) {
    t.keys = std::min(kBlockN, si.seqlen_k - t.j0);
    t.keys_pad = round_up(t.keys, kTileAlign);
    load_key_side<T, Acc>(p, si, b, hk, t, sc);
    recompute_ds(p, mod, bh, t, false, sc);
    gemm_tn(t.rows_pad, dp, t.keys_pad, sc.dst.get(), t.rows_pad, sc.k.get(), dp, dq, dp, true);
  }
  // dL/d(q.k) = dS' * scale.
  store_tile<T, Acc>(p.dq, b, si.q_start + t.i0, t.rows, h, d, dq, dp, static_cast<Acc>(mod.scale));
}

template <typename T, typename Acc>
void dkdv_tile(const Problem& p, int64_t b, int64_t hk, int64_t n_block, RefinedLse<Acc>* refined,
               BackwardScratch<Acc>& sc) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, dp = sc.d_pad;
  TilePair t;
  t.j0 = n_block * kBlockN;
  t.keys = std::min(kBlockN, si.seqlen_k - t.j0);
  t.keys_pad = round_up(t.keys, kTileAlign);
  load_key_side<T, Acc>(p, si, b, hk, t, sc);
  std::fill(sc.dk.get(), sc.dk.get() + t.keys_pad * dp, Acc(0));
  std::fill(sc.dv.get(), sc.dv.get() + t.keys_pad * dp, Acc(0));
  Acc dk_factor = 0;
  for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    const ScoreMod<Acc> mod(p, si, b, h);
    const uint64_t bh = static_cast<uint64_t>(b * p.heads_q + h);
    dk_factor = static_cast<Acc>(mod.scale / mod.q_scale());  // the Q tile holds q * q_scale
    const Acc* lse_row = refined ? refined->row(p, b, h) : nullptr;
    const int64_t row_end = mod.mask.row_end(t.j0 + t.keys);
    for (t.i0 = mod.mask.row_begin(t.j0) / kBlockM * kBlockM; t.i0 < row_end; t.i0 += kBlockM) {
      t.rows = std::min(kBlockM, si.seqlen_q - t.i0);
      t.rows_pad = round_up(t.rows, kTileAlign);
      load_query_side<T, Acc>(p, si, b, h, t, mod.q_scale(), true, lse_row, sc);
      recompute_ds(p, mod, bh, t, true, sc);
      gemm(t.keys_pad, dp, t.rows_pad, sc.pt.get(), t.rows_pad, sc.dout.get(), dp, sc.dv.get(), dp, true);
      gemm(t.keys_pad, dp, t.rows_pad, sc.dst.get(), t.rows_pad, sc.q.get(), dp, sc.dk.get(), dp, true);
    }
  }
  store_tile<T, Acc>(p.dk, b, si.k_start + t.j0, t.keys, hk, d, sc.dk.get(), dp, dk_factor);
  store_tile<T, Acc>(p.dv, b, si.k_start + t.j0, t.keys, hk, d, sc.dv.get(), dp, Acc(1));
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
  const int64_t d_pad = round_up(p.head_dim, kTileAlign);
  auto make = [&] { return BackwardScratch<Acc>(d_pad); };
  RefinedLse<Acc> refined_store;
  RefinedLse<Acc>* refined = nullptr;
  if constexpr (std::is_same_v<Acc, double>) {
    for (int64_t b = 0; b < p.batch; ++b) {
      refined_store.max_rows = std::max(refined_store.max_rows, detail::seq_info(p, b).seqlen_q);
    }
    refined_store.values.assign(static_cast<size_t>(p.batch * p.heads_q * refined_store.max_rows), 0);
    refined = &refined_store;
  }
  const std::vector<Item> q_items = items(p, p.heads_q, false, kBlockM);
  parallel_items(static_cast<int64_t>(q_items.size()), make,
                 [&](BackwardScratch<Acc>& sc, int64_t i) {
                   dq_tile<T, Acc>(p, q_items[i].b, q_items[i].head, q_items[i].block, refined, sc);
                 });
  const std::vector<Item> k_items = items(p, p.heads_kv, true, kBlockN);
  parallel_items(static_cast<int64_t>(k_items.size()), make,
                 [&](BackwardScratch<Acc>& sc, int64_t i) {
                   dkdv_tile<T, Acc>(p, k_items[i].b, k_items[i].head, k_items[i].block, refined, sc);
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

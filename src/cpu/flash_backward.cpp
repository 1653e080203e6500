// CPU FlashAttention backward: recomputes P from the saved LSE (no O(N^2) storage) with
// D = rowsum(dO * O). Two passes, each fully parallel and race-free, so the result is bitwise
// deterministic without atomics:
//   pass 1, one work item per (batch, head, q-tile):      S, dP       -> dQ   (3 tile GEMMs)
//   pass 2, one work item per (batch, kv-head, k-tile):   S, dP       -> dK, dV (4 tile GEMMs),
//           summing the query heads of a GQA group in a fixed order.
// This costs 7 tile GEMMs per (q-tile, k-tile) instead of the 5 of a single pass with atomic
// dQ accumulation; on a CPU, atomics on dQ would serialise far worse.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend.hpp"
#include "tiles.hpp"

namespace flashattn::cpu {
namespace {

using detail::Problem;
using detail::SeqInfo;

template <typename Acc>
struct BackwardScratch {
  int64_t d_pad;
  // Query side [kBlockM, d_pad]: q (times q_scale), dO, O (then dQ), and row vectors.
  Scratch<Acc> q, dout, acc_q;
  std::vector<Acc> delta, lse2;
  // Key side: K^T and V^T [d_pad, kBlockN], K [kBlockN, d_pad], dK/dV [kBlockN, d_pad].
  Scratch<Acc> kt, vt, k, dk, dv;
  // Tiles [kBlockM, kBlockN]: scores -> P, dP -> dS, raw products (softcap), and transposes.
  Scratch<Acc> p, ds, raw, transposed;

  explicit BackwardScratch(int64_t d_pad_)
      : d_pad(d_pad_),
        q(kBlockM * d_pad),
        dout(kBlockM * d_pad),
        acc_q(kBlockM * d_pad),
        delta(kBlockM),
        lse2(kBlockM),
        kt(d_pad * kBlockN),
        vt(d_pad * kBlockN),
        k(kBlockN * d_pad),
        dk(kBlockN * d_pad),
        dv(kBlockN * d_pad),
        p(kBlockM * kBlockN),
        ds(kBlockM * kBlockN),
        raw(kBlockM * kBlockN),
        transposed(kBlockN * kBlockM) {}
};

// Geometry of the (q-tile, k-tile) pair being recomputed.
struct TilePair {
  int64_t i0, rows, rows_pad;
  int64_t j0, cols, cols_pad;
};

// Loads q, dO of rows [i0, i0 + rows) of head h; computes D = rowsum(dO * O) and LSE * log2 e.
template <typename T, typename Acc>
void load_query_side(const Problem& p, const SeqInfo& si, int64_t b, int64_t h, int64_t i0,
                     int64_t rows, int64_t rows_pad, Acc q_scale, BackwardScratch<Acc>& sc) {
  const int64_t d = p.head_dim, dp = sc.d_pad;
  load_tile<T, Acc>(p.q, b, si.q_start + i0, rows, rows_pad, h, d, q_scale, sc.q.get(), dp);
  load_tile<T, Acc>(p.dout, b, si.q_start + i0, rows, rows_pad, h, d, Acc(1), sc.dout.get(), dp);
  load_tile<T, Acc>(p.out, b, si.q_start + i0, rows, rows_pad, h, d, Acc(1), sc.acc_q.get(), dp);
  for (int64_t r = 0; r < rows; ++r) {
    Acc dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += sc.dout.get()[r * dp + c] * sc.acc_q.get()[r * dp + c];
    sc.delta[r] = dot;
    sc.lse2[r] = static_cast<Acc>(*row_ptr<float>(p.lse, b, si.q_start + i0 + r, h) * core::kLog2e);
  }
}

// Loads K^T, V^T (and K when the dQ pass needs it) of keys [j0, j0 + cols) of kv head hk.
template <typename T, typename Acc>
void load_key_side(const Problem& p, const SeqInfo& si, int64_t b, int64_t hk, int64_t j0,
                   int64_t cols, int64_t cols_pad, bool with_k, BackwardScratch<Acc>& sc) {
  const int64_t d = p.head_dim, dp = sc.d_pad;
  load_tile_transposed<T, Acc>(p.k, b, si.k_start + j0, cols, cols_pad, hk, d, dp, sc.kt.get(), kBlockN);
  load_tile_transposed<T, Acc>(p.v, b, si.k_start + j0, cols, cols_pad, hk, d, dp, sc.vt.get(), kBlockN);
  if (with_k) load_tile<T, Acc>(p.k, b, si.k_start + j0, cols, cols_pad, hk, d, Acc(1), sc.k.get(), dp);
}

// Recomputes P (in sc.p, with dropout applied: the P that multiplied V) and
// dS' = P * (dP - D) * dsoftcap (in sc.ds) for one tile pair.
template <typename Acc>
void recompute_ds(const Problem& p, const ScoreMod<Acc>& mod, uint64_t bh, const TilePair& t,
                  BackwardScratch<Acc>& sc) {
  const int64_t dp = sc.d_pad;
  Acc* s = sc.p.get();
  gemm(t.rows_pad, t.cols_pad, dp, sc.q.get(), dp, sc.kt.get(), kBlockN, s, kBlockN, false);
  const bool softcap = mod.softcap > 0.0;
  if (softcap) std::copy(s, s + t.rows_pad * kBlockN, sc.raw.get());
  mod.apply(s, kBlockN, t.i0, t.rows, t.j0, t.cols, t.cols_pad);
  for (int64_t r = 0; r < t.rows_pad; ++r) {
    Acc* row = s + r * kBlockN;
    if (r < t.rows && sc.lse2[r] != -std::numeric_limits<Acc>::infinity()) {
      exp2_sub(row, t.cols_pad, sc.lse2[r]);
    } else {
      std::fill(row, row + kBlockN, Acc(0));  // empty row (or padding): P = 0
    }
  }
  Acc* dpt = sc.ds.get();
  gemm(t.rows_pad, t.cols_pad, dp, sc.dout.get(), dp, sc.vt.get(), kBlockN, dpt, kBlockN, false);
  if (p.dropout.enabled()) {
    // dP of the undropped P is keep * dO.V; dS uses the undropped P, dV the dropped one.
    apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.cols, dpt, kBlockN);
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t c = 0; c < t.cols_pad; ++c) {
      Acc ds = s[r * kBlockN + c] * (dpt[r * kBlockN + c] - sc.delta[r]);
      if (softcap) {
        const Acc th = std::tanh(sc.raw.get()[r * kBlockN + c]);
        ds *= Acc(1) - th * th;
      }
      dpt[r * kBlockN + c] = ds;
    }
  }
  for (int64_t r = t.rows; r < t.rows_pad; ++r) std::fill(dpt + r * kBlockN, dpt + (r + 1) * kBlockN, Acc(0));
  if (p.dropout.enabled()) apply_dropout(p.dropout, bh, t.i0, t.rows, t.j0, t.cols, s, kBlockN);
}

template <typename T, typename Acc>
void dq_tile(const Problem& p, int64_t b, int64_t h, int64_t m_block, BackwardScratch<Acc>& sc) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, dp = sc.d_pad;
  const ScoreMod<Acc> mod(p, si, b, h);
  const int64_t hk = h / p.group_size();
  const uint64_t bh = static_cast<uint64_t>(b * p.heads_q + h);
  TilePair t{};
  t.i0 = m_block * kBlockM;
  t.rows = std::min(kBlockM, si.seqlen_q - t.i0);
  t.rows_pad = round_up(t.rows, 4);
  load_query_side<T, Acc>(p, si, b, h, t.i0, t.rows, t.rows_pad, mod.q_scale(), sc);
  Acc* dq = sc.acc_q.get();
  std::fill(dq, dq + t.rows_pad * dp, Acc(0));
  const int64_t key_end = mod.mask.key_end(t.i0 + t.rows);
  for (t.j0 = mod.mask.key_begin(t.i0) / kBlockN * kBlockN; t.j0 < key_end; t.j0 += kBlockN) {
    t.cols = std::min(kBlockN, si.seqlen_k - t.j0);
    t.cols_pad = round_up(t.cols, kTileAlign);
    load_key_side<T, Acc>(p, si, b, hk, t.j0, t.cols, t.cols_pad, true, sc);
    recompute_ds(p, mod, bh, t, sc);
    gemm(t.rows_pad, dp, t.cols_pad, sc.ds.get(), kBlockN, sc.k.get(), dp, dq, dp, true);
  }
  // dL/d(q.k) = dS' * scale.
  store_tile<T, Acc>(p.dq, b, si.q_start + t.i0, t.rows, h, d, dq, dp, static_cast<Acc>(mod.scale));
}

template <typename T, typename Acc>
void dkdv_tile(const Problem& p, int64_t b, int64_t hk, int64_t n_block, BackwardScratch<Acc>& sc) {
  const SeqInfo si = detail::seq_info(p, b);
  const int64_t d = p.head_dim, dp = sc.d_pad;
  TilePair t{};
  t.j0 = n_block * kBlockN;
  t.cols = std::min(kBlockN, si.seqlen_k - t.j0);
  t.cols_pad = round_up(t.cols, kTileAlign);
  load_key_side<T, Acc>(p, si, b, hk, t.j0, t.cols, t.cols_pad, false, sc);
  std::fill(sc.dk.get(), sc.dk.get() + t.cols_pad * dp, Acc(0));
  std::fill(sc.dv.get(), sc.dv.get() + t.cols_pad * dp, Acc(0));
  Acc dk_factor = 0;
  for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    const ScoreMod<Acc> mod(p, si, b, h);
    const uint64_t bh = static_cast<uint64_t>(b * p.heads_q + h);
    dk_factor = static_cast<Acc>(mod.scale / mod.q_scale());  // the q tile holds q * q_scale
    const int64_t row_end = mod.mask.row_end(t.j0 + t.cols);
    for (t.i0 = mod.mask.row_begin(t.j0) / kBlockM * kBlockM; t.i0 < row_end; t.i0 += kBlockM) {
      t.rows = std::min(kBlockM, si.seqlen_q - t.i0);
      t.rows_pad = round_up(t.rows, 4);
      load_query_side<T, Acc>(p, si, b, h, t.i0, t.rows, t.rows_pad, mod.q_scale(), sc);
      recompute_ds(p, mod, bh, t, sc);
      Acc* tr = sc.transposed.get();
      transpose(t.rows_pad, t.cols_pad, sc.p.get(), kBlockN, tr, kBlockM);
      gemm(t.cols_pad, dp, t.rows_pad, tr, kBlockM, sc.dout.get(), dp, sc.dv.get(), dp, true);
      transpose(t.rows_pad, t.cols_pad, sc.ds.get(), kBlockN, tr, kBlockM);
      gemm(t.cols_pad, dp, t.rows_pad, tr, kBlockM, sc.q.get(), dp, sc.dk.get(), dp, true);
    }
  }
  store_tile<T, Acc>(p.dk, b, si.k_start + t.j0, t.cols, hk, d, sc.dk.get(), dp, dk_factor);
  store_tile<T, Acc>(p.dv, b, si.k_start + t.j0, t.cols, hk, d, sc.dv.get(), dp, Acc(1));
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
  const std::vector<Item> q_items = items(p, p.heads_q, false, kBlockM);
  parallel_items(static_cast<int64_t>(q_items.size()), make,
                 [&](BackwardScratch<Acc>& sc, int64_t i) {
                   dq_tile<T, Acc>(p, q_items[i].b, q_items[i].head, q_items[i].block, sc);
                 });
  const std::vector<Item> k_items = items(p, p.heads_kv, true, kBlockN);
  parallel_items(static_cast<int64_t>(k_items.size()), make,
                 [&](BackwardScratch<Acc>& sc, int64_t i) {
                   dkdv_tile<T, Acc>(p, k_items[i].b, k_items[i].head, k_items[i].block, sc);
                 });
}

}  // namespace

void flash_backward(const Problem& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, double>) {
      run_backward<T, double>(p);
    } else {
      if (p.precise) {
        run_backward<T, double>(p);
      } else {
        run_backward<T, float>(p);
      }
    }
  });
}

}  // namespace flashattn::cpu

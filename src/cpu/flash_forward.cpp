// CPU FlashAttention-2 forward: outer loop over query tiles (the parallel work items, one per
// (batch, head, q-tile)), inner loop over the key/value tiles the mask lets them see, online
// softmax in the exp2 domain, O normalised and written once. Extra memory is O(tile) per thread.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/softmax.hpp"
#include "backend.hpp"
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

// Per-thread tiles. Acc is float, or double for fp64 inputs and precise mode.
template <typename Acc>
struct ForwardScratch {
  int64_t d_pad;
  Scratch<Acc> q, kt, v, s, o, o_comp, pv;
  std::vector<core::SoftmaxState<Acc>> rows;
  std::vector<Acc> sum_comp;

  explicit ForwardScratch(int64_t d_pad_)
      : d_pad(d_pad_),
        q(kBlockM * d_pad),
        kt(d_pad * kBlockN),
        v(kBlockN * d_pad),
        s(kBlockM * kBlockN),
        o(kBlockM * d_pad),
        o_comp(kBlockM * d_pad),
        pv(kBlockM * d_pad),
        rows(kBlockM),
        sum_comp(kBlockM) {}
};

// Neumaier-compensated a += b (precise mode).
template <typename Acc>
inline void add_compensated(Acc& sum, Acc& comp, Acc x) {
  const Acc t = sum + x;
  comp += std::abs(sum) >= std::abs(x) ? (sum - t) + x : (x - t) + sum;
  sum = t;
}

template <typename T, typename Acc>
void forward_tile(const Problem& p, const WorkItem& w, ForwardScratch<Acc>& sc, bool precise) {
  const SeqInfo si = detail::seq_info(p, w.b);
  const int64_t d = p.head_dim, dp = sc.d_pad;
  const int64_t i0 = w.m_block * kBlockM;
  const int64_t rows = std::min(kBlockM, si.seqlen_q - i0);
  const int64_t rows_pad = round_up(rows, 4);
  const int64_t hk = w.h / p.group_size();
  const ScoreMod<Acc> mod(p, si, w.b, w.h);
  const uint64_t bh = static_cast<uint64_t>(w.b * p.heads_q + w.h);

  load_tile<T, Acc>(p.q, w.b, si.q_start + i0, rows, rows_pad, w.h, d, mod.q_scale(), sc.q.get(), dp);
  std::fill(sc.o.get(), sc.o.get() + rows_pad * dp, Acc(0));
  if (precise) std::fill(sc.o_comp.get(), sc.o_comp.get() + rows_pad * dp, Acc(0));
  for (int64_t r = 0; r < rows; ++r) {
    sc.rows[r] = {};
    sc.sum_comp[r] = 0;
  }

  const int64_t key_begin = mod.mask.key_begin(i0);
  const int64_t key_end = mod.mask.key_end(i0 + rows);
  for (int64_t j0 = key_begin / kBlockN * kBlockN; j0 < key_end; j0 += kBlockN) {
    const int64_t cols = std::min(kBlockN, si.seqlen_k - j0);
    const int64_t cols_pad = round_up(cols, kTileAlign);
    load_tile_transposed<T, Acc>(p.k, w.b, si.k_start + j0, cols, cols_pad, hk, d, dp, sc.kt.get(),
                                 kBlockN);
    load_tile<T, Acc>(p.v, w.b, si.k_start + j0, cols, cols_pad, hk, d, Acc(1), sc.v.get(), dp);

    Acc* s = sc.s.get();
    gemm(rows_pad, cols_pad, dp, sc.q.get(), dp, sc.kt.get(), kBlockN, s, kBlockN, false);
    mod.apply(s, kBlockN, i0, rows, j0, cols, cols_pad);

    for (int64_t r = 0; r < rows; ++r) {
      Acc* srow = s + r * kBlockN;
      Acc tile_max = -std::numeric_limits<Acc>::infinity();
      for (int64_t c = 0; c < cols_pad; ++c) tile_max = std::max(tile_max, srow[c]);
      core::SoftmaxState<Acc>& st = sc.rows[r];
      const Acc new_max = std::max(st.max, tile_max);
      const Acc factor = st.rescale_to(new_max);
      sc.sum_comp[r] *= factor;
      Acc* orow = sc.o.get() + r * dp;
      for (int64_t c = 0; c < dp; ++c) orow[c] *= factor;
      if (precise) {
        Acc* crow = sc.o_comp.get() + r * dp;
        for (int64_t c = 0; c < dp; ++c) crow[c] *= factor;
      }
      exp2_sub(srow, cols_pad, core::SoftmaxState<Acc>::safe(new_max));
      if (precise) {
        for (int64_t c = 0; c < cols; ++c) add_compensated(st.sum, sc.sum_comp[r], srow[c]);
      } else {
        Acc sum = 0;
        for (int64_t c = 0; c < cols_pad; ++c) sum += srow[c];
        st.sum += sum;
      }
    }
    for (int64_t r = rows; r < rows_pad; ++r) std::fill(s + r * kBlockN, s + (r + 1) * kBlockN, Acc(0));
    if (p.dropout.enabled()) apply_dropout(p.dropout, bh, i0, rows, j0, cols, s, kBlockN);

    if (precise) {
      gemm(rows_pad, dp, cols_pad, s, kBlockN, sc.v.get(), dp, sc.pv.get(), dp, false);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < dp; ++c) {
          add_compensated(sc.o.get()[r * dp + c], sc.o_comp.get()[r * dp + c], sc.pv.get()[r * dp + c]);
        }
      }
    } else {
      gemm(rows_pad, dp, cols_pad, s, kBlockN, sc.v.get(), dp, sc.o.get(), dp, true);
    }
  }

  // Normalise: O = acc / sum (dropout's 1/(1-p) was applied to P); empty rows give 0, -inf.
  for (int64_t r = 0; r < rows; ++r) {
    core::SoftmaxState<Acc>& st = sc.rows[r];
    if (precise) {
      st.sum += sc.sum_comp[r];
      for (int64_t c = 0; c < d; ++c) sc.o.get()[r * dp + c] += sc.o_comp.get()[r * dp + c];
    }
    const Acc inv = st.sum > Acc(0) ? Acc(1) / st.sum : Acc(0);
    for (int64_t c = 0; c < d; ++c) sc.o.get()[r * dp + c] *= inv;
    if (p.lse.data) {
      *row_ptr<float>(p.lse, w.b, si.q_start + i0 + r, w.h) = static_cast<float>(st.lse_natural());
    }
  }
  store_tile<T, Acc>(p.out, w.b, si.q_start + i0, rows, w.h, d, sc.o.get(), dp, Acc(1));
}

template <typename T, typename Acc>
void run_forward(const Problem& p, bool precise) {
  const std::vector<WorkItem> items = query_tiles(p);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t d_pad = round_up(p.head_dim, kTileAlign);
  parallel_items(
      n, [&] { return ForwardScratch<Acc>(d_pad); },
      [&](ForwardScratch<Acc>& scratch, int64_t t) {
        forward_tile<T, Acc>(p, items[t], scratch, precise);
      });
}

}  // namespace

void flash_forward(const Problem& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, double>) {
      run_forward<T, double>(p, true);
    } else {
      if (p.precise) {
        run_forward<T, double>(p, true);
      } else {
        run_forward<T, float>(p, false);
      }
    }
  });
}

}  // namespace flashattn::cpu

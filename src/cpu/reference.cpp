// The fp64 reference: explicit S and P per (batch, head), every feature, analytic backward.
// It is the oracle of the tests, written for obviousness rather than speed; it shares only the
// mask, score-mod and dropout definitions of src/core with the flash path.
#include <cmath>
#include <limits>
#include <vector>

#include "../core/mask.hpp"
#include "../core/philox.hpp"
#include "../core/variant.hpp"
#include "backend.hpp"
#include "elem.hpp"
#include "tiles.hpp"

namespace flashattn::cpu {
namespace {

using detail::Problem;
using detail::SeqInfo;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Rows [0, n) of one head of an operand, converted to fp64 (FP8 inputs dequantised: exact in
// fp64), row-major [n, d].
template <typename T>
std::vector<double> load_rows(const detail::Operand& op, int64_t b, int64_t row0, int64_t n, int64_t h, int64_t d) {
  std::vector<double> out(static_cast<size_t>(n * d));
  const double factor = dequantise_factor(op, b, h);
  for (int64_t i = 0; i < n; ++i) {
    const T* src = row_ptr<T>(op, b, row0 + i, h);
    for (int64_t c = 0; c < d; ++c) out[i * d + c] = to_float(src[c]) * factor;
  }
  return out;
}

template <typename T>
void store_rows(const detail::Operand& op, int64_t b, int64_t row0, int64_t n, int64_t h, int64_t d,
                const std::vector<double>& src) {
  for (int64_t i = 0; i < n; ++i) {
    T* dst = row_ptr<T>(op, b, row0 + i, h);
    for (int64_t c = 0; c < d; ++c) dst[c] = from_acc<T>(src[i * d + c]);
  }
}

// S (after scale, softcap, ALiBi and mask) and P = softmax(S) for one (batch, head); the LSE
// includes the sink, so P sums to 1 - P_sink over a row.
struct Probabilities {
  std::vector<double> s;     // [sq, sk], -inf where masked
  std::vector<double> p;     // [sq, sk]
  std::vector<double> keep;  // [sq, sk], 0 or 1/(1-p); empty without dropout

  double keep_factor(int64_t index) const { return keep.empty() ? 1.0 : keep[index]; }
  std::vector<double> lse;  // [sq]
};

Probabilities compute_probabilities(const Problem& pr, const SeqInfo& si, int64_t b, int64_t h,
                                    const std::vector<double>& q, const std::vector<double>& k) {
  const int64_t sq = si.seqlen_q, sk = si.seqlen_k, d = pr.head_dim;
  const core::SinkTokenMask window({sq, sk, pr.mask.window_left, pr.mask.window_right}, pr.mask.sink_tokens);
  const core::BlockMask& blocks = pr.block_mask;
  auto visible = [&](int64_t i, int64_t j) {
    return window.visible(i, j) && (!blocks.present() || blocks.visible(b, h, i, j));
  };
  const double slope = pr.score.alibi_slope(b, h);
  const double sink = pr.score.sink_logit(h);
  Probabilities out;
  out.s.assign(static_cast<size_t>(sq * sk), kNegInf);
  out.p.assign(static_cast<size_t>(sq * sk), 0.0);
  if (pr.dropout.enabled()) out.keep.assign(static_cast<size_t>(sq * sk), 1.0);
  out.lse.assign(static_cast<size_t>(sq), kNegInf);
  const uint64_t bh = static_cast<uint64_t>(b * pr.heads_q + h);
  for (int64_t i = 0; i < sq; ++i) {
    double* srow = out.s.data() + i * sk;
    double row_max = kNegInf;
    bool nan_score = false;
    for (int64_t j = 0; j < sk; ++j) {
      if (!visible(i, j)) continue;
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) dot += q[i * d + c] * k[j * d + c];
      double s = pr.score.scale * dot;
      if (pr.score.softcap > 0.0) s = core::softcap_apply(s, pr.score.softcap);
      if (pr.score.alibi) s += core::alibi_bias(slope, i, j, sq, sk);
      srow[j] = s;
      nan_score = nan_score || std::isnan(s);
      row_max = std::max(row_max, s);
    }
    if (nan_score) {  // a NaN score reaches the whole row: P, LSE and out NaN (not an empty row)
      out.lse[i] = std::numeric_limits<double>::quiet_NaN();
      for (int64_t j = 0; j < sk; ++j) {
        if (visible(i, j)) out.p[i * sk + j] = std::numeric_limits<double>::quiet_NaN();
      }
      continue;
    }
    // The sink joins the row's max and sum as one more logit without a value vector.
    row_max = std::max(row_max, sink);
    if (row_max == kNegInf) continue;  // empty row without a sink: P = 0, LSE = -inf
    double sum = sink == kNegInf ? 0.0 : std::exp(sink - row_max);
    for (int64_t j = 0; j < sk; ++j) sum += srow[j] == kNegInf ? 0.0 : std::exp(srow[j] - row_max);
    out.lse[i] = row_max + std::log(sum);
    for (int64_t j = 0; j < sk; ++j) {
      out.p[i * sk + j] = srow[j] == kNegInf ? 0.0 : std::exp(srow[j] - out.lse[i]);
    }
    if (pr.dropout.enabled()) {
      for (int64_t j = 0; j < sk; ++j) {
        const bool kept = core::dropout_keep(pr.dropout.seed, pr.dropout.offset, bh, i, j, pr.dropout.threshold);
        out.keep[i * sk + j] = kept ? 1.0 / (1.0 - pr.dropout.p) : 0.0;
      }
    }
  }
  return out;
}

// Rows of q and k have head_dim d, those of v, out, dout and d_v head_dim_v d_v. Types: the
// storage types of q, k / v and out (ElementTypes).
template <typename Types>
void forward_head(const Problem& pr, int64_t b, int64_t h) {
  const SeqInfo si = detail::seq_info(pr, b);
  const int64_t sq = si.seqlen_q, sk = si.seqlen_k, d = pr.head_dim, d_v = pr.head_dim_v;
  if (sq == 0) return;
  const int64_t hk = h / pr.group_size();
  const auto q = load_rows<typename Types::q>(pr.q, b, si.q_start, sq, h, d);
  const auto k = load_rows<typename Types::kv>(pr.k, b, si.k_start, sk, hk, d);
  const auto v = load_rows<typename Types::kv>(pr.v, b, si.k_start, sk, hk, d_v);
  const Probabilities pb = compute_probabilities(pr, si, b, h, q, k);
  std::vector<double> o(static_cast<size_t>(sq * d_v), 0.0);
  for (int64_t i = 0; i < sq; ++i) {
    for (int64_t j = 0; j < sk; ++j) {
      const double pd = pb.p[i * sk + j] * pb.keep_factor(i * sk + j);
      if (pd == 0.0) continue;
      for (int64_t c = 0; c < d_v; ++c) o[i * d_v + c] += pd * v[j * d_v + c];
    }
  }
  store_rows<typename Types::out>(pr.out, b, si.q_start, sq, h, d_v, o);
  if (pr.lse.data) {
    for (int64_t i = 0; i < sq; ++i) {
      *row_ptr<float>(pr.lse, b, si.q_start + i, h) = static_cast<float>(pb.lse[i]);
    }
  }
}

// All query heads of one kv head, so dK/dV of the group are summed without races. dsink
// gets the heads' sink gradients of this batch entry (summed over entries by the caller).
template <typename T>
void backward_kv_head(const Problem& pr, int64_t b, int64_t hk, double* dsink) {
  const SeqInfo si = detail::seq_info(pr, b);
  const int64_t sq = si.seqlen_q, sk = si.seqlen_k, d = pr.head_dim, d_v = pr.head_dim_v;
  std::vector<double> dk(static_cast<size_t>(sk * d), 0.0), dv(static_cast<size_t>(sk * d_v), 0.0);
  const auto k = load_rows<T>(pr.k, b, si.k_start, sk, hk, d);
  const auto v = load_rows<T>(pr.v, b, si.k_start, sk, hk, d_v);
  for (int64_t h = hk * pr.group_size(); h < (hk + 1) * pr.group_size(); ++h) {
    if (sq == 0) break;
    const auto q = load_rows<T>(pr.q, b, si.q_start, sq, h, d);
    const auto dout = load_rows<T>(pr.dout, b, si.q_start, sq, h, d_v);
    const Probabilities pb = compute_probabilities(pr, si, b, h, q, k);
    std::vector<double> dq(static_cast<size_t>(sq * d), 0.0);
    for (int64_t i = 0; i < sq; ++i) {
      // dP_ij = keep_ij * dO_i . V_j ; D_i = sum_j P_ij dP_ij ; dS = P (dP - D)
      std::vector<double> dp(static_cast<size_t>(sk), 0.0);
      double rowsum = 0.0;
      for (int64_t j = 0; j < sk; ++j) {
        const double p = pb.p[i * sk + j];
        if (p == 0.0) continue;
        double dot = 0.0;
        for (int64_t c = 0; c < d_v; ++c) dot += dout[i * d_v + c] * v[j * d_v + c];
        dp[j] = dot * pb.keep_factor(i * sk + j);
        rowsum += p * dp[j];
        const double pd = p * pb.keep_factor(i * sk + j);
        for (int64_t c = 0; c < d_v; ++c) dv[j * d_v + c] += pd * dout[i * d_v + c];
      }
      // rowsum is D_i = dO_i . O_i (O with dropout's keep factors).
      const double p_sink = core::sink_probability(pr.score.sink_logit(h), pb.lse[i]);
      if (p_sink != 0.0) dsink[h] -= p_sink * rowsum;
      for (int64_t j = 0; j < sk; ++j) {
        const double p = pb.p[i * sk + j];
        if (p == 0.0) continue;
        double ds = p * (dp[j] - rowsum);
        if (pr.score.softcap > 0.0) {
          // s = softcap(scale * qk) + bias: chain through the cap (the bias is constant).
          double capped = pb.s[i * sk + j];
          if (pr.score.alibi) capped -= core::alibi_bias(pr.score.alibi_slope(b, h), i, j, sq, sk);
          ds *= core::softcap_grad(capped, pr.score.softcap);
        }
        ds *= pr.score.scale;
        for (int64_t c = 0; c < d; ++c) {
          dq[i * d + c] += ds * k[j * d + c];
          dk[j * d + c] += ds * q[i * d + c];
        }
      }
    }
    store_rows<T>(pr.dq, b, si.q_start, sq, h, d, dq);
  }
  store_rows<T>(pr.dk, b, si.k_start, sk, hk, d, dk);
  store_rows<T>(pr.dv, b, si.k_start, sk, hk, d_v, dv);
}

}  // namespace

// One work item per (batch, head); parallel_items carries a failed allocation (the reference
// holds [sq, sk] matrices) back to the caller as an exception instead of terminating.
void reference_forward(const Problem& pr) {
  dispatch_element_types(pr, [&](auto types) {
    using Types = decltype(types);
    parallel_items(
        pr.batch * pr.heads_q, [] { return 0; },
        [&](int, int64_t t) { forward_head<Types>(pr, t / pr.heads_q, t % pr.heads_q); });
  });
}

void reference_backward(const Problem& pr) {
  // Per batch entry and query head, summed over the batch in order afterwards: race-free.
  std::vector<double> dsink(static_cast<size_t>(pr.batch * pr.heads_q), 0.0);
  dispatch_dtype(pr.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_items(
        pr.batch * pr.heads_kv, [] { return 0; },
        [&](int, int64_t t) {
          const int64_t b = t / pr.heads_kv;
          backward_kv_head<T>(pr, b, t % pr.heads_kv, dsink.data() + b * pr.heads_q);
        });
  });
  if (pr.dsink) {
    for (int64_t h = 0; h < pr.heads_q; ++h) {
      double sum = 0.0;
      for (int64_t b = 0; b < pr.batch; ++b) sum += dsink[b * pr.heads_q + h];
      pr.dsink[h * pr.dsink_stride] = static_cast<float>(sum);
    }
  }
}

}  // namespace flashattn::cpu

// The naive attention of naive_attention.hpp: plain loops over one (batch, kv head) at a time,
// in the checked dtype's precision.
#include "oracle/naive_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "core/float8.hpp"
#include "core/half.hpp"
#include "core/mask.hpp"
#include "core/philox.hpp"
#include "core/variant.hpp"

namespace flashattn_oracle {

using flashattn::DType;

double round_to(DType dtype, double x) {
  using namespace flashattn::core;
  switch (dtype) {
    case DType::kFloat16:
      return fp16_to_float(float_to_fp16(static_cast<float>(x)));
    case DType::kBFloat16:
      return bf16_to_float(float_to_bf16(static_cast<float>(x)));
    case DType::kFloat32:
      return static_cast<float>(x);
    case DType::kInt32:
      return static_cast<double>(static_cast<int32_t>(x));
    case DType::kFloat64:
      return x;
    case DType::kFloat8E4M3:
      return float8_to_float<E4M3Format>(float_to_float8<E4M3Format>(static_cast<float>(x)));
    case DType::kFloat8E5M2:
      return float8_to_float<E5M2Format>(float_to_float8<E5M2Format>(static_cast<float>(x)));
  }
  return x;
}

std::string Case::name() const {
  std::ostringstream os;
  os << flashattn::dtype_name(dtype);
  if (result_dtype() != dtype) os << "->" << flashattn::dtype_name(result_dtype());
  os << " b" << batch << " sq" << seqlen_q << " sk" << seqlen_k << " h" << heads_q << "/" << heads_kv << " d"
     << head_dim;
  if (value_head_dim() != head_dim) os << "/" << value_head_dim();
  if (causal) os << " causal";
  if (window_left >= 0 || window_right >= 0) os << " window(" << window_left << "," << window_right << ")";
  if (sink_tokens > 0) os << " sink_tokens" << sink_tokens;
  if (softcap > 0) os << " softcap" << softcap;
  if (alibi) os << " alibi";
  if (sink) os << " sink";
  if (dropout > 0) os << " dropout" << dropout;
  if (precise) os << " precise";
  if (varlen()) os << " varlen(" << lens_q.size() << " seqs" << (used_k.empty() ? "" : ", seqused_k") << ")";
  if (strided) os << " strided";
  if (input_scale != 1.0) os << " x" << input_scale;
  return os.str();
}

Geometry make_geometry(const Case& c) {
  Geometry g{};
  g.hq = c.heads_q;
  g.hkv = c.heads_kv;
  g.d = c.head_dim;
  g.dv = c.value_head_dim();
  g.varlen = c.varlen();
  if (!g.varlen) {
    g.batch = c.batch;
    g.rows_q = c.seqlen_q;
    g.rows_k = c.seqlen_k;
    for (int64_t b = 0; b < g.batch; ++b) {
      g.q_start.push_back(0);
      g.k_start.push_back(0);
      g.len_q.push_back(c.seqlen_q);
      g.len_k.push_back(c.seqlen_k);
    }
    return g;
  }
  g.batch = static_cast<int64_t>(c.lens_q.size());
  int64_t tq = 0, tk = 0;
  for (int64_t b = 0; b < g.batch; ++b) {
    g.q_start.push_back(tq);
    g.k_start.push_back(tk);
    g.len_q.push_back(c.lens_q[b]);
    g.len_k.push_back(c.used_k.empty() ? c.lens_k[b] : c.used_k[b]);
    tq += c.lens_q[b];
    tk += c.lens_k[b];
  }
  g.rows_q = tq + 3;  // trailing rows that belong to no sequence
  g.rows_k = tk + 2;
  return g;
}

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Naive attention in dtype-like precision: Acc arithmetic, P and dS rounded to the dtype.
template <typename Acc>
struct Naive {
  const Case& c;
  const Geometry& g;
  const std::vector<double>&q, &k, &v, &dout, &alibi, &sink;  // row-major copies of the inputs
  uint64_t seed, offset;                                      // dropout
  std::vector<double> out, lse, dq, dk, dv, dsink;
  double dsink_scale = 0;

  Acc rnd(double x) const { return static_cast<Acc>(round_to(c.dtype, x)); }

  // dots[j] = the sum over x of a[x] * rows[j * d + x], added in the order x = 0, 1, ... as a
  // plain loop does, for the j in [0, n) where need(j) (others untouched). Four rows at a time:
  // four independent sums in flight instead of one chain of dependent additions.
  template <class Need>
  static void row_dots(const Acc* a, const std::vector<Acc>& rows, int64_t n, int64_t d, Need need,
                       std::vector<Acc>& dots) {
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
      const int64_t m = std::min<int64_t>(4, n - j0);
      bool any = false;
      for (int64_t t = 0; t < m; ++t) any = any || need(j0 + t);
      if (!any) continue;
      const Acc* r = &rows[static_cast<size_t>(j0 * d)];
      if (m == 4) {
        Acc s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (int64_t x = 0; x < d; ++x) {
          s0 += a[x] * r[x];
          s1 += a[x] * r[d + x];
          s2 += a[x] * r[2 * d + x];
          s3 += a[x] * r[3 * d + x];
        }
        dots[j0] = s0, dots[j0 + 1] = s1, dots[j0 + 2] = s2, dots[j0 + 3] = s3;
        continue;
      }
      for (int64_t t = 0; t < m; ++t) {
        Acc sum = 0;
        for (int64_t x = 0; x < d; ++x) sum += a[x] * r[t * d + x];
        dots[j0 + t] = sum;
      }
    }
  }

  void run() {
    const int64_t q_rows = (g.varlen ? 1 : g.batch) * g.rows_q;
    out.assign(static_cast<size_t>(q_rows * g.hq * g.dv), 0.0);
    dq.assign(static_cast<size_t>(static_cast<int64_t>(q.size())), 0.0);
    lse.assign(static_cast<size_t>(g.hq * q_rows), kNegInf);
    dk.assign(static_cast<size_t>(static_cast<int64_t>(k.size())), 0.0);
    dv.assign(static_cast<size_t>(static_cast<int64_t>(v.size())), 0.0);
    std::vector<Acc> dk_acc(dk.size(), 0), dv_acc(dv.size(), 0);
    // Per (batch, head): d sink's share and the sum of its terms' magnitudes.
    std::vector<double> dsink_parts(static_cast<size_t>(g.batch * g.hq), 0.0), dsink_abs(dsink_parts);
    // One item per (batch, kv head): its query heads, in order, are the only ones that add to
    // its dK / dV rows, so running items in parallel gives the serial loop's result bitwise
    // (the GPU suites' host time is mostly this oracle).
    const int64_t group = g.hq / g.hkv;
#pragma omp parallel for schedule(dynamic)
    for (int64_t item = 0; item < g.batch * g.hkv; ++item) {
      const int64_t b = item / g.hkv, hk = item % g.hkv;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        head(b, h, dk_acc, dv_acc, dsink_parts[b * g.hq + h], dsink_abs[b * g.hq + h]);
      }
    }
    if (!sink.empty()) {
      dsink.assign(static_cast<size_t>(g.hq), 0.0);
      std::vector<double> magnitude(static_cast<size_t>(g.hq), 0.0);
      for (int64_t b = 0; b < g.batch; ++b) {
        for (int64_t h = 0; h < g.hq; ++h) {
          dsink[h] += dsink_parts[b * g.hq + h];
          magnitude[h] += dsink_abs[b * g.hq + h];
        }
      }
      for (double& x : dsink) x = static_cast<float>(x);
      for (double m : magnitude) dsink_scale = std::max(dsink_scale, m);
    }
    for (size_t i = 0; i < dk.size(); ++i) dk[i] = round_to(c.dtype, dk_acc[i]);
    for (size_t i = 0; i < dv.size(); ++i) dv[i] = round_to(c.dtype, dv_acc[i]);
  }

  void head(int64_t b, int64_t h, std::vector<Acc>& dk_acc, std::vector<Acc>& dv_acc, double& dsink_part,
            double& dsink_abs) {
    const int64_t sq = g.len_q[b], sk = g.len_k[b], d = g.d, d_v = g.dv, hk = h / (g.hq / g.hkv);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    // A side of kUnboundedWindow tokens or more is unbounded (the API folds it into -1); taken
    // as is, diag(i) + side would overflow.
    auto side = [](int64_t w) { return w >= flashattn::core::kUnboundedWindow ? int64_t{-1} : w; };
    const flashattn::core::SinkTokenMask mask({sq, sk, side(c.window_left), c.causal ? 0 : side(c.window_right)},
                                              c.sink_tokens);
    const double slope = c.alibi ? alibi[h] : 0.0;
    const Acc sink_logit = sink.empty() ? -std::numeric_limits<Acc>::infinity() : static_cast<Acc>(sink[h]);
    const double keep_scale = 1.0 / (1.0 - c.dropout);
    const uint32_t threshold = flashattn::core::dropout_threshold(c.dropout);
    const uint64_t bh = static_cast<uint64_t>(b * g.hq + h);
    std::vector<Acc> s(static_cast<size_t>(sk)), p(static_cast<size_t>(sk)), keep(static_cast<size_t>(sk));
    // The head's K / V rows, and each row's q / dout below, converted to Acc once: the loops then
    // read contiguous values (the same arithmetic in the same order as reading the inputs).
    std::vector<Acc> kh(static_cast<size_t>(sk * d)), vh(static_cast<size_t>(sk * d_v));
    for (int64_t j = 0; j < sk; ++j) {
      for (int64_t x = 0; x < d; ++x) kh[j * d + x] = static_cast<Acc>(k[g.k_index(b, j, hk, x)]);
      for (int64_t x = 0; x < d_v; ++x) vh[j * d_v + x] = static_cast<Acc>(v[g.v_index(b, j, hk, x)]);
    }
    std::vector<Acc> qi(static_cast<size_t>(d)), doi(static_cast<size_t>(d_v)), dots(static_cast<size_t>(sk));
    for (int64_t i = 0; i < sq; ++i) {
      const int64_t qb = g.q_index(b, i, h, 0), ob = g.out_index(b, i, h, 0);
      for (int64_t x = 0; x < d; ++x) qi[x] = static_cast<Acc>(q[qb + x]);
      for (int64_t x = 0; x < d_v; ++x) doi[x] = c.backward ? static_cast<Acc>(dout[ob + x]) : Acc{0};
      Acc mx = sink_logit;  // the sink joins the row's max and sum, with no value vector
      row_dots(
          qi.data(), kh, sk, d, [&](int64_t j) { return mask.visible(i, j); }, dots);
      for (int64_t j = 0; j < sk; ++j) {
        s[j] = -std::numeric_limits<Acc>::infinity();
        if (!mask.visible(i, j)) continue;
        Acc sv = static_cast<Acc>(scale) * dots[j];
        if (c.softcap > 0) sv = static_cast<Acc>(c.softcap) * std::tanh(sv / static_cast<Acc>(c.softcap));
        if (c.alibi) sv += static_cast<Acc>(flashattn::core::alibi_bias(slope, i, j, sq, sk));
        s[j] = sv;
        mx = std::max(mx, sv);
      }
      if (mx == -std::numeric_limits<Acc>::infinity()) continue;  // empty row
      Acc sum = std::exp(sink_logit - mx);
      for (int64_t j = 0; j < sk; ++j) sum += std::exp(s[j] - mx);
      lse[g.lse_index(b, i, h)] = static_cast<float>(mx + std::log(sum));
      for (int64_t j = 0; j < sk; ++j) {
        p[j] = std::exp(s[j] - mx) / sum;
        keep[j] = 1;
        if (c.dropout > 0) {
          keep[j] = flashattn::core::dropout_keep(seed, offset, bh, i, j, threshold) ? keep_scale : 0;
        }
      }
      std::vector<Acc> o(static_cast<size_t>(d_v), 0);
      for (int64_t j = 0; j < sk; ++j) {
        const Acc pd = rnd(p[j] * keep[j]);
        const Acc* vj = &vh[j * d_v];
        for (int64_t x = 0; x < d_v; ++x) o[x] += pd * vj[x];
      }
      for (int64_t x = 0; x < d_v; ++x) out[ob + x] = round_to(c.result_dtype(), o[x]);
      if (!c.backward) continue;
      Acc delta = 0;
      for (int64_t x = 0; x < d_v; ++x) delta += doi[x] * static_cast<Acc>(out[ob + x]);
      const double dsink_term = static_cast<double>(std::exp(sink_logit - mx) / sum * delta);
      dsink_part -= dsink_term;
      dsink_abs += std::abs(dsink_term);
      std::vector<Acc> dqi(static_cast<size_t>(d), 0);
      row_dots(
          doi.data(), vh, sk, d_v, [&](int64_t j) { return p[j] != 0; }, dots);
      for (int64_t j = 0; j < sk; ++j) {
        if (p[j] == 0) continue;
        const Acc* kj = &kh[j * d];
        Acc dpv = dots[j];
        dpv *= keep[j];
        Acc ds = p[j] * (dpv - delta);
        if (c.softcap > 0) {
          Acc capped = s[j];
          if (c.alibi) capped -= static_cast<Acc>(flashattn::core::alibi_bias(slope, i, j, sq, sk));
          ds *= flashattn::core::softcap_grad(capped, static_cast<Acc>(c.softcap));
        }
        ds = rnd(ds * static_cast<Acc>(scale));
        const Acc pd = rnd(p[j] * keep[j]);
        Acc* dkj = &dk_acc[g.k_index(b, j, hk, 0)];
        Acc* dvj = &dv_acc[g.v_index(b, j, hk, 0)];
        for (int64_t x = 0; x < d; ++x) {
          dqi[x] += ds * kj[x];
          dkj[x] += ds * qi[x];
        }
        for (int64_t x = 0; x < d_v; ++x) dvj[x] += pd * doi[x];
      }
      for (int64_t x = 0; x < d; ++x) dq[qb + x] = round_to(c.dtype, dqi[x]);
    }
  }
};

}  // namespace

NaiveResult naive_attention(const Case& c, const Geometry& g, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>& dout,
                            const std::vector<double>& alibi, uint64_t dropout_seed, uint64_t dropout_offset,
                            const std::vector<double>& sink) {
  auto run = [&](auto acc_tag) {
    Naive<decltype(acc_tag)> n{c, g, q, k, v, dout, alibi, sink, dropout_seed, dropout_offset, {}, {}, {}, {}, {}, {}};
    n.run();
    return NaiveResult{std::move(n.out), std::move(n.lse),   std::move(n.dq), std::move(n.dk),
                       std::move(n.dv),  std::move(n.dsink), n.dsink_scale};
  };
  return c.dtype == DType::kFloat64 ? run(double{}) : run(float{});
}

}  // namespace flashattn_oracle

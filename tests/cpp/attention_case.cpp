#include "attention_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "core/mask.hpp"
#include "core/philox.hpp"
#include "core/score.hpp"
#include "test_util.hpp"

namespace fa_test {

using flashattn::DType;

std::string Case::name() const {
  std::ostringstream os;
  os << flashattn::dtype_name(dtype) << " b" << batch << " sq" << seqlen_q << " sk" << seqlen_k
     << " h" << heads_q << "/" << heads_kv << " d" << head_dim;
  if (causal) os << " causal";
  if (window_left >= 0 || window_right >= 0) os << " window(" << window_left << "," << window_right << ")";
  if (softcap > 0) os << " softcap" << softcap;
  if (alibi) os << " alibi";
  if (dropout > 0) os << " dropout" << dropout;
  if (precise) os << " precise";
  if (varlen()) os << " varlen(" << lens_q.size() << " seqs" << (used_k.empty() ? "" : ", seqused_k") << ")";
  if (strided) os << " strided";
  if (input_scale != 1.0) os << " x" << input_scale;
  return os.str();
}

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Geometry of the case: per-sequence starts and lengths in the q / k tensors.
struct Geometry {
  int64_t batch, hq, hkv, d;
  std::vector<int64_t> q_start, k_start, len_q, len_k;
  int64_t rows_q, rows_k;  // tensor rows: total tokens (varlen) or seqlen (dense, per batch)
  bool varlen;

  // Linear index of element (b, i, h, c) in a q-like (heads hq) or k-like tensor.
  int64_t q_index(int64_t b, int64_t i, int64_t h, int64_t c) const {
    const int64_t row = varlen ? q_start[b] + i : b * rows_q + i;
    return (row * hq + h) * d + c;
  }
  int64_t k_index(int64_t b, int64_t j, int64_t h, int64_t c) const {
    const int64_t row = varlen ? k_start[b] + j : b * rows_k + j;
    return (row * hkv + h) * d + c;
  }
  int64_t lse_index(int64_t b, int64_t i, int64_t h) const {
    return varlen ? h * rows_q + q_start[b] + i : (b * hq + h) * rows_q + i;
  }
};

Geometry make_geometry(const Case& c) {
  Geometry g{};
  g.hq = c.heads_q;
  g.hkv = c.heads_kv;
  g.d = c.head_dim;
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

// Naive attention in dtype-like precision: Acc arithmetic, P and dS rounded to the dtype.
template <typename Acc>
struct Naive {
  const Case& c;
  const Geometry& g;
  const std::vector<double> &q, &k, &v, &dout, &alibi;  // row-major copies of the inputs
  uint64_t seed, offset;  // dropout
  std::vector<double> out, lse, dq, dk, dv;

  Acc rnd(double x) const { return static_cast<Acc>(round_to(c.dtype, x)); }

  void run() {
    out.assign(static_cast<size_t>(static_cast<int64_t>(q.size())), 0.0);
    dq.assign(static_cast<size_t>(static_cast<int64_t>(q.size())), 0.0);
    lse.assign(static_cast<size_t>(g.hq * (g.varlen ? g.rows_q : g.batch * g.rows_q)), kNegInf);
    dk.assign(static_cast<size_t>(static_cast<int64_t>(k.size())), 0.0);
    dv.assign(static_cast<size_t>(static_cast<int64_t>(k.size())), 0.0);
    std::vector<Acc> dk_acc(dk.size(), 0), dv_acc(dv.size(), 0);
    for (int64_t b = 0; b < g.batch; ++b) {
      for (int64_t h = 0; h < g.hq; ++h) head(b, h, dk_acc, dv_acc);
    }
    for (size_t i = 0; i < dk.size(); ++i) {
      dk[i] = round_to(c.dtype, dk_acc[i]);
      dv[i] = round_to(c.dtype, dv_acc[i]);
    }
  }

  void head(int64_t b, int64_t h, std::vector<Acc>& dk_acc, std::vector<Acc>& dv_acc) {
    const int64_t sq = g.len_q[b], sk = g.len_k[b], d = g.d, hk = h / (g.hq / g.hkv);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const flashattn::core::Mask mask{sq, sk, c.window_left, c.causal ? 0 : c.window_right};
    const double slope = c.alibi ? alibi[h] : 0.0;
    const double keep_scale = 1.0 / (1.0 - c.dropout);
    const uint32_t threshold = static_cast<uint32_t>(
        std::min(std::ceil(static_cast<double>(c.dropout) * 4294967296.0), 4294967295.0));
    const uint64_t bh = static_cast<uint64_t>(b * g.hq + h);
    std::vector<Acc> s(static_cast<size_t>(sk)), p(static_cast<size_t>(sk)), keep(static_cast<size_t>(sk));
    for (int64_t i = 0; i < sq; ++i) {
      Acc mx = -std::numeric_limits<Acc>::infinity();
      for (int64_t j = 0; j < sk; ++j) {
        s[j] = -std::numeric_limits<Acc>::infinity();
        if (!mask.visible(i, j)) continue;
        Acc dot = 0;
        for (int64_t x = 0; x < d; ++x) {
          dot += static_cast<Acc>(q[g.q_index(b, i, h, x)]) * static_cast<Acc>(k[g.k_index(b, j, hk, x)]);
        }
        Acc sv = static_cast<Acc>(scale) * dot;
        if (c.softcap > 0) sv = static_cast<Acc>(c.softcap) * std::tanh(sv / static_cast<Acc>(c.softcap));
        if (c.alibi) sv += static_cast<Acc>(flashattn::core::alibi_bias(slope, i, j, sq, sk));
        s[j] = sv;
        mx = std::max(mx, sv);
      }
      if (mx == -std::numeric_limits<Acc>::infinity()) continue;  // empty row
      Acc sum = 0;
      for (int64_t j = 0; j < sk; ++j) sum += std::exp(s[j] - mx);
      lse[g.lse_index(b, i, h)] = static_cast<float>(mx + std::log(sum));
      for (int64_t j = 0; j < sk; ++j) {
        p[j] = std::exp(s[j] - mx) / sum;
        keep[j] = 1;
        if (c.dropout > 0) {
          keep[j] = flashattn::core::dropout_keep(seed, offset, bh, i, j, threshold) ? keep_scale : 0;
        }
      }
      std::vector<Acc> o(static_cast<size_t>(d), 0);
      for (int64_t j = 0; j < sk; ++j) {
        const Acc pd = rnd(p[j] * keep[j]);
        for (int64_t x = 0; x < d; ++x) o[x] += pd * static_cast<Acc>(v[g.k_index(b, j, hk, x)]);
      }
      for (int64_t x = 0; x < d; ++x) out[g.q_index(b, i, h, x)] = round_to(c.dtype, o[x]);
      if (!c.backward) continue;
      Acc delta = 0;
      for (int64_t x = 0; x < d; ++x) {
        delta += static_cast<Acc>(dout[g.q_index(b, i, h, x)]) * static_cast<Acc>(out[g.q_index(b, i, h, x)]);
      }
      std::vector<Acc> dqi(static_cast<size_t>(d), 0);
      for (int64_t j = 0; j < sk; ++j) {
        if (p[j] == 0) continue;
        Acc dpv = 0;
        for (int64_t x = 0; x < d; ++x) {
          dpv += static_cast<Acc>(dout[g.q_index(b, i, h, x)]) * static_cast<Acc>(v[g.k_index(b, j, hk, x)]);
        }
        dpv *= keep[j];
        Acc ds = p[j] * (dpv - delta);
        if (c.softcap > 0) {
          Acc capped = s[j];
          if (c.alibi) capped -= static_cast<Acc>(flashattn::core::alibi_bias(slope, i, j, sq, sk));
          ds *= flashattn::core::softcap_grad(capped, static_cast<Acc>(c.softcap));
        }
        ds = rnd(ds * static_cast<Acc>(scale));
        const Acc pd = rnd(p[j] * keep[j]);
        for (int64_t x = 0; x < d; ++x) {
          dqi[x] += ds * static_cast<Acc>(k[g.k_index(b, j, hk, x)]);
          dk_acc[g.k_index(b, j, hk, x)] += ds * static_cast<Acc>(q[g.q_index(b, i, h, x)]);
          dv_acc[g.k_index(b, j, hk, x)] += pd * static_cast<Acc>(dout[g.q_index(b, i, h, x)]);
        }
      }
      for (int64_t x = 0; x < d; ++x) dq[g.q_index(b, i, h, x)] = round_to(c.dtype, dqi[x]);
    }
  }
};

struct Tensors {
  HostTensor q, k, v, dout, alibi, cu_q, cu_k, used_k;
};

// q-like / k-like shapes, packed-qkv-like strides when c.strided.
HostTensor value_tensor(const Case& c, const Geometry& g, int64_t heads, int64_t rows,
                        bool strided_rows, int64_t row_stride_factor_heads) {
  std::vector<int64_t> shape = g.varlen ? std::vector<int64_t>{rows, heads, g.d}
                                        : std::vector<int64_t>{g.batch, rows, heads, g.d};
  if (!strided_rows) return HostTensor(c.dtype, shape);
  const int64_t row_stride = row_stride_factor_heads * g.d;
  std::vector<int64_t> strides = g.varlen ? std::vector<int64_t>{row_stride, g.d, 1}
                                          : std::vector<int64_t>{rows * row_stride, row_stride, g.d, 1};
  return HostTensor(c.dtype, shape, strides);
}

flashattn::AttentionOptions options_of(const Case& c, const Tensors& t, uint64_t seed,
                                       uint64_t offset) {
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.window_left;
  o.mask.window_right = c.window_right;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = t.alibi.view();
  o.dropout.p = c.dropout;
  o.dropout.seed = seed;
  o.dropout.offset = offset;
  o.precise = c.precise;
  return o;
}

double max_finite_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) {
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  }
  return m;
}

// The tolerance rule: max error <= factor * naive's max error + atol, the same for the mean.
void expect_close(const char* what, const HostTensor& got_t, const std::vector<double>& ref,
                  const std::vector<double>& naive, double factor, DType dtype,
                  const std::string& name, double* err_out, double* bound_out,
                  double scale_floor = 0) {
  const std::vector<double> got = got_t.to_vector();
  const ErrorStats ours = compare(got, ref), base = compare(naive, ref);
  double scale = std::max(max_finite_abs(ref), scale_floor);
  // atol: accumulator rounding noise at the output's scale -- fp32's, or for fp64 2^-42, which
  // leaves room for the ~|logit| condition factor of softmax at large logits -- plus, for
  // 16-bit outputs, one ulp of the output: where the naive result is exact (one visible key,
  // P = 1), any other rounding of P may still land on the other side of a rounding boundary.
  const double acc_noise = dtype == DType::kFloat64 ? 0x1p-42 : 64 * 0x1p-23;
  const double out_ulp = dtype == DType::kFloat16 ? 0x1p-10 : dtype == DType::kBFloat16 ? 0x1p-7 : 0.0;
  const double atol = (acc_noise + out_ulp) * std::max(scale, 1e-3);
  const double bound = factor * base.max_abs + atol;
  EXPECT_FALSE(ours.has_nan) << what << ": NaN mismatch in " << name;
  EXPECT_FALSE(base.has_nan) << what << ": naive NaN mismatch in " << name;
  EXPECT_LE(ours.max_abs, bound) << what << " max error, naive " << base.max_abs << " atol "
                                 << atol << " in " << name;
  EXPECT_LE(ours.mean_abs, factor * base.mean_abs + atol)
      << what << " mean error, naive " << base.mean_abs << " in " << name;
  *err_out = std::max(*err_out, ours.max_abs);
  *bound_out = std::max(*bound_out, bound);
}

}  // namespace

CaseResult run_case(const Case& c) {
  const Geometry g = make_geometry(c);
  auto rng = rng_for(c.name());
  Tensors t;
  const int64_t packed_heads = c.heads_q + 2 * c.heads_kv;
  t.q = value_tensor(c, g, c.heads_q, g.rows_q, c.strided, packed_heads);
  t.k = value_tensor(c, g, c.heads_kv, g.rows_k, c.strided, packed_heads);
  t.v = value_tensor(c, g, c.heads_kv, g.rows_k, c.strided, packed_heads);
  t.dout = value_tensor(c, g, c.heads_q, g.rows_q, c.strided, 2 * c.heads_q);
  t.q.fill_normal(rng, c.input_scale);
  t.k.fill_normal(rng, c.input_scale);
  t.v.fill_normal(rng);
  t.dout.fill_normal(rng);
  if (c.alibi) {
    t.alibi = HostTensor(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(0.0, 0.3);
    for (int64_t h = 0; h < c.heads_q; ++h) t.alibi.set(h, u(rng));
  }
  flashattn::VarlenArgs vl;
  if (g.varlen) {
    t.cu_q = HostTensor(DType::kInt32, {g.batch + 1});
    t.cu_k = HostTensor(DType::kInt32, {g.batch + 1});
    for (int64_t b = 0; b <= g.batch; ++b) {
      t.cu_q.set(b, b < g.batch ? g.q_start[b] : g.q_start.back() + c.lens_q.back());
      t.cu_k.set(b, b < g.batch ? g.k_start[b] : g.k_start.back() + c.lens_k.back());
    }
    vl.cu_seqlens_q = t.cu_q.view();
    vl.cu_seqlens_k = t.cu_k.view();
    for (int64_t b = 0; b < g.batch; ++b) {
      vl.max_seqlen_q = std::max<int64_t>(vl.max_seqlen_q, c.lens_q[b]);
      vl.max_seqlen_k = std::max<int64_t>(vl.max_seqlen_k, c.lens_k[b]);
    }
    if (!c.used_k.empty()) {
      t.used_k = HostTensor(DType::kInt32, {g.batch});
      for (int64_t b = 0; b < g.batch; ++b) t.used_k.set(b, c.used_k[b]);
      vl.seqused_k = t.used_k.view();
    }
  }
  const uint64_t seed = rng(), offset = rng() % 1000;
  const flashattn::AttentionOptions opts = options_of(c, t, seed, offset);

  const std::vector<int64_t> lse_shape = g.varlen ? std::vector<int64_t>{c.heads_q, g.rows_q}
                                                  : std::vector<int64_t>{g.batch, c.heads_q, g.rows_q};
  auto out_like = [&](const HostTensor& x) {
    HostTensor o(c.dtype, x.shape());
    o.fill_storage_nan();  // every element must be written
    return o;
  };
  HostTensor out = out_like(t.q), out_ref = out_like(t.q);
  HostTensor lse(DType::kFloat32, lse_shape), lse_ref(DType::kFloat32, lse_shape);
  lse.fill_storage_nan();
  flashattn::ForwardArgs fa{t.q.view(), t.k.view(), t.v.view(), out.view(), lse.view()};
  flashattn::ForwardArgs fr{t.q.view(), t.k.view(), t.v.view(), out_ref.view(), lse_ref.view()};
  if (g.varlen) {
    flashattn::forward_varlen(fa, vl, opts);
    flashattn::reference_forward_varlen(fr, vl, opts);
  } else {
    flashattn::forward(fa, opts);
    flashattn::reference_forward(fr, opts);
  }
  auto run_naive = [&](auto acc_tag) {
    const std::vector<double> qv = t.q.to_vector(), kv = t.k.to_vector(), vv = t.v.to_vector(),
                              dov = t.dout.to_vector(), av = t.alibi.to_vector();
    Naive<decltype(acc_tag)> n{c, g, qv, kv, vv, dov, av, seed, offset, {}, {}, {}, {}, {}};
    n.run();
    return std::vector<std::vector<double>>{n.out, n.lse, n.dq, n.dk, n.dv};
  };
  const auto naive = c.dtype == DType::kFloat64 ? run_naive(double{}) : run_naive(float{});
  CaseResult r;
  const std::string name = c.name();
  {
    const std::vector<double> got = out.to_vector(), ref = out_ref.to_vector();
    double scale = 0;
    for (double x : ref) scale = std::max(scale, std::abs(x));
    r.out_rel_err = compare(got, ref).max_abs / std::max(scale, 1e-300);
  }
  expect_close("out", out, out_ref.to_vector(), naive[0], 2.0, c.dtype, name, &r.out_err, &r.out_bound);
  expect_close("lse", lse, lse_ref.to_vector(), naive[1], 2.0, DType::kFloat32, name, &r.out_err, &r.out_bound);
  if (!c.backward) return r;

  HostTensor dq = out_like(t.q), dk = out_like(t.k), dv = out_like(t.v);
  HostTensor dq_ref = out_like(t.q), dk_ref = out_like(t.k), dv_ref = out_like(t.v);
  flashattn::BackwardArgs ba{t.dout.view(), t.q.view(), t.k.view(), t.v.view(), out.view(),
                             lse.view(), dq.view(), dk.view(), dv.view()};
  flashattn::BackwardArgs br{t.dout.view(), t.q.view(), t.k.view(), t.v.view(), out_ref.view(),
                             lse_ref.view(), dq_ref.view(), dk_ref.view(), dv_ref.view()};
  if (g.varlen) {
    flashattn::backward_varlen(ba, vl, opts);
    flashattn::reference_backward_varlen(br, vl, opts);
  } else {
    flashattn::backward(ba, opts);
    flashattn::reference_backward(br, opts);
  }
  // The gradients share one rounding scale: a gradient that is exactly 0 (one visible key) is
  // computed as a difference of terms of the size of the others.
  const std::vector<double> rq = dq_ref.to_vector(), rk = dk_ref.to_vector(), rv = dv_ref.to_vector();
  const double grad_scale = std::max({max_finite_abs(rq), max_finite_abs(rk), max_finite_abs(rv)});
  expect_close("dq", dq, rq, naive[2], 3.0, c.dtype, name, &r.grad_err, &r.grad_bound, grad_scale);
  expect_close("dk", dk, rk, naive[3], 3.0, c.dtype, name, &r.grad_err, &r.grad_bound, grad_scale);
  expect_close("dv", dv, rv, naive[4], 3.0, c.dtype, name, &r.grad_err, &r.grad_bound, grad_scale);
  return r;
}

}  // namespace fa_test

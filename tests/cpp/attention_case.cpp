#include "attention_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "test_util.hpp"

namespace fa_test {

using flashattn::DType;

namespace {

struct Tensors {
  HostTensor q, k, v, dout, alibi, sink, cu_q, cu_k, used_k;
  HostTensor q_descale, k_descale, v_descale;  // FP8 cases: fp32 [batch, heads_kv]
};

// An FP8 input's values: each element times the factor of its (batch entry, KV head), in the
// naive attention's row-major layout (index(b, i, h, c) of Geometry). Rows outside every
// sequence keep their raw values (nothing reads them).
template <typename Index>
std::vector<double> dequantised(const HostTensor& x, const HostTensor& descale, const Geometry& g,
                                const std::vector<int64_t>& lens, int64_t heads, int64_t width, Index index) {
  std::vector<double> v = x.to_vector();
  const int64_t group = heads / g.hkv;
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t i = 0; i < lens[b]; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        const double factor = descale.get(b * g.hkv + h / group);
        for (int64_t c = 0; c < width; ++c) v[index(b, i, h, c)] *= factor;
      }
    }
  }
  return v;
}

// q-like / k-like shapes of head_dim `width` (g.d, or v's g.dv), packed-qkv-like strides when
// c.strided (rows of row_stride_factor_heads heads of the widest head_dim).
HostTensor value_tensor(const Case& c, const Geometry& g, int64_t heads, int64_t rows, int64_t width, bool strided_rows,
                        int64_t row_stride_factor_heads) {
  std::vector<int64_t> shape =
      g.varlen ? std::vector<int64_t>{rows, heads, width} : std::vector<int64_t>{g.batch, rows, heads, width};
  if (!strided_rows) return HostTensor(c.dtype, shape);
  const int64_t row_stride = row_stride_factor_heads * std::max(g.d, g.dv);
  std::vector<int64_t> strides = g.varlen ? std::vector<int64_t>{row_stride, width, 1}
                                          : std::vector<int64_t>{rows * row_stride, row_stride, width, 1};
  return HostTensor(c.dtype, shape, strides);
}

flashattn::AttentionOptions options_of(const Case& c, const Tensors& t, uint64_t seed, uint64_t offset) {
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.window_left;
  o.mask.window_right = c.window_right;
  o.mask.sink_tokens = c.sink_tokens;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = t.alibi.view();
  if (c.sink) o.score.learnable_sink = t.sink.view();
  o.dropout.p = c.dropout;
  o.dropout.seed = seed;
  o.dropout.offset = offset;
  o.precise = c.precise;
  return o;
}

}  // namespace

CaseResult run_case(const Case& c) {
  const Geometry g = make_geometry(c);
  auto rng = rng_for(c.name());
  Tensors t;
  const int64_t packed_heads = c.heads_q + 2 * c.heads_kv;
  t.q = value_tensor(c, g, c.heads_q, g.rows_q, g.d, c.strided, packed_heads);
  t.k = value_tensor(c, g, c.heads_kv, g.rows_k, g.d, c.strided, packed_heads);
  t.v = value_tensor(c, g, c.heads_kv, g.rows_k, g.dv, c.strided, packed_heads);
  t.dout = value_tensor(c, g, c.heads_q, g.rows_q, g.dv, c.strided, 2 * c.heads_q);
  t.q.fill_normal(rng, c.input_scale);
  t.k.fill_normal(rng, c.input_scale);
  t.v.fill_normal(rng);
  t.dout.fill_normal(rng);
  if (c.alibi) {
    t.alibi = HostTensor(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(0.0, 0.3);
    for (int64_t h = 0; h < c.heads_q; ++h) t.alibi.set(h, u(rng));
  }
  if (c.sink) {
    // Around the size of a row's logsumexp over a few keys: the sink takes a visible share.
    t.sink = HostTensor(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(-1.0, 3.0);
    for (int64_t h = 0; h < c.heads_q; ++h) t.sink.set(h, u(rng));
  }
  if (c.float8()) {
    // Factors around 1 that give FP8 values of order 1 (rounded as an FP8 tensor stores them) the
    // dynamic range of real activations.
    std::uniform_real_distribution<double> u(0.25, 4.0);
    for (HostTensor* d : {&t.q_descale, &t.k_descale, &t.v_descale}) {
      *d = HostTensor(DType::kFloat32, {g.batch, c.heads_kv});
      for (int64_t e = 0; e < d->numel(); ++e) d->set(e, u(rng));
    }
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

  const std::vector<int64_t> lse_shape =
      g.varlen ? std::vector<int64_t>{c.heads_q, g.rows_q} : std::vector<int64_t>{g.batch, c.heads_q, g.rows_q};
  auto out_like = [&](const HostTensor& x) {
    HostTensor o(c.result_dtype(), x.shape());
    o.fill_storage_nan();  // every element must be written
    return o;
  };
  HostTensor out = out_like(t.dout), out_ref = out_like(t.dout);  // q's rows, v's head_dim
  HostTensor lse(DType::kFloat32, lse_shape), lse_ref(DType::kFloat32, lse_shape);
  lse.fill_storage_nan();
  flashattn::ForwardArgs fa{t.q.view(), t.k.view(), t.v.view(), out.view(), lse.view()};
  flashattn::ForwardArgs fr{t.q.view(), t.k.view(), t.v.view(), out_ref.view(), lse_ref.view()};
  if (c.float8()) {
    fa.q_descale = fr.q_descale = t.q_descale.view();
    fa.k_descale = fr.k_descale = t.k_descale.view();
    fa.v_descale = fr.v_descale = t.v_descale.view();
  }
  if (g.varlen) {
    flashattn::forward_varlen(fa, vl, opts);
    flashattn::reference_forward_varlen(fr, vl, opts);
  } else {
    flashattn::forward(fa, opts);
    flashattn::reference_forward(fr, opts);
  }
  std::vector<double> q = t.q.to_vector(), k = t.k.to_vector(), v = t.v.to_vector();
  if (c.float8()) {
    using namespace std::placeholders;
    q = dequantised(t.q, t.q_descale, g, g.len_q, c.heads_q, g.d, std::bind(&Geometry::q_index, &g, _1, _2, _3, _4));
    k = dequantised(t.k, t.k_descale, g, g.len_k, c.heads_kv, g.d, std::bind(&Geometry::k_index, &g, _1, _2, _3, _4));
    v = dequantised(t.v, t.v_descale, g, g.len_k, c.heads_kv, g.dv, std::bind(&Geometry::v_index, &g, _1, _2, _3, _4));
  }
  const NaiveResult naive =
      naive_attention(c, g, q, k, v, t.dout.to_vector(), t.alibi.to_vector(), seed, offset, t.sink.to_vector());
  CaseResult r;
  const std::string name = c.name();
  {
    const std::vector<double> got = out.to_vector(), ref = out_ref.to_vector();
    double scale = 0;
    for (double x : ref) scale = std::max(scale, std::abs(x));
    r.out_rel_err = compare(got, ref).max_abs / std::max(scale, 1e-300);
  }
  expect_close("out", out.to_vector(), out_ref.to_vector(), naive.out, 2.0, c.result_dtype(), name, &r.out_err,
               &r.out_bound);
  r.out_only_err = compare(out.to_vector(), out_ref.to_vector()).max_abs;
  r.out_naive_err = compare(naive.out, out_ref.to_vector()).max_abs;
  expect_lse_close(lse.to_vector(), lse_ref.to_vector(), naive.lse, name, &r.out_err, &r.out_bound);
  if (!c.backward) return r;

  HostTensor dq = out_like(t.q), dk = out_like(t.k), dv = out_like(t.v);
  HostTensor dq_ref = out_like(t.q), dk_ref = out_like(t.k), dv_ref = out_like(t.v);
  flashattn::BackwardArgs ba{t.dout.view(), t.q.view(), t.k.view(), t.v.view(), out.view(),
                             lse.view(),    dq.view(),  dk.view(),  dv.view()};
  flashattn::BackwardArgs br{t.dout.view(),  t.q.view(),    t.k.view(),    t.v.view(),   out_ref.view(),
                             lse_ref.view(), dq_ref.view(), dk_ref.view(), dv_ref.view()};
  HostTensor dsink, dsink_ref;
  if (c.sink) {
    dsink = HostTensor(DType::kFloat32, {c.heads_q});
    dsink_ref = HostTensor(DType::kFloat32, {c.heads_q});
    dsink.fill_storage_nan();
    ba.dsink = dsink.view();
    br.dsink = dsink_ref.view();
  }
  if (g.varlen) {
    flashattn::backward_varlen(ba, vl, opts);
    flashattn::reference_backward_varlen(br, vl, opts);
  } else {
    flashattn::backward(ba, opts);
    flashattn::reference_backward(br, opts);
  }
  expect_grads_close({dq.to_vector(), dk.to_vector(), dv.to_vector()},
                     {dq_ref.to_vector(), dk_ref.to_vector(), dv_ref.to_vector()}, naive, c.dtype, name, &r.grad_err,
                     &r.grad_bound);
  if (c.sink) {
    expect_dsink_close(dsink.to_vector(), dsink_ref.to_vector(), naive, c.dtype, name, &r.grad_err, &r.grad_bound);
  }
  return r;
}

}  // namespace fa_test

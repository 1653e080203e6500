// Random calls, valid and invalid, through the C++ API and the C ABI (CPU backend).
// - A valid call -- random geometry (dense or varlen, GQA, any head dim, every dtype) and random
//   options (causal, windows, softcap, ALiBi, dropout) -- must agree with the fp64 reference and
//   give no NaN from finite inputs, forward and backward.
// - An invalid call -- one random mutation of a valid one -- must fail with a typed error that
//   names an argument ("name: ..."), and leave every output byte as it was.
// The ASan + UBSan build runs this too, so an out-of-bounds access or undefined behaviour on any
// of these paths is a failure. The seed is the run's (FLASHATTN_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "test_util.hpp"

namespace {

using fa_test::HostTensor;
using flashattn::AttentionOptions;
using flashattn::DType;
using flashattn::TensorView;

struct Problem {
  int64_t batch = 1, sq = 1, sk = 1, hq = 1, hkv = 1, d = 8;
  DType dtype = DType::kFloat32;
  bool varlen = false;
  std::vector<int32_t> cu_q, cu_k;  // varlen prefix sums
  AttentionOptions options;
};

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

Problem random_problem(std::mt19937_64& rng) {
  Problem p;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
  p.dtype = dtypes[pick(rng, 0, 3)];
  p.batch = pick(rng, 1, 3);
  p.hkv = pick(rng, 1, 3);
  p.hq = p.hkv * pick(rng, 1, 3);
  p.d = pick(rng, 1, 72);
  p.varlen = pick(rng, 0, 2) == 0;
  if (p.varlen) {
    p.cu_q = {0};
    p.cu_k = {0};
    for (int64_t b = 0; b < p.batch; ++b) {
      p.cu_q.push_back(p.cu_q.back() + static_cast<int32_t>(pick(rng, 0, 40)));
      p.cu_k.push_back(p.cu_k.back() + static_cast<int32_t>(pick(rng, 0, 50)));
    }
    p.sq = p.cu_q.back();
    p.sk = p.cu_k.back();
  } else {
    p.sq = pick(rng, 1, 70);
    p.sk = pick(rng, 1, 90);
  }
  AttentionOptions& o = p.options;
  o.mask.causal = pick(rng, 0, 2) == 0;
  if (pick(rng, 0, 2) == 0) o.mask.window_left = pick(rng, 0, 40);
  if (!o.mask.causal && pick(rng, 0, 2) == 0) o.mask.window_right = pick(rng, 0, 40);
  if (pick(rng, 0, 3) == 0) o.score.softcap = static_cast<float>(pick(rng, 5, 50));
  if (pick(rng, 0, 3) == 0) o.dropout = {0.2f, static_cast<uint64_t>(rng()), static_cast<uint64_t>(pick(rng, 0, 9))};
  return p;
}

struct Tensors {
  HostTensor q, k, v, out, lse, dout, dq, dk, dv, slopes, cu_q, cu_k;
  flashattn::ForwardArgs fwd;
  flashattn::BackwardArgs bwd;
  flashattn::VarlenArgs vl;
  AttentionOptions options;
};

std::vector<int64_t> rows_shape(const Problem& p, int64_t rows, int64_t heads) {
  return p.varlen ? std::vector<int64_t>{rows, heads, p.d} : std::vector<int64_t>{p.batch, rows, heads, p.d};
}

Tensors make_tensors(const Problem& p, std::mt19937_64& rng) {
  Tensors t;
  t.q = HostTensor(p.dtype, rows_shape(p, p.sq, p.hq));
  t.k = HostTensor(p.dtype, rows_shape(p, p.sk, p.hkv));
  t.v = HostTensor(p.dtype, rows_shape(p, p.sk, p.hkv));
  t.dout = HostTensor(p.dtype, rows_shape(p, p.sq, p.hq));
  for (HostTensor* x : {&t.q, &t.k, &t.v, &t.dout}) x->fill_normal(rng);
  t.out = HostTensor(p.dtype, rows_shape(p, p.sq, p.hq));
  t.lse = p.varlen ? HostTensor(DType::kFloat32, {p.hq, p.sq}) : HostTensor(DType::kFloat32, {p.batch, p.hq, p.sq});
  t.dq = HostTensor(p.dtype, t.q.shape());
  t.dk = HostTensor(p.dtype, t.k.shape());
  t.dv = HostTensor(p.dtype, t.v.shape());
  t.options = p.options;
  if (pick(rng, 0, 3) == 0) {
    t.slopes = HostTensor(DType::kFloat32, {p.hq});
    for (int64_t h = 0; h < p.hq; ++h) t.slopes.set(h, 0.05 * static_cast<double>(pick(rng, 0, 8)));
    t.options.score.alibi_slopes = t.slopes.view();
  }
  if (p.varlen) {
    t.cu_q = HostTensor(DType::kInt32, {p.batch + 1});
    t.cu_k = HostTensor(DType::kInt32, {p.batch + 1});
    for (int64_t b = 0; b <= p.batch; ++b) {
      t.cu_q.set(b, p.cu_q[static_cast<size_t>(b)]);
      t.cu_k.set(b, p.cu_k[static_cast<size_t>(b)]);
    }
    int64_t longest_q = 0, longest_k = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      longest_q = std::max<int64_t>(longest_q, p.cu_q[static_cast<size_t>(b) + 1] - p.cu_q[static_cast<size_t>(b)]);
      longest_k = std::max<int64_t>(longest_k, p.cu_k[static_cast<size_t>(b) + 1] - p.cu_k[static_cast<size_t>(b)]);
    }
    t.vl = {t.cu_q.view(), t.cu_k.view(), TensorView{}, longest_q, longest_k, TensorView{}};
  }
  t.fwd = {t.q.view(), t.k.view(), t.v.view(), t.out.view(), t.lse.view()};
  t.bwd = {t.dout.view(), t.q.view(),  t.k.view(),  t.v.view(), t.out.view(),
           t.lse.view(),  t.dq.view(), t.dk.view(), t.dv.view()};
  return t;
}

void forward(const Problem& p, const Tensors& t, const flashattn::ForwardArgs& a, bool reference) {
  if (p.varlen) {
    reference ? flashattn::reference_forward_varlen(a, t.vl, t.options) : flashattn::forward_varlen(a, t.vl, t.options);
  } else {
    reference ? flashattn::reference_forward(a, t.options) : flashattn::forward(a, t.options);
  }
}

// Largest |got - ref| against a bound that scales with the reference's magnitude: the dtype's
// rounding of the inputs and outputs dominates (the tolerance rule proper is test_forward's).
void expect_close(const char* name, const HostTensor& got, const HostTensor& ref, DType dtype) {
  const double tol = dtype == DType::kFloat64 ? 1e-9 : dtype == DType::kFloat32 ? 2e-4 : 6e-2;
  const auto g = got.to_vector(), r = ref.to_vector();
  double scale = 1.0;
  for (double x : r) {
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  }
  for (size_t i = 0; i < g.size(); ++i) {
    if (r[i] == -std::numeric_limits<double>::infinity()) {  // an empty row's LSE
      ASSERT_EQ(g[i], r[i]) << name << "[" << i << "]";
      continue;
    }
    ASSERT_FALSE(std::isnan(g[i])) << name << "[" << i << "] is NaN from finite inputs";
    ASSERT_LE(std::abs(g[i] - r[i]), tol * scale) << name << "[" << i << "]: " << g[i] << " vs " << r[i];
  }
}

fa_tensor c_view(const TensorView& v) {
  fa_tensor t{};
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.device_type = FA_DEVICE_CPU;
  t.ndim = v.ndim;
  for (int i = 0; i < v.ndim; ++i) {
    t.shape[i] = v.shape[i];
    t.strides[i] = v.strides[i];
  }
  return t;
}

// The forward through the C ABI: the status and fa_last_error as the C++ API's Error would be.
std::string c_forward(const Problem& p, const Tensors& t, const flashattn::ForwardArgs& a) {
  fa_forward_args ca{c_view(a.q),   c_view(a.k),         c_view(a.v),         c_view(a.out),
                     c_view(a.lse), c_view(a.q_descale), c_view(a.k_descale), c_view(a.v_descale)};
  fa_options o;
  fa_options_default(&o);
  const AttentionOptions& x = t.options;
  o.causal = x.mask.causal;
  o.window_left = x.mask.window_left;
  o.window_right = x.mask.window_right;
  o.softmax_scale = x.score.softmax_scale;
  o.softcap = x.score.softcap;
  o.alibi_slopes = x.score.alibi_slopes.present() ? c_view(x.score.alibi_slopes) : fa_tensor{};
  o.dropout_p = x.dropout.p;
  o.dropout_seed = x.dropout.seed;
  o.dropout_offset = x.dropout.offset;
  fa_status s;
  if (p.varlen) {
    fa_varlen vl{c_view(t.vl.cu_seqlens_q), c_view(t.vl.cu_seqlens_k), fa_tensor{},
                 t.vl.max_seqlen_q,         t.vl.max_seqlen_k,         fa_tensor{},
                 FA_INDEX_CHECK_HOST};
    s = fa_forward_varlen(&ca, &vl, &o, nullptr);
  } else {
    s = fa_forward(&ca, &o, nullptr);
  }
  return s == FA_OK ? "" : fa_last_error();
}

// One mutation of a valid call that makes it invalid; false where it does not apply.
using Mutation = std::function<bool(const Problem&, Tensors&, flashattn::ForwardArgs&)>;

std::vector<std::pair<const char*, Mutation>> mutations() {
  return {
      {"q dtype int32",
       [](const Problem&, Tensors&, flashattn::ForwardArgs& a) {
         a.q.dtype = DType::kInt32;
         return true;
       }},
      {"k head_dim",
       [](const Problem&, Tensors&, flashattn::ForwardArgs& a) {
         a.k.shape[a.k.ndim - 1] += 1;
         return true;
       }},
      {"heads not a multiple",
       [](const Problem& p, Tensors&, flashattn::ForwardArgs& a) {
         if (p.hq % (p.hkv + 1) == 0) return false;
         a.k.shape[a.k.ndim - 2] = a.v.shape[a.v.ndim - 2] = p.hkv + 1;
         return true;
       }},
      {"negative stride",
       [](const Problem& p, Tensors&, flashattn::ForwardArgs& a) {
         if (p.sq == 0) return false;
         a.q.strides[0] = -1;
         return true;
       }},
      {"window_left -2",
       [](const Problem&, Tensors& t, flashattn::ForwardArgs&) {
         t.options.mask.window_left = -2;
         return true;
       }},
      {"scale 1e300",
       [](const Problem&, Tensors& t, flashattn::ForwardArgs&) {
         t.options.score.softmax_scale = 1e300;
         return true;
       }},
      {"scale NaN",
       [](const Problem&, Tensors& t, flashattn::ForwardArgs&) {
         t.options.score.softmax_scale = std::nan("");
         return true;
       }},
      {"softcap -1",
       [](const Problem&, Tensors& t, flashattn::ForwardArgs&) {
         t.options.score.softcap = -1.0f;
         return true;
       }},
      {"dropout 1",
       [](const Problem&, Tensors& t, flashattn::ForwardArgs&) {
         t.options.dropout.p = 1.0f;
         return true;
       }},
      {"out aliases q",
       [](const Problem& p, Tensors&, flashattn::ForwardArgs& a) {
         if (p.sq == 0) return false;
         a.out.data = a.q.data;
         return true;
       }},
      {"lse shape",
       [](const Problem&, Tensors&, flashattn::ForwardArgs& a) {
         a.lse.shape[a.lse.ndim - 1] += 1;
         return true;
       }},
      {"null q",
       [](const Problem& p, Tensors&, flashattn::ForwardArgs& a) {
         if (p.sq == 0) return false;  // an empty tensor may be null
         a.q.data = nullptr;
         return true;
       }},
      {"misaligned q",
       [](const Problem& p, Tensors&, flashattn::ForwardArgs& a) {
         if (p.sq == 0 || p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16) return false;
         a.q.data = static_cast<char*>(a.q.data) + 2;
         return true;
       }},
      {"out rows overlap",
       [](const Problem& p, Tensors&, flashattn::ForwardArgs& a) {
         if (p.hq < 2 || p.sq < 2) return false;
         a.out.strides[a.out.ndim - 3] = a.out.strides[a.out.ndim - 2];  // a row the width of one head
         return true;
       }},
      {"q ndim",
       [](const Problem&, Tensors&, flashattn::ForwardArgs& a) {
         a.q.ndim -= 1;
         return true;
       }},
      {"cu_seqlens_q decreasing",
       [](const Problem& p, Tensors& t, flashattn::ForwardArgs&) {
         if (!p.varlen || p.sq == 0) return false;
         t.cu_q.set(p.batch, 0);
         t.cu_q.set(0, static_cast<double>(p.sq));
         return true;
       }},
      {"alibi dtype",
       [](const Problem&, Tensors& t, flashattn::ForwardArgs&) {
         if (!t.options.score.alibi_slopes.present()) return false;
         t.options.score.alibi_slopes.dtype = DType::kFloat16;
         return true;
       }},
  };
}

TEST(Fuzz, ValidCallsAgreeWithTheReference) {
  auto rng = fa_test::rng_for("fuzz valid");
  const int iterations = fa_test::quick_mode() ? 40 : 120;
  for (int it = 0; it < iterations; ++it) {
    const Problem p = random_problem(rng);
    Tensors t = make_tensors(p, rng);
    SCOPED_TRACE("iteration " + std::to_string(it) + ": " + flashattn::dtype_name(p.dtype) + " b" +
                 std::to_string(p.batch) + " sq" + std::to_string(p.sq) + " sk" + std::to_string(p.sk) + " h" +
                 std::to_string(p.hq) + "/" + std::to_string(p.hkv) + " d" + std::to_string(p.d) +
                 (p.varlen ? " varlen" : ""));
    t.out.fill_storage_nan();
    t.lse.fill_storage_nan();
    forward(p, t, t.fwd, false);
    HostTensor ref_out(p.dtype, t.out.shape()), ref_lse(DType::kFloat32, t.lse.shape());
    flashattn::ForwardArgs ra = t.fwd;
    ra.out = ref_out.view();
    ra.lse = ref_lse.view();
    forward(p, t, ra, true);
    expect_close("out", t.out, ref_out, p.dtype);
    expect_close("lse", t.lse, ref_lse, DType::kFloat32);
    if (pick(rng, 0, 1) == 0) {  // the backward from the reference's out / lse, against the reference's
      HostTensor rdq(p.dtype, t.q.shape()), rdk(p.dtype, t.k.shape()), rdv(p.dtype, t.v.shape());
      flashattn::BackwardArgs b = t.bwd, rb = t.bwd;
      b.out = rb.out = ref_out.view();
      b.lse = rb.lse = ref_lse.view();
      rb.dq = rdq.view();
      rb.dk = rdk.view();
      rb.dv = rdv.view();
      if (p.varlen) {
        flashattn::backward_varlen(b, t.vl, t.options);
        flashattn::reference_backward_varlen(rb, t.vl, t.options);
      } else {
        flashattn::backward(b, t.options);
        flashattn::reference_backward(rb, t.options);
      }
      expect_close("dq", t.dq, rdq, p.dtype);
      expect_close("dk", t.dk, rdk, p.dtype);
      expect_close("dv", t.dv, rdv, p.dtype);
    }
  }
}

TEST(Fuzz, InvalidCallsFailNamedAndWriteNothing) {
  auto rng = fa_test::rng_for("fuzz invalid");
  const auto all = mutations();
  const int iterations = fa_test::quick_mode() ? 150 : 400;
  int applied = 0;
  for (int it = 0; it < iterations; ++it) {
    const Problem p = random_problem(rng);
    Tensors t = make_tensors(p, rng);
    const auto& [what, mutate] = all[static_cast<size_t>(pick(rng, 0, static_cast<int64_t>(all.size()) - 1))];
    flashattn::ForwardArgs a = t.fwd;
    if (!mutate(p, t, a)) continue;
    ++applied;
    SCOPED_TRACE(std::string(what) + ", iteration " + std::to_string(it));
    std::memset(t.out.data(), 0xA5, static_cast<size_t>(t.out.numel()) * flashattn::dtype_size(p.dtype));
    std::memset(t.lse.data(), 0xA5, static_cast<size_t>(t.lse.numel()) * sizeof(float));
    const std::vector<double> out_before = t.out.to_vector(), lse_before = t.lse.to_vector();
    std::string error;
    if (pick(rng, 0, 1) == 0) {
      try {
        forward(p, t, a, false);
      } catch (const flashattn::Error& e) {
        EXPECT_TRUE(e.code() == flashattn::ErrorCode::kInvalidArgument ||
                    e.code() == flashattn::ErrorCode::kInvalidDtype)
            << e.what();
        error = e.what();
      }
    } else {
      error = c_forward(p, t, a);
    }
    ASSERT_FALSE(error.empty()) << "the call succeeded";
    EXPECT_NE(error.find(": "), std::string::npos) << "the error names no argument: " << error;
    // Bytes, not values (the sentinel's bits must survive); an empty output (a mutation may give
    // it zero elements) has no data pointer to hand memcmp.
    auto same_bytes = [](const std::vector<double>& x, const std::vector<double>& y) {
      return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0);
    };
    const auto out_after = t.out.to_vector(), lse_after = t.lse.to_vector();
    ASSERT_TRUE(same_bytes(out_before, out_after)) << "out was written by a failed call (" << error << ")";
    ASSERT_TRUE(same_bytes(lse_before, lse_after)) << "lse was written by a failed call (" << error << ")";
  }
  EXPECT_GT(applied, iterations / 2);
}

}  // namespace

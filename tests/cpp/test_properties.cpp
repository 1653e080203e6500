// Properties of attention that hold whatever the reference says: invariances, consistency
// between API forms, finite-difference gradients, determinism, empty rows, and 64-bit offsets.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "core/half.hpp"
#include "core/mask.hpp"
#include "test_util.hpp"

namespace {

using fa_test::HostTensor;
using flashattn::AttentionOptions;
using flashattn::DType;

struct Qkv {
  HostTensor q, k, v;
};

Qkv random_qkv(DType dt, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d,
               const std::string& seed_name) {
  auto rng = fa_test::rng_for(seed_name);
  Qkv x{HostTensor(dt, {b, sq, hq, d}), HostTensor(dt, {b, sk, hkv, d}), HostTensor(dt, {b, sk, hkv, d})};
  x.q.fill_normal(rng);
  x.k.fill_normal(rng);
  x.v.fill_normal(rng);
  return x;
}

struct Fwd {
  HostTensor out, lse;
};

Fwd forward(const HostTensor& q, const HostTensor& k, const HostTensor& v, const AttentionOptions& o) {
  const auto& s = q.shape();
  Fwd f{HostTensor(q.dtype(), s), HostTensor(DType::kFloat32, {s[0], s[2], s[1]})};
  f.out.fill_storage_nan();
  f.lse.fill_storage_nan();
  flashattn::forward({q.view(), k.view(), v.view(), f.out.view(), f.lse.view()}, o);
  return f;
}

struct Grads {
  HostTensor dq, dk, dv;
};

Grads backward(const HostTensor& dout, const Qkv& x, const Fwd& f, const AttentionOptions& o) {
  Grads g{HostTensor(x.q.dtype(), x.q.shape()), HostTensor(x.k.dtype(), x.k.shape()),
          HostTensor(x.v.dtype(), x.v.shape())};
  g.dq.fill_storage_nan();
  g.dk.fill_storage_nan();
  g.dv.fill_storage_nan();
  flashattn::backward({dout.view(), x.q.view(), x.k.view(), x.v.view(), f.out.view(), f.lse.view(), g.dq.view(),
                       g.dk.view(), g.dv.view()},
                      o);
  return g;
}

double max_diff(const HostTensor& a, const HostTensor& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) || std::isnan(vb[i])) return std::numeric_limits<double>::infinity();
    if (va[i] == vb[i]) continue;  // also equal infinities
    m = std::max(m, std::abs(va[i] - vb[i]));
  }
  return m;
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  return va.size() == vb.size() && (va.empty() || std::memcmp(va.data(), vb.data(), va.size() * sizeof(double)) == 0);
}

// Equal values element by element: like bitwise_equal, except that -0 equals +0 (a sum that
// starts at +0 turns a -0 term into +0) and NaN equals nothing.
bool values_equal(const HostTensor& a, const HostTensor& b) { return a.to_vector() == b.to_vector(); }

TEST(Properties, KeyPermutationInvariance) {
  const Qkv x = random_qkv(DType::kFloat64, 2, 77, 130, 4, 2, 48, "perm");
  Qkv y = x;
  y.k = HostTensor(DType::kFloat64, x.k.shape());
  y.v = HostTensor(DType::kFloat64, x.v.shape());
  std::vector<int64_t> perm(130);
  std::iota(perm.begin(), perm.end(), 0);
  auto rng = fa_test::rng_for("perm-order");
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t row = 2 * 48;  // elements per key row (heads_kv * d)
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < 130; ++j) {
      for (int64_t e = 0; e < row; ++e) {
        y.k.set((b * 130 + perm[j]) * row + e, x.k.get((b * 130 + j) * row + e));
        y.v.set((b * 130 + perm[j]) * row + e, x.v.get((b * 130 + j) * row + e));
      }
    }
  }
  AttentionOptions o;
  o.score.softcap = 30.0f;  // permutation invariance holds for any per-element score mod
  const Fwd a = forward(x.q, x.k, x.v, o), b = forward(y.q, y.k, y.v, o);
  EXPECT_LE(max_diff(a.out, b.out), 1e-12);
  EXPECT_LE(max_diff(a.lse, b.lse), 1e-5);  // lse is stored in fp32
}

TEST(Properties, RowsOfPSumToOne) {
  // With V = 1 every output element is the row sum of P (1, or 0 for an empty row).
  Qkv x = random_qkv(DType::kFloat32, 1, 200, 150, 3, 3, 64, "rowsum");
  x.v.fill(1.0);
  AttentionOptions o;
  o.mask.causal = true;  // sq > sk: the first 50 rows see no key
  const Fwd f = forward(x.q, x.k, x.v, o);
  for (int64_t i = 0; i < 200; ++i) {
    for (int64_t h = 0; h < 3; ++h) {
      const double expected = i < 50 ? 0.0 : 1.0;
      EXPECT_NEAR(f.out.get((i * 3 + h) * 64 + 5), expected, 2e-6) << "row " << i;
      const double lse = f.lse.get(h * 200 + i);
      if (i < 50) {
        EXPECT_EQ(lse, -std::numeric_limits<double>::infinity());
      } else {
        EXPECT_TRUE(std::isfinite(lse));
      }
    }
  }
}

TEST(Properties, EmptyRowsGiveZeroOutputAndGradients) {
  Qkv x = random_qkv(DType::kBFloat16, 2, 90, 40, 2, 1, 32, "empty");
  AttentionOptions o;
  o.mask.causal = true;  // rows 0..49 see nothing
  const Fwd f = forward(x.q, x.k, x.v, o);
  HostTensor dout(DType::kBFloat16, x.q.shape());
  auto rng = fa_test::rng_for("empty-dout");
  dout.fill_normal(rng);
  const Grads g = backward(dout, x, f, o);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 50; ++i) {
      for (int64_t e = 0; e < 2 * 32; ++e) {
        ASSERT_EQ(f.out.get((b * 90 + i) * 64 + e), 0.0);
        ASSERT_EQ(g.dq.get((b * 90 + i) * 64 + e), 0.0);
      }
    }
  }
  for (double v : g.dk.to_vector()) ASSERT_FALSE(std::isnan(v));
}

TEST(Properties, GqaEqualsMhaWithRepeatedKv) {
  const Qkv x = random_qkv(DType::kFloat32, 2, 70, 90, 6, 2, 40, "gqa");
  HostTensor k6(DType::kFloat32, {2, 90, 6, 40}), v6(DType::kFloat32, {2, 90, 6, 40});
  for (int64_t r = 0; r < 2 * 90; ++r) {
    for (int64_t h = 0; h < 6; ++h) {
      for (int64_t c = 0; c < 40; ++c) {
        k6.set((r * 6 + h) * 40 + c, x.k.get((r * 2 + h / 3) * 40 + c));
        v6.set((r * 6 + h) * 40 + c, x.v.get((r * 2 + h / 3) * 40 + c));
      }
    }
  }
  AttentionOptions o;
  o.mask.causal = true;
  const Fwd gqa = forward(x.q, x.k, x.v, o), mha = forward(x.q, k6, v6, o);
  EXPECT_TRUE(bitwise_equal(gqa.out, mha.out));
  EXPECT_TRUE(bitwise_equal(gqa.lse, mha.lse));
  HostTensor dout(DType::kFloat32, x.q.shape());
  auto rng = fa_test::rng_for("gqa-dout");
  dout.fill_normal(rng);
  const Grads g = backward(dout, x, gqa, o);
  const Grads m = backward(dout, Qkv{x.q, k6, v6}, mha, o);
  EXPECT_TRUE(bitwise_equal(g.dq, m.dq));
  // dK of a kv head is the sum of the MHA dK of its group.
  double worst = 0;
  for (int64_t r = 0; r < 2 * 90; ++r) {
    for (int64_t hk = 0; hk < 2; ++hk) {
      for (int64_t c = 0; c < 40; ++c) {
        double sk = 0, sv = 0;
        for (int64_t h = hk * 3; h < hk * 3 + 3; ++h) {
          sk += m.dk.get((r * 6 + h) * 40 + c);
          sv += m.dv.get((r * 6 + h) * 40 + c);
        }
        worst = std::max(
            {worst, std::abs(sk - g.dk.get((r * 2 + hk) * 40 + c)), std::abs(sv - g.dv.get((r * 2 + hk) * 40 + c))});
      }
    }
  }
  EXPECT_LE(worst, 1e-4);
}

TEST(Properties, VarlenEqualsPerSequenceLoop) {
  // Bitwise: a varlen batch computes each sequence exactly as a dense call on it alone.
  const std::vector<int64_t> lq = {37, 0, 130, 1}, lk = {50, 9, 130, 0};
  const int64_t h = 4, hkv = 2, d = 64;
  const int64_t tq = 168, tk = 189;
  auto rng = fa_test::rng_for("varlen-loop");
  HostTensor q(DType::kFloat16, {tq, h, d}), k(DType::kFloat16, {tk, hkv, d}), v(DType::kFloat16, {tk, hkv, d});
  HostTensor dout(DType::kFloat16, {tq, h, d});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  dout.fill_normal(rng);
  HostTensor cu_q(DType::kInt32, {5}), cu_k(DType::kInt32, {5});
  int64_t oq = 0, ok = 0;
  for (int b = 0; b <= 4; ++b) {
    cu_q.set(b, static_cast<double>(oq));
    cu_k.set(b, static_cast<double>(ok));
    if (b < 4) oq += lq[b], ok += lk[b];
  }
  AttentionOptions o;
  o.mask.causal = true;
  o.score.alibi_slopes = {};
  flashattn::VarlenArgs vl{cu_q.view(), cu_k.view(), {}, 130, 130, {}};
  HostTensor out(DType::kFloat16, {tq, h, d}), lse(DType::kFloat32, {h, tq});
  flashattn::forward_varlen({q.view(), k.view(), v.view(), out.view(), lse.view()}, vl, o);
  HostTensor dq(DType::kFloat16, {tq, h, d}), dk(DType::kFloat16, {tk, hkv, d}), dv(DType::kFloat16, {tk, hkv, d});
  flashattn::backward_varlen(
      {dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view()}, vl, o);
  oq = ok = 0;
  for (int b = 0; b < 4; ++b) {
    auto slice = [&](const HostTensor& t, int64_t off, int64_t len, int64_t heads) {
      HostTensor s(t.dtype(), {1, len, heads, d});
      for (int64_t e = 0; e < len * heads * d; ++e) s.set(e, t.get(off * heads * d + e));
      return s;
    };
    Qkv x{slice(q, oq, lq[b], h), slice(k, ok, lk[b], hkv), slice(v, ok, lk[b], hkv)};
    const Fwd f = forward(x.q, x.k, x.v, o);
    const Grads g = backward(slice(dout, oq, lq[b], h), x, f, o);
    EXPECT_TRUE(bitwise_equal(f.out, slice(out, oq, lq[b], h))) << "sequence " << b;
    EXPECT_TRUE(bitwise_equal(g.dq, slice(dq, oq, lq[b], h))) << "sequence " << b;
    EXPECT_TRUE(bitwise_equal(g.dk, slice(dk, ok, lk[b], hkv))) << "sequence " << b;
    EXPECT_TRUE(bitwise_equal(g.dv, slice(dv, ok, lk[b], hkv))) << "sequence " << b;
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < lq[b]; ++i) {
        const double a = f.lse.get(hh * lq[b] + i), bb = lse.get(hh * tq + oq + i);
        EXPECT_TRUE(a == bb) << "lse sequence " << b;
      }
    }
    oq += lq[b];
    ok += lk[b];
  }
}

TEST(Properties, CausalRowEqualsUnmaskedPrefix) {
  // Row i of causal attention (sq == sk) is unmasked attention of q_i over keys 0..i.
  const Qkv x = random_qkv(DType::kFloat64, 1, 150, 150, 2, 2, 32, "causal-prefix");
  AttentionOptions causal;
  causal.mask.causal = true;
  const Fwd full = forward(x.q, x.k, x.v, causal);
  for (int64_t i : {0, 1, 63, 64, 100, 149}) {
    HostTensor qi(DType::kFloat64, {1, 1, 2, 32}), kp(DType::kFloat64, {1, i + 1, 2, 32}),
        vp(DType::kFloat64, {1, i + 1, 2, 32});
    for (int64_t e = 0; e < 64; ++e) qi.set(e, x.q.get(i * 64 + e));
    for (int64_t e = 0; e < (i + 1) * 64; ++e) {
      kp.set(e, x.k.get(e));
      vp.set(e, x.v.get(e));
    }
    const Fwd row = forward(qi, kp, vp, AttentionOptions{});
    for (int64_t e = 0; e < 64; ++e) EXPECT_NEAR(row.out.get(e), full.out.get(i * 64 + e), 1e-12);
  }
}

// A window side wider than any sequence sees every key on that side: any int64 width, up to
// the largest, gives the unbounded result (bitwise, on the flash path and the reference), and
// a window_left wider than the keys with causal gives causal.
TEST(Properties, HugeWindowsAreUnbounded) {
  const Qkv x = random_qkv(DType::kFloat32, 2, 70, 90, 4, 2, 32, "huge windows");
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (bool causal : {false, true}) {
    AttentionOptions unbounded;
    unbounded.mask.causal = causal;
    const Fwd want = forward(x.q, x.k, x.v, unbounded);
    for (int64_t w : {int64_t{90}, int64_t{1} << 40, (int64_t{1} << 62) - 1, int64_t{1} << 62, kMax}) {
      SCOPED_TRACE("window " + std::to_string(w) + (causal ? " causal" : ""));
      AttentionOptions o = unbounded;
      o.mask.window_left = w;
      if (!causal) o.mask.window_right = w;
      const Fwd got = forward(x.q, x.k, x.v, o);
      EXPECT_LT(max_diff(got.out, want.out), 1e-6);
      EXPECT_LT(max_diff(got.lse, want.lse), 1e-6);
      if (w >= flashattn::core::kUnboundedWindow) {  // folded into -1: the very same call
        EXPECT_TRUE(bitwise_equal(got.out, want.out));
        EXPECT_TRUE(bitwise_equal(got.lse, want.lse));
      }
      Fwd ref{HostTensor(DType::kFloat32, x.q.shape()), HostTensor(DType::kFloat32, {2, 4, 70})};
      flashattn::reference_forward({x.q.view(), x.k.view(), x.v.view(), ref.out.view(), ref.lse.view()}, o);
      EXPECT_LT(max_diff(ref.out, want.out), 1e-5);
    }
  }
}

// A NaN input reaches exactly the rows and keys that see it, in out, LSE and gradients, on the
// flash path and in the reference alike; a NaN score row is NaN, not empty (LSE NaN, not -inf).
// Causal, 100 x 100 (two query tiles and two key tiles), GQA: both query heads read kv head 0.
TEST(Properties, NanReachesExactlyWhatSeesIt) {
  constexpr int64_t kS = 100, kD = 32;
  auto nan_rows = [](const HostTensor& t, int64_t head, int64_t heads, int64_t d) {
    std::vector<bool> rows(static_cast<size_t>(kS), false);
    for (int64_t i = 0; i < kS; ++i) {
      for (int64_t c = 0; c < d; ++c) rows[i] = rows[i] || std::isnan(t.get((i * heads + head) * d + c));
    }
    return rows;
  };
  AttentionOptions causal;
  causal.mask.causal = true;
  for (const char* where : {"v", "q"}) {
    SCOPED_TRACE(where);
    Qkv x = random_qkv(DType::kFloat32, 1, kS, kS, 2, 1, kD, std::string("nan reach ") + where);
    if (std::string(where) == "v") {
      x.v.set(6 * kD + 2, std::nan(""));  // key 6's value, column 2
    } else {
      x.q.set((5 * 2 + 0) * kD + 3, std::nan(""));  // query row 5 of head 0
    }
    const Fwd f = forward(x.q, x.k, x.v, causal);
    Fwd ref{HostTensor(DType::kFloat32, x.q.shape()), HostTensor(DType::kFloat32, {1, 2, kS})};
    flashattn::reference_forward({x.q.view(), x.k.view(), x.v.view(), ref.out.view(), ref.lse.view()}, causal);
    auto rng = fa_test::rng_for("nan reach dout");
    HostTensor dout(DType::kFloat32, x.q.shape());
    dout.fill_normal(rng);
    const Grads g = backward(dout, x, f, causal);
    for (int64_t h = 0; h < 2; ++h) {
      const auto out_nan = nan_rows(f.out, h, 2, kD);
      EXPECT_EQ(out_nan, nan_rows(ref.out, h, 2, kD)) << "head " << h;
      for (int64_t i = 0; i < kS; ++i) {
        const bool sees = std::string(where) == "v" ? i >= 6 : (h == 0 && i == 5);
        EXPECT_EQ(out_nan[i], sees) << "out row " << i << " head " << h;
        const double lse = f.lse.get(h * kS + i);
        EXPECT_EQ(std::isnan(lse), std::string(where) == "q" && sees) << "lse row " << i << " head " << h;
        EXPECT_EQ(std::isnan(ref.lse.get(h * kS + i)), std::isnan(lse)) << "reference lse row " << i;
        EXPECT_FALSE(lse == -std::numeric_limits<double>::infinity()) << "row " << i << " is not empty";
        EXPECT_EQ(nan_rows(g.dq, h, 2, kD)[i], sees) << "dq row " << i << " head " << h;
      }
    }
    const auto dk_nan = nan_rows(g.dk, 0, 1, kD), dv_nan = nan_rows(g.dv, 0, 1, kD);
    for (int64_t j = 0; j < kS; ++j) {
      // V: every key is seen by some row at or past 6, whose D = dO.O is NaN; dV never (V is not in it).
      // q row 5: keys 0..5, the ones it sees.
      const bool reached = std::string(where) == "v" ? true : j <= 5;
      EXPECT_EQ(dk_nan[j], reached) << "dk row " << j;
      EXPECT_EQ(dv_nan[j], std::string(where) == "q" && j <= 5) << "dv row " << j;
    }
  }
}

TEST(Properties, SplitKeysMergeEqualsWhole) {
  // Attention over K = [K1; K2] is the LSE-weighted merge of attention over K1 and over K2.
  const Qkv x = random_qkv(DType::kFloat64, 1, 40, 200, 2, 2, 32, "split");
  auto part = [&](const HostTensor& t, int64_t j0, int64_t n) {
    HostTensor s(DType::kFloat64, {1, n, 2, 32});
    for (int64_t e = 0; e < n * 64; ++e) s.set(e, t.get(j0 * 64 + e));
    return s;
  };
  const AttentionOptions o;
  const Fwd whole = forward(x.q, x.k, x.v, o);
  const Fwd a = forward(x.q, part(x.k, 0, 77), part(x.v, 0, 77), o);
  const Fwd b = forward(x.q, part(x.k, 77, 123), part(x.v, 77, 123), o);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 40; ++i) {
      const double la = a.lse.get(h * 40 + i), lb = b.lse.get(h * 40 + i);
      const double m = std::max(la, lb), l = m + std::log(std::exp(la - m) + std::exp(lb - m));
      EXPECT_NEAR(l, whole.lse.get(h * 40 + i), 1e-5);
      for (int64_t c = 0; c < 32; ++c) {
        const int64_t e = (i * 2 + h) * 32 + c;
        const double merged = std::exp(la - l) * a.out.get(e) + std::exp(lb - l) * b.out.get(e);
        EXPECT_NEAR(merged, whole.out.get(e), 1e-6);  // lse weights carry fp32 rounding
      }
    }
  }
}

// d(sum(dout * out))/dx by central differences in fp64 vs the backward pass.
TEST(Properties, FiniteDifferenceGradients) {
  struct Variant {
    const char* name;
    AttentionOptions o;
  };
  std::vector<Variant> variants(4);
  variants[0].name = "plain";
  variants[1].name = "causal+softcap";
  variants[1].o.mask.causal = true;
  variants[1].o.score.softcap = 2.0f;  // small cap: strongly non-linear
  variants[2].name = "window+alibi";
  variants[2].o.mask.window_left = 5;
  variants[2].o.mask.window_right = 2;
  HostTensor slopes(DType::kFloat32, {2});
  slopes.set(0, 0.25);
  slopes.set(1, 0.1);
  variants[2].o.score.alibi_slopes = slopes.view();
  variants[3].name = "dropout";
  variants[3].o.dropout = {0.3f, 1234, 5};
  for (const Variant& var : variants) {
    SCOPED_TRACE(var.name);
    Qkv x = random_qkv(DType::kFloat64, 1, 9, 13, 2, 1, 8, std::string("fd") + var.name);
    HostTensor dout(DType::kFloat64, x.q.shape());
    auto rng = fa_test::rng_for(std::string("fd-dout") + var.name);
    dout.fill_normal(rng);
    const Fwd f = forward(x.q, x.k, x.v, var.o);
    const Grads g = backward(dout, x, f, var.o);
    auto loss = [&]() {
      const Fwd ff = forward(x.q, x.k, x.v, var.o);
      double s = 0;
      for (int64_t e = 0; e < dout.numel(); ++e) s += dout.get(e) * ff.out.get(e);
      return s;
    };
    fa_test::expect_finite_difference_gradients({{&x.q, &g.dq}, {&x.k, &g.dk}, {&x.v, &g.dv}}, loss, 3);
  }
}

TEST(Properties, BitwiseDeterministicReruns) {
  const Qkv x = random_qkv(DType::kBFloat16, 2, 300, 333, 4, 2, 64, "rerun");
  HostTensor dout(DType::kBFloat16, x.q.shape());
  auto rng = fa_test::rng_for("rerun-dout");
  dout.fill_normal(rng);
  AttentionOptions o;
  o.mask.causal = true;
  o.dropout = {0.1f, 99, 0};
  const Fwd f0 = forward(x.q, x.k, x.v, o);
  const Grads g0 = backward(dout, x, f0, o);
  for (int run = 0; run < 20; ++run) {
    const Fwd f = forward(x.q, x.k, x.v, o);
    const Grads g = backward(dout, x, f, o);
    ASSERT_TRUE(bitwise_equal(f.out, f0.out) && bitwise_equal(f.lse, f0.lse));
    ASSERT_TRUE(bitwise_equal(g.dq, g0.dq) && bitwise_equal(g.dk, g0.dk) && bitwise_equal(g.dv, g0.dv));
  }
}

TEST(Properties, DropoutScalesExpectation) {
  // With V = 1, out_i = sum_j P_ij keep_ij / (1 - p): mean 1 over many rows.
  Qkv x = random_qkv(DType::kFloat32, 1, 512, 512, 4, 4, 32, "dropout-mean");
  x.v.fill(1.0);
  AttentionOptions o;
  o.dropout = {0.17f, 4242, 0};
  const Fwd f = forward(x.q, x.k, x.v, o);
  double sum = 0;
  for (int64_t r = 0; r < 512 * 4; ++r) sum += f.out.get(r * 32);
  const double mean = sum / (512 * 4);
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_GT(std::abs(mean - 1.0), 0.0);  // dropout really was applied
}

// Element offsets beyond 2^32: batch 1 of q/k/v/out lies 2^32 + 2^20 elements past batch 0,
// inside one sparse (mostly never touched) mapping.
TEST(Properties, OffsetsBeyond32Bits) {
  const int64_t stride_b = (int64_t{1} << 32) + (1 << 20);
  const int64_t s = 65, h = 2, d = 32, row = h * d;
  const size_t bytes = static_cast<size_t>(2 * stride_b + s * row) * 2 * 4;  // fp16, 4 tensors
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  auto* e = static_cast<uint16_t*>(base);
  uint16_t* t[4] = {e, e + (2 * stride_b + s * row), e + 2 * (2 * stride_b + s * row),
                    e + 3 * (2 * stride_b + s * row)};
  auto rng = fa_test::rng_for("offsets64");
  std::normal_distribution<float> n;
  for (int i = 0; i < 3; ++i) {
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t x = 0; x < s * row; ++x) t[i][b * stride_b + x] = flashattn::core::float_to_fp16(n(rng));
    }
  }
  auto view = [&](uint16_t* p) {
    return flashattn::TensorView::strided(p, DType::kFloat16, {2, s, h, d}, {stride_b, row, d, 1});
  };
  AttentionOptions o;
  o.mask.causal = true;
  HostTensor lse(DType::kFloat32, {2, h, s});
  flashattn::forward({view(t[0]), view(t[1]), view(t[2]), view(t[3]), lse.view()}, o);
  // Batch 1 recomputed from contiguous copies must match bitwise.
  HostTensor q1(DType::kFloat16, {1, s, h, d}), k1(DType::kFloat16, {1, s, h, d}), v1(DType::kFloat16, {1, s, h, d});
  for (int64_t x = 0; x < s * row; ++x) {
    q1.set(x, flashattn::core::fp16_to_float(t[0][stride_b + x]));
    k1.set(x, flashattn::core::fp16_to_float(t[1][stride_b + x]));
    v1.set(x, flashattn::core::fp16_to_float(t[2][stride_b + x]));
  }
  const Fwd f = forward(q1, k1, v1, o);
  for (int64_t x = 0; x < s * row; ++x) {
    ASSERT_EQ(flashattn::core::fp16_to_float(t[3][stride_b + x]), f.out.get(x)) << x;
  }
  munmap(base, bytes);
}

// The test matrix's huge shapes that fit this machine: many tiny sequences (b=8300, s=1, h=16,
// d=128, backward) and a decode step against 2^22 keys.
TEST(Properties, HugeBatchBackward) {
  const int64_t batch = fa_test::quick_mode() ? 830 : 8300;  // sanitizer build: fewer
  const Qkv x = random_qkv(DType::kFloat16, batch, 1, 1, 16, 16, 128, "huge-batch");
  HostTensor dout(DType::kFloat16, x.q.shape());
  auto rng = fa_test::rng_for("huge-batch-dout");
  dout.fill_normal(rng);
  const AttentionOptions o;
  const Fwd f = forward(x.q, x.k, x.v, o);
  const Grads g = backward(dout, x, f, o);
  // One key: out = v, dq = dk = 0 (softmax of one element is constant), dv = dout. As values:
  // fp16 inputs include -0 (a normal sample below 2^-25 rounds to it), and 1 * -0 added to a
  // +0 accumulator is +0.
  EXPECT_TRUE(values_equal(f.out, x.v));
  EXPECT_TRUE(values_equal(g.dv, dout));
  for (double v : g.dq.to_vector()) ASSERT_EQ(v, 0.0);
  for (double v : g.dk.to_vector()) ASSERT_EQ(v, 0.0);
}

TEST(Properties, DecodeAgainstFourMillionKeys) {
  const int64_t sk = int64_t{1} << (fa_test::quick_mode() ? 18 : 22);  // sanitizer build: fewer
  const Qkv x = random_qkv(DType::kBFloat16, 1, 1, sk, 2, 1, 64, "decode");
  const AttentionOptions o;
  const Fwd f = forward(x.q, x.k, x.v, o);
  Fwd r{HostTensor(DType::kBFloat16, x.q.shape()), HostTensor(DType::kFloat32, {1, 2, 1})};
  flashattn::reference_forward({x.q.view(), x.k.view(), x.v.view(), r.out.view(), r.lse.view()}, o);
  double scale = 0;
  for (double v : r.out.to_vector()) scale = std::max(scale, std::abs(v));
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(max_diff(f.out, r.out), scale * 0x1p-7);  // one bf16 ulp at the output's scale
  EXPECT_LE(max_diff(f.lse, r.lse), 1e-4);
}

}  // namespace

// Learnable attention sinks on the CPU backend: the flash path against the fp64 reference and
// the naive attention (the tolerance rule) with every mask and score modifier, the sink's
// gradient by central differences, a second oracle (a zero-value key whose score is the sink),
// a sink of -inf being exactly no sink, rows that see no key, and the KV-cache path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "test_util.hpp"

namespace {

using fa_test::Case;
using fa_test::HostTensor;
using flashattn::AttentionOptions;
using flashattn::DType;

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& p) { return flashattn::dtype_name(p.param); }

class SinkFeatures : public ::testing::TestWithParam<DType> {};

// The sink with each mask, softcap, ALiBi, dropout, GQA / MQA, strided views and large logits.
TEST_P(SinkFeatures, MatchReferenceWithEveryModifier) {
  struct Shape {
    int64_t sq, sk;
  };
  const std::vector<Shape> shapes = {{1, 1}, {113, 203}, {127, 513}, {239, 1}, {3, 799}};
  const std::vector<std::pair<int64_t, int64_t>> heads = {{6, 6}, {6, 2}, {6, 1}};
  const std::vector<int64_t> head_dims = {32, 59, 64, 128, 96};
  int n = 0;
  for (const Shape& s : shapes) {
    for (int feature = 0; feature < 6; ++feature) {
      Case c;
      c.dtype = GetParam();
      c.sink = true;
      c.seqlen_q = s.sq;
      c.seqlen_k = s.sk;
      c.heads_q = heads[n % heads.size()].first;
      c.heads_kv = heads[n % heads.size()].second;
      c.head_dim = head_dims[n % head_dims.size()];
      c.batch = n % 2 == 0 ? 2 : 1;
      c.causal = feature == 1 || feature == 4;
      if (feature == 2) c.window_left = 17, c.window_right = 3;  // rows past the keys see none
      c.softcap = feature == 3 || feature == 5 ? 30.0f : 0.0f;
      c.alibi = feature == 4 || feature == 5;
      c.dropout = feature == 5 ? 0.17f : 0.0f;
      c.strided = n % 5 == 3;
      c.input_scale = n % 7 == 6 ? 5.0 : 1.0;
      SCOPED_TRACE(c.name());
      fa_test::run_case(c);
      ++n;
    }
  }
}

TEST_P(SinkFeatures, Varlen) {
  auto rng = fa_test::rng_for(std::string("sink-varlen") + flashattn::dtype_name(GetParam()));
  for (int trial = 0; trial < 4; ++trial) {
    Case c;
    c.dtype = GetParam();
    c.sink = true;
    c.heads_q = 4;
    c.heads_kv = trial % 2 == 0 ? 4 : 2;
    c.head_dim = trial < 2 ? 64 : 40;
    c.causal = trial % 2 == 1;
    if (trial == 3) c.softcap = 20.0f, c.alibi = true, c.dropout = 0.1f;
    std::uniform_int_distribution<int32_t> len(0, 200);
    for (int b = 0; b < 2 + trial; ++b) {  // zero-length sequences on either side
      c.lens_q.push_back(rng() % 4 == 0 ? 0 : len(rng));
      c.lens_k.push_back(rng() % 4 == 0 ? 0 : len(rng));
    }
    if (trial >= 2) {
      for (int32_t lk : c.lens_k) c.used_k.push_back(lk == 0 ? 0 : static_cast<int32_t>(rng() % (lk + 1)));
    }
    SCOPED_TRACE(c.name());
    fa_test::run_case(c);
  }
}

TEST_P(SinkFeatures, Precise) {
  Case c;
  c.dtype = GetParam();
  c.sink = true;
  c.precise = true;
  c.seqlen_q = 130;
  c.seqlen_k = 300;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 64;
  c.causal = true;
  SCOPED_TRACE(c.name());
  fa_test::run_case(c);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, SinkFeatures,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64),
                         dtype_param_name);

// Sink tokens (the first keys exempt from window_left) with windows, causal masks, GQA, varlen,
// softcap / ALiBi / dropout and a learnable sink; sink ranges shorter, longer and not a multiple
// of the CPU's key tile.
TEST_P(SinkFeatures, SinkTokens) {
  struct Shape {
    int64_t sq, sk;
  };
  const std::vector<Shape> shapes = {{1, 300}, {113, 203}, {300, 300}, {64, 777}};
  int n = 0;
  for (const Shape& s : shapes) {
    for (int64_t tokens : {1, 4, 70, 200}) {
      Case c;
      c.dtype = GetParam();
      c.seqlen_q = s.sq;
      c.seqlen_k = s.sk;
      c.heads_q = 4;
      c.heads_kv = n % 2 == 0 ? 4 : 1;
      c.head_dim = n % 3 == 0 ? 64 : 40;
      c.batch = 2;
      c.sink_tokens = tokens;
      c.window_left = n % 4 == 3 ? 0 : 16 + 9 * n;
      c.causal = n % 2 == 0;
      if (!c.causal) c.window_right = n % 5;
      c.softcap = n % 6 == 5 ? 20.0f : 0.0f;
      c.alibi = n % 7 == 4;
      c.dropout = n % 5 == 2 ? 0.1f : 0.0f;
      c.sink = n % 3 == 1;
      SCOPED_TRACE(c.name());
      fa_test::run_case(c);
      ++n;
    }
  }
  Case c;  // varlen: each sequence's own first keys
  c.dtype = GetParam();
  c.heads_q = c.heads_kv = 2;
  c.head_dim = 32;
  c.causal = true;
  c.window_left = 20;
  c.sink_tokens = 5;
  c.lens_q = {70, 0, 130, 9};
  c.lens_k = {90, 40, 130, 3};
  SCOPED_TRACE(c.name());
  fa_test::run_case(c);
}

// ---- dense fp64 helpers -----------------------------------------------------------------------

struct Problem {
  HostTensor q, k, v, dout, sink;
  AttentionOptions o;
};

Problem make_problem(DType dt, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d,
                     const std::string& seed) {
  auto rng = fa_test::rng_for(seed);
  Problem p{HostTensor(dt, {b, sq, hq, d}), HostTensor(dt, {b, sk, hkv, d}),   HostTensor(dt, {b, sk, hkv, d}),
            HostTensor(dt, {b, sq, hq, d}), HostTensor(DType::kFloat32, {hq}), {}};
  p.q.fill_normal(rng);
  p.k.fill_normal(rng);
  p.v.fill_normal(rng);
  p.dout.fill_normal(rng);
  std::uniform_real_distribution<double> u(-1.0, 2.0);
  for (int64_t h = 0; h < hq; ++h) p.sink.set(h, u(rng));
  p.o.score.learnable_sink = p.sink.view();
  return p;
}

struct Result {
  HostTensor out, lse, dq, dk, dv, dsink;
};

// Forward (and backward when `grads`) with the flash path, or the reference.
Result run(const Problem& p, const AttentionOptions& o, bool reference, bool grads = true) {
  const auto& s = p.q.shape();
  const int64_t hq = s[2];
  Result r{HostTensor(p.q.dtype(), s),           HostTensor(DType::kFloat32, {s[0], hq, s[1]}),
           HostTensor(p.q.dtype(), s),           HostTensor(p.k.dtype(), p.k.shape()),
           HostTensor(p.v.dtype(), p.v.shape()), HostTensor(DType::kFloat32, {hq})};
  for (HostTensor* t : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv, &r.dsink}) t->fill_storage_nan();
  const flashattn::ForwardArgs fa{p.q.view(), p.k.view(), p.v.view(), r.out.view(), r.lse.view()};
  reference ? flashattn::reference_forward(fa, o) : flashattn::forward(fa, o);
  if (!grads) return r;
  flashattn::BackwardArgs ba{p.dout.view(), p.q.view(),  p.k.view(),  p.v.view(), r.out.view(),
                             r.lse.view(),  r.dq.view(), r.dk.view(), r.dv.view()};
  if (o.score.learnable_sink.present()) ba.dsink = r.dsink.view();
  reference ? flashattn::reference_backward(ba, o) : flashattn::backward(ba, o);
  return r;
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  return va.size() == vb.size() && std::memcmp(va.data(), vb.data(), va.size() * sizeof(double)) == 0;
}

// ---- properties -------------------------------------------------------------------------------

// d sink (and dq, dk, dv with the sink on) by central differences of sum(dout * out) in fp64, on
// the flash path and the reference, with a mask, softcap + ALiBi, and dropout.
TEST(Sink, FiniteDifferenceGradients) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    Problem p = make_problem(DType::kFloat64, 2, 9, 13, 4, 2, 8, "sink-fd" + std::to_string(variant));
    HostTensor slopes(DType::kFloat32, {4});
    for (int64_t h = 0; h < 4; ++h) slopes.set(h, 0.05 * (h + 1));
    if (variant == 0) p.o.mask.causal = true;
    if (variant == 1) p.o.score.softcap = 2.0f, p.o.score.alibi_slopes = slopes.view(), p.o.mask.window_left = 4;
    if (variant == 2) p.o.dropout = {0.3f, 77, 3};
    auto loss = [&] {
      const Result f = run(p, p.o, false, false);
      double s = 0;
      for (int64_t e = 0; e < p.dout.numel(); ++e) s += p.dout.get(e) * f.out.get(e);
      return s;
    };
    const double eps = 1.0 / 1024;  // (the sink is fp32: the step is what it holds)
    for (bool reference : {false, true}) {
      const Result g = run(p, p.o, reference);
      for (int64_t h = 0; h < 4; ++h) {
        const double orig = p.sink.get(h);
        p.sink.set(h, orig + eps);
        const double up = loss();
        p.sink.set(h, orig - eps);
        const double down = loss();
        p.sink.set(h, orig);
        const double step = static_cast<double>(static_cast<float>(orig + eps)) - static_cast<float>(orig - eps);
        const double numeric = (up - down) / step;
        // Central differences err by eps^2 / 6 * f''' (~1e-7 here), far above fp64 rounding.
        EXPECT_NEAR(g.dsink.get(h), numeric, 2e-6 * std::max(1.0, std::abs(numeric)))
            << "head " << h << (reference ? " (reference)" : " (flash)");
      }
    }
    const Result g = run(p, p.o, false);
    const double eps_x = 1e-6;
    for (auto [t, grad] : {std::pair{&p.q, &g.dq}, std::pair{&p.k, &g.dk}, std::pair{&p.v, &g.dv}}) {
      for (int64_t e = 0; e < t->numel(); e += 5) {
        const double orig = t->get(e);
        t->set(e, orig + eps_x);
        const double up = loss();
        t->set(e, orig - eps_x);
        const double down = loss();
        t->set(e, orig);
        const double numeric = (up - down) / (2 * eps_x);
        EXPECT_NEAR(grad->get(e), numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << "element " << e;
      }
    }
  }
}

// A second oracle, written here in plain fp64 loops: the sink is a key whose score is sink[h]
// and whose value row is zero. Attention over the keys plus that one gives the same out and
// LSE, and its score's gradient, summed over the rows, is d sink.
TEST(Sink, EqualsAZeroValueKeyWithTheSinkAsScore) {
  const int64_t b = 2, sq = 7, sk = 11, hq = 4, hkv = 2, d = 16;
  Problem p = make_problem(DType::kFloat64, b, sq, sk, hq, hkv, d, "sink-oracle");
  p.o.mask.causal = true;
  const Result r = run(p, p.o, false);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t hk = h / (hq / hkv);
    double dsink = 0;
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t i = 0; i < sq; ++i) {
        // Scores of the visible keys, then the extra key (index sk) with score sink[h].
        std::vector<double> s(sk + 1, -std::numeric_limits<double>::infinity());
        for (int64_t j = 0; j <= i + sk - sq; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c)
            dot += p.q.get(((bb * sq + i) * hq + h) * d + c) * p.k.get(((bb * sk + j) * hkv + hk) * d + c);
          s[j] = scale * dot;
        }
        s[sk] = p.sink.get(h);
        double m = -std::numeric_limits<double>::infinity(), sum = 0;
        for (double x : s) m = std::max(m, x);
        for (double x : s) sum += std::exp(x - m);
        const double lse = m + std::log(sum);
        EXPECT_NEAR(r.lse.get((bb * hq + h) * sq + i), lse, 1e-6);  // the LSE output is fp32
        std::vector<double> o(d, 0.0);
        for (int64_t j = 0; j < sk; ++j) {  // the extra key's value row is zero
          for (int64_t c = 0; c < d; ++c) o[c] += std::exp(s[j] - lse) * p.v.get(((bb * sk + j) * hkv + hk) * d + c);
        }
        double delta = 0, dp_extra = 0;  // D_i and dO_i . v_extra (= 0)
        for (int64_t c = 0; c < d; ++c) {
          EXPECT_NEAR(r.out.get(((bb * sq + i) * hq + h) * d + c), o[c], 1e-12);
          delta += p.dout.get(((bb * sq + i) * hq + h) * d + c) * o[c];
        }
        dsink += std::exp(s[sk] - lse) * (dp_extra - delta);  // dS of the extra key
      }
    }
    EXPECT_NEAR(r.dsink.get(h), dsink, 1e-6) << "head " << h;  // dsink is fp32
  }
}

// sink = -inf is no sink, bit for bit, on the flash path and the reference; its gradient is 0.
TEST(Sink, MinusInfinityIsExactlyNoSink) {
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    Problem p = make_problem(dt, 2, 70, 90, 4, 2, 32, "sink-minus-inf");
    p.o.mask.causal = true;
    p.o.dropout = {0.1f, 5, 0};
    for (int64_t h = 0; h < 4; ++h) p.sink.set(h, -std::numeric_limits<double>::infinity());
    AttentionOptions none = p.o;
    none.score.learnable_sink = {};
    for (bool reference : {false, true}) {
      const Result with = run(p, p.o, reference), without = run(p, none, reference);
      EXPECT_TRUE(bitwise_equal(with.out, without.out));
      EXPECT_TRUE(bitwise_equal(with.lse, without.lse));
      EXPECT_TRUE(bitwise_equal(with.dq, without.dq));
      EXPECT_TRUE(bitwise_equal(with.dk, without.dk));
      EXPECT_TRUE(bitwise_equal(with.dv, without.dv));
      for (int64_t h = 0; h < 4; ++h) EXPECT_EQ(with.dsink.get(h), 0.0);
    }
  }
}

// Sink tokens change nothing without a window's left side, nor when the window already covers
// them; they are exactly the keys [0, n) added to each row's window.
TEST(SinkTokens, AreTheFirstKeysAddedToTheWindow) {
  Problem p = make_problem(DType::kFloat32, 1, 50, 80, 2, 2, 16, "sink-tokens");
  p.o.score.learnable_sink = {};
  AttentionOptions plain;
  plain.mask.causal = true;
  AttentionOptions tokens = plain;
  tokens.mask.sink_tokens = 7;  // no window_left: all keys were visible already
  const Result a = run(p, plain, false), b = run(p, tokens, false);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  // With window_left 3, row i sees [0, 7) and [i + 30 - 3, i + 30]: its keys, checked directly
  // on the reference against an explicit window that it equals for the rows past the sinks.
  tokens.mask.window_left = 3;
  const Result r = run(p, tokens, true), f = run(p, tokens, false);
  for (int64_t e = 0; e < r.out.numel(); ++e) EXPECT_NEAR(f.out.get(e), r.out.get(e), 1e-5);
  AttentionOptions window = plain;
  window.mask.window_left = 3;
  const Result w = run(p, window, true);
  int64_t differs = 0;
  for (int64_t e = 0; e < w.out.numel(); ++e) differs += w.out.get(e) != r.out.get(e);
  EXPECT_GT(differs, 0);  // the sink tokens were seen
}

// A row that sees no key (a window past the keys; varlen rows with no keys are in the matrix):
// out 0, LSE = sink, gradients 0, and no share of d sink (its D is 0).
TEST(Sink, RowsThatSeeNoKey) {
  Problem p = make_problem(DType::kFloat32, 1, 6, 4, 2, 2, 8, "sink-empty-rows");
  p.o.mask.window_left = 0;
  p.o.mask.window_right = 0;  // row i sees key i + sk - sq: rows 0 and 1 see none
  const Result r = run(p, p.o, false);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 2; ++i) {
      // The exp2-domain round trip (sink * log2 e, then / log2 e) may move it by an ulp.
      EXPECT_FLOAT_EQ(static_cast<float>(r.lse.get(h * 6 + i)), static_cast<float>(p.sink.get(h)));
      for (int64_t c = 0; c < 8; ++c) {
        EXPECT_EQ(r.out.get((i * 2 + h) * 8 + c), 0.0);
        EXPECT_EQ(r.dq.get((i * 2 + h) * 8 + c), 0.0);
      }
    }
  }
  const Result ref = run(p, p.o, true);
  for (int64_t h = 0; h < 2; ++h) EXPECT_NEAR(r.dsink.get(h), ref.dsink.get(h), 1e-5);
}

// The backward pass's dsink: optional, and overwritten (not added to).
TEST(Sink, GradientIsOptionalAndOverwritten) {
  Problem p = make_problem(DType::kFloat32, 1, 33, 40, 2, 1, 16, "sink-optional");
  const Result r = run(p, p.o, false);
  HostTensor dq(DType::kFloat32, p.q.shape()), dk(DType::kFloat32, p.k.shape()), dv(DType::kFloat32, p.v.shape());
  flashattn::backward(
      {p.dout.view(), p.q.view(), p.k.view(), p.v.view(), r.out.view(), r.lse.view(), dq.view(), dk.view(), dv.view()},
      p.o);  // no dsink: the other gradients alone
  EXPECT_TRUE(bitwise_equal(dq, r.dq));
  EXPECT_TRUE(bitwise_equal(dk, r.dk));
  HostTensor dsink(DType::kFloat32, {2});
  dsink.fill(1e6);
  flashattn::BackwardArgs ba{p.dout.view(), p.q.view(), p.k.view(), p.v.view(), r.out.view(),
                             r.lse.view(),  dq.view(),  dk.view(),  dv.view()};
  ba.dsink = dsink.view();
  flashattn::backward(ba, p.o);
  EXPECT_TRUE(bitwise_equal(dsink, r.dsink));
}

// forward_kvcache with a sink (new tokens appended, paged cache) equals the dense forward with
// the sink over the same keys.
TEST(Sink, KvCacheEqualsDenseForward) {
  const int64_t b = 2, sq = 3, cache = 40, s_new = 3, hq = 4, hkv = 2, d = 32, page = 8;
  auto rng = fa_test::rng_for("sink-kvcache");
  HostTensor q(DType::kFloat32, {b, sq, hq, d}), k_new(DType::kFloat32, {b, s_new, hkv, d}),
      v_new(DType::kFloat32, {b, s_new, hkv, d}), sink(DType::kFloat32, {hq});
  q.fill_normal(rng);
  k_new.fill_normal(rng);
  v_new.fill_normal(rng);
  for (int64_t h = 0; h < hq; ++h) sink.set(h, 0.5 * h - 0.5);
  const int64_t pages_per_seq = cache / page;
  HostTensor k_cache(DType::kFloat32, {b * pages_per_seq, page, hkv, d}),
      v_cache(DType::kFloat32, {b * pages_per_seq, page, hkv, d}), table(DType::kInt32, {b, pages_per_seq}),
      seqlens(DType::kInt32, {b});
  k_cache.fill_normal(rng);
  v_cache.fill_normal(rng);
  for (int64_t i = 0; i < b * pages_per_seq; ++i) table.set(i, (i * 7) % (b * pages_per_seq));  // a permutation
  const int32_t lens[2] = {17, 29};
  for (int64_t bb = 0; bb < b; ++bb) seqlens.set(bb, lens[bb]);
  AttentionOptions o;
  o.mask.causal = true;
  o.score.learnable_sink = sink.view();
  HostTensor out(DType::kFloat32, q.shape()), lse(DType::kFloat32, {b, hq, sq});
  flashattn::KvCacheArgs ka;
  ka.q = q.view();
  ka.k_cache = k_cache.view();
  ka.v_cache = v_cache.view();
  ka.k_new = k_new.view();
  ka.v_new = v_new.view();
  ka.cache_seqlens = seqlens.view();
  ka.block_table = table.view();
  ka.out = out.view();
  ka.lse = lse.view();
  flashattn::forward_kvcache(ka, o);
  for (int64_t bb = 0; bb < b; ++bb) {  // the dense forward of sequence bb over its keys
    const int64_t sk = lens[bb] + s_new;
    HostTensor qd(DType::kFloat32, {1, sq, hq, d}), kd(DType::kFloat32, {1, sk, hkv, d}),
        vd(DType::kFloat32, {1, sk, hkv, d}), od(DType::kFloat32, {1, sq, hq, d}), ld(DType::kFloat32, {1, hq, sq});
    for (int64_t e = 0; e < sq * hq * d; ++e) qd.set(e, q.get(bb * sq * hq * d + e));
    for (int64_t j = 0; j < sk; ++j) {
      const int64_t blk = static_cast<int64_t>(table.get(bb * pages_per_seq + j / page));
      for (int64_t e = 0; e < hkv * d; ++e) {
        kd.set(j * hkv * d + e, k_cache.get((blk * page + j % page) * hkv * d + e));
        vd.set(j * hkv * d + e, v_cache.get((blk * page + j % page) * hkv * d + e));
      }
    }
    flashattn::forward({qd.view(), kd.view(), vd.view(), od.view(), ld.view()}, o);
    for (int64_t e = 0; e < sq * hq * d; ++e) EXPECT_NEAR(out.get(bb * sq * hq * d + e), od.get(e), 1e-6);
    for (int64_t e = 0; e < hq * sq; ++e) EXPECT_NEAR(lse.get(bb * hq * sq + e), ld.get(e), 1e-6);
  }
}

// StreamingLLM decoding: a sliding-window cache read with sink tokens (the first keys kept)
// equals the dense forward with the same mask.
TEST(SinkTokens, KvCacheWindowKeepsTheFirstTokens) {
  const int64_t b = 1, sq = 1, cache = 300, hq = 2, hkv = 1, d = 32;
  auto rng = fa_test::rng_for("sink-tokens-kvcache");
  HostTensor q(DType::kFloat32, {b, sq, hq, d}), k(DType::kFloat32, {b, cache, hkv, d}),
      v(DType::kFloat32, {b, cache, hkv, d}), seqlens(DType::kInt32, {b});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  seqlens.set(0, 250);
  AttentionOptions o;
  o.mask.causal = true;
  o.mask.window_left = 31;
  o.mask.sink_tokens = 4;
  HostTensor out(DType::kFloat32, q.shape()), lse(DType::kFloat32, {b, hq, sq});
  flashattn::KvCacheArgs ka;
  ka.q = q.view();
  ka.k_cache = k.view();
  ka.v_cache = v.view();
  ka.cache_seqlens = seqlens.view();
  ka.out = out.view();
  ka.lse = lse.view();
  flashattn::forward_kvcache(ka, o);
  // The dense forward over the 250 cached keys, and the same by hand: keys 0-3 and 218-249.
  HostTensor kd(DType::kFloat32, {b, 250, hkv, d}), vd(DType::kFloat32, {b, 250, hkv, d});
  for (int64_t e = 0; e < 250 * hkv * d; ++e) kd.set(e, k.get(e)), vd.set(e, v.get(e));
  HostTensor od(DType::kFloat32, q.shape()), ld(DType::kFloat32, {b, hq, sq});
  flashattn::forward({q.view(), kd.view(), vd.view(), od.view(), ld.view()}, o);
  for (int64_t e = 0; e < out.numel(); ++e) EXPECT_NEAR(out.get(e), od.get(e), 1e-6);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t h = 0; h < hq; ++h) {
    double m = -std::numeric_limits<double>::infinity(), sum = 0;
    std::vector<double> s;
    std::vector<int64_t> keys = {0, 1, 2, 3};
    for (int64_t j = 218; j < 250; ++j) keys.push_back(j);
    for (int64_t j : keys) {
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += q.get(h * d + c) * k.get(j * d + c);
      s.push_back(scale * dot);
      m = std::max(m, s.back());
    }
    for (double x : s) sum += std::exp(x - m);
    EXPECT_NEAR(lse.get(h), m + std::log(sum), 1e-5);
  }
}

}  // namespace

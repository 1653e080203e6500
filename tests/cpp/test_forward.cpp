// The CPU flash path against the fp64 reference over the shape matrix of docs/CONVENTIONS.md:
// every case runs forward and backward and checks out, lse, dq, dk, dv with the tolerance rule.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "test_util.hpp"

namespace {

using fa_test::Case;
using flashattn::DType;

struct Shape {
  int64_t sq, sk;
};
const std::vector<Shape> kShapes = {{1, 1},     {1, 3},       {2, 1},       {1, 147},     {1, 239},
                                    {239, 1},   {3, 799},     {113, 203},   {127, 513},   {128, 217},
                                    {512, 256}, {1023, 1024}, {1024, 1023}, {2048, 2048}, {4224, 4224}};
const std::vector<int64_t> kHeadDims = {32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256};
const std::vector<std::pair<int64_t, int64_t>> kHeads = {{6, 6}, {6, 2}, {6, 1}};

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& p) { return flashattn::dtype_name(p.param); }

enum class MaskKind { kNone, kCausal, kLocal };

// One case per (shape, mask kind); head dim, head layout and batch rotate through the matrix so
// every value of each axis is met by every dtype.
std::vector<Case> matrix(DType dtype) {
  std::vector<Case> cases;
  size_t n = 0;
  for (const Shape& s : kShapes) {
    for (MaskKind m : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kLocal}) {
      const int64_t work = s.sq * s.sk;
      if (fa_test::quick_mode() && work > 300000) continue;
      Case c;
      c.dtype = dtype;
      c.seqlen_q = s.sq;
      c.seqlen_k = s.sk;
      c.head_dim = kHeadDims[n % kHeadDims.size()];
      c.heads_q = kHeads[n % kHeads.size()].first;
      c.heads_kv = kHeads[n % kHeads.size()].second;
      c.batch = work <= 100000 && n % 2 == 1 ? 4 : 1;
      if (work > 1000000) {  // the big shapes: one head group, small head dim, to bound time
        c.heads_q = 2;
        c.heads_kv = 1;
        c.head_dim = 64;
      }
      c.causal = m == MaskKind::kCausal;
      if (m == MaskKind::kLocal) {
        auto rng = fa_test::rng_for("window" + std::to_string(n));
        std::uniform_int_distribution<int64_t> w(0, std::max<int64_t>(s.sk, 1));
        c.window_left = w(rng);
        c.window_right = w(rng);
      }
      cases.push_back(c);
      ++n;
    }
  }
  return cases;
}

class ShapeMatrix : public ::testing::TestWithParam<DType> {};

TEST_P(ShapeMatrix, ForwardAndBackwardMatchReference) {
  for (const Case& c : matrix(GetParam())) {
    SCOPED_TRACE(c.name());
    fa_test::run_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, ShapeMatrix,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64),
                         dtype_param_name);

// Score mods and dropout, alone and together, with and without causal masking.
class Features : public ::testing::TestWithParam<DType> {};

TEST_P(Features, SoftcapAlibiDropout) {
  const std::vector<Shape> shapes = {{113, 203}, {127, 513}, {239, 1}, {3, 799}};
  int n = 0;
  for (const Shape& s : shapes) {
    for (int feature = 0; feature < 4; ++feature) {
      for (bool causal : {false, true}) {
        Case c;
        c.dtype = GetParam();
        c.seqlen_q = s.sq;
        c.seqlen_k = s.sk;
        c.head_dim = kHeadDims[n % kHeadDims.size()];
        c.heads_q = kHeads[n % kHeads.size()].first;
        c.heads_kv = kHeads[n % kHeads.size()].second;
        c.causal = causal;
        c.softcap = feature == 0 || feature == 3 ? 50.0f : 0.0f;
        c.alibi = feature == 1 || feature == 3;
        c.dropout = feature == 2 || feature == 3 ? 0.17f : 0.0f;
        SCOPED_TRACE(c.name());
        fa_test::run_case(c);
        ++n;
      }
    }
  }
}

TEST_P(Features, LargeLogits) {
  // q, k x5: logits in the hundreds; the running max must keep exp from overflowing.
  for (bool causal : {false, true}) {
    Case c;
    c.dtype = GetParam();
    c.seqlen_q = 127;
    c.seqlen_k = 513;
    c.heads_q = 6;
    c.heads_kv = 2;
    c.head_dim = 128;
    c.causal = causal;
    c.input_scale = 5.0;
    SCOPED_TRACE(c.name());
    fa_test::run_case(c);
  }
}

TEST_P(Features, NonContiguousViews) {
  for (bool causal : {false, true}) {
    Case c;
    c.dtype = GetParam();
    c.batch = 2;
    c.seqlen_q = 128;
    c.seqlen_k = 217;
    c.heads_q = 6;
    c.heads_kv = 2;
    c.head_dim = 96;
    c.causal = causal;
    c.strided = true;
    SCOPED_TRACE(c.name());
    fa_test::run_case(c);
  }
}

TEST_P(Features, Varlen) {
  auto rng = fa_test::rng_for(std::string("varlen") + flashattn::dtype_name(GetParam()));
  for (int trial = 0; trial < 6; ++trial) {
    Case c;
    c.dtype = GetParam();
    c.heads_q = kHeads[trial % 3].first;
    c.heads_kv = kHeads[trial % 3].second;
    c.head_dim = kHeadDims[(trial * 3) % kHeadDims.size()];
    c.causal = trial % 2 == 1;
    if (trial == 4) {
      c.window_left = 17;
      c.window_right = 3;
    }
    if (trial == 5) c.softcap = 50.0f, c.alibi = true, c.dropout = 0.17f;
    std::uniform_int_distribution<int32_t> len(0, 300);
    const int batch = 1 + trial;
    for (int b = 0; b < batch; ++b) {
      // Zero-length sequences on either side appear with probability 1/5 each.
      c.lens_q.push_back(rng() % 5 == 0 ? 0 : len(rng));
      c.lens_k.push_back(rng() % 5 == 0 ? 0 : len(rng));
    }
    if (trial >= 3) {
      for (int b = 0; b < batch; ++b)
        c.used_k.push_back(c.lens_k[b] == 0 ? 0 : static_cast<int32_t>(rng() % (c.lens_k[b] + 1)));
    }
    SCOPED_TRACE(c.name());
    fa_test::run_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, Features,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64),
                         dtype_param_name);

TEST(Precise, Fp32WithinOneMillionthOfReference) {
  // Issue bar: b=2, h=4, s=1024, d=128, fp32 inputs, precise mode: forward within 1e-6 relative
  // of the fp64 reference -- the reference run on fp64 copies of the same values, so its
  // output is not rounded to fp32 first.
  const int64_t b = 2, h = 4, s = fa_test::quick_mode() ? 256 : 1024, d = 128;
  auto rng = fa_test::rng_for("precise");
  fa_test::HostTensor q(DType::kFloat32, {b, s, h, d}), k(DType::kFloat32, {b, s, h, d}),
      v(DType::kFloat32, {b, s, h, d});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  auto as_fp64 = [](const fa_test::HostTensor& t) {
    fa_test::HostTensor o(DType::kFloat64, t.shape());
    for (int64_t e = 0; e < t.numel(); ++e) o.set(e, t.get(e));
    return o;
  };
  const fa_test::HostTensor q64 = as_fp64(q), k64 = as_fp64(k), v64 = as_fp64(v);
  fa_test::HostTensor ref(DType::kFloat64, {b, s, h, d});
  flashattn::AttentionOptions o;
  flashattn::reference_forward({q64.view(), k64.view(), v64.view(), ref.view(), {}}, o);
  const std::vector<double> r = ref.to_vector();
  double scale = 0;
  for (double x : r) scale = std::max(scale, std::abs(x));
  auto rel_error = [&](bool precise) {
    fa_test::HostTensor out(DType::kFloat32, {b, s, h, d});
    o.precise = precise;
    flashattn::forward({q.view(), k.view(), v.view(), out.view(), {}}, o);
    return fa_test::compare(out.to_vector(), r).max_abs / scale;
  };
  const double precise = rel_error(true), plain = rel_error(false);
  std::printf("max |out - ref| / max |ref|: precise %.3g, default fp32 path %.3g\n", precise, plain);
  EXPECT_LE(precise, 1e-6);
  EXPECT_LE(precise, plain);
}

}  // namespace

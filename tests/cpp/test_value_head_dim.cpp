// v with a head_dim of its own (multi-head latent attention: q / k 192, v 128): the CPU flash path
// against the fp64 reference for several (q/k, v) pairs with masks, GQA, varlen and the score
// mods; the gradients by finite differences; the argument rules (out and dout take v's head_dim,
// dq and dk q's); and the CUDA backend's refusal, named, until its kernels take two head dims.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.hpp"
#include "test_util.hpp"
#include "validation_harness.hpp"

namespace {

using fa_test::Case;
using fa_test::HostTensor;
using flashattn::DType;
using flashattn::TensorView;

Case value_case(DType dtype, int64_t d, int64_t dv, int64_t sq, int64_t sk, int64_t hq, int64_t hkv) {
  Case c;
  c.dtype = dtype;
  c.head_dim = d;
  c.head_dim_v = dv;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = hq;
  c.heads_kv = hkv;
  return c;
}

// Small shapes that still cross the CPU path's 64-row and 64-key tiles.
TEST(ValueHeadDim, ForwardAndBackwardMatchReference) {
  std::vector<Case> cases;
  Case c = value_case(DType::kBFloat16, 192, 128, 77, 131, 4, 2);  // GQA, causal
  c.causal = true;
  cases.push_back(c);
  c = value_case(DType::kFloat16, 128, 64, 70, 90, 4, 1);  // MQA, sliding window
  c.window_left = 17;
  c.window_right = 3;
  cases.push_back(c);
  c = value_case(DType::kFloat32, 64, 128, 65, 70, 2, 2);  // v wider than q / k, every score mod
  c.softcap = 20.0f;
  c.alibi = true;
  c.dropout = 0.17f;
  c.sink = true;
  cases.push_back(c);
  c = value_case(DType::kFloat32, 128, 64, 40, 71, 2, 1);  // precise mode's compensated sums
  c.precise = true;
  c.causal = true;
  cases.push_back(c);
  c = value_case(DType::kFloat64, 33, 17, 66, 67, 6, 2);  // odd head dims, strided views
  c.batch = 2;
  c.strided = true;
  c.window_left = 20;
  cases.push_back(c);
  c = value_case(DType::kBFloat16, 33, 17, 0, 0, 6, 2);  // varlen: empty sequences, seqused_k
  c.lens_q = {40, 0, 70};
  c.lens_k = {65, 9, 30};
  c.used_k = {60, 0, 30};
  c.causal = true;
  cases.push_back(c);
  c = value_case(DType::kFloat16, 192, 128, 0, 0, 4, 2);  // varlen with a window
  c.lens_q = {1, 66};
  c.lens_k = {80, 70};
  c.window_left = 30;
  c.window_right = 0;
  cases.push_back(c);
  for (const Case& one : cases) {
    SCOPED_TRACE(one.name());
    fa_test::run_case(one);
  }
}

// Head dims past the CUDA kernels' 256 (Gemma-class layers' 512; multi-head latent attention's
// 576 / 512 with one shared K / V head), on the CPU path.
TEST(ValueHeadDim, LargeHeadDimsMatchReference) {
  Case c = value_case(DType::kBFloat16, 512, 512, 70, 67, 4, 2);  // GQA, causal
  c.causal = true;
  Case mla = value_case(DType::kFloat32, 576, 512, 66, 80, 4, 1);  // MQA, a window
  mla.window_left = 40;
  for (const Case& one : {c, mla}) {
    SCOPED_TRACE(one.name());
    fa_test::run_case(one);
  }
}

// d(sum(dout * out))/dx by central differences in fp64, against the backward pass of the flash
// path and of the reference (each differentiating its own forward).
TEST(ValueHeadDim, FiniteDifferenceGradients) {
  const int64_t b = 1, sq = 9, sk = 13, hq = 2, hkv = 1, d = 8, dv = 5;
  auto rng = fa_test::rng_for("value head dim fd");
  HostTensor q(DType::kFloat64, {b, sq, hq, d}), k(DType::kFloat64, {b, sk, hkv, d}),
      v(DType::kFloat64, {b, sk, hkv, dv}), dout(DType::kFloat64, {b, sq, hq, dv});
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  o.score.softcap = 2.0f;  // strongly non-linear
  for (bool reference : {false, true}) {
    SCOPED_TRACE(reference ? "reference" : "flash");
    auto forward = [&](HostTensor& out, HostTensor& lse) {
      const flashattn::ForwardArgs a{q.view(), k.view(), v.view(), out.view(), lse.view()};
      reference ? flashattn::reference_forward(a, o) : flashattn::forward(a, o);
    };
    HostTensor out(DType::kFloat64, {b, sq, hq, dv}), lse(DType::kFloat32, {b, hq, sq});
    forward(out, lse);
    HostTensor dq(DType::kFloat64, q.shape()), dk(DType::kFloat64, k.shape()), dv_grad(DType::kFloat64, v.shape());
    const flashattn::BackwardArgs ba{dout.view(), q.view(),  k.view(),  v.view(),      out.view(),
                                     lse.view(),  dq.view(), dk.view(), dv_grad.view()};
    reference ? flashattn::reference_backward(ba, o) : flashattn::backward(ba, o);
    auto loss = [&] {
      HostTensor out2(DType::kFloat64, out.shape()), lse2(DType::kFloat32, lse.shape());
      forward(out2, lse2);
      double s = 0;
      for (int64_t e = 0; e < dout.numel(); ++e) s += dout.get(e) * out2.get(e);
      return s;
    };
    fa_test::expect_finite_difference_gradients({{&q, &dq}, {&k, &dk}, {&v, &dv_grad}}, loss, 2);
  }
}

// ---------------------------------------------------------------------------------------------
// Arguments
// ---------------------------------------------------------------------------------------------
using fa_validation::Call;
using fa_validation::Dims;
using fa_validation::each_mode;
using fa_validation::kArg;

Dims value_dims() {
  Dims d;
  d.head_dim = 8;
  d.head_dim_v = 5;
  return d;
}

TEST(ValueHeadDimArguments, EveryEntryPointRuns) {
  each_mode([](Call& s) { s.expect_all_run(); }, value_dims());
}

TEST(ValueHeadDimArguments, OutAndDoutTakeVsHeadDim) {
  each_mode(
      [](Call& s) {
        for (const char* name : {"out", "dout"}) {
          SCOPED_TRACE(name);
          const TensorView saved = s[name];
          s[name] = s.output(s.dims().dtype, s.shape_of(s.q));  // q's head_dim, 8
          const std::string expected = s.varlen() ? "[6, 4, 5]" : "[2, 3, 4, 5]";
          const std::vector<std::string> parts = {std::string(name) + ": shape ",
                                                  "!= " + expected + ", q's shape with v's head_dim",
                                                  "(v's head_dim 5 differs from q's 8)"};
          EXPECT_TRUE(std::string(name) == "out" ? s.all_fail(kArg, parts) : s.bwd_fails(kArg, parts));
          s[name] = saved;
        }
        // Another row count: the same message, naming the shape expected.
        auto rows = s.shape_of(s.out);
        rows[s.varlen() ? 0 : 1] += 1;
        s.out = s.output(s.dims().dtype, rows);
        EXPECT_TRUE(s.all_fail(kArg, {"out: shape ", "q's shape with v's head_dim"}));
      },
      value_dims());
}

TEST(ValueHeadDimArguments, GradientsTakeTheirInputsShapes) {
  each_mode(
      [](Call& s) {
        const std::vector<std::pair<const char*, const char*>> swapped = {{"dq", "dout"}, {"dk", "v"}, {"dv", "k"}};
        for (auto [name, wrong] : swapped) {  // each gradient given its partner's head_dim
          SCOPED_TRACE(name);
          const TensorView saved = s[name];
          s[name] = s.output(s.dims().dtype, s.shape_of(s[wrong]));
          const std::string ref = std::string(name).substr(1);  // dq -> q, dk -> k, dv -> v
          EXPECT_TRUE(s.bwd_fails(kArg, {std::string(name) + ": shape [", "] != " + ref + " shape ["}));
          s[name] = saved;
        }
      },
      value_dims());
}

TEST(ValueHeadDimArguments, VHeadDimRangeAndOtherDims) {
  each_mode(
      [](Call& s) {
        for (int64_t bad : {0, 577}) {
          auto vs = s.shape_of(s.v);
          vs.back() = bad;
          s.v = s.tensor(s.dims().dtype, vs);
          EXPECT_TRUE(s.all_fail(kArg, {"v: head_dim " + std::to_string(bad) + " outside [1, 576]"}));
        }
        auto vs = s.shape_of(s.k);
        vs.back() = 5;
        vs[s.nd() - 2] += 1;  // heads
        s.v = s.tensor(s.dims().dtype, vs);
        EXPECT_TRUE(s.all_fail(kArg, {"v: shape [", "] != k shape [", "(v may differ from k in head_dim alone)"}));
      },
      value_dims());
}

std::vector<float> float_values(const TensorView& t) {
  std::vector<float> values;
  fa_validation::for_each_element(t, [&](std::byte* p) {
    float x;
    std::memcpy(&x, p, sizeof x);
    values.push_back(x);
  });
  return values;
}

// The default scale is 1/sqrt of q's and k's head_dim: an explicit one of that value gives the
// same bits, one of v's does not.
TEST(ValueHeadDimArguments, DefaultScaleIsQsHeadDim) {
  Call s(value_dims());
  ASSERT_TRUE(s.runs("fwd", {s.out}));
  const std::vector<float> by_default = float_values(s.out);
  s.opt.score.softmax_scale = 1.0 / std::sqrt(8.0);
  ASSERT_TRUE(s.runs("fwd", {s.out}));
  EXPECT_EQ(float_values(s.out), by_default);
  s.opt.score.softmax_scale = 1.0 / std::sqrt(5.0);
  ASSERT_TRUE(s.runs("fwd", {s.out}));
  EXPECT_NE(float_values(s.out), by_default);
}

// CUDA tensors with two head dims: refused by name before any device is touched (host pointers
// labelled cuda:0 here, so only where no device is present), by the CUDA backend where the build
// has it, else as tensors this build cannot run.
TEST(ValueHeadDimArguments, CudaTensorsAreRefusedByName) {
  if (flashattn::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  Call s(value_dims());  // dense: a varlen call would first need its lengths from the device
  for (const char* n : {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"}) s[n].device = fa_validation::kCuda0;
  const std::string why = flashattn::cuda_compiled()
                              ? "v: head_dim 5 differs from q/k's 8: the CUDA kernels need equal head dims; the CPU "
                                "backend takes it"
                              : "q: tensors on cuda:0 need the CUDA backend, which this build does not provide";
  EXPECT_TRUE(s.fails({"fwd", "fwd_ws", "bwd", "bwd_ws"}, flashattn::ErrorCode::kUnsupported, {why}));
}

// Past 256, CUDA tensors are refused by name (the decode kernels check the same bound).
TEST(ValueHeadDimArguments, CudaTensorsPastTheKernelsHeadDimAreRefusedByName) {
  if (flashattn::cuda_device_count() > 0 || !flashattn::cuda_compiled()) {
    GTEST_SKIP() << "needs a CUDA build on a machine without a device";
  }
  fa_validation::Dims d;
  d.head_dim = 512;
  Call s(d);
  for (const char* n : {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"}) s[n].device = fa_validation::kCuda0;
  EXPECT_TRUE(s.fails({"fwd", "fwd_ws", "bwd", "bwd_ws"}, flashattn::ErrorCode::kUnsupported,
                      {"q: head_dim 512 exceeds the CUDA kernels' 256; the CPU backend takes up to 576"}));
}

}  // namespace

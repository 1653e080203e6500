// The tolerance rule itself (tools/oracle/tolerance.hpp), on made-up errors: the suites and
// `flashattn run` only ever see it pass on correct results, so its failing side is tested here.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "oracle/tolerance.hpp"

namespace {

using flashattn::DType;
using flashattn_oracle::compare;
using flashattn_oracle::ErrorStats;
using flashattn_oracle::judge;
using flashattn_oracle::judge_lse;
using flashattn_oracle::tolerance_atol;
using flashattn_oracle::Verdict;
using flashattn_oracle::verdict;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

ErrorStats stats(double max_abs, double mean_abs, bool has_nan = false) {
  ErrorStats s;
  s.max_abs = max_abs;
  s.mean_abs = mean_abs;
  s.has_nan = has_nan;
  return s;
}

TEST(ToleranceRule, BoundIsFactorTimesNaivePlusAtol) {
  const Verdict v = verdict("out", stats(2.5e-3, 1e-4), stats(1e-3, 1e-4), 2.0, 5e-4);
  EXPECT_DOUBLE_EQ(v.max_bound, 2.5e-3);
  EXPECT_DOUBLE_EQ(v.mean_bound, 7e-4);
  EXPECT_TRUE(v.passed) << v.failure;  // at the bound: within it
  EXPECT_TRUE(v.failure.empty());
}

TEST(ToleranceRule, MaxErrorAboveTheBoundFails) {
  const Verdict v = verdict("out", stats(2.6e-3, 1e-4), stats(1e-3, 1e-4), 2.0, 5e-4);
  EXPECT_FALSE(v.passed);
  EXPECT_NE(v.failure.find("out: max error 0.0026 > 2 x naive 0.001 + atol 0.0005 = 0.0025"), std::string::npos)
      << v.failure;
  EXPECT_EQ(v.failure.find("mean"), std::string::npos) << v.failure;
}

TEST(ToleranceRule, MeanErrorAboveTheBoundFails) {
  // Gradients: factor 3. The max is fine, the mean is not.
  const Verdict v = verdict("dq", stats(1e-3, 5e-4), stats(1e-3, 1e-4), 3.0, 1e-5);
  EXPECT_FALSE(v.passed);
  EXPECT_NE(v.failure.find("dq: mean error 0.0005 > 3 x naive 0.0001 + atol 1e-05 = 0.00031"), std::string::npos)
      << v.failure;
}

TEST(ToleranceRule, NaNNeverPasses) {
  // Errors of zero do not save a result with a NaN the reference does not have, or a naive
  // attention that disagrees with the reference about NaN.
  EXPECT_FALSE(verdict("out", stats(0, 0, true), stats(1, 1), 2.0, 1).passed);
  EXPECT_FALSE(verdict("out", stats(0, 0), stats(1, 1, true), 2.0, 1).passed);
  EXPECT_FALSE(verdict("out", stats(kNaN, 0), stats(1, 1), 2.0, 1).passed);
  EXPECT_FALSE(verdict("out", stats(0, kNaN), stats(1, 1), 2.0, 1).passed);

  const std::vector<double> ref{1.0, 2.0}, naive{1.0, 2.0};
  const Verdict v = judge("out", {1.0, kNaN}, ref, naive, 2.0, DType::kFloat32);
  EXPECT_FALSE(v.passed);
  EXPECT_NE(v.failure.find("NaN"), std::string::npos) << v.failure;
}

TEST(ToleranceRule, InfinitiesMustMatchExactly) {
  // An empty row's LSE is -inf: equal infinities count no error, any other value fails.
  const std::vector<double> ref{-kInf, 0.5}, naive{-kInf, 0.5};
  EXPECT_TRUE(judge_lse({-kInf, 0.5}, ref, naive).passed);
  const Verdict v = judge_lse({-1e30, 0.5}, ref, naive);
  EXPECT_FALSE(v.passed);
  EXPECT_EQ(v.ours.max_abs, kInf);
  EXPECT_FALSE(judge_lse({kInf, 0.5}, ref, naive).passed);
}

TEST(ToleranceRule, AtolIsRoundingNoiseAtTheScale) {
  EXPECT_DOUBLE_EQ(tolerance_atol(DType::kFloat32, 2.0), 2.0 * 64 * 0x1p-23);
  EXPECT_DOUBLE_EQ(tolerance_atol(DType::kFloat16, 1.0), 64 * 0x1p-23 + 0x1p-10);
  EXPECT_DOUBLE_EQ(tolerance_atol(DType::kBFloat16, 1.0), 64 * 0x1p-23 + 0x1p-7);
  EXPECT_DOUBLE_EQ(tolerance_atol(DType::kFloat64, 1.0), 0x1p-42);
  EXPECT_DOUBLE_EQ(tolerance_atol(DType::kFloat32, 0.0), 1e-3 * 64 * 0x1p-23);  // floor 1e-3
}

TEST(ToleranceRule, JudgeMeasuresAgainstTheReference) {
  // The naive attention is off by 1e-3 at most; ours by 3e-3 fails at factor 2, passes at 3.
  const std::vector<double> ref{1.0, -1.0, 0.5, 0.0}, naive{1.001, -1.0, 0.5, 0.0};
  const std::vector<double> ours{1.0, -1.003, 0.5, 0.0};
  const Verdict v2 = judge("out", ours, ref, naive, 2.0, DType::kFloat32);
  EXPECT_NEAR(v2.ours.max_abs, 3e-3, 1e-12);
  EXPECT_NEAR(v2.naive.max_abs, 1e-3, 1e-12);
  EXPECT_NEAR(v2.ours.mean_abs, 0.75e-3, 1e-12);
  EXPECT_FALSE(v2.passed);
  EXPECT_TRUE(judge("dq", ours, ref, naive, 3.0, DType::kFloat32).passed);
  // Identical results pass with a naive attention that is exact too (the bound is atol).
  EXPECT_TRUE(judge("out", ref, ref, ref, 2.0, DType::kFloat32).passed);
}

}  // namespace

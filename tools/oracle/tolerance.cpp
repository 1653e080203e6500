#include "oracle/tolerance.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

namespace flashattn_oracle {

using flashattn::DType;

namespace {

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

}  // namespace

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats s;
  double sum = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(ref[i])) s.has_nan = true;
    if (std::isnan(got[i]) || std::isnan(ref[i])) continue;
    if (std::isinf(got[i]) || std::isinf(ref[i])) {
      if (got[i] != ref[i]) s.max_abs = std::numeric_limits<double>::infinity();
      continue;
    }
    const double e = std::abs(got[i] - ref[i]);
    s.max_abs = std::max(s.max_abs, e);
    sum += e;
  }
  s.mean_abs = got.empty() ? 0 : sum / static_cast<double>(got.size());
  return s;
}

double max_finite_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) {
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  }
  return m;
}

double tolerance_atol(DType dtype, double scale) {
  const double acc_noise = dtype == DType::kFloat64 ? 0x1p-42 : 64 * 0x1p-23;
  const double out_ulp = dtype == DType::kFloat16 ? 0x1p-10 : dtype == DType::kBFloat16 ? 0x1p-7 : 0.0;
  return (acc_noise + out_ulp) * std::max(scale, 1e-3);
}

Verdict verdict(std::string what, const ErrorStats& ours, const ErrorStats& naive, double factor, double atol) {
  Verdict v;
  v.what = std::move(what);
  v.ours = ours;
  v.naive = naive;
  v.factor = factor;
  v.atol = atol;
  v.max_bound = factor * naive.max_abs + atol;
  v.mean_bound = factor * naive.mean_abs + atol;
  std::string why;
  auto fail = [&](const std::string& part) { why += (why.empty() ? "" : "; ") + part; };
  if (ours.has_nan) fail(v.what + ": NaN where the fp64 reference has none, or the reverse");
  if (naive.has_nan) fail(v.what + ": the naive attention's NaN differ from the fp64 reference's");
  // Written so that a NaN error or bound fails too.
  if (!(ours.max_abs <= v.max_bound)) {
    fail(v.what + ": max error " + num(ours.max_abs) + " > " + num(factor) + " x naive " + num(naive.max_abs) +
         " + atol " + num(atol) + " = " + num(v.max_bound));
  }
  if (!(ours.mean_abs <= v.mean_bound)) {
    fail(v.what + ": mean error " + num(ours.mean_abs) + " > " + num(factor) + " x naive " + num(naive.mean_abs) +
         " + atol " + num(atol) + " = " + num(v.mean_bound));
  }
  v.passed = why.empty();
  v.failure = std::move(why);
  return v;
}

Verdict judge(std::string what, const std::vector<double>& got, const std::vector<double>& ref,
              const std::vector<double>& naive, double factor, DType dtype, double scale_floor) {
  const double scale = std::max(max_finite_abs(ref), scale_floor);
  return verdict(std::move(what), compare(got, ref), compare(naive, ref), factor, tolerance_atol(dtype, scale));
}

Verdict judge_lse(const std::vector<double>& got, const std::vector<double>& ref, const std::vector<double>& naive,
                  std::string what) {
  return judge(std::move(what), got, ref, naive, kOutputFactor, DType::kFloat32, kLseScaleFloor);
}

double grads_scale(const Grads& ref) {
  return std::max({max_finite_abs(ref.dq), max_finite_abs(ref.dk), max_finite_abs(ref.dv)});
}

std::array<Verdict, 3> judge_grads(const Grads& got, const Grads& ref, const NaiveResult& naive, DType dtype) {
  const double scale = grads_scale(ref);
  return {judge("dq", got.dq, ref.dq, naive.dq, kGradFactor, dtype, scale),
          judge("dk", got.dk, ref.dk, naive.dk, kGradFactor, dtype, scale),
          judge("dv", got.dv, ref.dv, naive.dv, kGradFactor, dtype, scale)};
}

Verdict judge_dsink(const std::vector<double>& got, const std::vector<double>& ref, const NaiveResult& naive,
                    flashattn::DType dtype) {
  return judge("dsink", got, ref, naive.dsink, kGradFactor, dtype, naive.dsink_scale);
}

}  // namespace flashattn_oracle

#include "naive_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>

namespace fa_test {

namespace {

void expect_passed(const flashattn_oracle::Verdict& v, const std::string& name, double* err_out, double* bound_out) {
  EXPECT_TRUE(v.passed) << v.failure << " in " << name;
  *err_out = std::max(*err_out, v.ours.max_abs);
  *bound_out = std::max(*bound_out, v.max_bound);
}

}  // namespace

void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                  const std::vector<double>& naive, double factor, flashattn::DType dtype, const std::string& name,
                  double* err_out, double* bound_out, double scale_floor) {
  expect_passed(flashattn_oracle::judge(what, got, ref, naive, factor, dtype, scale_floor), name, err_out, bound_out);
}

void expect_lse_close(const std::vector<double>& got, const std::vector<double>& ref, const std::vector<double>& naive,
                      const std::string& name, double* err_out, double* bound_out, const char* what) {
  expect_passed(flashattn_oracle::judge_lse(got, ref, naive, what), name, err_out, bound_out);
}

void expect_grads_close(const Grads& got, const Grads& ref, const NaiveResult& naive, flashattn::DType dtype,
                        const std::string& name, double* err_out, double* bound_out) {
  for (const flashattn_oracle::Verdict& v : flashattn_oracle::judge_grads(got, ref, naive, dtype)) {
    expect_passed(v, name, err_out, bound_out);
  }
}

void expect_dsink_close(const std::vector<double>& got, const std::vector<double>& ref, const NaiveResult& naive,
                        flashattn::DType dtype, const std::string& name, double* err_out, double* bound_out) {
  expect_passed(flashattn_oracle::judge_dsink(got, ref, naive, dtype), name, err_out, bound_out);
}

}  // namespace fa_test

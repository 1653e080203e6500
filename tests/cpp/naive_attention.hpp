// The test oracle shared by the CPU and GPU suites: the problem description, the naive attention
// and the tolerance rule of docs/CONVENTIONS.md come from tools/oracle (one implementation, which
// `flashattn run` uses too); this file asserts the rule with GoogleTest.
#pragma once

#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "oracle/naive_attention.hpp"
#include "oracle/tolerance.hpp"

namespace fa_test {

using flashattn_oracle::Case;
using flashattn_oracle::Geometry;
using flashattn_oracle::Grads;
using flashattn_oracle::kLseScaleFloor;
using flashattn_oracle::make_geometry;
using flashattn_oracle::max_finite_abs;
using flashattn_oracle::naive_attention;
using flashattn_oracle::NaiveResult;

// The tolerance rule (factor 2 for outputs, 3 for gradients) as a non-fatal failure naming the
// result and the case. Updates *err_out / *bound_out with the maxima of the error and the bound.
void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                  const std::vector<double>& naive, double factor, flashattn::DType dtype, const std::string& name,
                  double* err_out, double* bound_out, double scale_floor = 0);

// LSE (fp32) by the rule with factor 2 at a scale of at least kLseScaleFloor (judge_lse).
void expect_lse_close(const std::vector<double>& got, const std::vector<double>& ref, const std::vector<double>& naive,
                      const std::string& name, double* err_out, double* bound_out, const char* what = "lse");

// dq, dk, dv by the rule with factor 3 at one shared scale (judge_grads).
void expect_grads_close(const Grads& got, const Grads& ref, const NaiveResult& naive, flashattn::DType dtype,
                        const std::string& name, double* err_out, double* bound_out);

// d sink by the rule with factor 3 at the scale of its terms (judge_dsink).
void expect_dsink_close(const std::vector<double>& got, const std::vector<double>& ref, const NaiveResult& naive,
                        flashattn::DType dtype, const std::string& name, double* err_out, double* bound_out);

}  // namespace fa_test

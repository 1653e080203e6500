// One attention test case: builds random inputs, runs the CPU flash path and the fp64
// reference on them, and checks outputs and gradients with the tolerance rule of
// docs/CONVENTIONS.md against a naive attention computed in the tested dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "naive_attention.hpp"

namespace fa_test {

struct CaseResult {
  double out_err = 0, out_bound = 0;           // max over out and lse
  double out_rel_err = 0;                      // max|out - ref| / max|ref|
  double out_only_err = 0, out_naive_err = 0;  // out's max error, and the naive attention's
  double grad_err = 0, grad_bound = 0;
};

// Runs the case with gtest EXPECTs (a failure prints the case and the seed). FP8 cases
// (c.float8(): forward only) get random descale factors, and the naive attention reads the
// dequantised inputs.
CaseResult run_case(const Case& c);

}  // namespace fa_test

// The tolerance rule of docs/CONVENTIONS.md ("Testing: the oracle and the tolerance rule"): a
// result passes when
//   max|ours - ref| <= factor * max|naive - ref| + atol, and the same for the mean error,
// factor 2 for outputs and the LSE, 3 for gradients, `ref` the fp64 reference and `naive` the
// naive attention of naive_attention.hpp. NaN never passes (a NaN where the reference has none,
// or the reverse); an infinity (an empty row's -inf LSE) must match exactly. The C++ tests
// assert it (tests/cpp/naive_attention.hpp), `flashattn run` reports it as PASS / FAIL.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "oracle/naive_attention.hpp"

namespace flashattn_oracle {

inline constexpr double kOutputFactor = 2.0;  // out and lse
inline constexpr double kGradFactor = 3.0;    // dq, dk and dv

struct ErrorStats {
  double max_abs = 0, mean_abs = 0;
  bool has_nan = false;  // a NaN in one vector where the other has none
};

// got vs ref element by element. NaN positions must agree (else has_nan) and count no error;
// infinities must be equal (else max_abs is infinite).
ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref);

double max_finite_abs(const std::vector<double>& x);

// The rule's atol for a result of magnitude `scale` in `dtype`: accumulator rounding noise at
// that scale -- fp32's, or for fp64 2^-42, which leaves room for the ~|logit| condition factor
// of softmax at large logits -- plus, for 16-bit results, one ulp of the result: where the
// naive result is exact (one visible key, P = 1), any other rounding of P may still land on
// the other side of a rounding boundary. Scales below 1e-3 count as 1e-3.
double tolerance_atol(flashattn::DType dtype, double scale);

// One result judged by the rule.
struct Verdict {
  std::string what;        // "out", "lse", "dq", ...
  ErrorStats ours, naive;  // each against the fp64 reference
  double factor = kOutputFactor, atol = 0;
  double max_bound = 0, mean_bound = 0;  // factor * naive's error + atol
  bool passed = false;
  std::string failure;  // what broke the rule, with the bound; empty when passed
};

// The rule applied to errors already measured: the one place that decides.
Verdict verdict(std::string what, const ErrorStats& ours, const ErrorStats& naive, double factor, double atol);

// Measures got and naive against ref and applies the rule, atol at the scale
// max(max_finite_abs(ref), scale_floor).
Verdict judge(std::string what, const std::vector<double>& got, const std::vector<double>& ref,
              const std::vector<double>& naive, double factor, flashattn::DType dtype, double scale_floor = 0);

// LSE (fp32) by the rule with factor 2, at a rounding scale of at least 1: an LSE near 0 (one
// visible key whose logit cancels to ~0) carries the rounding of the q.k terms it sums, which a
// tensor core's fp32 accumulation (truncating, aligned to the largest term) makes larger than the
// naive sequential FMAs do. Seen on an H200: 5.6e-8 off an LSE of 0.003 (fp16, d128, one key),
// where the scale |LSE| gave a bound of 4e-8.
inline constexpr double kLseScaleFloor = 1.0;
Verdict judge_lse(const std::vector<double>& got, const std::vector<double>& ref, const std::vector<double>& naive,
                  std::string what = "lse");

// dq, dk, dv by the rule with factor 3. The three share one rounding scale, the largest of their
// references: a gradient that is exactly 0 (one visible key) is computed as a difference of
// terms of the size of the others.
struct Grads {
  std::vector<double> dq, dk, dv;
};
double grads_scale(const Grads& ref);
std::array<Verdict, 3> judge_grads(const Grads& got, const Grads& ref, const NaiveResult& naive,
                                   flashattn::DType dtype);

// d sink by the rule with factor 3, at the rounding scale of its terms (NaiveResult's
// dsink_scale): d sink[h] = -sum_i P_sink,i * D_i is a short vector (one value per head) of
// cancelling sums, each D_i carrying the rounding of the 16-bit out it is computed from, so a
// scale of the result alone (or the naive error of a few heads) says little about its noise.
Verdict judge_dsink(const std::vector<double>& got, const std::vector<double>& ref, const NaiveResult& naive,
                    flashattn::DType dtype);

}  // namespace flashattn_oracle

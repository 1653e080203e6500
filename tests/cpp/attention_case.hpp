// One attention test case: builds random inputs, runs the CPU flash path and the fp64
// reference on them, and checks outputs and gradients with the tolerance rule of GUIDE.md
// section 5 against a naive attention computed in the tested dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace fa_test {

struct Case {
  flashattn::DType dtype = flashattn::DType::kFloat32;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads_q = 6, heads_kv = 6, head_dim = 64;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  float dropout = 0.0f;
  bool precise = false;
  // Varlen: per-sequence lengths (then batch/seqlen_* are ignored); seqused_k optional.
  std::vector<int32_t> lens_q, lens_k, used_k;
  bool strided = false;  // q/k/v as slices of a packed qkv layout, dout[:, ::2]
  bool backward = true;
  double input_scale = 1.0;  // stddev of q and k (x5 tests large logits)

  bool varlen() const { return !lens_q.empty(); }
  std::string name() const;
};

struct CaseResult {
  double out_err = 0, out_bound = 0;  // max over out and lse
  double out_rel_err = 0;             // max|out - ref| / max|ref|
  double grad_err = 0, grad_bound = 0;
};

// Runs the case with gtest EXPECTs (a failure prints the case and the seed).
CaseResult run_case(const Case& c);

}  // namespace fa_test

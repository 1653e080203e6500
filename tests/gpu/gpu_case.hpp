// One GPU forward test case: random inputs (seeded from the run's printed seed), laid out
// contiguously, strided or as views of one packed qkv buffer, copied to the device; outputs
// poisoned with NaN before every run; the CUDA result checked against the fp64 CPU reference with
// the tolerance rule of GUIDE.md section 5 (against a naive attention in the tested dtype).
#pragma once

#include <cstdint>
#include <string>

#include "flashattn/flashattn.hpp"

namespace fa_gpu_test {

enum class Layout {
  kContiguous,  // [b, s, h, d] row-major
  kStrided,     // gaps between heads, rows and batches (out too: the gaps must stay untouched)
  kPacked,      // q, k, v: views of one [b, s, hq + 2 hkv, d] buffer (needs seqlen_q == seqlen_k)
};

struct GpuCase {
  flashattn::DType dtype = flashattn::DType::kFloat16;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads_q = 6, heads_kv = 6, head_dim = 64;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  Layout layout = Layout::kContiguous;
  double input_scale = 1.0;  // stddev of q and k (larger: larger logits)
  bool own_stream = false;   // run on a created stream instead of the default one

  std::string name() const;
};

// True when a CUDA device is visible (tests skip otherwise).
bool have_device();

// Runs the case twice with GoogleTest EXPECTs: the tolerance rule for out and lse, no NaN,
// bitwise-identical reruns, and no byte of the output buffers outside the views written.
void run_gpu_case(const GpuCase& c);

}  // namespace fa_gpu_test

// One GPU forward test case: random inputs (seeded from the run's printed seed), laid out
// contiguously, strided or as views of one packed qkv buffer, copied to the device; outputs
// poisoned with NaN before every run; the CUDA result checked against the fp64 CPU reference with
// the tolerance rule of GUIDE.md section 5 (against a naive attention in the tested dtype).
#pragma once

#include <cstdint>
#include <string>

#include "flashattn/flashattn.hpp"
#include "naive_attention.hpp"

namespace fa_gpu_test {

enum class Layout {
  kContiguous,  // [b, s, h, d] row-major
  kStrided,     // gaps between heads, rows and batches (out too: the gaps must stay untouched)
  kPacked,      // q, k, v: views of one [b, s, hq + 2 hkv, d] buffer (needs seqlen_q == seqlen_k)
};

// The CPU suites' case (dtype, shape, mask, score mods, dropout, input scale; dense only) plus how
// the tensors are laid out on the device and which stream runs the call.
struct GpuCase : fa_test::Case {
  Layout layout = Layout::kContiguous;
  bool own_stream = false;  // run on a created stream instead of the default one
  int reruns = 1;           // further runs that must reproduce the first bitwise

  GpuCase() {
    dtype = flashattn::DType::kFloat16;
    backward = false;
  }
  std::string name() const;
};

// True when a CUDA device is visible (tests skip otherwise).
bool have_device();

// Runs the case 1 + c.reruns times with GoogleTest EXPECTs: the tolerance rule for out and lse,
// no NaN, bitwise-identical reruns, and no byte of the output buffers outside the views written.
void run_gpu_case(const GpuCase& c);

// The same for a varlen case (c.lens_q / lens_k / used_k; contiguous [total, h, d] tensors with
// rows that belong to no sequence, cu_seqlens and seqused_k in device memory).
void run_gpu_varlen_case(const GpuCase& c);

}  // namespace fa_gpu_test

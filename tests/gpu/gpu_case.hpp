// One GPU test case, forward or forward + backward: random inputs (seeded from the run's printed
// seed), laid out contiguously, strided or as views of one packed qkv buffer, copied to the
// device; outputs (and the backward's workspace) poisoned with NaN before every run; the CUDA
// results checked against the fp64 CPU reference with the tolerance rule of docs/CONVENTIONS.md
// (against a naive attention in the tested dtype).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "naive_attention.hpp"

namespace fa_gpu_test {

enum class Layout {
  kContiguous,  // [b, s, h, d] row-major
  kStrided,     // gaps between heads, rows and batches (outputs too: the gaps must stay untouched)
  kPacked,      // q, k, v (and dq, dk, dv): views of one [b, s, hq + 2 hkv, d] buffer
                // (needs seqlen_q == seqlen_k)
};

// The CPU suites' case (dtype, shape or varlen lengths, mask, score mods, dropout, input scale,
// `backward`) plus how the tensors are laid out on the device and how the calls run.
// Case::strided (the CPU suites' packed views) is not used here: `layout` and
// `dout_every_other_row` say it.
struct GpuCase : fa_test::Case {
  Layout layout = Layout::kContiguous;  // dense cases only; varlen tensors are contiguous
  bool dout_every_other_row = false;    // dout[:, ::2]: its seqlen stride is twice out's
  bool own_stream = false;              // run on a created stream instead of the default one
  bool deterministic = false;           // backward: AttentionOptions::deterministic
  int reruns = 1;                       // further runs that must reproduce the first bitwise (dq only if deterministic)
  // Varlen: q rows of no sequence, and k / v rows of none or past a sequence's seqused_k, hold
  // NaN instead of random values (a kernel must not let them reach any sequence's result).
  bool nan_outside_sequences = false;
  // Varlen forward: K / V handed to the call in pages of this many keys (block_table), each
  // sequence's blocks shuffled among spare ones, every page row no key fills NaN; 0 = packed.
  int64_t page_size = 0;
  // Varlen: where the lengths are checked (run_gpu_varlen_case runs both).
  flashattn::IndexCheck index_check = flashattn::IndexCheck::kHost;

  GpuCase() {
    dtype = flashattn::DType::kFloat16;
    backward = false;
  }
  std::string name() const;
};

// The lengths and mask of one varlen batch (the forward suites' lists of them).
struct VarlenSpec {
  std::vector<int32_t> lens_q, lens_k, used_k;  // used_k empty: no seqused_k
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float dropout = 0.0f;
};

// A forward case of that batch: heads_q query heads over heads_kv, head_dim d.
GpuCase varlen_forward_case(flashattn::DType dtype, int64_t heads_q, int64_t heads_kv, int64_t d,
                            const VarlenSpec& spec);

// A dense forward + backward case; the other fields keep GpuCase's defaults.
GpuCase backward_case(flashattn::DType dtype, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q,
                      int64_t heads_kv, int64_t head_dim);
// A varlen forward + backward case: per-sequence lengths, seqused_k optional (used_k empty).
GpuCase varlen_backward_case(flashattn::DType dtype, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                             std::vector<int32_t> lens_q, std::vector<int32_t> lens_k,
                             std::vector<int32_t> used_k = {});

// True when a CUDA device is visible (tests skip otherwise).
bool have_device();
// True when device 0 has compute capability 9.0, where the sm90a kernels run.
bool have_sm90_device();

// An environment variable set for the scope (the library reads its switches on every call), its
// earlier value (or its absence) restored after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// Runs the case 1 + c.reruns times with GoogleTest EXPECTs: each run is the CUDA forward and,
// with c.backward, the CUDA backward on its out and lse (dout random, workspace as the query
// says). Checks: the tolerance rule for out and lse (against the fp64 reference) and for dq,
// dk, dv (against the reference backward on the reference's out and lse), no NaN, reruns
// bitwise identical to the first run (out, lse, dk, dv; dq when deterministic), no byte of the
// output buffers outside the views written.
void run_gpu_case(const GpuCase& c);

// The same for a varlen case (c.lens_q / lens_k / used_k; [total, h, d] tensors with rows that
// belong to no sequence, cu_seqlens and seqused_k in device memory). Rows of no sequence, and
// keys past seqused_k, must come back as the CPU backend defines them: out, dq, dk, dv 0 and
// LSE -inf. Runs twice: the lengths checked on the host, then on the device (IndexCheck).
void run_gpu_varlen_case(const GpuCase& c);

}  // namespace fa_gpu_test

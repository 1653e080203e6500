// Options of `flashattn run` and the entry points of the two subcommands.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn_cli {

enum class DeviceChoice { kAuto, kCpu, kCuda };
enum class Impl { kFlash, kReference };

// Resolved problem dimensions (defaults such as "seqlen_k = seqlen_q" already applied).
struct Dims {
  int64_t batch = 1, seqlen_q = 1024, seqlen_k = 1024, heads = 16, heads_kv = 16, head_dim = 128;
  flashattn::DType dtype = flashattn::DType::kFloat32;  // q, k, v (and the gradients)
  bool float8() const { return dtype == flashattn::DType::kFloat8E4M3 || dtype == flashattn::DType::kFloat8E5M2; }
  // out's dtype: FP8 inputs give a bfloat16 out (the library's default for them), others their own.
  flashattn::DType out_dtype() const { return float8() ? flashattn::DType::kBFloat16 : dtype; }
};

struct RunOptions {
  Dims dims;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded side
  float softcap = 0.0f;
  bool alibi = false;
  float dropout = 0.0f;
  uint64_t seed = 1;
  bool backward = false;
  bool precise = false;
  DeviceChoice device = DeviceChoice::kAuto;
  int repeats = 3;
  int64_t check_rows = 16;
  bool time_reference = false;  // --reference
  Impl impl = Impl::kFlash;
  bool json = false;
};

// Exit statuses of `flashattn`: 0 success (a run whose check passed, or that checked nothing),
// 1 a runtime error (the library refused the call, memory ran out, ...), 2 a usage error (bad
// arguments), 3 a run whose results broke the tolerance rule (its report says which and by how
// much). A script can tell a wrong result from a call that did not run.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntime = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitCheckFailed = 3;

// A failure of the tool itself (not of the library), e.g. a shape too large to allocate.
// main() prints it as a runtime error (exit 1).
class CliError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

int info_command(bool json);                 // json: one JSON object instead of text
int run_command(const RunOptions& options);  // the exit status: kExitOk or kExitCheckFailed

}  // namespace flashattn_cli

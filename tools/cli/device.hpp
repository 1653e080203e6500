// Where `flashattn run` runs, decided through the public API only (no CUDA headers here).
#pragma once

#include <string>

#include "cli.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn_cli {

// The one CUDA device the tool uses: device 0 of those visible (CUDA_VISIBLE_DEVICES picks it).
inline constexpr flashattn::Device kCuda0{flashattn::DeviceType::kCUDA, 0};

struct DeviceDecision {
  flashattn::Device device;
  std::string why;  // e.g. "auto: CUDA backend not compiled into this build"
};

// --device auto picks CUDA only when a device is visible AND this build can run the problem
// there (asked through the validation-only workspace queries); otherwise the CPU, saying why.
// --device cuda throws the library's own error when it cannot run there, and a CliError for
// options that exist on the CPU only.
DeviceDecision choose_device(const RunOptions& run, const flashattn::AttentionOptions& options);

// Whether the library can run a small, valid fp16 problem on CUDA device 0 (the kernels are in
// this build); false when the backend is not compiled.
bool cuda_kernels_available();

}  // namespace flashattn_cli

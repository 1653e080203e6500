// Where `flashattn run` runs, decided through the public API only (no CUDA headers here).
#pragma once

#include <string>

#include "cli.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn_cli {

struct DeviceDecision {
  flashattn::Device device;
  std::string why;  // e.g. "auto: CUDA backend not compiled into this build"
};

// --device auto picks CUDA only when a device is visible AND this build can run the problem
// there (asked through the validation-only workspace queries); otherwise the CPU, saying why.
// --device cuda throws the library's own error when it cannot run there.
DeviceDecision choose_device(DeviceChoice choice, const Dims& dims,
                             const flashattn::AttentionOptions& options, bool backward);

// Whether the library can run a small, valid fp16 problem on CUDA device 0 (the kernels are in
// this build); false when the backend is not compiled.
bool cuda_kernels_available();

}  // namespace flashattn_cli

// The compiled CUDA kernels, keyed by (arch family, dtype, head-dim
// bucket, direction, mask kind). The entries come from generated lists
// (sm80_{forward,backward}_kernels.inc and sm90_{forward,backward}_kernels.inc, written by
// src/cuda/kernels.cmake and src/cuda/sm90/sm90.cmake next to the instantiation files), so the
// table always matches what the build compiled.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "../problem.hpp"
#include "params.hpp"

namespace flashattn::cuda {

struct KernelKey {
  int arch = 80;  // kernel family, by the compute capability it needs (major * 10 + minor): 80 or 90
  ElemType dtype = ElemType::kFloat16;
  int head_dim = 0;  // bucket
  detail::Direction direction = detail::Direction::kForward;
  MaskKind mask = MaskKind::kNone;
  // The compute capability the tile shapes are tuned for: 80 (the code runs on every sm80+ GPU)
  // or 90 (a variant in the sm_90 code only, which replaces the 80 one there).
  int tuned_for = 80;
  bool paged = false;         // K / V in pages (the varlen forward with a block_table; sm80 family only)
  bool block_sparse = false;  // a block-sparse mask's tiles (the dense masked kind, sm80 forward and backward)

  friend bool operator==(const KernelKey&, const KernelKey&) = default;
};

using ForwardLauncher = cudaError_t (*)(const ForwardParams&, cudaStream_t);
// Why a kernel cannot run these params (a message), or nullptr when it can.
using ForwardCheck = const char* (*)(const ForwardParams&);

struct ForwardKernel {
  KernelKey key;
  ForwardLauncher launch = nullptr;
  // The sm90 family's limits beyond the key (no varlen, no dropout, exact head dim, TMA's
  // alignment); nullptr for the sm80 kernels, which run everything their key covers.
  ForwardCheck unsupported = nullptr;
};

using BackwardLauncher = cudaError_t (*)(const BackwardParams&, cudaStream_t);
using BackwardCheck = const char* (*)(const BackwardParams&);

struct BackwardKernel {
  KernelKey key;
  BackwardLauncher launch = nullptr;
  int smem_bytes = 0;  // dynamic shared memory per block it needs (opt-in above 48 KB)
  // The sm90 family's limits beyond the key (see ForwardKernel); nullptr for the sm80 kernels.
  BackwardCheck unsupported = nullptr;
};

const std::vector<ForwardKernel>& forward_kernels();
const std::vector<BackwardKernel>& backward_kernels();

// The kernel for `key` where the device runs code compiled for `code_arch` (__CUDA_ARCH__ / 10,
// code_arch.hpp): the variant tuned for that generation where the build has one, else the
// sm80-tuned one (the kernels' target_compiled_for makes the same choice); nullptr when neither
// was compiled.
const ForwardKernel* find_forward_kernel(KernelKey key, int code_arch);
const BackwardKernel* find_backward_kernel(KernelKey key, int code_arch);

// The forward kernel that runs `params` (key.arch = 80): on a device running sm_90 code
// (code_arch 90, compute capability 9.0) the sm90a kernel of the same key when the build has it,
// `allow_sm90` is set and it supports the params, unless the sm80 kernels run them faster
// (sm90::varlen_prefers_sm80); otherwise find_forward_kernel's sm80 kernel.
const ForwardKernel* select_forward_kernel(KernelKey key, int code_arch, int compute_capability,
                                           const ForwardParams& params, bool allow_sm90);

// The backward kernel that runs `params`: the sm90a kernel of the key where select_forward_kernel
// would take the sm90 family and that kernel supports the params, else find_backward_kernel's.
const BackwardKernel* select_backward_kernel(KernelKey key, int code_arch, int compute_capability,
                                             const BackwardParams& params, bool allow_sm90);

// "sm80_fwd_bf16_d128_masked", "sm80_fwd_bf16_d128_masked_sm90tiles", "sm80_fwd_bf16_d128_masked_paged",
// "sm80_fwd_bf16_d128_masked_blocksparse", "sm90_fwd_bf16_d128_masked", "sm90_fwd_bf16_d128_masked_blocksparse"
std::string kernel_name(const KernelKey& key);

}  // namespace flashattn::cuda

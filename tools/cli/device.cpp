// Device choice. The tool allocates host memory only (it does not link the CUDA runtime), so
// even a build whose library can run on CUDA is refused here with a clear message, rather than
// handing host pointers to GPU kernels.
#include "device.hpp"

#include <string>

#include "tensors.hpp"

namespace flashattn_cli {
namespace {

using flashattn::DeviceType;

constexpr flashattn::Device kCuda0{DeviceType::kCUDA, 0};

// Throws the library's error when it cannot run this problem on CUDA device 0.
void ask_library_for_cuda(const Dims& dims, const flashattn::AttentionOptions& options,
                          bool backward) {
  const ProbeArgs p = probe_args(dims, options, kCuda0);
  flashattn::forward_workspace_size(p.forward, p.options);
  if (backward) flashattn::backward_workspace_size(p.backward, p.options);
}

[[noreturn]] void no_cuda_allocator() {
  throw CliError("--device cuda: this flashattn tool allocates host memory only and cannot place "
                 "tensors on a CUDA device yet; use --device cpu");
}

}  // namespace

DeviceDecision choose_device(DeviceChoice choice, const Dims& dims,
                             const flashattn::AttentionOptions& options, bool backward) {
  if (choice == DeviceChoice::kCpu) return {{}, "--device cpu"};
  if (choice == DeviceChoice::kCuda) {
    ask_library_for_cuda(dims, options, backward);  // today: throws "need the CUDA backend"
    no_cuda_allocator();
  }
  if (!flashattn::cuda_compiled()) return {{}, "auto: CUDA backend not compiled into this build"};
  if (flashattn::cuda_device_count() == 0) return {{}, "auto: no CUDA device visible"};
  try {
    ask_library_for_cuda(dims, options, backward);
  } catch (const flashattn::Error& e) {
    if (e.code() == flashattn::ErrorCode::kUnsupported) {
      return {{}, "auto: this build cannot run this problem on CUDA (" + std::string(e.what()) + ")"};
    }
    throw;  // an invalid problem is invalid on every device
  }
  return {{}, "auto: this tool cannot allocate CUDA memory yet"};
}

bool cuda_kernels_available() {
  if (!flashattn::cuda_compiled()) return false;
  Dims tiny;
  tiny.batch = tiny.seqlen_q = tiny.seqlen_k = tiny.heads = tiny.heads_kv = 1;
  tiny.head_dim = 64;
  tiny.dtype = flashattn::DType::kFloat16;
  try {
    ask_library_for_cuda(tiny, {}, false);
    return true;
  } catch (const flashattn::Error&) {
    return false;  // kUnsupported: no kernels for CUDA tensors in this build
  }
}

}  // namespace flashattn_cli

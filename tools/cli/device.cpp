// Device choice. The library answers whether it can run the problem on CUDA; the tool adds
// the options that only the CPU has (the fp64 reference, precise mode).
#include "device.hpp"

#include <string>

#include "tensors.hpp"

namespace flashattn_cli {
namespace {

// Throws the library's error when it cannot run this problem on CUDA device 0.
void ask_library_for_cuda(const Dims& dims, const flashattn::AttentionOptions& options, bool backward) {
  const ProbeArgs p = probe_args(dims, options, kCuda0);
  flashattn::forward_workspace_size(p.forward, p.options);
  if (backward) flashattn::backward_workspace_size(p.backward, p.options);
}

// Why these options keep the run on the CPU, or "" when they do not. The CUDA backend would
// accept `precise` and ignore it, so the tool has to ask.
std::string cpu_only(const RunOptions& run) {
  if (run.impl == Impl::kReference) {
    return "--impl reference: the fp64 reference runs on the CPU only";
  }
  if (run.precise) return "--precise: precise mode is the CPU backend's";
  return "";
}

}  // namespace

DeviceDecision choose_device(const RunOptions& run, const flashattn::AttentionOptions& options) {
  if (run.device == DeviceChoice::kCpu) return {{}, "--device cpu"};
  const std::string cpu_reason = cpu_only(run);
  if (run.device == DeviceChoice::kCuda) {
    if (!cpu_reason.empty()) throw CliError(cpu_reason + "; use --device cpu");
    ask_library_for_cuda(run.dims, options, run.backward);
    return {kCuda0, "--device cuda"};
  }
  if (!flashattn::cuda_compiled()) return {{}, "auto: CUDA backend not compiled into this build"};
  if (flashattn::cuda_device_count() == 0) return {{}, "auto: no CUDA device visible"};
  if (!cpu_reason.empty()) return {{}, "auto: " + cpu_reason};
  try {
    ask_library_for_cuda(run.dims, options, run.backward);
  } catch (const flashattn::Error& e) {
    if (e.code() == flashattn::ErrorCode::kUnsupported) {
      return {{}, "auto: this build cannot run this problem on CUDA (" + std::string(e.what()) + ")"};
    }
    throw;  // an invalid problem is invalid on every device
  }
  return {kCuda0, "auto: a CUDA device is visible and this build runs the problem there"};
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

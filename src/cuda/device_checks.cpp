// The CUDA backend's shared host-side checks (device_checks.hpp).
#include "device_checks.hpp"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "../tensor_checks.hpp"
#include "../validate_common.hpp"
#include "code_arch.hpp"
#include "runtime.hpp"

namespace flashattn::cuda {

using detail::Problem;

bool cuda_dtype(DType dtype, ElemType* out) {
  if (dtype == DType::kFloat16) {
    *out = ElemType::kFloat16;
  } else if (dtype == DType::kBFloat16) {
    *out = ElemType::kBFloat16;
  } else {
    return false;
  }
  return true;
}

bool log_kernels() {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHATTN_LOG_KERNELS");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  return enabled;
}

int compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

int code_arch(int device) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices] = {};  // 0: not queried yet
  if (device < kCachedDevices && cache[device].load(std::memory_order_relaxed) != 0) {
    return cache[device].load(std::memory_order_relaxed);
  }
  const DeviceGuard guard(device);
  const int arch = current_device_code_arch();
  if (device < kCachedDevices) cache[device].store(arch, std::memory_order_relaxed);
  return arch;
}

bool device_runs_kernels(const Problem& p, std::string* why) {
  const int devices = cuda_device_count();
  if (p.device.index >= devices) {
    *why = "q: tensors on " + detail::device_str(p.device) + " need a CUDA device; this process sees " +
           std::to_string(devices);
    return false;
  }
  const int arch = compute_capability(p.device.index);
  if (arch < 0) {
    *why = "q: cannot query the compute capability of " + detail::device_str(p.device);
    return false;
  }
  const std::string cc = std::to_string(arch / 10) + "." + std::to_string(arch % 10);
  if (arch < kMinComputeCapability) {
    *why = "q: tensors on " + detail::device_str(p.device) + " (compute capability " + cc +
           ") need compute capability 8.0 or newer for the CUDA kernels";
    return false;
  }
  if (code_arch(p.device.index) < 0) {
    *why = "q: this build of flashattn has no CUDA code that " + detail::device_str(p.device) +
           " (compute capability " + cc + ") can run; add its arch to CMAKE_CUDA_ARCHITECTURES";
    return false;
  }
  return true;
}

bool float8_refused(const Problem& p, std::string* why) {
  const bool q8 = detail::is_float8_dtype(p.q_dtype);
  if (!q8 && !detail::is_float8_dtype(p.kv_dtype)) return false;
  const char* name = q8 ? "q" : (p.kv_cache ? "k_cache" : "k");
  *why = std::string(name) + ": dtype " + dtype_name(q8 ? p.q_dtype : p.kv_dtype) +
         ": the CUDA kernels do not take float8 inputs yet (the CPU backend runs them)";
  return true;
}

bool check_rows(const char* name, const detail::Operand& op, int64_t batch, int64_t rows, int64_t heads,
                int64_t elem_bytes, std::string* why) {
  const int64_t chunk_elems = kChunkBytes / elem_bytes;
  if (batch * rows * heads == 0) return true;  // empty: never read or written
  if (reinterpret_cast<uintptr_t>(op.data) % kChunkBytes != 0) {
    *why = std::string(name) + ": data pointer must be 16-byte aligned for the CUDA kernels";
    return false;
  }
  const struct {
    const char* dim;
    int64_t extent, stride;
  } strides[] = {{"batch", batch, op.layout.batch_stride},
                 {"seqlen", rows, op.layout.row_stride},
                 {"heads", heads, op.layout.head_stride}};
  for (const auto& s : strides) {
    if (s.extent > 1 && s.stride % chunk_elems != 0) {
      *why = std::string(name) + ": " + s.dim + " stride " + std::to_string(s.stride) + " must be a multiple of " +
             std::to_string(chunk_elems) + " elements (16 bytes) for the CUDA kernels";
      return false;
    }
  }
  return true;
}

}  // namespace flashattn::cuda

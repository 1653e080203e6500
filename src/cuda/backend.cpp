// CUDA dispatch: Problem -> ForwardParams, choice of the compiled kernel by KernelKey, device
// checks and CUDA error reporting. Plain C++: the kernels are reached through the registry.
#include "backend.hpp"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "../core/score.hpp"
#include "../tensor_checks.hpp"
#include "code_arch.hpp"
#include "fill_rows.hpp"
#include "kernel_registry.hpp"
#include "params.hpp"
#include "sm80/forward_launch.hpp"

namespace flashattn::cuda {
namespace {

using detail::Problem;

constexpr int kMinComputeCapability = 80;
constexpr int kChunkBytes = 16;        // cp.async / vector store width
constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on gridDim.y and gridDim.z

[[noreturn]] void cuda_fail(cudaError_t err, const std::string& what) {
  detail::fail(ErrorCode::kBackendError, what + ": " + cudaGetErrorString(err));
}

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) cuda_fail(err, what);
}

// Makes the tensors' device current for the call and restores the caller's afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      cuda_check(cudaSetDevice(device), ("cudaSetDevice(" + std::to_string(device) + ")").c_str());
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

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

// The smallest bucket >= head_dim, or 0.
int head_dim_bucket(int64_t head_dim) {
  for (int b : sm80::kHeadDimBuckets) {
    if (head_dim <= b) return b;
  }
  return 0;
}

// FLASHATTN_LOG_KERNELS=1 (read once): every call prints the kernel it runs, for debugging
// dispatch ("which kernel ran?").
bool log_kernels() {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHATTN_LOG_KERNELS");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  return enabled;
}

// major * 10 + minor, or -1 when the device cannot be queried.
int compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

// __CUDA_ARCH__ / 10 of the library's code as `device` runs it (code_arch.hpp), or -1; cached
// per device (it cannot change while the library is loaded).
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

MaskKind mask_kind(const Problem& p) {
  if (p.dropout.enabled()) return MaskKind::kMaskedDropout;
  return p.mask.window_left >= 0 || p.mask.window_right >= 0 ? MaskKind::kMasked : MaskKind::kNone;
}

KernelKey forward_key(const Problem& p, ElemType elem) {
  return {kMinComputeCapability, elem, head_dim_bucket(p.head_dim), detail::Direction::kForward,
          mask_kind(p)};
}

// 16-byte rows: the base pointer is 16-byte aligned and every stride that is used (its extent
// is > 1) is a multiple of 8 elements.
bool check_rows(const char* name, const detail::Operand& op, int64_t batch, int64_t rows,
                int64_t heads, int64_t elem_bytes, std::string* why) {
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
      *why = std::string(name) + ": " + s.dim + " stride " + std::to_string(s.stride) +
             " must be a multiple of " + std::to_string(chunk_elems) +
             " elements (16 bytes) for the CUDA kernels";
      return false;
    }
  }
  return true;
}

ForwardParams forward_params(const Problem& p) {
  auto rows_in = [](const detail::Operand& op) {
    return RowsIn{op.data, op.layout.batch_stride, op.layout.row_stride, op.layout.head_stride};
  };
  ForwardParams fp;
  fp.q = rows_in(p.q);
  fp.k = rows_in(p.k);
  fp.v = rows_in(p.v);
  fp.out = {p.out.data, p.out.layout.batch_stride, p.out.layout.row_stride, p.out.layout.head_stride};
  fp.lse = {static_cast<float*>(p.lse.data), p.lse.layout.batch_stride, p.lse.layout.row_stride,
            p.lse.layout.head_stride};
  // Varlen: the kernels read each sequence's lengths; the maxima size the grid.
  fp.shape = {p.batch, p.heads_q, p.heads_kv, p.head_dim, p.max_seqlen_q, p.max_seqlen_k};
  fp.cu_seqlens_q = p.cu_seqlens_q;
  fp.cu_seqlens_k = p.cu_seqlens_k;
  fp.seqused_k = p.seqused_k;
  fp.window = {p.mask.window_left, p.mask.window_right};
  // The one place log2(e) is folded into the scale (GUIDE.md section 2).
  fp.score.scale_log2 = static_cast<float>(p.score.scale * core::kLog2e);
  if (p.score.softcap > 0.0) {
    fp.score.tanh_scale = static_cast<float>(p.score.scale / p.score.softcap);
    fp.score.softcap_log2 = static_cast<float>(p.score.softcap * core::kLog2e);
  }
  fp.score.raw_scores = p.score.softcap == 0.0 && p.score.alibi == nullptr && p.score.scale > 0.0;
  fp.dropout = {p.dropout.seed, p.dropout.offset, p.dropout.threshold,
                static_cast<float>(1.0 / (1.0 - p.dropout.p))};
  fp.score.alibi = p.score.alibi;
  fp.score.alibi_batch_stride = p.score.alibi_batch_stride;
  fp.score.alibi_head_stride = p.score.alibi_head_stride;
  return fp;
}

}  // namespace

bool supports_forward(const Problem& p, std::string* why) {
  std::string reason;
  std::string* out = why ? why : &reason;
  auto no = [&](std::string r) {
    *out = std::move(r);
    return false;
  };
  // A device that is there and new enough: host pointers labelled cuda:N never reach a kernel
  // when no device is visible.
  const int devices = cuda_device_count();
  if (p.device.index >= devices) {
    return no("q: tensors on " + detail::device_str(p.device) + " need a CUDA device; this process sees " +
              std::to_string(devices));
  }
  const int arch = compute_capability(p.device.index);
  if (arch < 0) return no("q: cannot query the compute capability of " + detail::device_str(p.device));
  if (arch < kMinComputeCapability) {
    return no("q: tensors on " + detail::device_str(p.device) + " (compute capability " +
              std::to_string(arch / 10) + "." + std::to_string(arch % 10) +
              ") need compute capability 8.0 or newer for the CUDA kernels");
  }
  const int code = code_arch(p.device.index);
  if (code < 0) {
    return no("q: this build of flashattn has no CUDA code that " + detail::device_str(p.device) +
              " (compute capability " + std::to_string(arch / 10) + "." + std::to_string(arch % 10) +
              ") can run; add its arch to CMAKE_CUDA_ARCHITECTURES");
  }
  ElemType elem;
  if (!cuda_dtype(p.dtype, &elem)) {
    return no("q: dtype " + std::string(dtype_name(p.dtype)) +
              " is not supported by the CUDA kernels (float16, bfloat16)");
  }
  if (p.head_dim % 8 != 0) {
    return no("q: head_dim " + std::to_string(p.head_dim) +
              " must be a multiple of 8 for the CUDA kernels (16-byte rows)");
  }
  const KernelKey key = forward_key(p, elem);
  if (key.head_dim == 0 || find_forward_kernel(key, code) == nullptr) {
    return no("q: head_dim " + std::to_string(p.head_dim) + " needs kernel " + kernel_name(key) +
              ", which this build does not compile (see FLASHATTN_CUDA_HEAD_DIMS)");
  }
  const int64_t elem_bytes = static_cast<int64_t>(dtype_size(p.dtype));
  // Varlen tensors are one batch of total_* rows (batch stride 0).
  const int64_t batches = p.varlen() ? 1 : p.batch;
  const int64_t rows_q = p.varlen() ? p.total_q : p.seqlen_q, rows_k = p.varlen() ? p.total_k : p.seqlen_k;
  if (!check_rows("q", p.q, batches, rows_q, p.heads_q, elem_bytes, out) ||
      !check_rows("k", p.k, batches, rows_k, p.heads_kv, elem_bytes, out) ||
      !check_rows("v", p.v, batches, rows_k, p.heads_kv, elem_bytes, out) ||
      !check_rows("out", p.out, batches, rows_q, p.heads_q, elem_bytes, out)) {
    return false;
  }
  if (p.heads_q > kMaxGridYZ) {
    return no("q: " + std::to_string(p.heads_q) + " heads exceed the CUDA grid limit " +
              std::to_string(kMaxGridYZ));
  }
  if (p.batch > kMaxGridYZ) {
    return no("q: batch " + std::to_string(p.batch) + " exceeds the CUDA grid limit " +
              std::to_string(kMaxGridYZ));
  }
  if (p.max_seqlen_k > std::numeric_limits<int32_t>::max()) {  // 32-bit key-tile indices
    return no("k: seqlen " + std::to_string(p.max_seqlen_k) + " exceeds the CUDA kernels' limit of 2^31 - 1 keys");
  }
  if ((p.max_seqlen_q + sm80::kMinBlockM - 1) / sm80::kMinBlockM > std::numeric_limits<int32_t>::max()) {
    return no("q: seqlen " + std::to_string(p.max_seqlen_q) + " exceeds the CUDA grid limit");
  }
  return true;
}

void copy_to_host(void* dst, const void* src, size_t bytes, int device, void* stream) {
  if (device >= cuda_device_count()) {
    detail::fail(ErrorCode::kUnsupported, "cu_seqlens_q: tensors on cuda:" + std::to_string(device) +
                                              " need a CUDA device; this process sees " +
                                              std::to_string(cuda_device_count()));
  }
  const DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync (varlen lengths)");
  cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (varlen lengths)");
}

namespace {

// Varlen: out / LSE rows that belong to no sequence, [0, cu_seqlens_q[0]) and
// [cu_seqlens_q[batch], total_q), get 0 and -inf like every backend writes them.
cudaError_t fill_unused_rows(const Problem& p, const ForwardParams& fp, cudaStream_t stream) {
  const std::vector<int32_t>& cu = p.host_cu_seqlens_q;
  const int64_t ranges[2][2] = {{0, cu.front()}, {cu.back(), p.total_q}};
  for (const auto& r : ranges) {
    if (r[1] <= r[0]) continue;
    const cudaError_t err = launch_fill_rows(fp.out, fp.lse, r[0], r[1], p.heads_q, p.head_dim, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

void flash_forward(const Problem& p, void* stream) {
  ElemType elem;
  if (!cuda_dtype(p.dtype, &elem)) detail::fail(ErrorCode::kInternal, "flash_forward: unsupported dtype");
  const ForwardKernel* kernel = find_forward_kernel(forward_key(p, elem), code_arch(p.device.index));
  if (kernel == nullptr) detail::fail(ErrorCode::kInternal, "flash_forward: no kernel (supports_forward not checked)");
  const DeviceGuard guard(p.device.index);
  const ForwardParams params = forward_params(p);
  if (p.varlen()) {
    const cudaError_t err = fill_unused_rows(p, params, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) cuda_fail(err, "CUDA kernel fill_rows failed to launch");
  }
  if (p.batch == 0 || p.max_seqlen_q == 0) return;  // no row of any sequence

  if (log_kernels()) {
    std::fprintf(stderr, "flashattn: %s on cuda:%d (batch %lld, heads %lld, seqlen_q %lld, seqlen_k %lld)\n",
                 kernel_name(kernel->key).c_str(), p.device.index, static_cast<long long>(p.batch),
                 static_cast<long long>(p.heads_q), static_cast<long long>(p.max_seqlen_q),
                 static_cast<long long>(p.max_seqlen_k));
  }
  const cudaError_t err = kernel->launch(params, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) cuda_fail(err, "CUDA kernel " + kernel_name(kernel->key) + " failed to launch");
}

std::vector<std::string> compiled_kernels() {
  std::vector<std::string> names;
  for (const ForwardKernel& k : forward_kernels()) names.push_back(kernel_name(k.key));
  return names;
}

}  // namespace flashattn::cuda

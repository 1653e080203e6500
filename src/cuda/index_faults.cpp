// Per-device index-fault records (index_faults.hpp) and the checks that raise them.
#include "index_faults_host.hpp"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "runtime.hpp"

namespace flashattn::cuda {
namespace {

constexpr int kMaxDevices = 64;

// Null until the device's first call that checks indices on the device; then set once, under the
// mutex, `host` last (the checks read it without the mutex).
struct DeviceRecord {
  IndexFaultSink sink;                     // the kernels' pointers
  std::atomic<IndexFault*> host{nullptr};  // the record, as the host addresses it
};

std::mutex& records_mutex() {
  static std::mutex m;
  return m;
}
std::array<DeviceRecord, kMaxDevices>& records() {
  static std::array<DeviceRecord, kMaxDevices> r;
  return r;
}

// A cu_seqlens entry's fault, in the words of check_varlen (validate.cpp).
std::string describe_cu_seqlens(const IndexFault& f, const char* name, const char* max_name) {
  const std::string b = std::to_string(f.batch), v = std::to_string(f.value);
  switch (static_cast<VarlenRule>(f.rule)) {
    case VarlenRule::kNegativeStart:
      return std::string(name) + ": entry 0 is " + v + " < 0";
    case VarlenRule::kNotMonotone:
      return std::string(name) + ": not monotone at entry " + b + " (" + v + " < " + std::to_string(f.low) + ")";
    case VarlenRule::kLongerThanMax:
      return std::string(max_name) + ": " + std::to_string(f.high) + " < length " + v + " of sequence " + b;
    case VarlenRule::kPastEnd:
      return std::string(name) + ": last entry " + v + " is past the end of the tensor (" + std::to_string(f.high) +
             " tokens)";
    case VarlenRule::kTooFewPages:
      return std::string(name) + ": sequence " + b + " has " + v + " keys, more than its " + std::to_string(f.low) +
             " pages of " + std::to_string(f.high) + " hold";
  }
  return std::string(name) + ": entry " + b + " is out of range (value " + v + ")";
}

// A block mask's fault, in the words of core::block_mask_error.
std::string describe_block_mask(const IndexFault& f) {
  const char* list = f.rule == 1 ? "full_kv" : "kv";
  const std::string where = " at (batch " + std::to_string(f.batch) + ", head " + std::to_string(f.column) +
                            ", query block " + std::to_string(f.row) + ")";
  const std::string v = std::to_string(f.value), high = std::to_string(f.high);
  switch (static_cast<IndexArgument>(f.argument)) {
    case IndexArgument::kBlockCount:
      return std::string("block_mask: ") + list + "_num_blocks " + v + where + " outside [0, " + high + "]";
    case IndexArgument::kBlockIndex:
      return std::string("block_mask: ") + list + "_indices entry " + v + where + " outside [0, " +
             std::to_string(f.high + 1) + ")";
    case IndexArgument::kBlockTwice:
      return "block_mask: key block " + v + " listed twice" + where;
    default:
      return "block_mask: bits_block entry " + v + where + " with " + std::to_string(f.low) +
             " partial blocks is outside the " + high + " blocks of bits";
  }
}

}  // namespace

// In the words of the host's checks (validate_kvcache.cpp, validate.cpp), so an entry reads the
// same whichever side found it.
std::string index_fault_message(const IndexFault& f, int device) {
  const std::string b = std::to_string(f.batch), v = std::to_string(f.value);
  const std::string low = std::to_string(f.low), high = std::to_string(f.high);
  const std::string past_high = std::to_string(f.high + 1);
  std::string m;
  switch (static_cast<IndexArgument>(f.argument)) {
    case IndexArgument::kCacheSeqlens:
      m = "cache_seqlens: entry " + b;
      m += " is " + v + ", outside [0, " + high + "] (the cache capacity less the new tokens)";
      break;
    case IndexArgument::kCacheLeftpad:
      m = "cache_leftpad: entry " + b;
      m += " is " + v + ", outside [0, cache_seqlens " + high + "]";
      break;
    case IndexArgument::kCacheBatchIdx:
      m = "cache_batch_idx: entry " + b;
      m += " is " + v + ", outside [0, " + past_high + ") (k_cache batch)";
      break;
    case IndexArgument::kBlockTable:
      m = "block_table: entry [" + b;
      m += ", " + std::to_string(f.column) + "] is " + v + ", outside [0, " + past_high + ") (k blocks)";
      break;
    case IndexArgument::kRotaryRows:
      m = "cache_seqlens: entry " + b;
      m += " is " + v + ", outside [0, " + high + "] (the positions rotary_cos / rotary_sin have rows for)";
      break;
    case IndexArgument::kCuSeqlensQ:
      m = describe_cu_seqlens(f, "cu_seqlens_q", "max_seqlen_q");
      break;
    case IndexArgument::kCuSeqlensK:
      m = describe_cu_seqlens(f, "cu_seqlens_k", "max_seqlen_k");
      break;
    case IndexArgument::kSequsedK:
      m = "seqused_k: entry " + b;
      m += " is " + v + ", outside [0, " + high + "]";
      break;
    case IndexArgument::kBlockCount:
    case IndexArgument::kBlockIndex:
    case IndexArgument::kBlockTwice:
    case IndexArgument::kBlockBitsFirst:
      m = describe_block_mask(f);
      break;
    default:
      m = "an index entry is out of range (fault " + std::to_string(f.argument);
      m += ", entry " + b + ", value " + v + ", range [" + low + ", " + high + "])";
  }
  m += " (found on cuda:" + std::to_string(device) + " by the kernels of an earlier ";
  switch (static_cast<FaultingCall>(f.call)) {
    case FaultingCall::kVarlenForward:
      m += "varlen forward call with index_check=device, which wrote NaN to all of its out and lse)";
      break;
    case FaultingCall::kVarlenBackward:
      m += "varlen backward call with index_check=device, which wrote NaN to all of its dq, dk and dv)";
      break;
    case FaultingCall::kBlockSparseForward:
      m += "block-sparse forward call with index_check=device, which wrote NaN to that query tile's out and lse "
           "rows)";
      break;
    default:
      m += "forward_kvcache call with index_check=device, which wrote NaN to its out and lse rows)";
  }
  return m;
}

namespace {

void check_index(int device) {
  if (device < 0 || device >= kMaxDevices) {
    detail::fail(ErrorCode::kInvalidArgument, "device: cuda:" + std::to_string(device) + " is out of range [0, " +
                                                  std::to_string(kMaxDevices - 1) + "]");
  }
}

// Relaxed stream-capture mode for this thread while it lives: a device's first
// kDevice-checked call may come while the caller captures a CUDA graph (global mode, as
// PyTorch's), where allocations and synchronisation would otherwise invalidate the capture.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// The claim word, zeroed on a stream of its own (outside any capture, and not the legacy stream,
// which would wait for the caller's blocking streams).
unsigned int* new_claim() {
  void* claim = nullptr;
  cuda_check(cudaMalloc(&claim, sizeof(unsigned int)), "index-fault record: cudaMalloc");
  cudaStream_t zeroing = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    err = cudaMemsetAsync(claim, 0, sizeof(unsigned int), zeroing);
    const cudaError_t synced = cudaStreamSynchronize(zeroing);
    cudaStreamDestroy(zeroing);
    if (err == cudaSuccess) err = synced;
  }
  if (err != cudaSuccess) {
    cudaFree(claim);
    cuda_fail(err, "index-fault record: zeroing");
  }
  return static_cast<unsigned int*>(claim);
}

}  // namespace

IndexFaultSink index_fault_sink(int device) {
  check_index(device);
  DeviceRecord& r = records()[static_cast<size_t>(device)];
  // Every device-checked call asks: once made, the sink is read without the mutex (`host` is
  // stored after it, with release).
  if (r.host.load(std::memory_order_acquire) != nullptr) return r.sink;
  const std::lock_guard<std::mutex> lock(records_mutex());
  if (r.host.load(std::memory_order_acquire) != nullptr) return r.sink;
  const RelaxedCapture relaxed;
  unsigned int* claim = new_claim();
  void* record = nullptr;
  if (const cudaError_t err = cudaHostAlloc(&record, sizeof(IndexFault), cudaHostAllocMapped | cudaHostAllocPortable);
      err != cudaSuccess) {
    cudaFree(claim);
    cuda_fail(err, "index-fault record: cudaHostAlloc");
  }
  *static_cast<IndexFault*>(record) = IndexFault{};
  void* record_on_device = nullptr;
  if (const cudaError_t err = cudaHostGetDevicePointer(&record_on_device, record, 0); err != cudaSuccess) {
    cudaFree(claim);
    cudaFreeHost(record);
    cuda_fail(err, "index-fault record: cudaHostGetDevicePointer");
  }
  r.sink = {claim, static_cast<IndexFault*>(record_on_device)};
  r.host.store(static_cast<IndexFault*>(record), std::memory_order_release);
  return r.sink;
}

void raise_index_fault(int device, void* stream) {
  check_index(device);
  DeviceRecord& r = records()[static_cast<size_t>(device)];
  IndexFault* host = r.host.load(std::memory_order_acquire);
  if (host == nullptr || std::atomic_ref<int32_t>(host->argument).load(std::memory_order_acquire) == 0) return;
  IndexFault fault;
  {
    const std::lock_guard<std::mutex> lock(records_mutex());
    fault = *host;
    if (fault.argument == 0) return;  // another thread raised it
    *host = IndexFault{};
    const DeviceGuard guard(device);
    cuda_check(cudaMemsetAsync(r.sink.claim, 0, sizeof(unsigned int), static_cast<cudaStream_t>(stream)),
               "index-fault record: cudaMemsetAsync");
  }
  detail::fail(ErrorCode::kInvalidArgument, index_fault_message(fault, device));
}

void check_device_errors(int device) {
  for (int d = device < 0 ? 0 : device; d < (device < 0 ? kMaxDevices : device + 1); ++d) {
    check_index(d);
    if (records()[static_cast<size_t>(d)].host.load(std::memory_order_acquire) == nullptr) continue;
    {
      const DeviceGuard guard(d);
      cuda_check(cudaDeviceSynchronize(), "check_device_errors: cudaDeviceSynchronize");
    }
    raise_index_fault(d, nullptr);
  }
}

}  // namespace flashattn::cuda

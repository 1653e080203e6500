// CUDA runtime calls of the tool. Every return code is checked and thrown as a CliError that
// names the call and the tensor; without CUDA support in the tool, the same entry points throw
// a CliError saying so (the rest of the tool compiles the same either way).
#include "device_memory.hpp"

#include <string>
#include <utility>

#include "device.hpp"
#include "memory.hpp"

#if FLASHATTN_CLI_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashattn_cli {

#if FLASHATTN_CLI_CUDA
namespace {

void check(cudaError_t err, const std::string& call) {
  if (err != cudaSuccess) {
    throw CliError(call + ": " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
  }
}

cudaEvent_t event(void* e) { return static_cast<cudaEvent_t>(e); }

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {
  if (bytes_ > 0) {
    check(cudaMalloc(&data_, bytes_), "cudaMalloc(" + what_ + ", " + format_bytes(static_cast<int64_t>(bytes_)) + ")");
  }
}

DeviceBuffer::~DeviceBuffer() {
  // Not thrown from a destructor: cudaFree fails only with a sticky error of an earlier call,
  // which that call's check already reported.
  if (data_ != nullptr) (void)cudaFree(data_);
}

void DeviceBuffer::upload(const void* host) {
  check(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy(" + what_ + ", host to device)");
}

void DeviceBuffer::download(void* host) const {
  check(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy(" + what_ + ", device to host)");
}

void DeviceBuffer::poison() { check(cudaMemset(data_, 0xFF, bytes_), "cudaMemset(" + what_ + ", 0xFF)"); }

CudaTimer::CudaTimer() {
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate(start)");
  const cudaError_t err = cudaEventCreate(&stop);
  if (err != cudaSuccess) (void)cudaEventDestroy(start);  // the throw below skips the destructor
  check(err, "cudaEventCreate(stop)");
  start_ = start;
  stop_ = stop;
}

CudaTimer::~CudaTimer() {
  // As in ~DeviceBuffer: a failure here only repeats an error already reported.
  (void)cudaEventDestroy(event(start_));
  (void)cudaEventDestroy(event(stop_));
}

double CudaTimer::time(const std::function<void()>& call) {
  check(cudaEventRecord(event(start_), nullptr), "cudaEventRecord(start)");
  call();
  check(cudaEventRecord(event(stop_), nullptr), "cudaEventRecord(stop)");
  check(cudaEventSynchronize(event(stop_)), "cudaEventSynchronize (waiting for the timed call)");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, event(start_), event(stop_)), "cudaEventElapsedTime");
  return static_cast<double>(ms) * 1e-3;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties(" + std::to_string(device) + ")");
  return prop.name;
}

#else  // no CUDA runtime in this tool

namespace {

[[noreturn]] void no_cuda() {
  throw CliError(
      "--device cuda: CUDA support is not compiled into this flashattn tool "
      "(configure with -DFLASHATTN_CUDA=ON)");
}

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes, std::string what) : bytes_(bytes), what_(std::move(what)) { no_cuda(); }
DeviceBuffer::~DeviceBuffer() = default;
void DeviceBuffer::upload(const void*) { no_cuda(); }
void DeviceBuffer::download(void*) const { no_cuda(); }
void DeviceBuffer::poison() { no_cuda(); }
CudaTimer::CudaTimer() { no_cuda(); }
CudaTimer::~CudaTimer() = default;
double CudaTimer::time(const std::function<void()>&) { no_cuda(); }
std::string cuda_device_name(int) { no_cuda(); }

#endif

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      what_(std::move(other.what_)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(data_, other.data_);  // `other` frees what this held
  std::swap(bytes_, other.bytes_);
  std::swap(what_, other.what_);
  return *this;
}

flashattn::TensorView DeviceTensors::Tensor::view() const { return make_view(buffer.data(), dtype, shape, kCuda0); }

DeviceTensors::DeviceTensors(const Tensors& host, bool backward) : backward_(backward) {
  auto place = [](Tensor& d, const HostTensor& h, const char* name) {
    d.buffer = DeviceBuffer(static_cast<size_t>(h.numel()) * flashattn::dtype_size(h.dtype()), name);
    d.dtype = h.dtype();
    d.shape = h.shape();
  };
  auto input = [&](Tensor& d, const HostTensor& h, const char* name) {
    place(d, h, name);
    d.buffer.upload(h.data());
  };
  auto output = [&](Tensor& d, const HostTensor& h, const char* name) {
    place(d, h, name);
    d.buffer.poison();
  };
  input(q_, host.q, "q");
  input(k_, host.k, "k");
  input(v_, host.v, "v");
  output(out_, host.out, "out");
  output(lse_, host.lse, "lse");
  if (!backward_) return;
  input(dout_, host.dout, "dout");
  output(dq_, host.dq, "dq");
  output(dk_, host.dk, "dk");
  output(dv_, host.dv, "dv");
}

void DeviceTensors::download_outputs(Tensors& host) const {
  out_.buffer.download(host.out.data());
  lse_.buffer.download(host.lse.data());
  if (!backward_) return;
  dq_.buffer.download(host.dq.data());
  dk_.buffer.download(host.dk.data());
  dv_.buffer.download(host.dv.data());
}

flashattn::ForwardArgs DeviceTensors::forward_args() const {
  return {q_.view(), k_.view(), v_.view(), out_.view(), lse_.view()};
}

flashattn::BackwardArgs DeviceTensors::backward_args() const {
  return {dout_.view(), q_.view(), k_.view(), v_.view(), out_.view(), lse_.view(), dq_.view(), dk_.view(), dv_.view()};
}

}  // namespace flashattn_cli

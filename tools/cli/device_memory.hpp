// Device memory and timing of `flashattn run --device cuda`. device_memory.cpp is the only file
// of the tool that calls the CUDA runtime; this header keeps its types out of the others. A tool
// built without CUDA support (FLASHATTN_CLI_CUDA=0) throws a CliError from every CUDA call.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "tensors.hpp"

namespace flashattn_cli {

// One cudaMalloc allocation on the current device (the tool never changes it: device 0), freed
// on destruction. `what` names it in errors: "cudaMalloc(q, 64.0 MiB): out of memory".
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, std::string what);  // 0 bytes: no allocation, data() is null
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host);    // bytes() from the host; waits for the copy
  void download(void* host) const;  // bytes() to the host, after the work queued before it
  void poison();                    // 0xFF bytes: NaN in every floating-point dtype

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::string what_;
};

// Device copies of a run's tensors, on kCuda0 with the shapes of the host ones.
struct DeviceTensors {
  // Copies the inputs (q, k, v; dout for the backward) and poisons the outputs, so an element
  // that no call writes reads back as NaN and fails the reference check.
  DeviceTensors(const Tensors& host, bool backward);

  // Copies the outputs (out, lse; dq, dk, dv for the backward) back into `host`.
  void download_outputs(Tensors& host) const;
  flashattn::ForwardArgs forward_args() const;
  flashattn::BackwardArgs backward_args() const;

 private:
  struct Tensor {
    DeviceBuffer buffer;
    flashattn::DType dtype = flashattn::DType::kFloat32;
    std::vector<int64_t> shape;
    flashattn::TensorView view() const;
  };
  Tensor q_, k_, v_, out_, lse_, dout_, dq_, dk_, dv_;
  bool backward_;
};

// Times work the library queues on the legacy default stream (the tool passes a null stream)
// with a pair of CUDA events.
class CudaTimer {
 public:
  CudaTimer();
  ~CudaTimer();
  CudaTimer(const CudaTimer&) = delete;
  CudaTimer& operator=(const CudaTimer&) = delete;

  // Seconds of device time from before `call` queued its work until that work finished; waits
  // for it, so an error of the kernels surfaces here, naming the call that waited.
  double time(const std::function<void()>& call);

 private:
  void* start_ = nullptr;  // cudaEvent_t
  void* stop_ = nullptr;
};

// The device's name, e.g. "NVIDIA H100 80GB HBM3" (cudaGetDeviceProperties).
std::string cuda_device_name(int device);

}  // namespace flashattn_cli

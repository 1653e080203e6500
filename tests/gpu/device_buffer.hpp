// Device memory for the GPU tests: an owning buffer with upload / download / NaN poisoning, an
// owned stream, and CUDA error checks that throw (GoogleTest reports the exception as a failure
// of the test).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace fa_gpu_test {

inline void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) cuda_ok(cudaMalloc(&ptr_, bytes_), "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

  void upload(const void* host) {
    if (bytes_) cuda_ok(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void download(void* host) const {
    if (bytes_) cuda_ok(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  // 0xFF bytes are NaN in every float format: an element the kernel forgets stays NaN.
  void poison() { fill(0xFF); }
  void fill(int byte) {
    if (bytes_) cuda_ok(cudaMemset(ptr_, byte, bytes_), "cudaMemset");
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A created non-blocking stream, or the default stream (nullptr); destroyed with the object, so a
// test that throws does not leak it.
class DeviceStream {
 public:
  explicit DeviceStream(bool create) {
    if (create) cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~DeviceStream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace fa_gpu_test

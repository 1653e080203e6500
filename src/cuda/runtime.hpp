// The CUDA runtime as the host code of the backend uses it: its errors as flashattn::Error
// (kBackendError, with cudaGetErrorString's text), and the tensors' device made current for a call.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../tensor_checks.hpp"

namespace flashattn::cuda {

[[noreturn]] inline void cuda_fail(cudaError_t err, const std::string& what) {
  detail::fail(ErrorCode::kBackendError, what + ": " + cudaGetErrorString(err));
}

inline void cuda_check(cudaError_t err, const char* what) {
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

}  // namespace flashattn::cuda

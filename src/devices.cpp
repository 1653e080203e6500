// Device discovery. With the CUDA runtime compiled in, it is asked; otherwise there is none.
#include "flashattn/flashattn.hpp"

#if FLASHATTN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/backend.hpp"
#include "cuda/index_faults_host.hpp"
#endif

#include <string>

#include "problem.hpp"
#include "tensor_checks.hpp"

namespace flashattn {

bool cuda_compiled() { return FLASHATTN_WITH_CUDA != 0; }

int cuda_device_count() {
#if FLASHATTN_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: clear the sticky error, report none
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

void check_device_errors(int cuda_device) {
  if (cuda_device < -1) {
    detail::fail(ErrorCode::kInvalidArgument,
                 "cuda_device: " + std::to_string(cuda_device) + " is neither a device index nor -1 (every device)");
  }
#if FLASHATTN_WITH_CUDA
  cuda::check_device_errors(cuda_device);
#endif
}

namespace detail {

void copy_to_host(const std::vector<HostCopy>& copies, const Device& device, void* stream) {
#if FLASHATTN_WITH_CUDA
  cuda::copy_to_host(copies, device.index, stream);
#else
  (void)copies;
  (void)stream;
  fail(ErrorCode::kUnsupported, "tensors on " + device_str(device) + " need the CUDA backend");
#endif
}

}  // namespace detail

std::vector<std::string> cuda_kernels() {
#if FLASHATTN_WITH_CUDA
  return cuda::compiled_kernels();
#else
  return {};
#endif
}

}  // namespace flashattn

// Device discovery. With the CUDA runtime compiled in, it is asked; otherwise there is none.
#include "flashattn/flashattn.hpp"

#if FLASHATTN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/backend.hpp"
#endif

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

std::vector<std::string> cuda_kernels() {
#if FLASHATTN_WITH_CUDA
  return cuda::compiled_kernels();
#else
  return {};
#endif
}

}  // namespace flashattn

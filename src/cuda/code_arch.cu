#include "code_arch.hpp"

#include <cuda_runtime_api.h>

namespace flashattn::cuda {
namespace {

__global__ void code_arch_probe() {}

}  // namespace

int current_device_code_arch() {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, code_arch_probe) != cudaSuccess) {
    cudaGetLastError();  // e.g. no kernel image for this device
    return -1;
  }
  return attributes.ptxVersion;  // the virtual arch the running code was compiled from
}

}  // namespace flashattn::cuda

// Which compiled code the current device runs. The kernels choose their tile shapes by
// __CUDA_ARCH__ (sm80/forward_kernel.cuh compiled_for), which is the arch of the code the
// driver loads: a cubin for the device, or PTX of an older virtual arch JIT-compiled for it
// (a build for "80" run on an H100). The dispatcher must follow that arch, not the device's.
#pragma once

namespace flashattn::cuda {

// __CUDA_ARCH__ / 10 of this library's device code as the current device runs it (every kernel
// file is compiled for the same archs), or -1 when the library has no code the device can run.
int current_device_code_arch();

}  // namespace flashattn::cuda

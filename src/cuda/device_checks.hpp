// The CUDA backend's shared host-side checks (backend.cpp's attention calls, kvcache_backend.cpp's
// decode calls): the device and its code, dtypes, row alignment, grid limits, kernel logging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../problem.hpp"
#include "params.hpp"

namespace flashattn::cuda {

inline constexpr int kMinComputeCapability = 80;
inline constexpr int kChunkBytes = 16;                        // cp.async / vector store width
inline constexpr int64_t kMaxGridYZ = 65535;                  // CUDA's limit on gridDim.y and gridDim.z
inline constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;  // and on gridDim.x

// The kernels' element type of `dtype` (float16, bfloat16), or false.
bool cuda_dtype(DType dtype, ElemType* out);

// FLASHATTN_LOG_KERNELS=1 (read once): every call prints the kernel it runs, for debugging
// dispatch ("which kernel ran?").
bool log_kernels();

// major * 10 + minor, or -1 when the device cannot be queried.
int compute_capability(int device);

// __CUDA_ARCH__ / 10 of the library's code as `device` runs it (code_arch.hpp), or -1; cached
// per device (it cannot change while the library is loaded).
int code_arch(int device);

// A device that is there and new enough, with code this build compiled for it: host pointers
// labelled cuda:N never reach a kernel when no device is visible.
bool device_runs_kernels(const detail::Problem& p, std::string* why);

// FP8 inputs run on the CPU backend only, so far: no CUDA kernel reads float8 tensors. Checked
// before anything else, with a GPU or without.
bool float8_refused(const detail::Problem& p, std::string* why);

// 16-byte rows: the base pointer is 16-byte aligned and every stride that is used (its extent
// is > 1) is a multiple of 8 elements.
bool check_rows(const char* name, const detail::Operand& op, int64_t batch, int64_t rows, int64_t heads,
                int64_t elem_bytes, std::string* why);

// Whether the sink-token pass runs after the kernels: only a left window edge hides keys that
// sink tokens bring back (without one every sink key is in the window already).
inline bool sink_tokens_joined(const detail::Problem& p) { return p.mask.sink_tokens > 0 && p.mask.window_left >= 0; }

inline size_t align_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace flashattn::cuda

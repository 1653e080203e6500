// Launchers of the KV-cache decode kernels (decode_kernel.cuh), one per element type
// (decode_fp16.cu, decode_bf16.cu); plain C++ for the dispatch in backend.cpp.
#pragma once

#include <cstdint>

#include "decode_params.hpp"

namespace flashattn::cuda::decode {

// Enqueues on `stream` (a cudaStream_t): the append kernel (when `append` and there are new
// tokens), the decode kernel of `layout`, and with several splits the combine kernel. Returns
// the launch status (a cudaError_t; 0 = success).
int launch_fp16(const DecodeParams& p, const DecodeLayout& layout, bool append, void* stream);
int launch_bf16(const DecodeParams& p, const DecodeLayout& layout, bool append, void* stream);

}  // namespace flashattn::cuda::decode

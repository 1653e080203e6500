// The FA1-order teaching kernel's C entry points (fa1_order.h): argument checks that name the
// argument, the workspace carve-up, and the launch of the compiled (dtype, head_dim) instance.
#include "fa1_order.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "fa1_order_launch.hpp"
#include "fa1_order_params.hpp"

namespace {

using flashattn::cuda::ElemType;
using flashattn::cuda::teaching::fa1_tile_shape;
using flashattn::cuda::teaching::Fa1Params;

constexpr int64_t kMaxGridYZ = 65535;   // CUDA's limit on gridDim.y and gridDim.z
constexpr uintptr_t kVectorBytes = 16;  // cp.async chunks

bool supported_head_dim(int head_dim) {
  for (int d : flashattn::cuda::teaching::kFa1HeadDims) {
    if (head_dim == d) return true;
  }
  return false;
}

int report(int status, char* error, size_t error_len, const std::string& message) {
  if (error != nullptr && error_len > 0) std::snprintf(error, error_len, "%s", message.c_str());
  return status;
}

// The first argument error, or "" when the arguments are valid.
std::string check_arguments(const void* q, const void* k, const void* v, void* out, const float* lse,
                            const void* workspace, int batch, int seqlen, int heads, int head_dim, int dtype,
                            int causal, int q_groups) {
  const auto s = [](auto x) { return std::to_string(x); };
  if (batch < 0) return "batch: " + s(batch) + " < 0";
  if (seqlen < 0) return "seqlen: " + s(seqlen) + " < 0";
  if (heads < 0) return "heads: " + s(heads) + " < 0";
  if (!supported_head_dim(head_dim)) return "head_dim: " + s(head_dim) + " is not 64 or 128";
  if (dtype != 0 && dtype != 1) return "dtype: " + s(dtype) + " is not 0 (fp16) or 1 (bf16)";
  if (causal != 0 && causal != 1) return "causal: " + s(causal) + " is not 0 or 1";
  if (batch > kMaxGridYZ) return "batch: " + s(batch) + " > " + s(kMaxGridYZ) + " (grid limit)";
  if (heads > kMaxGridYZ) return "heads: " + s(heads) + " > " + s(kMaxGridYZ) + " (grid limit)";
  const auto shape = fa1_tile_shape(head_dim);
  if (seqlen % shape.block_m != 0 || seqlen % shape.block_n != 0) {
    return "seqlen: " + s(seqlen) + " is not a multiple of the head_dim " + s(head_dim) + " tiles (" +
           s(shape.block_m) + " query rows, " + s(shape.block_n) + " keys)";
  }
  const int q_tiles = seqlen / shape.block_m;
  if (q_groups < 0) return "q_groups: " + s(q_groups) + " < 0";
  if (q_groups > q_tiles && q_tiles > 0) {
    return "q_groups: " + s(q_groups) + " > " + s(q_tiles) + " query tiles (seqlen " + s(seqlen) + " / " +
           s(shape.block_m) + " rows)";
  }
  if (batch == 0 || seqlen == 0 || heads == 0) return "";  // nothing to read or write
  const struct {
    const char* name;
    const void* ptr;
    uintptr_t align;
    bool optional;
  } pointers[] = {{"q", q, kVectorBytes, false},      {"k", k, kVectorBytes, false},
                  {"v", v, kVectorBytes, false},      {"out", out, kVectorBytes, false},
                  {"lse", lse, alignof(float), true}, {"workspace", workspace, kVectorBytes, q_groups == 0}};
  for (const auto& x : pointers) {
    if (x.ptr == nullptr) {
      if (x.optional) continue;
      return std::string(x.name) + ": NULL";
    }
    if (reinterpret_cast<uintptr_t>(x.ptr) % x.align != 0) {
      return std::string(x.name) + ": address not " + s(x.align) + "-byte aligned";
    }
  }
  return "";
}

using Launcher = cudaError_t (*)(const Fa1Params&, int, int, cudaStream_t);

Launcher launcher(int dtype, int head_dim) {
  using flashattn::cuda::teaching::run_fa1_order;
  if (dtype == 0)
    return head_dim == 64 ? run_fa1_order<ElemType::kFloat16, 64> : run_fa1_order<ElemType::kFloat16, 128>;
  return head_dim == 64 ? run_fa1_order<ElemType::kBFloat16, 64> : run_fa1_order<ElemType::kBFloat16, 128>;
}

}  // namespace

extern "C" size_t fa1_workspace_bytes(int batch, int seqlen, int heads, int head_dim) {
  if (batch < 0 || seqlen < 0 || heads < 0 || head_dim < 0) return 0;
  return static_cast<size_t>(flashattn::cuda::teaching::fa1_workspace_floats(batch, seqlen, heads, head_dim)) *
         sizeof(float);
}

extern "C" int fa1_tile_sizes(int head_dim, int* block_m, int* block_n) {
  if (!supported_head_dim(head_dim)) return FA1_INVALID_ARGUMENT;
  if (block_m != nullptr) *block_m = fa1_tile_shape(head_dim).block_m;
  if (block_n != nullptr) *block_n = fa1_tile_shape(head_dim).block_n;
  return FA1_OK;
}

extern "C" int fa1_forward(const void* q, const void* k, const void* v, void* out, float* lse, void* workspace,
                           int batch, int seqlen, int heads, int head_dim, int dtype, int causal, int q_groups,
                           void* stream, char* error, size_t error_len) {
  const std::string bad =
      check_arguments(q, k, v, out, lse, workspace, batch, seqlen, heads, head_dim, dtype, causal, q_groups);
  if (!bad.empty()) return report(FA1_INVALID_ARGUMENT, error, error_len, bad);
  if (error != nullptr && error_len > 0) error[0] = '\0';
  if (batch == 0 || seqlen == 0 || heads == 0) return FA1_OK;

  const auto launch = flashattn::cuda::teaching::fa1_launch(q, k, v, out, lse, workspace, batch, seqlen, heads,
                                                            head_dim, causal != 0, q_groups);
  const cudaError_t err =
      launcher(dtype, head_dim)(launch.params, batch, launch.q_groups, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    return report(FA1_CUDA_ERROR, error, error_len,
                  std::string("fa1_forward launch: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
  return FA1_OK;
}

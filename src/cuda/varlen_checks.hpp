// Host side of the varlen length checks (varlen_checks.cuh): their scratch memory in the call's
// workspace, their parameters, and the launches.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "index_faults.hpp"
#include "params.hpp"

namespace flashattn::cuda::varlen {

inline constexpr int kCheckThreads = 256;
inline constexpr int kFillThreads = 256;

// What the check writes, in the call's workspace: the copies the attention kernels read in place
// of the caller's arrays, the verdict (1: a rule broke) and the word that picks the first fault.
struct CheckScratch {
  unsigned long long* first_fault = nullptr;
  int32_t* verdict = nullptr;
  int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  int32_t* cu_seqlens_k = nullptr;  // [batch + 1]
  int32_t* seqused_k = nullptr;     // [batch]
};

// Bytes of CheckScratch for `batch` sequences, a multiple of 256.
inline size_t check_scratch_bytes(int64_t batch) {
  const auto entries = static_cast<size_t>(3 * batch + 2);
  return (16 + entries * sizeof(int32_t) + 255) / 256 * 256;
}

// CheckScratch laid out from `base` (256-byte aligned, check_scratch_bytes(batch) long).
inline CheckScratch check_scratch(void* base, int64_t batch) {
  auto* bytes = static_cast<char*>(base);
  CheckScratch s;
  s.first_fault = reinterpret_cast<unsigned long long*>(bytes);
  s.verdict = reinterpret_cast<int32_t*>(bytes + 8);
  s.cu_seqlens_q = reinterpret_cast<int32_t*>(bytes + 16);
  s.cu_seqlens_k = s.cu_seqlens_q + batch + 1;
  s.seqused_k = s.cu_seqlens_k + batch + 1;
  return s;
}

struct VarlenCheckParams {
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_k = nullptr;    // null: absent
  const int32_t* block_table = nullptr;  // null: keys packed, not paged
  int64_t block_table_stride = 0, table_columns = 0, page_size = 1, num_blocks = 0;
  int64_t batch = 0;
  int64_t total_q = 0, total_k = 0;  // rows of q and k (paged: unbounded)
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  CheckScratch scratch;
  IndexFaultSink sink;
  int32_t call = 0;  // a FaultingCall
};

// One output whose rows outside [cu[0], cu[batch]) are filled (16-bit rows; LSE optional).
struct FillTarget {
  RowsOut rows;
  LseOut lse;
  const int32_t* cu = nullptr;  // device memory
  int64_t batch = 0, total = 0, heads = 0;
};

struct FillParams {
  FillTarget targets[3];
  int count = 0;
  const int32_t* verdict = nullptr;  // null: the call's lengths were checked on the host
  bool bf16 = false;
  int64_t head_dim = 0;
};

// Asynchronous on `stream`; return the launch's error.
cudaError_t launch_check(const VarlenCheckParams& p, cudaStream_t stream);
cudaError_t launch_fill(const FillParams& p, cudaStream_t stream);

}  // namespace flashattn::cuda::varlen

// The device-side check of a varlen call's length arrays (IndexCheck::kDevice): cu_seqlens_q,
// cu_seqlens_k, seqused_k and, for paged keys, the block-table entries those lengths reach.
//
// One CTA reads the arrays, applies check_varlen's rules (validate.cpp) in the host's order, and
// writes the copies the attention kernels then read: the values themselves when every rule
// holds, else zeros (every sequence empty, so no kernel reads a row or page through a bad
// value). The first broken rule in the host's order is recorded in the index-fault record
// (index_faults.hpp) and raised by a later call, and the call's outputs are filled with NaN
// (fill_outside_sequences_kernel). No host round trip: the call stays asynchronous.
//
// Kernel bodies only, compiled by varlen_checks.cu and, with the CUDA builtins emulated, by the
// CPU tests; shared variables are avoided for that reason (block reductions use
// __syncthreads_or and a word of the call's workspace).
#pragma once

#include <cmath>
#include <cstdint>

#include "index_faults.hpp"
#include "varlen_checks.hpp"

namespace flashattn::cuda::varlen {

// ~0: no fault. Else (stage << 60) | (entry << 28) | detail (entry < 2^32), ordered as the host checks:
// stage 0 cu_seqlens_q, 1 cu_seqlens_k, 2 seqused_k, 3 paged keys; within a stage by entry, then
// by the rule or block-table column. Columns past 2^28 - 2 share the last detail value (the
// fault is still found; only which of those columns is named may differ from the host's).
constexpr unsigned long long kNoFault = ~0ull;

__host__ __device__ __forceinline__ unsigned long long fault_key(int stage, int64_t entry, int64_t detail) {
  constexpr int64_t kMaxDetail = (int64_t{1} << 28) - 1;
  return (static_cast<unsigned long long>(stage) << 60) | (static_cast<unsigned long long>(entry) << 28) |
         static_cast<unsigned long long>(detail < kMaxDetail ? detail : kMaxDetail);
}

__device__ __forceinline__ void atomic_min_u64(unsigned long long* word, unsigned long long value) {
#if defined(__CUDA_ARCH__)
  atomicMin(word, value);
#else  // the CPU tests' emulated threads
  unsigned long long seen = __atomic_load_n(word, __ATOMIC_RELAXED);
  while (value < seen && !__atomic_compare_exchange_n(word, &seen, value, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {}
#endif
}

// The first fault one thread found: its key and the record to publish should it be the CTA's
// first.
struct ThreadFault {
  unsigned long long key = kNoFault;
  IndexFault fault;

  __device__ __forceinline__ void note(unsigned long long k, IndexArgument argument, VarlenRule rule, int64_t batch,
                                       int64_t column, int64_t value, int64_t low, int64_t high) {
    if (k >= key) return;
    key = k;
    fault.argument = static_cast<int32_t>(argument);
    fault.rule = static_cast<int32_t>(rule);
    fault.batch = batch;
    fault.column = column;
    fault.value = value;
    fault.low = low;
    fault.high = high;
  }
};

// Entry i of a prefix-sum array: entry 0 >= 0; entry i >= entry i - 1 and at most max_len more;
// the last entry within the tensor's rows.
__device__ __forceinline__ void check_prefix_entry(ThreadFault& t, int stage, IndexArgument argument, const int32_t* cu,
                                                   int64_t i, int64_t batch, int64_t rows, int64_t max_len) {
  const int64_t value = cu[i];
  if (i == 0) {
    if (value < 0) t.note(fault_key(stage, 0, 0), argument, VarlenRule::kNegativeStart, 0, -1, value, 0, 0);
  } else {
    const int64_t before = cu[i - 1];
    if (value < before) {
      t.note(fault_key(stage, i, 0), argument, VarlenRule::kNotMonotone, i, -1, value, before, 0);
    } else if (value - before > max_len) {
      t.note(fault_key(stage, i, 1), argument, VarlenRule::kLongerThanMax, i - 1, -1, value - before, 0, max_len);
    }
  }
  if (i == batch && value > rows) {
    t.note(fault_key(stage, batch + 1, 0), argument, VarlenRule::kPastEnd, batch, -1, value, 0, rows);
  }
}

// Keys sequence b uses: seqused_k[b] when given, else its cu_seqlens_k length.
__device__ __forceinline__ int64_t keys_used(const VarlenCheckParams& p, int64_t b) {
  return p.seqused_k != nullptr ? int64_t{p.seqused_k[b]} : int64_t{p.cu_seqlens_k[b + 1]} - p.cu_seqlens_k[b];
}

// One CTA of kCheckThreads threads. Every thread writes scratch only after the verdict.
__global__ void __launch_bounds__(kCheckThreads) check_varlen_kernel(VarlenCheckParams p) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) *p.scratch.first_fault = kNoFault;
  ThreadFault t;
  for (int64_t i = tid; i <= p.batch; i += kCheckThreads) {
    check_prefix_entry(t, 0, IndexArgument::kCuSeqlensQ, p.cu_seqlens_q, i, p.batch, p.total_q, p.max_seqlen_q);
    check_prefix_entry(t, 1, IndexArgument::kCuSeqlensK, p.cu_seqlens_k, i, p.batch, p.total_k, p.max_seqlen_k);
  }
  if (p.seqused_k != nullptr) {
    for (int64_t b = tid; b < p.batch; b += kCheckThreads) {
      const int64_t used = p.seqused_k[b], len = int64_t{p.cu_seqlens_k[b + 1]} - p.cu_seqlens_k[b];
      if (used < 0 || used > len)
        t.note(fault_key(2, b, 0), IndexArgument::kSequsedK, VarlenRule::kNegativeStart, b, -1, used, 0, len);
    }
  }
  if (p.block_table != nullptr) {  // a warp a sequence, its lanes across the pages in use
    const int lane = tid % 32, warp = tid / 32;
    const int64_t capacity = p.table_columns * p.page_size;
    for (int64_t b = warp; b < p.batch; b += kCheckThreads / 32) {
      const int64_t len = keys_used(p, b);
      if (len > capacity) {
        if (lane == 0) {
          t.note(fault_key(3, b, 0), IndexArgument::kCuSeqlensK, VarlenRule::kTooFewPages, b, -1, len, p.table_columns,
                 p.page_size);
        }
        continue;
      }
      const int64_t pages = len > 0 ? (len + p.page_size - 1) / p.page_size : 0;
      for (int64_t col = lane; col < pages; col += 32) {
        const int64_t block = p.block_table[b * p.block_table_stride + col];
        if (block < 0 || block >= p.num_blocks) {
          t.note(fault_key(3, b, 1 + col), IndexArgument::kBlockTable, VarlenRule::kNegativeStart, b, col, block, 0,
                 p.num_blocks - 1);
        }
      }
    }
  }
  // The verdict, then the first fault in the host's order: the least key.
  const bool faulty = __syncthreads_or(t.key != kNoFault) != 0;
  if (faulty) {
    if (t.key != kNoFault) atomic_min_u64(p.scratch.first_fault, t.key);
    __syncthreads();
    if (t.key != kNoFault && t.key == *p.scratch.first_fault) {  // keys are unique to a thread
      t.fault.call = p.call;
      record_index_fault(p.sink, t.fault);
    }
  }
  for (int64_t i = tid; i <= p.batch; i += kCheckThreads) {
    p.scratch.cu_seqlens_q[i] = faulty ? 0 : p.cu_seqlens_q[i];
    p.scratch.cu_seqlens_k[i] = faulty ? 0 : p.cu_seqlens_k[i];
    if (p.seqused_k != nullptr && i < p.batch) p.scratch.seqused_k[i] = faulty ? 0 : p.seqused_k[i];
  }
  if (tid == 0) *p.scratch.verdict = faulty ? 1 : 0;
}

// Rows of one output that no sequence owns, [0, cu[0]) and [cu[batch], total), get 0 (and LSE
// -inf); after a failed check (verdict 1) every row gets NaN. A grid-stride loop over the rows'
// elements; with nothing to fill, each CTA reads three words and exits.
__device__ __forceinline__ void fill_target(const FillTarget& t, const int32_t* verdict, bool bf16, int64_t head_dim) {
  const bool failed = verdict != nullptr && *verdict != 0;
  const int64_t first = failed ? 0 : t.cu[0], last = failed ? 0 : t.cu[t.batch];
  const uint16_t value = failed ? (bf16 ? 0x7FC0 : 0x7E00) : 0;  // NaN, or +0.0
  const float lse_value = failed ? NAN : -INFINITY;
  const int64_t per_row = t.heads * head_dim;
  const int64_t before = first, after = t.total - last;  // the two ranges' rows
  const int64_t elements = (before + after) * per_row;
  for (int64_t e = blockIdx.x * int64_t{kFillThreads} + threadIdx.x; e < elements;
       e += int64_t{gridDim.x} * kFillThreads) {
    const int64_t r = e / per_row, row = r < before ? r : last + (r - before);
    const int64_t c = e % head_dim, h = e / head_dim % t.heads;
    static_cast<uint16_t*>(t.rows.data)[row * t.rows.row_stride + h * t.rows.head_stride + c] = value;
    if (t.lse.data != nullptr && c == 0) t.lse.data[row * t.lse.row_stride + h * t.lse.head_stride] = lse_value;
  }
}

__global__ void __launch_bounds__(kFillThreads) fill_outside_sequences_kernel(FillParams p) {
  for (int i = 0; i < p.count; ++i) fill_target(p.targets[i], p.verdict, p.bf16, p.head_dim);
}

}  // namespace flashattn::cuda::varlen

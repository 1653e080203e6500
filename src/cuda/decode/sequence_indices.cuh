// A decode call's index values per sequence (cache_seqlens, cache_leftpad, cache_batch_idx, the
// rotary rows they need, the block-table entries): read at a kernel's start, checked against
// KvCacheArgs' rules, and -- where the call left them to the kernels (IndexCheck::kDevice) -- the
// first value out of range recorded for the host (index_faults.hpp). Recording is the cold path
// of a kernel that already found a bad value: it costs the good path nothing.
#pragma once

#include <cstdint>

#include "../index_faults.hpp"
#include "decode_params.hpp"

namespace flashattn::cuda::decode {

// Sequence b's index values, read together at a kernel's start: the first K / V copies wait on
// them, and loaded at once they cost one memory round trip, not one each.
struct SequenceIndices {
  int64_t used;   // cache_seqlens[b], or the capacity
  int64_t first;  // leftpad[b], or 0: the sequence's first position
  int64_t entry;  // batch_idx[b], or b: its entry of a contiguous cache
};
__device__ __forceinline__ SequenceIndices sequence_indices(const CacheParams& c, int64_t b) {
  return {c.used(b), c.first_position(b), c.batch_idx != nullptr ? c.batch_idx[b] : b};
}

// Whether sequence b's index values are in range (KvCacheArgs' rules): cache_seqlens leaves room
// for the new tokens, leftpad lies within it, batch_idx names a cache entry, the rotary tables
// hold every position rotated. Validation has checked them on the host unless the caller chose
// IndexCheck::kDevice; either way no kernel reads or writes through a value that fails here.
// (Block-table entries are checked where they are read.)
__device__ __forceinline__ bool sequence_indices_ok(const DecodeParams& p, const SequenceIndices& s) {
  const CacheParams& c = p.cache;
  if (s.used < 0 || s.used > c.capacity - c.seqlen_new || s.first < 0 || s.first > s.used) return false;
  if (c.batch_idx != nullptr && !c.entry_ok(s.entry)) return false;
  if (p.rotary.dim > 0) {
    const int64_t q_end = p.shape.seqlen_q == 0 ? 0 : s.used + (p.rotary.per_row_q ? p.shape.seqlen_q : 1);
    if (s.used + c.seqlen_new > p.rotary.rows || q_end > p.rotary.rows) return false;
  }
  return true;
}

// The value of sequence b that failed sequence_indices_ok, with the range it had to lie in.
__device__ __forceinline__ IndexFault sequence_fault(const DecodeParams& p, const SequenceIndices& s, int64_t b) {
  const CacheParams& c = p.cache;
  auto fault = [b](IndexArgument a, int64_t value, int64_t low, int64_t high) {
    return IndexFault{static_cast<int32_t>(a), b, -1, value, low, high};
  };
  const int64_t most_used = c.capacity - c.seqlen_new;
  if (s.used < 0 || s.used > most_used) return fault(IndexArgument::kCacheSeqlens, s.used, 0, most_used);
  if (s.first < 0 || s.first > s.used) return fault(IndexArgument::kCacheLeftpad, s.first, 0, s.used);
  if (c.batch_idx != nullptr && !c.entry_ok(s.entry)) {
    return fault(IndexArgument::kCacheBatchIdx, s.entry, 0, c.entries - 1);
  }
  // The rotary tables: positions used + t of the new tokens and of the queries must have rows.
  const int64_t q_rows = p.shape.seqlen_q == 0 ? 0 : (p.rotary.per_row_q ? p.shape.seqlen_q : 1);
  const int64_t rotated = c.seqlen_new > q_rows ? c.seqlen_new : q_rows;
  return fault(IndexArgument::kRotaryRows, s.used, 0, p.rotary.rows - rotated);
}

// A CTA whose sequence failed sequence_indices_ok records why (thread 0; CTA-uniform call).
__device__ __forceinline__ void report_sequence_fault(const DecodeParams& p, const SequenceIndices& s, int64_t b) {
  if (p.fault.claim != nullptr && threadIdx.x == 0) record_index_fault(p.fault, sequence_fault(p, s, b));
}

// A CTA that read an out-of-range block-table entry for positions [pos_begin, pos_end) of sequence
// b records the first such entry (thread 0; CTA-uniform call, after the CTA agreed it saw one).
__device__ __forceinline__ void report_block_fault(const DecodeParams& p, int64_t b, int64_t pos_begin,
                                                   int64_t pos_end) {
  const CacheParams& c = p.cache;
  if (p.fault.claim == nullptr || threadIdx.x != 0 || pos_begin >= pos_end) return;
  const int32_t* row = c.block_table + b * c.block_table_stride;
  for (int64_t col = pos_begin / c.page_size; col <= (pos_end - 1) / c.page_size; ++col) {
    if (!c.entry_ok(row[col])) {
      record_index_fault(
          p.fault, IndexFault{static_cast<int32_t>(IndexArgument::kBlockTable), b, col, row[col], 0, c.entries - 1});
      return;
    }
  }
}

}  // namespace flashattn::cuda::decode

// The validated description of a KV-cache call (forward_kvcache): the attention Problem over
// the cache, plus what is written into the cache first (k_new / v_new with rotary).
#pragma once

#include <cstdint>
#include <vector>

#include "problem.hpp"

namespace flashattn::detail {

// Rotary embedding of the first `dim` features: pairs (x1, x2) become
// (x1 cos - x2 sin, x1 sin + x2 cos), with cos / sin from row `position`, column `pair`.
struct RotaryParams {
  const void* cos = nullptr;
  const void* sin = nullptr;
  DType dtype = DType::kFloat32;  // float32 or q's dtype
  int64_t dim = 0;                // rotary_dim; 0 = off
  int64_t rows = 0;               // seqlen_ro
  int64_t cos_row_stride = 0, sin_row_stride = 0;
  bool interleaved = true;  // pairs (2i, 2i + 1), else (i, i + dim / 2)
  bool per_row_q = false;   // q row i at position cache_seqlens + i, else all at cache_seqlens

  bool enabled() const { return dim > 0; }
};

struct KvCacheProblem {
  Problem attn;                        // q attends to attn.k / attn.v, the caches
  int64_t capacity = 0;                // positions a sequence's cache holds (shape only)
  int64_t cache_entries = 0;           // k_cache's dim 0: cache entries, or blocks when paged
  bool device_checks_indices = false;  // IndexCheck::kDevice on device tensors: values unread here
  bool append = false;                 // k_new / v_new given (possibly with s_new = 0)
  Operand k_new, v_new;                // [b, s_new, hkv, d]
  int64_t seqlen_new = 0;
  const int32_t* cache_seqlens = nullptr;   // as given (device memory for CUDA tensors); may be null
  std::vector<int64_t> host_cache_seqlens;  // the values (capacity each when absent); empty if unread
  RotaryParams rotary;
  int64_t num_splits = 0;
};

KvCacheProblem validate_kvcache(const KvCacheArgs& args, const AttentionOptions& options, void* stream = nullptr,
                                LengthValues lengths = LengthValues::kCheck);

}  // namespace flashattn::detail

// KV-cache test cases shared by the decode kernels' emulated test and their GPU test: random
// inputs for forward_kvcache (contiguous or paged caches, leftpad, new tokens, rotary, masks,
// softcap, ALiBi), with every cache position no call may read set to NaN, and the comparison
// with the CPU backend, the oracle of every decode test.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "flashattn/flashattn.hpp"
#include "test_util.hpp"

namespace fa_test {

struct KvCase {
  flashattn::DType dtype = flashattn::DType::kBFloat16;
  int64_t batch = 2, seqlen_q = 1, seqlen_new = 1, heads_q = 8, heads_kv = 2, head_dim = 128;
  int64_t capacity = 200, page_size = 0;
  bool leftpad = false;
  bool empty_sequence = false;  // sequence 0 holds no token (with seqlen_new 0: no key at all)
  bool full_sequence = false;   // the last sequence ends at the capacity after the append
  int64_t rotary_dim = 0;
  bool interleaved = true;
  bool causal = true;
  int64_t window_left = -1;
  int64_t sink_tokens = 0;
  float softcap = 0.0f;
  bool alibi = false;
  bool sink = false;  // a learnable sink: every head a logit of its own, the last head's -inf (none)
  int64_t num_splits = 1;
  // A NaN in column 3 of every KV head of one key of every sequence (in v, or in k with nan_in_k):
  // key nan_key of the sequence (from its first position), counted from its last key when
  // negative (-1: the last new token); none where the sequence has no such key. The rule
  // (docs/CONVENTIONS.md, "NaN"): it reaches exactly the rows that see that key.
  int64_t nan_key = 0;
  bool nan_in_k = false;
  bool has_nan_key = false;

  std::string name() const;
};

struct KvTensors {
  HostTensor q, k_cache, v_cache, k_new, v_new, seqlens, leftpad, table, cos, sin, alibi, sink, out, lse;
};

KvTensors make_kv_tensors(const KvCase& c, std::mt19937_64& rng);
flashattn::KvCacheArgs kv_args(const KvCase& c, const KvTensors& t);
flashattn::AttentionOptions kv_options(const KvCase& c, const KvTensors& t);

// Element by element within tol * max(1, |ref|); NaN matches NaN, -inf matches -inf.
void expect_near(const char* what, const HostTensor& got, const HostTensor& ref, double tol, const std::string& name);

// got against the CPU backend's run of the same case (`cpu`, already run): caches exact (rotated
// keys too), out within two ulps, lse within 1e-5 (1e-4 with a softcap).
void expect_matches_cpu(const KvCase& c, const KvTensors& got, const KvTensors& cpu);

// A run whose sequence 0 had an out-of-range index the kernels met (IndexCheck::kDevice) against
// the CPU's run of the valid inputs (`cpu`) and the inputs before either (`before`): sequence 0's
// out and lse rows all NaN, sequence 1's as the CPU's (expect_matches_cpu's tolerances), the
// caches as before but for sequence 1's new row (the CPU's) and, unless append_skipped, sequence
// 0's (whose append is then unspecified). Batch 2, seqlen_new 1.
void expect_only_sequence_zero_bad(const KvCase& c, const KvTensors& got, const KvTensors& cpu, const KvTensors& before,
                                   bool append_skipped);

}  // namespace fa_test

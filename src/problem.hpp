// The validated description of one attention call: the contract between the API layer
// (validate.cpp) and every backend. Built only by validate(); backends may trust every field.
#pragma once

#include <cstdint>
#include <vector>

#include "core/block_mask.hpp"
#include "core/cache_rows.hpp"
#include "core/float8.hpp"
#include "core/variant.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

// Where row `i` of head `h` of batch `b` lives in one tensor, in elements from its base pointer.
// Dense and varlen tensors share this form: a varlen tensor is a dense one with batch stride 0
// whose rows of batch b start at token cu_seqlens[b].
struct RowLayout {
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;

  int64_t offset(int64_t b, int64_t row, int64_t h) const {
    return b * batch_stride + row * row_stride + h * head_stride;
  }
};

// The indirections of a KV cache (forward_kvcache, paged varlen), shared with the CUDA kernels.
// Validation has checked every index a call reads.
using CacheRows = core::CacheRows;

struct Operand {
  void* data = nullptr;
  RowLayout layout;
  CacheRows cache;        // K / V of a KV cache; inactive for every other operand
  core::Descale descale;  // FP8 q / k / v: the factor of (batch entry, head); else absent (1)

  // Offset of row `row` of head h of batch entry b (key `row`, for a cache).
  int64_t offset(int64_t b, int64_t row, int64_t h) const {
    if (!cache.active()) return layout.offset(b, row, h);
    return cache.position_offset(layout, b, cache.first_position(b) + row, h);
  }
};

// LSE is [b, h, sq] (dense) or [h, total_q] (varlen): offset(b, row, h) with its own strides.
struct MaskParams {
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded (causal sets 0)
  int64_t sink_tokens = 0;    // keys [0, sink_tokens) exempt from window_left (core::SinkTokenMask)
};

struct DropoutParams {
  double p = 0.0;
  uint32_t threshold = 0;  // drop iff the element's 16 Philox bits < threshold (core/philox.hpp); 0 = off
  uint64_t seed = 0;
  uint64_t offset = 0;
  bool enabled() const { return threshold != 0; }
};

struct Problem {
  // out's dtype, and that of every other value tensor but FP8 inputs: q_dtype (FP8 q, k and v
  // of the forward) and kv_dtype (k and v, an FP8 KV cache) say what q and k / v hold. The CPU
  // backend runs FP8 inputs; the CUDA backend refuses them (cuda::supports_*).
  DType dtype = DType::kFloat32;
  DType q_dtype = DType::kFloat32, kv_dtype = DType::kFloat32;
  Device device{};
  int64_t batch = 0, heads_q = 0, heads_kv = 0;
  // q's and k's head dim, and v's (out's, dout's, dv's): they may differ (multi-head latent
  // attention's 192 / 128), on the CPU backend; the CUDA kernels take equal ones.
  int64_t head_dim = 0, head_dim_v = 0;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;

  // Dense: seqlen_q/k apply to all batches and the cu/seqused pointers are null.
  int64_t seqlen_q = 0, seqlen_k = 0;
  int64_t total_q = 0, total_k = 0;  // varlen: rows of the q and k tensors
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_k = nullptr;
  // Varlen on a device: the host copies validation read (same contents as the pointers above,
  // which stay device pointers for the kernels); empty otherwise.
  std::vector<int32_t> host_cu_seqlens_q, host_cu_seqlens_k, host_seqused_k;
  // Varlen on a device under IndexCheck::kDevice: the values are left unread here (the host
  // copies above stay empty) and checked by the backend on the device.
  bool device_checks_lengths = false;
  int64_t table_columns = 0;  // paged varlen keys: block_table's columns (pages a sequence has)
  // KV cache (forward_kvcache): k / v are the caches (their CacheRows), seqlen_k is the largest
  // sequence's, and host_seqlens_k holds each sequence's keys, new tokens included (empty when
  // a size query left the index arrays unread).
  bool kv_cache = false;
  std::vector<int64_t> host_seqlens_k;

  Operand q, k, v, out, lse;  // lse.data may be null in forward
  Operand dout, dq, dk, dv;   // backward only

  // The learnable sinks' gradient, fp32 [heads_q] (backward with a sink; null: not wanted).
  float* dsink = nullptr;
  int64_t dsink_stride = 1;

  MaskParams mask;
  // A block-sparse mask (AttentionOptions::block_mask; dense CPU calls): row i sees key j only
  // where it shows j too. Absent unless block_mask.present().
  core::BlockMask block_mask;
  // CUDA tensors under BlockMaskOptions' IndexCheck::kDevice: the lists' values are left unread
  // here, for the forward kernel to check.
  bool block_mask_checked_on_device = false;
  core::VariantParams score;
  DropoutParams dropout;
  bool deterministic = false;
  bool precise = false;

  bool varlen() const { return cu_seqlens_q != nullptr; }
  int64_t group_size() const { return heads_q / heads_kv; }
};

// Lengths and first-row indices of one batch entry.
struct SeqInfo {
  int64_t q_start = 0, k_start = 0;  // first row (token) of this batch entry in q / k
  int64_t seqlen_q = 0, seqlen_k = 0;
};

// Host-side: the CPU backend's (a CUDA problem's length arrays may live on the device).
inline SeqInfo seq_info(const Problem& p, int64_t b) {
  if (!p.varlen()) {
    const int64_t sk = p.host_seqlens_k.empty() ? p.seqlen_k : p.host_seqlens_k[b];
    return {0, 0, p.seqlen_q, sk};
  }
  SeqInfo s;
  s.q_start = p.cu_seqlens_q[b];
  // Paged keys are numbered from each sequence's first page; cu_seqlens_k gives lengths only.
  s.k_start = p.k.cache.paged() ? 0 : p.cu_seqlens_k[b];
  s.seqlen_q = p.cu_seqlens_q[b + 1] - s.q_start;
  s.seqlen_k = p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  return s;
}

enum class Direction { kForward, kBackward };

// What validation does with the varlen length arrays (cu_seqlens, seqused_k) beyond their shapes:
// read and check their values before a call runs (arrays in device memory copied to the host on
// `stream`, the call's, and waited for), or leave them unread for a workspace-size query, whose
// answer depends on shapes alone (so it needs no stream and never waits on the device).
enum class LengthValues { kCheck, kUnread };

// Validation (validate.cpp). Throws flashattn::Error naming the argument.
Problem validate_forward(const ForwardArgs& args, const VarlenArgs* varlen, const AttentionOptions& options,
                         void* stream = nullptr, LengthValues lengths = LengthValues::kCheck);
Problem validate_backward(const BackwardArgs& args, const VarlenArgs* varlen, const AttentionOptions& options,
                          void* stream = nullptr, LengthValues lengths = LengthValues::kCheck);

// A copy of `bytes` from device memory to the host (validation's index arrays).
struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};
// Every copy from device memory on `device`, ordered on `stream`, with one wait for them all
// (devices.cpp; kUnsupported without the CUDA backend, kBackendError on a CUDA failure).
void copy_to_host(const std::vector<HostCopy>& copies, const Device& device, void* stream);

}  // namespace flashattn::detail

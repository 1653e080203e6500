// The contract between the CUDA dispatch (backend.cpp, plain C++) and the kernels: plain data,
// readable on host and device, built once per call from the validated Problem. It includes no
// CUDA, CuTe or public-API header, so kernel translation units stay light and C++17.
#pragma once

#include <cstdint>
#include <limits>

#include "../core/block_mask.hpp"
#include "../core/fast_divmod.hpp"
#include "../core/host_device.hpp"
#include "index_faults.hpp"
#include "variant.hpp"

namespace flashattn::cuda {

enum class ElemType : int { kFloat16 = 0, kBFloat16 = 1 };

// The mask logic a kernel is compiled with (a template parameter; the window sizes stay
// runtime). kNone still masks the keys past seqlen_k in the last key tile; kMasked adds the
// bottom-right causal / sliding window of core::Mask; kMaskedDropout is kMasked plus dropout,
// a kernel of its own because the Philox code needs registers the others spend on tiles.
enum class MaskKind : int { kNone = 0, kMasked = 1, kMaskedDropout = 2 };

// Rows of a [batch, seqlen, heads, head_dim] tensor: strides in elements, head_dim stride 1.
struct RowsIn {
  const void* data = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};
struct RowsOut {
  void* data = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};

// fp32 LSE [batch, heads_q, seqlen_q] addressed like RowsOut; data == nullptr: not wanted.
struct LseOut {
  float* data = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};

// Dense: seqlen_q / seqlen_k of every batch entry. Varlen: their maxima (the grid's extent);
// each sequence's lengths come from the cu_seqlens arrays of ForwardParams.
struct ShapeParams {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;
};

// core::Mask's window; -1 = unbounded side (causal is right = 0). sink_tokens: the keys
// [0, sink_tokens) exempt from `left` (core::SinkTokenMask), which the attention kernels leave to
// the sink-token pass (common/sink_tokens.cuh): they run the window alone.
struct WindowParams {
  int64_t left = -1, right = -1;
  int64_t sink_tokens = 0;
};

// Dropout on P (core/philox.hpp's keep-mask, shared with the CPU backend): P * keep, and O
// scaled by 1 / (1 - p) at the end. threshold 0 = off.
struct DropoutParams {
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;   // drop iff the element's 16 Philox bits < threshold (core/philox.hpp)
  float keep_scale = 1.0f;  // 1 / (1 - p)
};

struct ForwardParams {
  RowsIn q, k, v;
  RowsOut out;
  LseOut lse;
  ShapeParams shape;
  WindowParams window;
  ScoreParams score;
  DropoutParams dropout;
  // Varlen (device int32 arrays, validated on the host; null for dense): sequence b has rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q / out / LSE and keys from cu_seqlens_k[b], of
  // which seqused_k[b] (when given) or cu_seqlens_k[b + 1] - cu_seqlens_k[b] are used.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_k = nullptr;
  int64_t total_q = 0, total_k = 0;  // varlen: rows of the q / out and k / v tensors (TMA's extents)
  // Paged K / V (varlen; the sm80 kernels' kPaged variants): k / v are blocks [num_blocks,
  // page_size, heads_kv, head_dim] (batch_stride: one block) and key j of sequence b is row
  // j % page_size of block block_table[b * block_table_stride + j / page_size]; cu_seqlens_k
  // (or seqused_k) gives the lengths only. Null when not paged.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  core::FastDivmod page;  // by page_size (< 2^31: supports_forward)
  // The sm90 kernels' tile counter, in the caller's forward workspace (null when the caller gave
  // none: those kernels then run one CTA per tile).
  int* tile_counter = nullptr;
  // Masked calls' tile order (tile_order.hpp): (head, batch entry) pairs whose query tiles are
  // dealt together, heaviest first; waves of CTAs the last group spans at least (the backend's
  // choice); the last group's first pair (the launcher's, from the grid it launches; sm80 sets
  // tile_group 0 for a grid past 32-bit block indices: each pair's tiles in turn). The defaults
  // deal every pair's tiles together.
  int tile_group = 1;
  int tile_tail_waves = 0;
  int64_t tile_last_first = 0;
  // A block-sparse mask's lists and element bits (device memory; the sm80 kernels' kSparse
  // variant, common/sparse_tiles.cuh); absent (partial_count_data null) otherwise. Last, so the
  // other kernels' parameter offsets are as they were without it.
  core::BlockMask block_mask;
  // Its lists left to the kernel (IndexCheck::kDevice): where a bad entry is recorded; null claim:
  // checked on the host.
  IndexFaultSink block_mask_fault;
};

// The backward pass's fp32 scratch, carved out of the caller's workspace (backward_workspace.hpp):
// per query head, `rows` rows in which sequence b's query rows start at row_base(b), padded to
// whole tiles of kBackwardRowPad rows (rows past a sequence hold D = 0 and LSE2 = +inf, so any
// tile that reads them computes P = 0 there).
struct BackwardScratch {
  float* dq_accum = nullptr;    // [heads_q, rows, head_dim_bucket] in 8 x 8 blocks (dq_sum_offset)
  float* delta = nullptr;       // [heads_q, rows]: D = rowsum(dO * O)
  float* lse2 = nullptr;        // [heads_q, rows]: the forward's LSE * log2(e); +inf for empty rows
  int* dq_semaphore = nullptr;  // [heads_q, rows / kBackwardMinBlockM]: deterministic mode's turn counters
  int64_t rows = 0;
  int head_dim_bucket = 0;
};

// Where element (row, col) of one head's dQ sums lies: rows in groups of 8, each group's columns
// in blocks of 8, each 8 x 8 block in 256 contiguous bytes ordered as one warp's m16n8
// accumulator values hold it (lane l: row l / 4, columns 2 (l % 4) and + 1): the even columns
// in lane order, then the odd ones. Each of the main kernel's atomic adds of a warp then covers
// 128 contiguous bytes (one memory transaction, as FA2's layout gives) instead of 8 bytes in each
// of 8 rows. Row r's even (odd) columns of a block are 16 contiguous bytes, for the convert kernel.
inline constexpr int64_t dq_sum_offset(int64_t row, int64_t col, int64_t head_dim_bucket) {
  return (row / 8) * 8 * head_dim_bucket + (col / 8) * 64 + (col % 2) * 32 + (row % 8) * 4 + (col % 8) / 2;
}

// The backward pass: `fwd` holds the forward's inputs and its outputs out / lse (read here),
// dout the incoming gradient; dq / dk / dv are written. Dropout replays the forward's keep-mask.
struct BackwardParams {
  ForwardParams fwd;
  RowsIn dout;
  RowsOut dq, dk, dv;
  BackwardScratch scratch;
  float softmax_scale = 0.0f;  // natural-log scale, applied to dQ and dK once, at the end
  bool deterministic = false;  // dQ summed in key-tile order (semaphores) instead of any order
  float* dsink = nullptr;      // the learnable sink's gradient, fp32 [heads_q] a stride apart; null: not wanted
  int64_t dsink_stride = 0;
  // Varlen lengths checked on the device: their verdict (1: a rule broke, and every output is
  // NaN, d sink too); null when checked on the host.
  const int32_t* length_verdict = nullptr;
  // A block-sparse mask (fwd.block_mask): its transpose, the cells the key-tile walk reads (built
  // in the workspace before the kernel; core/block_mask.hpp).
  core::BlockCells block_cells;
};

// Every backward kernel's query tile divides kBackwardRowPad and is at least kBackwardMinBlockM.
inline constexpr int kBackwardRowPad = 128;
inline constexpr int kBackwardMinBlockM = 64;

// First scratch row of sequence b: dense entries are laid end to end at a padded stride; varlen
// sequence b starts at (cu_seqlens_q[b] + b * kBackwardRowPad) rounded down to kBackwardRowPad,
// which leaves every sequence its rows rounded up to whole pads (rows = total_q + batch * pad).
inline constexpr int64_t backward_row_base(const int32_t* cu_seqlens_q, int64_t seqlen_q, int64_t b) {
  return cu_seqlens_q == nullptr ? b * ((seqlen_q + kBackwardRowPad - 1) / kBackwardRowPad * kBackwardRowPad)
                                 : (cu_seqlens_q[b] + b * kBackwardRowPad) / kBackwardRowPad * kBackwardRowPad;
}

}  // namespace flashattn::cuda

// The contract between the CUDA dispatch and the KV-cache decode kernels (decode_kernel.cuh):
// plain data readable on host and device, built once per call from the validated
// KvCacheProblem. Like params.hpp it includes no CUDA or CuTe header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../core/cache_rows.hpp"
#include "../../core/fast_divmod.hpp"
#include "../../core/host_device.hpp"
#include "../index_faults.hpp"
#include "../params.hpp"

namespace flashattn::cuda {

namespace decode {
inline constexpr int kThreads = 128;  // a decode CTA: 4 warps
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kMaxSplits = 128;
inline constexpr int kMaxClusterSplits = 8;  // the portable thread-block cluster size
// The split heuristic's least keys per split: the tensor-core kernel's, the one-row kernel's
// (H200, MHA batch 1 at 1k keys: 4 splits of 256 read 1.15 TB/s, 8 of 128 1.06).
inline constexpr int64_t kMinSplitKeys = 128;
inline constexpr int64_t kMinOneRowSplitKeys = 256;
// Contexts up to kShortKeys keys are not split when the unsplit grid already fills a quarter of
// the SMs: a split's fixed cost (its CTAs' prologue and epilogue, the partials, the combine) is
// not repaid by so short a key loop (H200, batch 8 at 1k keys: GQA 1.68 TB/s unsplit against 1.50
// at the 4 splits the fill rule gives, MHA 2.96 against 2.88 at 2). Except the tensor-core kernel
// on a paged cache: unsplit it runs a CTA an SM on half the SMs, and the block-table read in its
// chain costs more than the splits (GQA batch 8 at 1k, pages of 16: 1.17 TB/s unsplit, 1.35-1.46
// at 4 splits; the one-row kernel's MHA pages of 16 gain: 2.90 unsplit, 2.69-2.71 at 2).
inline constexpr int64_t kShortKeys = 1024;
// CTAs an SM must hold at once (__launch_bounds__) of the CUDA-core kernel, one query row a CTA:
// decoding is a stream of loads, and the more warps an SM holds the more loads are in flight; 4
// CTAs leave 128 registers a thread. (Two or more rows a KV group take the tensor-core kernel:
// the CUDA-core kernel with 2 and 4 rows a CTA, at 3 and 2 CTAs an SM, measured slower.)
inline constexpr int kOneRowCtasPerSm = 4;
// Two or more query rows a KV group take the tensor-core kernel (decode_mma_kernel.cuh): one
// m16 tile of rows a CTA, its CTAs an SM by head-dim bucket (its pipeline's shared memory).
inline constexpr int kMmaRows = 16;
constexpr int mma_ctas_per_sm(int head_dim) { return head_dim <= 128 ? 2 : 1; }
// Keys and query rows a CUDA call may have: positions are 32-bit in the kernels, with room for a
// step past the last key.
inline constexpr int64_t kMaxPositions = (int64_t{1} << 31) - (int64_t{1} << 16);

// Lanes per key row come in the head-dim buckets 64, 128 and 256 (0: past 256).
constexpr int head_dim_bucket(int64_t head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : head_dim <= 256 ? 256 : 0;
}

// How a call is spread over CTAs (decode_setup.hpp's decode_layout).
struct DecodeLayout {
  int rows_per_cta = 1;  // 1: decode_kernel; kMmaRows: decode_mma_kernel
  int row_blocks = 1;    // CTAs per KV group
  int num_splits = 1;
  // The combine kernel launched programmatically dependent on the decode kernel (the device runs
  // sm90+ code; set by the dispatch, not from shapes).
  bool overlap_combine = false;
  // The splits of a row block merged in the decode kernel through distributed shared memory (a
  // thread-block cluster of num_splits CTAs, 2 <= num_splits <= kMaxClusterSplits; sm90 code; set
  // by the dispatch): no combine kernel, no partials in the workspace.
  bool cluster_merge = false;
  size_t partial_out_bytes = 0, partial_lse_bytes = 0;  // workspace (0 with one split)
  size_t workspace_bytes() const { return partial_out_bytes + partial_lse_bytes; }
};
}  // namespace decode

// The cache's rows (core::CacheRows: pages, leftpad, batch_idx; device pointers) and the
// sequences' lengths: the keys of sequence b are positions [first_position(b), used(b) +
// seqlen_new), used(b) = cache_seqlens[b], or the capacity when cache_seqlens is absent (which
// validation allows only without new tokens).
struct CacheParams : core::CacheRows {
  const int32_t* cache_seqlens = nullptr;  // [batch]; null: every cache full
  int64_t capacity = 0;                    // positions per sequence
  int64_t seqlen_new = 0;
  int64_t entries = 0;    // the caches' dim 0: cache entries, or blocks when paged
  core::FastDivmod page;  // by page_size (paged)

  FA_HOST_DEVICE int64_t used(int64_t b) const { return cache_seqlens != nullptr ? cache_seqlens[b] : capacity; }
  FA_HOST_DEVICE bool entry_ok(int64_t e) const { return e >= 0 && e < entries; }
};

// Rotary embedding (see KvCacheArgs): pairs (2i, 2i + 1) or (i, i + dim / 2) of the first `dim`
// features, cos / sin [rows, dim / 2] in fp32 or the kernel's element type. dim % 16 == 0, so a
// 16-byte vector of features and its partner's lie in whole vectors.
struct RotaryParams {
  const void* cos = nullptr;
  const void* sin = nullptr;
  bool fp32_tables = false;
  int64_t dim = 0;   // 0 = off
  int64_t rows = 0;  // positions the tables hold
  int64_t cos_row_stride = 0, sin_row_stride = 0;
  bool interleaved = true;
  bool per_row_q = false;  // q row i at position cache_seqlens + i, else all at cache_seqlens
};

// Split-KV: CTA (split, kv head x row block, batch) attends rows [row_block * rows_per_cta, ...)
// of its KV group (row r = query i * group + head offset: all query heads of a KV head are rows
// of one tile, so K / V are read once per KV head) to its split's share of the keys. With one
// split it writes out / lse; with more, fp32 partials that the combine kernel merges.
struct DecodeParams {
  RowsIn q, k, v;                    // k / v: the caches, addressed through `cache`
  RowsIn k_new, v_new;               // [batch, seqlen_new, heads_kv, d]
  RowsOut k_cache_out, v_cache_out;  // the same caches, written by the append kernel
  RowsOut out;
  LseOut lse;
  ShapeParams shape;  // seqlen_k: the cache capacity (the largest possible sequence)
  WindowParams window;
  ScoreParams score;
  CacheParams cache;
  RotaryParams rotary;
  int num_splits = 1;
  // Divisors fixed per call, as multiply-and-shift (a run-time division is tens of dependent
  // instructions, on the path from a kernel's start to its first K / V copy):
  core::FastDivmod split_divisor;  // num_splits (split_range)
  core::FastDivmod row_blocks;     // CTAs a KV group's rows take (rows_per_cta each)
  core::FastDivmod group;          // query heads a KV head serves (heads_q / heads_kv)
  int rows_per_cta = 1;
  bool cluster_merge = false;    // DecodeLayout::cluster_merge
  float* partial_out = nullptr;  // [num_splits, batch, heads_q, seqlen_q, head_dim]
  float* partial_lse = nullptr;  // [num_splits, batch, heads_q, seqlen_q]; -inf: no key seen
  IndexFaultSink fault;          // IndexCheck::kDevice: where a bad index value is recorded (else null)
};

}  // namespace flashattn::cuda

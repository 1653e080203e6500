// The decode kernels' output side: where a row goes (out / lse, or a split's partials), the
// warps' partial states of a row merged (store_merged), the splits of a row merged in a
// thread-block cluster (merge_cluster) or by the combine kernel (combine_kernel), and the NaN rows
// of a sequence whose indices failed the kernels' checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "../../core/softmax.hpp"
#include "decode_blocks.cuh"
#include "decode_params.hpp"

namespace flashattn::cuda::decode {

// The one-row kernel's shared memory after the key loop (in the pipeline's bytes,
// decode_kernel.cuh's decode_smem_bytes): the warps' partial states of the row to merge.
template <int kHeadDim>
struct MergeShared {
  float max[kWarps], sum[kWarps];
  float acc[kWarps][kHeadDim];
  float weight[kWarps];  // a warp's factor in the row's normalised output
  float lse;
  int64_t out_at;                        // the row's offset in out (one split, or the cluster merge) or partial_out
  int64_t lse_at;                        // its offset in lse or partial_lse; -1: none
  float out[kHeadDim];                   // cluster merge: the CTA's normalised row, read by its peers
  float peer_weight[kMaxClusterSplits];  // cluster merge: each split's share of the row
};

// Whether a CTA writes out / lse itself (one split, or the splits merged in a cluster), not
// partials for the combine kernel.
__device__ __forceinline__ bool writes_output(const DecodeParams& p) { return p.num_splits == 1 || p.cluster_merge; }

// Thread-block clusters (sm90): the CTA's rank, a barrier over the cluster (release / acquire:
// shared-memory writes before it are seen by peers after it), and a float of a peer's shared
// memory at the address of `local` in this CTA's.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float peer_float(const float* local, unsigned rank) {
  const auto at = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(at), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

// Where row `row` of KV head hk's group in batch entry b goes (query token row / group, head
// hk * group + row % group): its offsets in out and lse (one split, or the splits merged in a
// cluster; lse_at -1 when no lse is asked for), else in the split's partials.
struct RowDestination {
  int64_t out_at, lse_at;
};
__device__ __forceinline__ RowDestination row_destination(const DecodeParams& p, int64_t b, int hk, int row,
                                                          int split) {
  uint32_t head_in_group;
  const int64_t i = p.group.divmod(static_cast<uint32_t>(row), &head_in_group);
  const int64_t h = int64_t{hk} * p.group.divisor + head_in_group;
  if (writes_output(p)) {
    return {b * p.out.batch_stride + i * p.out.row_stride + h * p.out.head_stride,
            p.lse.data != nullptr ? b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride : -1};
  }
  const int64_t at = ((split * p.shape.batch + b) * p.shape.heads_q + h) * p.shape.seqlen_q + i;
  return {at * p.shape.head_dim, at};
}

// NaN in every element and lse of the CTA's rows (a sequence whose indices failed the kernel's
// own checks), in out / lse or the split's partials. Thread x takes column x % kHeadDim of rows
// x / kHeadDim, x / kHeadDim + kThreads / kHeadDim, ...
template <typename Element, int kHeadDim, int kRows>
__device__ __forceinline__ void store_nan_rows(const DecodeParams& p, int64_t b, int hk, int row0, int split) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const int total_rows = static_cast<int>(p.shape.seqlen_q * p.group.divisor);
  for (int idx = static_cast<int>(threadIdx.x); idx < kRows * kHeadDim; idx += kThreads) {
    const int r = idx / kHeadDim, c = idx % kHeadDim, row = row0 + r;
    if (r >= p.rows_per_cta || row >= total_rows || c >= p.shape.head_dim) continue;
    const RowDestination d = row_destination(p, b, hk, row, split);
    if (writes_output(p)) {
      static_cast<Element*>(p.out.data)[d.out_at + c] = static_cast<Element>(kNaN);
      if (c == 0 && d.lse_at >= 0) p.lse.data[d.lse_at] = kNaN;
    } else {
      p.partial_out[d.out_at + c] = kNaN;
      if (c == 0) p.partial_lse[d.lse_at] = kNaN;
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The cluster's CTAs are the splits of one row (rank = split). Each puts its normalised row and
// lse in shared memory; after a cluster barrier, one thread weighs the splits as the combine
// kernel does (empty splits 0, a NaN split makes the row NaN), and rank k writes the elements
// k, k + splits, ... of the row. A last barrier keeps every CTA's shared memory until its peers
// have read it. (store_merged has filled weight, lse, out_at and lse_at.)
template <typename Element, int kHeadDim>
__device__ __forceinline__ void merge_cluster(const DecodeParams& p, MergeShared<kHeadDim>& shared) {
  const int me = static_cast<int>(threadIdx.x), splits = p.num_splits;
  for (int c = me; c < kHeadDim; c += kThreads) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += shared.acc[w][c] * shared.weight[w];
    shared.out[c] = o;
  }
  cluster_sync();
  const unsigned rank = cluster_rank();
  if (me == 0) {  // (every split's load in flight at once: the loops unrolled to the cluster limit)
    float lse[kMaxClusterSplits];
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lse[s] = s < splits ? peer_float(&shared.lse, static_cast<unsigned>(s)) : m;
      m = fmaxf(m, lse[s]);
      nan = nan || std::isnan(lse[s]);
    }
    const float base = core::safe_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) sum += s < splits ? expf(lse[s] - base) : 0.0f;
    const float total = nan          ? std::numeric_limits<float>::quiet_NaN()
                        : sum > 0.0f ? base + logf(sum)
                                     : -std::numeric_limits<float>::infinity();
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      shared.peer_weight[s] = s >= splits ? 0.0f : nan ? total : sum > 0.0f ? expf(lse[s] - total) : 0.0f;
    }
    if (rank == 0 && shared.lse_at >= 0) p.lse.data[shared.lse_at] = total;
  }
  __syncthreads();
  for (int c = static_cast<int>(rank) + me * splits; c < p.shape.head_dim; c += kThreads * splits) {
    float o = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s < splits) o += shared.peer_weight[s] * peer_float(&shared.out[c], static_cast<unsigned>(s));
    }
    static_cast<Element*>(p.out.data)[shared.out_at + c] = static_cast<Element>(o);
  }
  cluster_sync();
}
#endif

// Row `row`'s learnable sink (exp2 domain) as split `split` counts it: split 0 alone, so that the
// splits' merge by their LSEs counts it once (a split of no key then has LSE = the sink); -inf
// without a sink, or for the other splits.
__device__ __forceinline__ float row_sink_log2(const DecodeParams& p, int hk, int row, int split) {
  if (p.score.sink == nullptr || split != 0) return -std::numeric_limits<float>::infinity();
  uint32_t head_in_group;
  p.group.divmod(static_cast<uint32_t>(row), &head_in_group);
  return sink_log2(p.score, int64_t{hk} * p.group.divisor + head_in_group);
}

// A row's (max, sum) states of the CTA's warps (each over its own keys) merged, with the row's
// learnable sink (sink_log2 > -inf: a state (sink, 1) of no value row; join_sink's term): the
// common base and the total of the sums rescaled to it; a warp that saw no key (sum 0) counts
// nothing. A warp's share of the row's output is share(its max, its sum). A warp whose scores
// met a NaN (sum NaN; fmaxf left the NaN out of its max) makes the total, every share and the
// lse NaN: the row met a NaN (docs/CONVENTIONS.md, "NaN"), not a key that counts for nothing.
struct MergedWarps {
  float base, total;
  __device__ __forceinline__ float share(float max, float sum) const {
    return sum != 0.0f ? exp2f(max - base) / total : 0.0f;  // (total >= this warp's term > 0, or NaN)
  }
  __device__ __forceinline__ float lse() const { return core::lse_natural(base, total); }
};
__device__ __forceinline__ MergedWarps merge_warps(const float (&max)[kWarps], const float (&sum)[kWarps],
                                                   float sink_log2) {
  float m = sink_log2;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = sum[w] > 0.0f ? fmaxf(m, max[w]) : m;
  const float base = core::safe_max(m);
  float total = sink_log2 == -std::numeric_limits<float>::infinity() ? 0.0f : exp2f(sink_log2 - base);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += sum[w] != 0.0f ? exp2f(max[w] - base) * sum[w] : 0.0f;
  return {base, total};
}

// Writes the CTA's row from the warps' states in `shared` (max, sum, acc of each warp): first one
// thread merges them (each warp's weight, the lse, where the row goes), then every thread takes
// columns, so the per-element work is a weighted sum and a store. NaN when `bad` (a block-table
// entry out of range).
template <typename Element, int kHeadDim>
__device__ __forceinline__ void store_merged(const DecodeParams& p, MergeShared<kHeadDim>& shared, int64_t b, int hk,
                                             int row, int split, bool bad) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const int me = static_cast<int>(threadIdx.x);
  if (me == 0) {
    const MergedWarps merged = merge_warps(shared.max, shared.sum, row_sink_log2(p, hk, row, split));
#pragma unroll
    for (int w = 0; w < kWarps; ++w) shared.weight[w] = bad ? kNaN : merged.share(shared.max[w], shared.sum[w]);
    shared.lse = bad ? kNaN : merged.lse();
    const RowDestination d = row_destination(p, b, hk, row, split);
    shared.out_at = d.out_at;
    shared.lse_at = d.lse_at;
  }
  __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster_merge) {
    merge_cluster<Element>(p, shared);
    return;
  }
#endif
  for (int c = me; c < p.shape.head_dim; c += kThreads) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += shared.acc[w][c] * shared.weight[w];
    if (writes_output(p)) {
      static_cast<Element*>(p.out.data)[shared.out_at + c] = static_cast<Element>(o);
    } else {
      p.partial_out[shared.out_at + c] = o;
    }
  }
  if (me == 0 && shared.lse_at >= 0) {
    (writes_output(p) ? p.lse.data : p.partial_lse)[shared.lse_at] = shared.lse;
  }
}

// The combine kernel's shared memory: the splits' weights, the block reductions' warp values,
// and the column sums of the thread groups that share a row's splits. 16-byte column chunks:
// head_dim % 8 == 0, so a chunk never crosses the row's end.
struct alignas(16) Float4 {
  float x[4];
};
template <int kHeadDim>
struct CombineShared {
  static constexpr int kChunks = kHeadDim / 4;        // a row's chunks at the bucket's width
  static constexpr int kGroups = kThreads / kChunks;  // threads that share a chunk's splits
  float weight[kThreads];
  float warp_value[kWarps];
  Float4 sums[kGroups][kChunks];
};

// `x` reduced with `op` over the CTA's threads (every thread gets the result).
template <class Op>
__device__ __forceinline__ float block_reduce(float x, float (&warp_value)[kWarps], Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if (threadIdx.x % 32 == 0) warp_value[threadIdx.x / 32] = x;
  __syncthreads();
  float r = warp_value[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = op(r, warp_value[w]);
  __syncthreads();  // (warp_value is free again)
  return r;
}

// Grid (batch * heads_q * seqlen_q), a CTA per (b, h, i) row: its splits' normalised outputs
// weighted by exp(lse_split - lse). Splits that saw no key (lse -inf) weigh 0; a row no split saw
// gives 0 and -inf; a NaN split gives NaN. The splits are a short latency-bound read (from L2),
// so every load is issued before any is used: thread t holds split t's lse, and the threads
// sharing a column chunk take every kGroups-th split, the first kEarlySplits of them loaded with
// the lse, before the weights are known (one round trip to L2 instead of two).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kThreads) combine_kernel(const DecodeParams p) {
  static_assert(kMaxSplits <= kThreads, "a thread per split's lse");
  using Shared = CombineShared<kHeadDim>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  extern __shared__ __align__(16) char smem_raw[];
  auto& shared = *reinterpret_cast<Shared*>(smem_raw);
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.seqlen_q;
  const int64_t row = blockIdx.x;
  const int me = static_cast<int>(threadIdx.x);

  const int chunk = me % Shared::kChunks, group = me / Shared::kChunks;
  const int c0 = 4 * chunk;
  const bool column = c0 < p.shape.head_dim;
  const float* src = p.partial_out + row * p.shape.head_dim + c0;
  const int64_t split_stride = rows * p.shape.head_dim;
  constexpr int kEarlySplits = 4;
  Float4 early[kEarlySplits];

  wait_for_prerequisite_grid();  // the decode kernel's partials
  const float split_lse = me < p.num_splits ? p.partial_lse[me * rows + row] : kNegInf;
#pragma unroll
  for (int k = 0; k < kEarlySplits; ++k) {
    const int s = group + k * Shared::kGroups;
    early[k] = column && s < p.num_splits ? *reinterpret_cast<const Float4*>(src + s * split_stride) : Float4{};
  }
  const bool nan = __syncthreads_or(std::isnan(split_lse));
  const float base =
      core::safe_max(block_reduce(split_lse, shared.warp_value, [](float a, float b) { return fmaxf(a, b); }));
  const float e = expf(split_lse - base);  // 0 for an empty split or a thread past the splits
  const float sum = block_reduce(nan ? 0.0f : e, shared.warp_value, [](float a, float b) { return a + b; });
  const float lse = nan ? std::numeric_limits<float>::quiet_NaN() : sum > 0.0f ? base + logf(sum) : kNegInf;
  shared.weight[me] = sum > 0.0f ? e / sum : 0.0f;
  __syncthreads();

  Float4 acc = {};
  if (!nan && sum > 0.0f && column) {
#pragma unroll
    for (int k = 0; k < kEarlySplits; ++k) {
      const int s = group + k * Shared::kGroups;
      const float w = s < p.num_splits ? shared.weight[s] : 0.0f;  // (0: an empty split, whose partial is 0)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc.x[i] += w * early[k].x[i];
    }
#pragma unroll 4
    for (int s = group + kEarlySplits * Shared::kGroups; s < p.num_splits; s += Shared::kGroups) {
      const Float4 x = *reinterpret_cast<const Float4*>(src + s * split_stride);
      const float w = shared.weight[s];  // 0 for an empty split (its partial is 0)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc.x[i] += w * x.x[i];
    }
  }
  shared.sums[group][chunk] = acc;
  __syncthreads();

  const int64_t i = row % p.shape.seqlen_q, h = (row / p.shape.seqlen_q) % p.shape.heads_q,
                b = row / (p.shape.seqlen_q * p.shape.heads_q);
  if (group == 0 && c0 < p.shape.head_dim) {
#pragma unroll
    for (int g = 1; g < Shared::kGroups; ++g) {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc.x[k] += shared.sums[g][chunk].x[k];
    }
    auto* dst =
        static_cast<Element*>(p.out.data) + b * p.out.batch_stride + i * p.out.row_stride + h * p.out.head_stride + c0;
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[k] = static_cast<Element>(nan ? lse : acc.x[k]);
  }
  if (me == 0 && p.lse.data != nullptr) {
    p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
  }
}

}  // namespace flashattn::cuda::decode

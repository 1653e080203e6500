// KV-cache decoding: few query rows against a long cache is a memory-bound read of K
// and V, so the kernels are shaped for bandwidth. This file: the append, the CUDA-core decode
// kernel (dispatched for one query row a KV group; with more, the tensor-core kernel of
// decode_mma_kernel.cuh, whose per-key cost does not grow with the rows) and the combine.
//
//   append_kernel   k_new / v_new into the cache (keys rotated), one warp per (token, kv head)
//   decode_kernel   split-KV attention for one query row: CTA (split, kv head x row, batch); a
//                   lane group of kLanesPerKey lanes holds one key row (16 bytes a lane), every
//                   lane keeps the query row and its accumulators for its 16 bytes of columns.
//                   A step is kKeysPerStep keys per lane group; each lane copies its steps' K
//                   and V chunks into its own shared-memory slots with cp.async, kOneRowStages - 1
//                   steps ahead of the one it computes, so the loads stay in flight through the
//                   arithmetic (no other thread reads a lane's slots: no barrier). Online softmax
//                   per group, groups merged by shuffles, warps through shared memory
//   combine_kernel  the splits' (out, lse) merged exactly, a CTA per row; all-empty rows give 0
//                   and -inf
//
// The code uses the CUDA built-ins and, under __CUDA_ARCH__, cp.async through inline PTX with a
// plain-copy host version beside it (no CuTe), so tests/gpu's emulation runs it on CPU threads.
#pragma once

#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <algorithm>

#include "../../core/mask.hpp"
#include "../../core/score.hpp"
#include "../../core/softmax.hpp"
#include "decode_params.hpp"
#include "sequence_indices.cuh"

namespace flashattn::cuda::decode {

inline constexpr int kVec = 8;  // elements of one 16-byte load
// Keys a lane group takes per step, and the steps in flight (the pipeline's depth: the shared
// memory of kOneRowCtasPerSm CTAs fits an H100's SM).
inline constexpr int kKeysPerStep = 4;
inline constexpr int kOneRowStages = 3;

// A lane group holds one key row: the head-dim bucket's 16-byte vectors, one a lane.
template <int kHeadDim>
inline constexpr int kLanesPerKey = kHeadDim / kVec;
template <int kHeadDim>
inline constexpr int kKeysPerWarp = 32 / kLanesPerKey<kHeadDim>;

template <typename Element>
struct alignas(16) Vec {
  Element e[kVec];
};

template <typename Element>
__device__ __forceinline__ void to_float(const Vec<Element>& v, float (&f)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = static_cast<float>(v.e[i]);
}

// 16 bytes of a K or V row as loaded: 8 elements in 4 words, converted by bit operations (bf16)
// or the half-to-float instruction (fp16), not element by element through the 16-bit type.
struct alignas(16) Chunk {
  uint32_t w[4];
};

__device__ __forceinline__ float bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// cp.async: 16 bytes from global to shared memory without passing through registers, cached in
// L2 only (the cache is read once); invalid copies read nothing and write zeros.
__device__ __forceinline__ void copy_async(Chunk* dst, const void* src, bool valid) {
#ifdef __CUDA_ARCH__
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
  if (valid) {
    std::memcpy(dst, src, sizeof(Chunk));
  } else {
    *dst = Chunk{};
  }
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most `kPending` of this thread's committed groups are still in flight. (Every
// asm here clobbers "memory": the compiler must not move shared-memory reads across them.)
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

template <typename Element>
__device__ __forceinline__ void to_float(const Chunk& c, float (&f)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      f[2 * i] = bits_to_float(c.w[i] << 16);
      f[2 * i + 1] = bits_to_float(c.w[i] & 0xffff0000u);
    } else {
      f[2 * i] = static_cast<float>(Element::bitcast(static_cast<uint16_t>(c.w[i] & 0xffffu)));
      f[2 * i + 1] = static_cast<float>(Element::bitcast(static_cast<uint16_t>(c.w[i] >> 16)));
    }
  }
}

template <typename Element>
__device__ __forceinline__ float table_value(const RotaryParams& r, const void* table, int64_t stride, int64_t pos,
                                             int64_t pair) {
  const int64_t at = pos * stride + pair;
  return r.fp32_tables ? static_cast<const float*>(table)[at]
                       : static_cast<float>(static_cast<const Element*>(table)[at]);
}

// a * b + c * d with both products rounded, never fused (the compiler would contract one into
// an FMA): exactly what the CPU backend computes. Rotated values are rounded to the element
// type, where one fp32 ulp can flip a rounding; a flipped q element moved a GPU lse by 5e-4.
__device__ __forceinline__ float mul_add(float a, float b, float c, float d) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(__fmul_rn(a, b), __fmul_rn(c, d));
#else
  return a * b + c * d;
#endif
}

// x: the 8 features [c0, c0 + 8) of a row at `row` (element pointer to feature 0), rotated to
// position `pos` in fp32 (features past rotary.dim unchanged). Non-interleaved pairs read the
// partner features from memory (their 16-byte vector, since dim % 16 == 0).
template <typename Element>
__device__ __forceinline__ void rotate(const RotaryParams& r, const Element* row, int c0, int64_t pos,
                                       float (&x)[kVec]) {
  if (c0 >= r.dim) return;
  const int half = static_cast<int>(r.dim / 2);
  if (r.interleaved) {
#pragma unroll
    for (int i = 0; i < kVec; i += 2) {
      const int pair = (c0 + i) / 2;
      const float c = table_value<Element>(r, r.cos, r.cos_row_stride, pos, pair);
      const float s = table_value<Element>(r, r.sin, r.sin_row_stride, pos, pair);
      const float x1 = x[i], x2 = x[i + 1];
      x[i] = mul_add(x1, c, -x2, s);
      x[i + 1] = mul_add(x1, s, x2, c);
    }
    return;
  }
  const bool first_half = c0 < half;
  float partner[kVec];
  to_float(*reinterpret_cast<const Vec<Element>*>(row + (first_half ? c0 + half : c0 - half)), partner);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int pair = (first_half ? c0 : c0 - half) + i;
    const float c = table_value<Element>(r, r.cos, r.cos_row_stride, pos, pair);
    const float s = table_value<Element>(r, r.sin, r.sin_row_stride, pos, pair);
    // (x1, x2) -> (x1 c - x2 s, x1 s + x2 c): this lane holds x1 (first half) or x2.
    x[i] = first_half ? mul_add(x[i], c, -partner[i], s) : mul_add(partner[i], s, x[i], c);
  }
}

template <typename Element>
__device__ __forceinline__ Vec<Element> from_float(const float (&f)[kVec]) {
  Vec<Element> v;
#pragma unroll
  for (int i = 0; i < kVec; ++i) v.e[i] = static_cast<Element>(f[i]);
  return v;
}

// Programmatic dependent launch (sm90 on): the combine kernel is launched while the decode CTAs
// still run (it is let in once every decode CTA has started) and waits for their results at its
// start, so its launch latency hides behind them. Below sm90 both are no-ops and the launcher
// orders the kernels plainly.
__device__ __forceinline__ void let_dependent_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Grid (seqlen_new, heads_kv, batch), one warp: lane l writes features [8 l, 8 l + 8). A
// sequence with an index out of range (sequence_indices_ok, its block) writes nothing.
template <typename Element>
__global__ void __launch_bounds__(32) append_kernel(const DecodeParams p) {
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int c0 = static_cast<int>(threadIdx.x) * kVec;
  const SequenceIndices seq = sequence_indices(p.cache, b);
  if (!sequence_indices_ok(p, seq)) {
    report_sequence_fault(p, seq, b);
    return;
  }
  if (c0 >= p.shape.head_dim) return;
  const int64_t pos = seq.used + t;
  if (p.cache.paged() &&
      !p.cache.entry_ok(p.cache.block_table[b * p.cache.block_table_stride + pos / p.cache.page_size])) {
    report_block_fault(p, b, pos, pos + 1);
    return;
  }
  const auto* k_row = static_cast<const Element*>(p.k_new.data) + b * p.k_new.batch_stride + t * p.k_new.row_stride +
                      h * p.k_new.head_stride;
  const auto* v_row = static_cast<const Element*>(p.v_new.data) + b * p.v_new.batch_stride + t * p.v_new.row_stride +
                      h * p.v_new.head_stride;
  float x[kVec];
  to_float(*reinterpret_cast<const Vec<Element>*>(k_row + c0), x);
  if (p.rotary.dim > 0) rotate(p.rotary, k_row, c0, pos, x);
  auto* k_dst = static_cast<Element*>(p.k_cache_out.data) + p.cache.position_offset(p.k_cache_out, b, pos, h);
  auto* v_dst = static_cast<Element*>(p.v_cache_out.data) + p.cache.position_offset(p.v_cache_out, b, pos, h);
  *reinterpret_cast<Vec<Element>*>(k_dst + c0) = from_float<Element>(x);
  *reinterpret_cast<Vec<Element>*>(v_dst + c0) = *reinterpret_cast<const Vec<Element>*>(v_row + c0);
}

// The keys [begin, end) split `split` of `splits` attends to, of the range [lo, hi), in whole
// steps of kStep keys (the last split takes the rest; a split past the range is empty).
struct KeyRange {
  int begin, end;
};
template <int kStep>
__device__ __forceinline__ KeyRange split_range(int lo, int hi, int split, const core::FastDivmod& splits) {
  const int n = hi > lo ? hi - lo : 0;
  // ceil(n / splits) rounded up to whole steps (n < 2^31 - 2^16: no overflow). (It was
  // n / splits + one step, rounded down: a whole step more than needed wherever n / splits was
  // already whole steps, e.g. 3 steps a CTA instead of 2 for 1024 keys in 8 splits.)
  const auto per_split = static_cast<int>(splits.div(static_cast<uint32_t>(n) + splits.divisor - 1));
  const int64_t chunk = (per_split + kStep - 1) / kStep * kStep;
  const int64_t begin = lo + split * chunk;
  return {static_cast<int>(begin < hi ? begin : hi), static_cast<int>(begin + chunk < hi ? begin + chunk : hi)};
}

// Where this lane's 16 bytes of each key's K and V rows are, for one (sequence, KV head, column
// c0) and the keys of a split: the cache-row rule of core::CacheRows with everything fixed per CTA
// hoisted out (batch entry, leftpad, head, column). Contiguous, slot t's rows are a fixed
// distance from the step's first and a step moves every slot by the same distance: pointer
// additions. Paged, a key's block is read from block_table a step ahead (prefetch) and checked
// where the copy uses it (an instruction reading it at the read would wait for the load there),
// so the table's load does not delay the K / V loads; the page split is a multiply and shift
// (FastDivmod; positions are 32-bit, the dispatch bounds them).
template <typename Element, bool kPaged, int kSlots, int kSlotStride, int kStepKeys>
struct KeyRows {
  const Element* k;  // contiguous: slot 0 of the current step; paged: head + column
  const Element* v;
  int64_t k_row, v_row;      // row strides
  int64_t k_block, v_block;  // block strides (paged)
  const int32_t* table;      // the sequence's block_table row (paged)
  core::FastDivmod page;
  int64_t blocks;          // paged: entries in [0, blocks) are valid
  int first;               // the sequence's first position (leftpad)
  int block[kSlots];       // paged: the entries of the current step's keys, as read (unchecked)
  bool bad_block = false;  // paged: an entry read was out of range (block 0 read instead)

  __device__ __forceinline__ KeyRows(const DecodeParams& p, const SequenceIndices& seq, int64_t b, int64_t hk, int c0,
                                     int key0) {
    const CacheParams& c = p.cache;
    first = static_cast<int>(seq.first);
    k_row = p.k.row_stride;
    v_row = p.v.row_stride;
    k = static_cast<const Element*>(p.k.data) + hk * p.k.head_stride + c0;
    v = static_cast<const Element*>(p.v.data) + hk * p.v.head_stride + c0;
    if constexpr (kPaged) {
      k_block = p.k.batch_stride;
      v_block = p.v.batch_stride;
      table = c.block_table + b * c.block_table_stride;
      page = c.page;
      blocks = c.entries;
    } else {
      const int64_t pos = first + int64_t{key0};
      k += seq.entry * p.k.batch_stride + pos * k_row;
      v += seq.entry * p.v.batch_stride + pos * v_row;
    }
  }
  // Paged: reads the blocks of keys key0 + t * kSlotStride that are below `end`.
  __device__ __forceinline__ void prefetch(int key0, int end) {
    if constexpr (kPaged) {
#pragma unroll
      for (int t = 0; t < kSlots; ++t) {
        const int j = key0 + t * kSlotStride;
        if (j < end) block[t] = table[page.div(static_cast<uint32_t>(first + j))];
      }
    }
  }
  // Copies slot t's rows (key j = key0 + t * kSlotStride of the current step) to k_dst / v_dst;
  // zeros where j is not below `end` (then the head's row 0 stands in as a valid address).
  // Paged, a block-table entry out of range reads block 0 and sets bad_block.
  __device__ __forceinline__ void copy(int t, int j, int end, Chunk* k_dst, Chunk* v_dst) {
    const bool valid = j < end;
    const Element *k_src = k, *v_src = v;
    if constexpr (kPaged) {
      uint32_t row;
      page.divmod(static_cast<uint32_t>(first + j), &row);
      const bool ok = block[t] >= 0 && block[t] < blocks;
      bad_block |= valid && !ok;
      if (valid) {
        k_src += (ok ? block[t] : 0) * k_block + static_cast<int64_t>(row) * k_row;
        v_src += (ok ? block[t] : 0) * v_block + static_cast<int64_t>(row) * v_row;
      }
    } else if (valid) {
      k_src += t * kSlotStride * k_row;
      v_src += t * kSlotStride * v_row;
    }
    copy_async(k_dst, k_src, valid);
    copy_async(v_dst, v_src, valid);
  }
  __device__ __forceinline__ void next_step() {
    if constexpr (!kPaged) {
      k += kStepKeys * k_row;
      v += kStepKeys * v_row;
    }
  }
};

// The kernel's dynamic shared memory: the pipeline's slots (stage, slot, thread: a warp's
// 16-byte reads are contiguous), then, after the key loop, the warps' partial states of the row
// to merge in the same bytes. The launch (and the emulated tests) size it by decode_smem_bytes.
struct PipelineShared {
  Chunk k[kOneRowStages][kKeysPerStep][kThreads];
  Chunk v[kOneRowStages][kKeysPerStep][kThreads];
};
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
template <int kHeadDim>
inline constexpr size_t decode_smem_bytes = std::max(sizeof(PipelineShared), sizeof(MergeShared<kHeadDim>));

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

// A row's (max, sum) states of the CTA's warps (each over its own keys) merged: the common base
// and the total of the sums rescaled to it; a warp that saw no key (sum 0) counts nothing. A
// warp's share of the row's output is share(its max, its sum). A warp whose scores met a NaN
// (sum NaN; fmaxf left the NaN out of its max) makes the total, every share and the lse NaN:
// the row met a NaN (docs/CONVENTIONS.md, "NaN"), not a key that counts for nothing.
struct MergedWarps {
  float base, total;
  __device__ __forceinline__ float share(float max, float sum) const {
    return sum != 0.0f ? exp2f(max - base) / total : 0.0f;  // (total >= this warp's term > 0, or NaN)
  }
  __device__ __forceinline__ float lse() const { return core::lse_natural(base, total); }
};
__device__ __forceinline__ MergedWarps merge_warps(const float (&max)[kWarps], const float (&sum)[kWarps]) {
  float m = -std::numeric_limits<float>::infinity();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = sum[w] > 0.0f ? fmaxf(m, max[w]) : m;
  const float base = core::safe_max(m);
  float total = 0.0f;
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
    const MergedWarps merged = merge_warps(shared.max, shared.sum);
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

// One CTA: row `row` of KV head hk's group in batch entry b (query token row / group, head
// hk * group + row % group), keys of one split. kPaged: the caches are paged (block_table), else
// contiguous. The key loop is the kernel's cost: per key it does the loads, the dot product's
// shuffles and the softmax, nothing else (masking only on the steps at the edges of what the row
// sees; 32-bit key arithmetic).
template <typename Element, int kHeadDim, bool kPaged>
__global__ void __launch_bounds__(kThreads, kOneRowCtasPerSm) decode_kernel(const DecodeParams p) {
  constexpr int kLanes = kLanesPerKey<kHeadDim>;
  constexpr int kKeysWarp = kKeysPerWarp<kHeadDim>;
  constexpr int kKeys = kKeysPerStep;
  constexpr int kStepKeys = kWarps * kKeysWarp * kKeys;  // keys a CTA step covers
  static_assert(kLanes * kVec == kHeadDim && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  const int split = static_cast<int>(blockIdx.x);
  const int64_t b = blockIdx.z;
  // (32-bit row arithmetic: the dispatch bounds rows and heads by 2^31.)
  uint32_t row_in_group;
  const int hk = static_cast<int>(p.row_blocks.divmod(blockIdx.y, &row_in_group));
  const int row = static_cast<int>(row_in_group);         // (rows_per_cta is 1)
  if (row >= p.shape.seqlen_q * p.group.divisor) return;  // seqlen_q 0: a grid of one CTA, no row
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int key_in_warp = lane / kLanes, c0 = (lane % kLanes) * kVec;
  const bool active = c0 < p.shape.head_dim;

  let_dependent_grid_launch();
  const SequenceIndices seq = sequence_indices(p.cache, b);
  if (!sequence_indices_ok(p, seq)) {  // (uniform over the CTA) a NaN row, nothing read
    report_sequence_fault(p, seq, b);
    store_nan_rows<Element, kHeadDim, 1>(p, b, hk, row, split);
    return;
  }
  const int64_t used = seq.used;
  const int seqlen_k = static_cast<int>(used + p.cache.seqlen_new - seq.first);
  const core::Mask mask{p.shape.seqlen_q, seqlen_k, p.window.left, p.window.right};
  // The row is query i of head h (32-bit: the dispatch bounds seqlen_q, heads and keys by 2^31).
  uint32_t head_in_group;
  const int i = static_cast<int>(p.group.divmod(static_cast<uint32_t>(row), &head_in_group));
  const int h = hk * static_cast<int>(p.group.divisor) + static_cast<int>(head_in_group);
  const float slope = p.score.alibi != nullptr
                          ? p.score.alibi[b * p.score.alibi_batch_stride + h * p.score.alibi_head_stride] *
                                static_cast<float>(core::kLog2e)
                          : 0.0f;
  const KeyRange keys = split_range<kStepKeys>(static_cast<int>(mask.key_begin(i)),
                                               static_cast<int>(mask.key_end(i + 1)), split, p.split_divisor);
  // Steps inside [full_begin, full_end) see every key: they skip the per-element mask.
  const int full_begin = static_cast<int>(mask.key_begin(i));
  const int row_end = static_cast<int>(mask.key_end(i + 1));
  const int full_end = row_end < keys.end ? row_end : keys.end;

  float acc[kVec], row_max = kNegInf, row_sum = 0.0f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) acc[e] = 0.0f;

  const bool softcap = p.score.softcap_log2 != 0.0f, alibi = p.score.alibi != nullptr, plain = !softcap && !alibi;
  const float scale_log2 = p.score.scale_log2, softcap_log2 = p.score.softcap_log2, tanh_scale = p.score.tanh_scale;
  // Key of slot t in a step: consecutive keys across the warps' lane groups, so a warp reads
  // neighbouring rows. Lanes past head_dim (a head dim below its bucket) read column 0 (their
  // q is 0, their output columns are not written).
  const int slot0 = warp * kKeysWarp + key_in_warp;
  constexpr int kSlotStride = kWarps * kKeysWarp;
  KeyRows<Element, kPaged, kKeys, kSlotStride, kStepKeys> rows(p, seq, b, hk, active ? c0 : 0, keys.begin + slot0);
  extern __shared__ __align__(16) char smem_raw[];
  auto& pipe = *reinterpret_cast<PipelineShared*>(smem_raw);
  const int me = static_cast<int>(threadIdx.x);
  // Issues the copies of the step at `issue` (keys past the split's end fill zeros) into
  // `stage`, one commit group per step, even an empty one, so the wait count stays fixed. A step
  // past the split's end (the pipeline's last kOneRowStages - 1) issues no copies: its slots are
  // never read, and a short split's whole prologue was such steps.
  int issue = keys.begin;
  auto issue_step = [&](int stage) {
    if (issue < keys.end) {
#pragma unroll
      for (int t = 0; t < kKeys; ++t) {
        rows.copy(t, issue + slot0 + t * kSlotStride, keys.end, &pipe.k[stage][t][me], &pipe.v[stage][t][me]);
      }
    }
    copy_async_commit();
    rows.next_step();
    issue += kStepKeys;
    rows.prefetch(issue + slot0, keys.end);
  };
  rows.prefetch(keys.begin + slot0, keys.end);
#pragma unroll
  for (int stage = 0; stage < kOneRowStages - 1; ++stage) issue_step(stage);

  // q, rotated and in fp32, this lane's 8 features (loaded after the first copies are issued:
  // its latency overlaps theirs).
  float q[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) q[e] = 0.0f;
  if (active) {
    const auto* q_row =
        static_cast<const Element*>(p.q.data) + b * p.q.batch_stride + i * p.q.row_stride + h * p.q.head_stride;
    to_float(*reinterpret_cast<const Vec<Element>*>(q_row + c0), q);
    if (p.rotary.dim > 0) {
      // Rounded to the element type, as the CPU backend and flash_attn keep rotated q.
      rotate(p.rotary, q_row, c0, used + (p.rotary.per_row_q ? i : 0), q);
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[e] = static_cast<float>(static_cast<Element>(q[e]));
    }
  }

  int stage = 0;
  for (int step = keys.begin; step < keys.end; step += kStepKeys) {
    issue_step(stage == 0 ? kOneRowStages - 1 : stage - 1);  // the slots computed last step
    copy_async_wait<kOneRowStages - 1>();
    Chunk k_vec[kKeys], v_vec[kKeys];
#pragma unroll
    for (int t = 0; t < kKeys; ++t) {
      k_vec[t] = pipe.k[stage][t][me];
      v_vec[t] = pipe.v[stage][t][me];
    }
    stage = stage + 1 == kOneRowStages ? 0 : stage + 1;
    // The step's scores. Most steps take the plain path: no score modifier, every key seen. It
    // is a separate (uniformly branched) copy of the code, since the compiler would otherwise
    // predicate the modifiers' and the mask's instructions into every step.
    float s[kKeys];
    auto scores = [&](auto generic) {
#pragma unroll
      for (int t = 0; t < kKeys; ++t) {
        const int j = step + slot0 + t * kSlotStride;
        float k[kVec];
        to_float<Element>(k_vec[t], k);
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot += q[e] * k[e];
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        if constexpr (decltype(generic)::value) {
          float score = softcap ? softcap_log2 * tanhf(dot * tanh_scale) : dot * scale_log2;
          if (alibi) score += core::alibi_bias(slope, i, j, mask.seqlen_q, seqlen_k);
          s[t] = j < keys.end && mask.visible(i, j) ? score : kNegInf;
        } else {
          s[t] = dot * scale_log2;
        }
      }
    };
    if (plain && step >= full_begin && step + kStepKeys <= full_end) {
      scores(std::false_type{});
    } else {
      scores(std::true_type{});
    }
    // Online softmax over the step's keys, then O += P V.
    float m = row_max;
#pragma unroll
    for (int t = 0; t < kKeys; ++t) m = fmaxf(m, s[t]);
    const float factor = core::rescale_factor(row_max, m);
    const float base = core::safe_max(m);
    row_max = m;
    row_sum *= factor;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] *= factor;
#pragma unroll
    for (int t = 0; t < kKeys; ++t) {
      const float prob = exp2f(s[t] - base);
      row_sum += prob;
      float v[kVec];
      to_float<Element>(v_vec[t], v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += prob * v[e];
    }
  }

  // Merge the lane groups of a warp (same columns, other keys), then the warps.
#pragma unroll
  for (int offset = kLanes; offset < 32; offset *= 2) {
    core::SoftmaxState<float> mine{row_max, row_sum};
    const core::SoftmaxState<float> other{__shfl_xor_sync(0xffffffffu, row_max, offset),
                                          __shfl_xor_sync(0xffffffffu, row_sum, offset)};
    float fa, fb;
    mine = core::merge(mine, other, &fa, &fb);
    row_max = mine.max;
    row_sum = mine.sum;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = acc[e] * fa + __shfl_xor_sync(0xffffffffu, acc[e], offset) * fb;
  }
  // The pipeline's last (empty) copies land before its bytes take the merge. A block-table entry
  // out of range anywhere in the CTA makes its rows NaN.
  copy_async_wait<0>();
  const bool bad_block = __syncthreads_or(rows.bad_block);
  if (bad_block) report_block_fault(p, b, seq.first + keys.begin, seq.first + keys.end);
  auto& shared = *reinterpret_cast<MergeShared<kHeadDim>*>(smem_raw);
  if (key_in_warp == 0) {
    if (lane == 0) {
      shared.max[warp] = row_max;
      shared.sum[warp] = row_sum;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) shared.acc[warp][c0 + e] = acc[e];
  }
  __syncthreads();

  store_merged<Element, kHeadDim>(p, shared, b, hk, row, split, bad_block);
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

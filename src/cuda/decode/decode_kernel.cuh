// KV-cache decoding: few query rows against a long cache is a memory-bound read of K
// and V, so the kernels are shaped for bandwidth. This file: the append, the CUDA-core decode
// kernel (dispatched for one query row a KV group; with more, the tensor-core kernel of
// decode_mma_kernel.cuh, whose per-key cost does not grow with the rows), and through
// decode_merge.cuh the combine; decode_blocks.cuh holds the pieces both kernels build on.
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
#include "../../core/variant.hpp"
#include "../../core/softmax.hpp"
#include "decode_blocks.cuh"
#include "decode_merge.cuh"
#include "decode_params.hpp"
#include "sequence_indices.cuh"

namespace flashattn::cuda::decode {

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
// to merge in the same bytes (MergeShared, decode_merge.cuh). The launch (and the emulated tests)
// size it by decode_smem_bytes.
struct PipelineShared {
  Chunk k[kOneRowStages][kKeysPerStep][kThreads];
  Chunk v[kOneRowStages][kKeysPerStep][kThreads];
};
template <int kHeadDim>
inline constexpr size_t decode_smem_bytes = std::max(sizeof(PipelineShared), sizeof(MergeShared<kHeadDim>));

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
  const float slope = alibi_slope_log2_of(p.score, b, h);
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

}  // namespace flashattn::cuda::decode

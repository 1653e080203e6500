// KV-cache decoding on tensor cores for packed query rows: when a KV group has several
// query rows (GQA heads, several query tokens), the CUDA-core kernel's per-key arithmetic (a dot
// product, its shuffle reduction and an exp per row) outgrows the loads, and with 4 rows its
// registers leave an SM 8 warps. Here the group's rows are one m16 tile (up to 16 rows; unused
// rows are zeros that cost nothing, the MMAs are not the bound) and every warp runs FA2's step
// on 16 keys: S = Q K^T (mma.sync m16n8k16, fp32), the online softmax on S's fragments, then
// O += P V with P from S's registers. So a warp-step of 16 keys is 4 kHeadDim / 16 MMAs, a few
// shuffles and 8 exponentials per lane, whatever the row count.
//
//   CTA (split, kv head x row block, batch), 4 warps; warp w takes keys [step + 16 w, + 16) of
//   each CTA step of 64. A warp copies its K and V tiles (16 x kHeadDim) with cp.async into its
//   own swizzled shared-memory slots, kStages - 1 steps ahead (no CTA barrier in the loop), and
//   reads them with ldmatrix (.trans for V). q (rotated, rounded to the element type) is staged
//   once through shared memory. After the loop each warp weighs its O by its share of each row
//   (from all warps' (max, sum) in shared memory) and the weighted tiles are summed by columns;
//   with several splits the combine kernel merges the partials.
//
// A key masked for some of the tile's rows (new tokens under the causal mask, a window's edge)
// gets probability 0 in them, and 0 times a NaN (or inf) value element is NaN on the tensor
// cores: rows whose O holds a NaN are recomputed at the end, key by key without the terms of
// probability 0 (repair_rows; ../common/careful_rows.cuh), so a NaN reaches only the rows that
// see its key (docs/CONVENTIONS.md, "NaN").
//
// The tensor-core operations come from Ops (TensorOps: inline PTX), so the emulated test can run
// the kernel on CPU threads with its own.
#pragma once

#include "../common/careful_rows.cuh"
#include "../pack_pair.cuh"
#include "decode_kernel.cuh"

namespace flashattn::cuda::decode {

inline constexpr int kMmaKeys = 16;  // keys of a warp-step: two n8 tiles of S, one k16 step of P V
// Pipeline depth by head-dim bucket: MmaShared of mma_ctas_per_sm CTAs fits an H100's SM (d64:
// its 4 stages with a third CTA would too, but 170 registers a thread spill).
template <int kHeadDim>
inline constexpr int kMmaStages = kHeadDim <= 64    ? 4
                                  : kHeadDim <= 128 ? 3
                                                    : 2;

// mma.sync m16n8k16 (fp32 accumulators) and ldmatrix .x4, sm80 on.
template <typename Element>
struct TensorOps {
  // d += a b: a the 16 x 16 A fragment, (b0, b1) the 16 x 8 B fragment.
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef __CUDA_ARCH__
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    (void)d, (void)a, (void)b0, (void)b1;
#endif
  }
  // Lane l gives the address of row l % 8 of 8 x 8 matrix l / 8; register i receives matrix i's
  // (row l / 4, columns 2 (l % 4) + {0, 1}), or with kTransposed (rows 2 (l % 4) + {0, 1}, column
  // l / 4). (volatile, with a memory clobber: it must stay after the cp.async wait.)
  template <bool kTransposed>
  __device__ __forceinline__ static void ldsm_x4(const Chunk* row, uint32_t (&r)[4]) {
#ifdef __CUDA_ARCH__
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if constexpr (kTransposed) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(at)
                   : "memory");
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(at)
                   : "memory");
    }
#else
    (void)row, (void)r;
#endif
  }
  __device__ __forceinline__ static void sync_warp() {
#ifdef __CUDA_ARCH__
    __syncwarp();
#endif
  }
  __device__ __forceinline__ static int shfl(int x, int lane) {
#ifdef __CUDA_ARCH__
    return __shfl_sync(0xffffffffu, x, lane);
#else
    (void)lane;
    return x;
#endif
  }
};

// A 16 x kHeadDim tile of 16-byte chunks, row-major, chunk c of row r stored at c ^ (r % 8) of
// its row: the 8 rows an ldmatrix reads (one chunk column) fall in 8 different bank groups.
template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * (kHeadDim / kVec) + (chunk ^ (row & 7));
}

// The epilogue's rows: every warp's O, already weighted by its share of each row, summed by
// columns. A row is padded by 8 floats so that the quads writing rows g and g + 4 (8 floats
// each) fall in other banks: a warp's 64-bit stores take the two wavefronts they need.
template <int kHeadDim>
struct MmaMerge {
  static constexpr int kRowFloats = kHeadDim + 8;
  float acc[kWarps][kMmaRows][kRowFloats];
  float lse[kMmaRows];
  int64_t out_at[kMmaRows];  // the row's offset in out (one split) or partial_out
  int64_t lse_at[kMmaRows];  // its offset in lse or partial_lse; -1: none
};

template <int kHeadDim>
struct MmaShared {
  static constexpr int kTile = kMmaRows * kHeadDim / kVec;  // chunks of a 16-row tile
  Chunk q[kTile];
  // The warps' softmax states of each row, apart from the pipeline's bytes: written before the
  // barrier after which those are free.
  float row_max[kMmaRows][kWarps], row_sum[kMmaRows][kWarps];
  union {
    struct {
      Chunk k[kMmaStages<kHeadDim>][kWarps][kTile];
      Chunk v[kMmaStages<kHeadDim>][kWarps][kTile];
    } pipe;
    MmaMerge<kHeadDim> merge;  // after the key loop
  };
};

// The CTA's rows and keys: rows [row0, row0 + 16) of KV head hk's group in batch entry b (query
// tokens i_lo .. i_hi), the keys of its split (split_range over what those rows see).
struct RowBlock {
  int hk, row0, total_rows, i_lo, i_hi;
  __device__ __forceinline__ static RowBlock of(const DecodeParams& p) {
    // (32-bit row arithmetic: the dispatch bounds rows and heads by 2^31.)
    uint32_t block_of_rows;
    RowBlock r;
    r.hk = static_cast<int>(p.row_blocks.divmod(blockIdx.y, &block_of_rows));
    r.row0 = static_cast<int>(block_of_rows) * kMmaRows;
    r.total_rows = static_cast<int>(p.shape.seqlen_q * p.group.divisor);
    const int last_row = (r.row0 + kMmaRows < r.total_rows ? r.row0 + kMmaRows : r.total_rows) - 1;
    r.i_lo = static_cast<int>(p.group.div(static_cast<uint32_t>(r.row0)));
    r.i_hi = static_cast<int>(p.group.div(static_cast<uint32_t>(last_row)));
    return r;
  }
  __device__ __forceinline__ KeyRange keys(const DecodeParams& p, const core::Mask& mask) const {
    return split_range<kWarps * kMmaKeys>(static_cast<int>(mask.key_begin(i_lo)),
                                          static_cast<int>(mask.key_end(i_hi + 1)), static_cast<int>(blockIdx.x),
                                          p.split_divisor);
  }
};

// The cold path of the epilogue: every row of the CTA whose weighted O in `merge` holds a NaN
// is recomputed by one warp over the split's keys, key by key without the terms of probability
// 0, from q as staged (rotated, in the element type) and K / V in global memory, and put in
// merge.acc as the sum of the warps' rows (warp 0's, the others' 0). Everything is re-derived
// from the params (nothing stays live across the key loop for it). The lse needs no repair: it
// depends on q and K alone, whose masked scores are -inf. Not for a CTA with a bad block entry.
template <typename Element, int kHeadDim, bool kPaged>
__device__ __forceinline__ void repair_rows(const DecodeParams& p, MmaShared<kHeadDim>& shared) {
  const int64_t b = blockIdx.z;
  const RowBlock block = RowBlock::of(p);
  const SequenceIndices seq = sequence_indices(p.cache, b);
  const int first = static_cast<int>(seq.first);
  const core::Mask mask{p.shape.seqlen_q, static_cast<int>(seq.used + p.cache.seqlen_new - first), p.window.left,
                        p.window.right};
  const KeyRange keys = block.keys(p, mask);
  CarefulRows r;
  const auto* k_head = static_cast<const Element*>(p.k.data) + block.hk * p.k.head_stride;
  const auto* v_head = static_cast<const Element*>(p.v.data) + block.hk * p.v.head_stride;
  if constexpr (kPaged) {
    r.table = p.cache.block_table + b * p.cache.block_table_stride;
    r.page = p.cache.page;
    r.k_block_stride = p.k.batch_stride;
    r.v_block_stride = p.v.batch_stride;
    r.key_offset = first;
  } else {
    k_head += seq.entry * p.k.batch_stride + first * p.k.row_stride;
    v_head += seq.entry * p.v.batch_stride + first * p.v.row_stride;
  }
  r.k = k_head;
  r.v = v_head;
  r.k_row_stride = p.k.row_stride;
  r.v_row_stride = p.v.row_stride;
  r.mask = mask;
  r.score = p.score;
  r.head_dim = static_cast<int>(p.shape.head_dim);
  r.keys_begin = keys.begin;
  r.keys_end = keys.end;
  auto& merge = shared.merge;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int rows = kMmaRows < block.total_rows - block.row0 ? kMmaRows : block.total_rows - block.row0;
  for (int t = warp; t < rows; t += kWarps) {
    bool nan = false;
    for (int c = lane; c < r.head_dim; c += 32) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) nan |= std::isnan(merge.acc[w][t][c]);
    }
    if (!__any_sync(0xffffffffu, nan)) continue;
    uint32_t head_in_group;
    const int i = static_cast<int>(p.group.divmod(static_cast<uint32_t>(block.row0 + t), &head_in_group));
    const int64_t h = int64_t{block.hk} * p.group.divisor + head_in_group;
    r.sink_log2 = row_sink_log2(p, block.hk, block.row0 + t, static_cast<int>(blockIdx.x));
    r.alibi_slope_log2 = alibi_slope_log2_of(p.score, b, h);
    auto q_at = [&](int c) {
      uint16_t bits;
      std::memcpy(&bits, reinterpret_cast<const char*>(&shared.q[swizzled<kHeadDim>(t, c / kVec)]) + 2 * (c % kVec), 2);
      return static_cast<float>(Element::bitcast(bits));
    };
    careful_row_of<Element, kHeadDim / 32, kPaged>(r, i, lane, q_at, [&](int c, float value) {
      merge.acc[0][t][c] = value;
#pragma unroll
      for (int w = 1; w < kWarps; ++w) merge.acc[w][t][c] = 0.0f;
    });
  }
}

template <typename Element, int kHeadDim, bool kPaged, class Ops = TensorOps<Element>>
__global__ void __launch_bounds__(kThreads, mma_ctas_per_sm(kHeadDim)) decode_mma_kernel(const DecodeParams p) {
  constexpr int kChunks = kHeadDim / kVec;          // 16-byte chunks of a row
  constexpr int kKSteps = kHeadDim / 16;            // k16 steps of Q K^T, n8-tile pairs of P V
  constexpr int kCopies = kMmaKeys * kChunks / 32;  // a lane's copies of one K (or V) tile
  constexpr int kStages = kMmaStages<kHeadDim>;
  constexpr int kStepKeys = kWarps * kMmaKeys;     // keys of a CTA step
  constexpr bool kQInRegisters = kHeadDim <= 128;  // else re-read from shared memory each step
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  using Shared = MmaShared<kHeadDim>;

  const int split = static_cast<int>(blockIdx.x);
  const int64_t b = blockIdx.z;
  let_dependent_grid_launch();
  const SequenceIndices seq = sequence_indices(p.cache, b);  // (first: the key range waits on it)
  const core::FastDivmod& group = p.group;
  const RowBlock rows_of_cta = RowBlock::of(p);
  const int hk = rows_of_cta.hk, row0 = rows_of_cta.row0, total_rows = rows_of_cta.total_rows;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  if (!sequence_indices_ok(p, seq)) {  // (uniform over the CTA) NaN rows, nothing read
    report_sequence_fault(p, seq, b);
    store_nan_rows<Element, kHeadDim, kMmaRows>(p, b, hk, row0, split);
    return;
  }
  const CacheParams& cache = p.cache;
  const int64_t used = seq.used;
  const int first = static_cast<int>(seq.first);
  const int seqlen_k = static_cast<int>(used + cache.seqlen_new - first);
  const core::Mask mask{p.shape.seqlen_q, seqlen_k, p.window.left, p.window.right};
  const int i_lo = rows_of_cta.i_lo, i_hi = rows_of_cta.i_hi;
  const KeyRange keys = rows_of_cta.keys(p, mask);
  // Keys every row sees: steps inside [full_begin, full_end) skip the per-element mask.
  const int full_begin = static_cast<int>(mask.key_begin(i_hi));
  const int lo_end = static_cast<int>(mask.key_end(i_lo + 1));
  const int full_end = lo_end < keys.end ? lo_end : keys.end;

  extern __shared__ __align__(16) char smem_raw[];
  auto& shared = *reinterpret_cast<Shared*>(smem_raw);

  // This lane's two rows of the S / O fragments: g = lane / 4 and g + 8.
  int row_i[2];
  bool row_ok[2];
  float slope[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + 8 * half;
    row_ok[half] = row < total_rows;
    uint32_t head_in_group;
    const int i = static_cast<int>(group.divmod(static_cast<uint32_t>(row), &head_in_group));
    row_i[half] = row_ok[half] ? i : 0;
    const int64_t h = int64_t{hk} * group.divisor + (row_ok[half] ? head_in_group : 0);
    slope[half] = alibi_slope_log2_of(p.score, b, h);
  }

  // The copies: a warp's tile is 16 keys x kChunks chunks; copy n of lane l is flat chunk
  // n * 32 + l (the warp's 32 copies are whole rows of neighbouring 16-byte chunks). Paged, lane
  // l reads the block of the warp-step's key l % 16 a step ahead, and a copy takes its key's
  // block from that lane. The entry is checked where it is used, not where it is read: any
  // instruction reading the register waits for the load. (Checked at the read, the wait was 27%
  // of the paged kernel's stall samples at b1 64k GQA in pages of 16 (ncu), 4-6% slower than
  // contiguous at long contexts.) Reading further ahead does not pay here: into registers, ptxas
  // put two steps' loads on one scoreboard, so a use waited for the newer one too; by cp.async
  // into shared memory, kStages steps ahead, b1 64k gained 2% and short calls lost 1-2%
  // (bench/results/gpu/decode_tuning.md).
  const Element* k_head = static_cast<const Element*>(p.k.data) + hk * p.k.head_stride;
  const Element* v_head = static_cast<const Element*>(p.v.data) + hk * p.v.head_stride;
  if constexpr (!kPaged) {
    k_head += seq.entry * p.k.batch_stride;
    v_head += seq.entry * p.v.batch_stride;
  }
  const int32_t* table = kPaged ? cache.block_table + b * cache.block_table_stride : nullptr;
  int block = 0;                          // paged: this lane's entry of the step issued next, as read
  bool bad_block = false;                 // paged: an entry read was out of range (block 0 read instead)
  auto read_block = [&](int step_key0) {  // this lane's entry of the step from step_key0
    if constexpr (kPaged) {
      const int j = step_key0 + warp * kMmaKeys + lane % kMmaKeys;
      block = j < keys.end ? table[cache.page.div(static_cast<uint32_t>(first + j))] : 0;
    }
  };
  int issue = keys.begin;
  // Per lane the chunk column and the first tile row are fixed (copy n takes row n *
  // kRowsPerCopy + lane_row), so the addresses are hoisted: a contiguous copy is the lane's
  // pointer plus n row steps, and a step moves the pointer by kStepKeys rows.
  constexpr int kRowsPerCopy = 32 / kChunks;
  const int lane_row = lane / kChunks, lane_chunk = lane % kChunks;
  const bool lane_in_row = lane_chunk * kVec < p.shape.head_dim;
  const int64_t k_stride = p.k.row_stride, v_stride = p.v.row_stride;
  const int64_t k_block_stride = p.k.batch_stride, v_block_stride = p.v.batch_stride;
  const Element* k_lane = k_head + lane_chunk * kVec;  // paged: plus block and in-page row
  const Element* v_lane = v_head + lane_chunk * kVec;
  if constexpr (!kPaged) {
    const int64_t row = first + keys.begin + warp * kMmaKeys + lane_row;
    k_lane += row * k_stride;
    v_lane += row * v_stride;
  }
  // (A step past the split's end, the pipeline's last kStages - 1, issues no copies, only its
  // commit group: its slots are never read, and a short split's prologue was such steps.)
  auto issue_step = [&](int stage) {
    if (issue < keys.end) {
      int lane_block = 0;  // paged: this lane's entry, checked (out of range: block 0, the CTA's rows NaN)
      if constexpr (kPaged) {
        const bool ok = cache.entry_ok(block);
        bad_block |= !ok && issue + warp * kMmaKeys + lane % kMmaKeys < keys.end;
        lane_block = ok ? block : 0;
      }
      const int key0 = issue + warp * kMmaKeys + lane_row;
#pragma unroll 4  // (d256's 16 copies unrolled whole spill)
      for (int n = 0; n < kCopies; ++n) {
        const int r = n * kRowsPerCopy + lane_row, j = key0 + n * kRowsPerCopy;
        const bool valid = j < keys.end && lane_in_row;
        const Element *k_src = k_head, *v_src = v_head;  // (a valid address for the zero fill)
        if constexpr (kPaged) {
          const int row_block = Ops::shfl(lane_block, r);
          uint32_t in_page;
          cache.page.divmod(static_cast<uint32_t>(first + j), &in_page);
          if (valid) {
            k_src = k_lane + row_block * k_block_stride + static_cast<int64_t>(in_page) * k_stride;
            v_src = v_lane + row_block * v_block_stride + static_cast<int64_t>(in_page) * v_stride;
          }
        } else if (valid) {
          k_src = k_lane + n * kRowsPerCopy * k_stride;
          v_src = v_lane + n * kRowsPerCopy * v_stride;
        }
        copy_async(&shared.pipe.k[stage][warp][swizzled<kHeadDim>(r, lane_chunk)], k_src, valid);
        copy_async(&shared.pipe.v[stage][warp][swizzled<kHeadDim>(r, lane_chunk)], v_src, valid);
      }
    }
    copy_async_commit();
    read_block(issue + kStepKeys);
    issue += kStepKeys;
    if constexpr (!kPaged) {
      k_lane += kStepKeys * k_stride;
      v_lane += kStepKeys * v_stride;
    }
  };
  read_block(keys.begin);
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) issue_step(stage);
  // q's rows, rotated and rounded to the element type, zeros past the rows and head_dim (after
  // the first copies are issued: q's load latency overlaps theirs).
  for (int idx = static_cast<int>(threadIdx.x); idx < Shared::kTile; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r;
    float x[kVec] = {};
    if (row < total_rows && c * kVec < p.shape.head_dim) {
      uint32_t head_in_group;
      const int64_t i = group.divmod(static_cast<uint32_t>(row), &head_in_group);
      const int64_t h = int64_t{hk} * group.divisor + head_in_group;
      const auto* q_row =
          static_cast<const Element*>(p.q.data) + b * p.q.batch_stride + i * p.q.row_stride + h * p.q.head_stride;
      to_float(*reinterpret_cast<const Vec<Element>*>(q_row + c * kVec), x);
      if (p.rotary.dim > 0) rotate(p.rotary, q_row, c * kVec, used + (p.rotary.per_row_q ? i : 0), x);
    }
    const Vec<Element> v = from_float<Element>(x);
    std::memcpy(&shared.q[swizzled<kHeadDim>(r, c)], &v, sizeof(Chunk));
  }

  __syncthreads();  // q staged

  // ldmatrix addresses: lane l points at row l % 8 of matrix l / 8.
  const int q_row = (lane / 8) % 2 * 8 + lane % 8, q_chunk = lane / 16;  // A: rows 0-7 / 8-15, k 0-7 / 8-15
  const int k_row = lane / 16 * 8 + lane % 8, k_chunk = (lane / 8) % 2;  // B of S: keys 0-7 / 8-15
  const int v_row = (lane / 8) % 2 * 8 + lane % 8, v_chunk = lane / 16;  // B of O (.trans)
  uint32_t q_frag[kQInRegisters ? kKSteps : 1][4];
  if constexpr (kQInRegisters) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      Ops::template ldsm_x4<false>(&shared.q[swizzled<kHeadDim>(q_row, 2 * kk + q_chunk)], q_frag[kk]);
    }
  }

  float acc[2 * kKSteps][4];  // O: n8 tile n holds columns 8 n + 2 (lane % 4) + {0, 1} of rows g, g + 8
#pragma unroll
  for (int n = 0; n < 2 * kKSteps; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  }
  float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this lane's keys only

  const bool softcap = p.score.softcap_log2 != 0.0f, alibi = p.score.alibi != nullptr, plain = !softcap && !alibi;
  const float scale_log2 = p.score.scale_log2, softcap_log2 = p.score.softcap_log2, tanh_scale = p.score.tanh_scale;
  int stage = 0;
  for (int step = keys.begin; step < keys.end; step += kStepKeys) {
    Ops::sync_warp();  // every lane is done reading the slots about to be refilled
    issue_step(stage == 0 ? kStages - 1 : stage - 1);
    copy_async_wait<kStages - 1>();
    Ops::sync_warp();  // the warp's copies of this step visible to all its lanes
    const Chunk* k_tile = shared.pipe.k[stage][warp];
    const Chunk* v_tile = shared.pipe.v[stage][warp];
    stage = stage + 1 == kStages ? 0 : stage + 1;

    // S = Q K^T: s[t] is n8 tile t (keys 8 t + 2 (lane % 4) + {0, 1}; rows g: [0, 1], g + 8: [2, 3]).
    // The k16 steps alternate between two accumulators, summed at the end: four independent MMA
    // chains of kKSteps / 2, not two of kKSteps (a short call's step is latency, not throughput).
    float s[2][4] = {}, s_odd[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t a[4], kb[4];
      if constexpr (kQInRegisters) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = q_frag[kk][e];
      } else {
        Ops::template ldsm_x4<false>(&shared.q[swizzled<kHeadDim>(q_row, 2 * kk + q_chunk)], a);
      }
      Ops::template ldsm_x4<false>(&k_tile[swizzled<kHeadDim>(k_row, 2 * kk + k_chunk)], kb);
      float(&d)[2][4] = kk % 2 == 0 ? s : s_odd;
      Ops::mma(d[0], a, kb[0], kb[1]);
      Ops::mma(d[1], a, kb[2], kb[3]);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] += s_odd[t][e];
    }
    // Scores in the log2 domain. Most steps take the plain path (no modifier, every key seen by
    // every row), a separate uniformly branched copy so the mask is not predicated into it.
    const int key0 = step + warp * kMmaKeys + 2 * (lane % 4);
    if (plain && step >= full_begin && step + kStepKeys <= full_end) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[t][e] *= scale_log2;
      }
    } else {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e / 2, j = key0 + 8 * t + e % 2;
          float score = softcap ? softcap_log2 * tanhf(s[t][e] * tanh_scale) : s[t][e] * scale_log2;
          if (alibi) score += core::alibi_bias(slope[half], row_i[half], j, mask.seqlen_q, seqlen_k);
          const bool seen = row_ok[half] && j < keys.end && mask.visible(row_i[half], j);
          s[t][e] = seen ? score : kNegInf;
        }
      }
    }
    // Online softmax per row (a row's 16 scores lie in the 4 lanes of a quad), then P in place.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = fmaxf(row_max[half],
                      fmaxf(fmaxf(s[0][2 * half], s[0][2 * half + 1]), fmaxf(s[1][2 * half], s[1][2 * half + 1])));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float factor = core::rescale_factor(row_max[half], m);
      const float base = core::safe_max(m);
      row_max[half] = m;
      row_sum[half] *= factor;
#pragma unroll
      for (int n = 0; n < 2 * kKSteps; ++n) {
        acc[n][2 * half] *= factor;
        acc[n][2 * half + 1] *= factor;
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[t][e] = exp2f(s[t][e] - base);
          row_sum[half] += s[t][e];
        }
      }
    }
    // O += P V: P's A fragment is S's two C fragments (keys 0-7, 8-15) in the element type.
    const uint32_t pa[4] = {pack_pair<Element>(s[0][0], s[0][1]), pack_pair<Element>(s[0][2], s[0][3]),
                            pack_pair<Element>(s[1][0], s[1][1]), pack_pair<Element>(s[1][2], s[1][3])};
#pragma unroll
    for (int jj = 0; jj < kKSteps; ++jj) {
      uint32_t vb[4];
      Ops::template ldsm_x4<true>(&v_tile[swizzled<kHeadDim>(v_row, 2 * jj + v_chunk)], vb);
      Ops::mma(acc[2 * jj], pa, vb[0], vb[1]);
      Ops::mma(acc[2 * jj + 1], pa, vb[2], vb[3]);
    }
  }

  // The epilogue. The warps hold the same rows over different keys: each lane weighs its own
  // accumulators by its warp's share of each of its rows (every lane reads the warps' max / sum,
  // so no thread merges rows while the others wait), then the weighted rows are summed by column
  // chunks and stored. Two barriers.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    if (lane % 4 == 0) {
      shared.row_max[lane / 4 + 8 * half][warp] = row_max[half];
      shared.row_sum[lane / 4 + 8 * half][warp] = row_sum[half];
    }
  }
  copy_async_wait<0>();                          // (the pipeline's last, empty groups: its bytes become the merge's)
  const bool bad = __syncthreads_or(bad_block);  // a bad block-table entry: NaN rows
  if (bad) report_block_fault(p, b, first + keys.begin, first + keys.end);
  auto& merge = shared.merge;
  bool nan = false;  // in this lane's O: a 0 * NaN of a masked key may have reached its rows
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + 8 * half;
    const MergedWarps merged = merge_warps(shared.row_max[r], shared.row_sum[r], row_sink_log2(p, hk, row0 + r, split));
    const float weight = bad ? kNaN : merged.share(row_max[half], row_sum[half]);
#pragma unroll
    for (int n = 0; n < 2 * kKSteps; ++n) {
      float* at = &merge.acc[warp][r][8 * n + 2 * (lane % 4)];
      at[0] = acc[n][2 * half] * weight;
      at[1] = acc[n][2 * half + 1] * weight;
      nan |= std::isnan(acc[n][2 * half]) || std::isnan(acc[n][2 * half + 1]);
    }
    if (warp == 0 && lane % 4 == 0) {
      merge.lse[r] = bad ? kNaN : merged.lse();
      const int row = row0 + r;
      const RowDestination d = row < total_rows ? row_destination(p, b, hk, row, split) : RowDestination{-1, -1};
      merge.out_at[r] = d.out_at;
      merge.lse_at[r] = d.lse_at;
    }
  }
  if (__syncthreads_or(nan && !bad)) {  // rare: an input held NaN or inf
    repair_rows<Element, kHeadDim, kPaged>(p, shared);
    __syncthreads();
  }
  // Thread x sums 4 columns of a row over the warps: chunk x % (kHeadDim / 4) of row x / (kHeadDim / 4), ...
  constexpr int kColumnChunks = kHeadDim / 4;
  const int rows = kMmaRows < total_rows - row0 ? kMmaRows : total_rows - row0;
  for (int idx = static_cast<int>(threadIdx.x); idx < rows * kColumnChunks; idx += kThreads) {
    const int r = idx / kColumnChunks, c = idx % kColumnChunks * 4;
    if (c >= p.shape.head_dim) continue;
    Float4 o = *reinterpret_cast<const Float4*>(&merge.acc[0][r][c]);
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const Float4 x = *reinterpret_cast<const Float4*>(&merge.acc[w][r][c]);
#pragma unroll
      for (int e = 0; e < 4; ++e) o.x[e] += x.x[e];
    }
    if (writes_output(p)) {
      Element* dst = static_cast<Element*>(p.out.data) + merge.out_at[r] + c;
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[e] = static_cast<Element>(o.x[e]);
    } else {
      *reinterpret_cast<Float4*>(p.partial_out + merge.out_at[r] + c) = o;  // (16-byte aligned: d % 8 == 0)
    }
  }
  const int me = static_cast<int>(threadIdx.x);
  if (me < rows && merge.lse_at[me] >= 0) {
    (writes_output(p) ? p.lse.data : p.partial_lse)[merge.lse_at[me]] = merge.lse[me];
  }
}

}  // namespace flashattn::cuda::decode

// The sm90a forward kernel's epilogue (a base of ForwardKernel, forward_kernel.cuh): O
// normalised in registers with each row's LSE, NaN rows repaired (careful_rows.cuh), O staged in
// shared memory and stored (TMA; varlen: plain stores of the sequence's rows), and the consumers'
// named barriers and Q-buffer release that it shares with the main loop.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../core/softmax.hpp"
#include "../common/careful_rows.cuh"
#include "../common/fragment.cuh"
#include "../common/join_sink.cuh"
#include "../params.hpp"
#include "forward_tiles.cuh"
#include "forward_traits.cuh"
#include "trace.cuh"
#include "warpgroup.cuh"

namespace flashattn::cuda::sm90 {

// 1 / x and log2(x) from MUFU.RCP / MUFU.LG2 alone (no IEEE rounding, no slow path; subnormals
// flushed).
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float log2_approx(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

template <class Traits, MaskKind kMask, bool kVarlen>
struct ForwardEpilogue : ForwardTiles<Traits, kMask, kVarlen> {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Tile = typename ForwardTiles<Traits, kMask, kVarlen>::Tile;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kConsumers = Traits::kConsumerWarpGroups;

  // Named barrier ids are offset past CUTLASS's reserved ones by cutlass::arch::NamedBarrier (8 of
  // the 16 left: 1 + 2 x 3 consumers used at most).
  static constexpr uint32_t kEpilogueBarrier = 0;               // all consumers (varlen's single tile)
  static constexpr uint32_t kPingpongBarrier = 1;               // to kConsumers: one per consumer
  static constexpr uint32_t kConsumerBarrier = 1 + kConsumers;  // to 2 kConsumers: one consumer's 128 threads
  static __device__ __forceinline__ void consumer_sync(int consumer_wg) {
    cutlass::arch::NamedBarrier::sync(Traits::kWarpGroupThreads, kConsumerBarrier + consumer_wg);
  }

  // The consumer's index, warp-uniform (canonical_warp_group_idx shuffles it from lane 0). Each
  // part derives it afresh: passed along and held through the main loop, it spilled (d64 varlen,
  // bf16 d256 masked).
  static __device__ __forceinline__ int consumer_index() {
    return cutlass::canonical_warp_group_idx() - static_cast<int>(WarpGroupRole::kFirstConsumer);
  }
  // The same from a fresh read of the thread index: for code after (or rare code inside) the key
  // loop, so that the index is not held in a register through it.
  static __device__ __forceinline__ int fresh_consumer_index() {
    return fresh_thread_idx() / Traits::kWarpGroupThreads - static_cast<int>(WarpGroupRole::kFirstConsumer);
  }

  // A consumer thread is done with Q's buffer and the tile index beside it. Every thread arrives
  // (after its own reads and GEMM waits), so the buffer is free only when all have. (The index's
  // write and reads are ordered by the mbarriers, arrive releasing and wait acquiring; with each
  // reader's own arrive after its read, compute-sanitizer's racecheck sees that order too and
  // reports nothing. When lane 0 alone arrived for its warpgroup, it reported the handover.)
  static __device__ __forceinline__ void release_q(SharedStorage& storage, int buffer) {
    cutlass::arch::ClusterBarrier::arrive(&storage.q_empty[buffer]);
  }

  // The epilogue's register half: O / rowsum in 16 bits (rO, tOrO's layout) and each row's LSE
  // (natural log), with the tile's head's learnable sink joined (sink: exp2 domain, -inf without).
  // O's accumulator is free after it.
  template <class AccO, class Softmax, class FragO, int kRows>
  static __device__ __forceinline__ void normalise(const ForwardParams& params, AccO& tOrO, Softmax& softmax, FragO& rO,
                                                   float (&lse)[kRows], float sink) {
    using namespace cute;
    Tensor tOrO_rc = make_tensor(tOrO.data(), gmma_accum_rowcol(tOrO.layout()));  // (rows, D)
    // Dropout's 1 / (1 - p) joins the normalisation.
    const float keep_scale = kMask == MaskKind::kMaskedDropout ? params.dropout.keep_scale : 1.0f;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = quad_sum(softmax.sum[r]);
      float max = softmax.max[r];
      const float o_factor = join_sink(max, sum, sink);
      // The reciprocal and log2 from MUFU.RCP / MUFU.LG2 alone, with no branch: IEEE division and
      // log2f put a slow-path branch around each row's, and the rows' chains ran one after the
      // other (~1000 cycles of a tile's ~2000-cycle epilogue at d128, bench/sm90_trace.py).
      // A row's sum is 0 (saw no key and no sink: O = 0, LSE = -inf) or at least 1 (its max's own
      // term, a key's or the sink's), so no subnormal reaches them; their error (~2^-22) is far
      // below O's 16 bits and LSE's bound.
      const bool seen = sum > 0.0f;
      const float inv_sum = seen ? keep_scale * rcp_approx(sum) * o_factor : 0.0f;
      lse[r] = seen ? (max + log2_approx(sum)) * static_cast<float>(core::kLn2) : -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(tOrO_rc); ++c) tOrO_rc(r, c) *= inv_sum;
    }
    convert_fragment_into(tOrO, rO);
  }

  // The whole epilogue, normalise then store_out (stamp: a tracing build's, trace.cuh).
  template <class SO, class AccO, class Softmax, class Stamp>
  static __device__ __forceinline__ void epilogue(const KernelParams<Traits>& kp, SharedStorage& storage, SO& sO,
                                                  typename Traits::TiledMmaPV& mma_pv, AccO& tOrO, Softmax& softmax,
                                                  const Tile& t, int buffer, Stamp stamp) {
    auto rO = cute::make_tensor<Element>(tOrO.layout());
    float lse[std::extent_v<decltype(Softmax::sum)>];
    normalise(kp.params, tOrO, softmax, rO, lse, sink_log2(kp.params.score, t.bidh));
    stamp(trace::kNormalised);
    store_out(kp, storage, sO, mma_pv, rO, lse, t, buffer, stamp);
  }

  // The epilogue's stores: rO into the consumer's rows of sO and one TMA store of them (varlen:
  // plain stores of the sequence's rows); the rows' LSE. Only the consumer's own warpgroup syncs.
  template <class SO, class FragO, int kRows, class Stamp = trace::NoStamp>
  static __device__ __forceinline__ void store_out(const KernelParams<Traits>& kp, SharedStorage& storage, SO& sO,
                                                   typename Traits::TiledMmaPV& mma_pv, const FragO& rO,
                                                   const float (&lse)[kRows], const Tile& t, int buffer,
                                                   Stamp stamp = {}) {
    using namespace cute;
    const ForwardParams& params = kp.params;
    const int consumer_wg = fresh_consumer_index();
    // The thread's addresses here derived from a fresh index read: derived in the prologue and held
    // through the loop, one spilled (varlen d256; d64's three consumers once the tile came from
    // its slot).
    const int consumer_tid = fresh_thread_idx() - Traits::kWarpGroupThreads;
    const bool lead = consumer_tid % Traits::kWarpGroupThreads == 0;  // issues the consumer's O store

    if (params.lse.data != nullptr && consumer_tid % 4 == 0) {  // lane 0 of each quad owns its rows
      float* lse_ptr = params.lse.data + t.bidb * params.lse.batch_stride + t.bidh * params.lse.head_stride +
                       (t.q_start + t.m0) * params.lse.row_stride;
      Tensor tOcO =
          mma_pv.get_thread_slice(consumer_tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
      Tensor tOcO_rc = make_tensor(tOcO.data(), gmma_accum_rowcol(tOcO.layout()));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = get<0>(tOcO_rc(r, 0));
        if (row < t.rows_valid) lse_ptr[row * params.lse.row_stride] = lse[r];
      }
    }
    stamp(trace::kLseStored);

    // Each consumer writes only its own 64 rows of sO; in Q's buffer, those only its own S GEMMs
    // read (and waited for). In O's own buffer, its last tile's store must have read them first.
    if constexpr (Traits::kSeparateO) {
      if (lead) tma_store_wait<0>();
      consumer_sync(consumer_wg);
    }
    stamp(trace::kOBufferFree);
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, mma_pv);
    auto smem_thr_o = smem_copy_o.get_thread_slice(consumer_tid);
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
    // (Without a mask every key of a visited tile is seen by every row, keys past a dense
    // sequence being zero-filled by the TMA; varlen tiles may reach into the next sequence.)
    if constexpr (kMask != MaskKind::kNone || kVarlen) repair_nan_rows(params, sO, mma_pv, rO, t, consumer_tid);
    if constexpr (kVarlen) {
      store_rows(params, sO, t, consumer_wg, consumer_tid);
    } else {
      tma_store_fence();  // the generic-proxy writes become visible to the TMA (async proxy)
      stamp(trace::kOWritten);
      consumer_sync(consumer_wg);
      stamp(trace::kOSynced);
      if (lead) {
        constexpr int kRowsPerConsumer = Traits::kRowsPerConsumer;
        Tensor mO = kp.tma_o.get_tma_tensor(kp.shape_q);  // (seqlen_q, D, heads_q, batch)
        Tensor gO = local_tile(mO(_, _, t.bidh, t.bidb), Shape<Int<kRowsPerConsumer>, Int<kHeadDim>>{},
                               make_coord(t.m_block * kConsumers + consumer_wg, _0{}));  // (64, D)
        Tensor sO_rows = local_tile(sO, Shape<Int<kRowsPerConsumer>, Int<kHeadDim>>{}, make_coord(consumer_wg, _0{}));
        auto tma_thr_o = kp.tma_o.get_slice(_0{});
        copy(kp.tma_o, tma_thr_o.partition_S(sO_rows), tma_thr_o.partition_D(gO));
        tma_store_arrive();
        if constexpr (!Traits::kSeparateO) tma_store_wait<0>();  // read out before Q's next load
      }
    }
    if constexpr (!Traits::kSeparateO) release_q(storage, buffer);
  }

  // Rows of this warp whose O holds a NaN: a 0 * NaN of a masked key's value row may have
  // reached them (careful_rows.cuh). Found with a compare per element of rO; in the rare case,
  // the warp recomputes them key by key into sO, before the store reads it.
  template <class SO, class FragO>
  static __device__ __forceinline__ void repair_nan_rows(const ForwardParams& params, SO& sO,
                                                         typename Traits::TiledMmaPV& mma_pv, const FragO& rO,
                                                         const Tile& t, int consumer_tid) {
    using namespace cute;
    Tensor rO_rc = make_tensor(rO.data(), gmma_accum_rowcol(rO.layout()));
    constexpr int kRows = decltype(size<0>(rO_rc))::value;
    bool nan_row[kRows];
    bool any_nan = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      nan_row[r] = fragment_row_has_nan(rO_rc, r);
      any_nan |= nan_row[r];
    }
    // (Block-sparse lists that broke a rule: NaN rows on purpose.)
    if ((Traits::kSparse && t.lists_bad) || !__any_sync(0xffffffffu, any_nan)) return;
    __syncwarp();
    const int lane = consumer_tid % 32, warp_base = consumer_tid - lane;
    auto row_of = [&](int r, int q) {
      Tensor c = mma_pv.get_thread_slice(warp_base + 4 * q)
                     .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
      return static_cast<int>(get<0>(make_tensor(c.data(), gmma_accum_rowcol(c.layout()))(r, 0)));
    };
    const CarefulRows rows = careful_rows_of<Element>(params, t.bidb, t.bidh, t.bidh_kv, t.q_start, t.k_start, t.mask);
    auto put = [&](int row, int c, float value) { sO(row, c) = Element(value); };
    if constexpr (Traits::kSparse) {  // only the keys the block mask shows
      cuda::repair_nan_rows<Element, (kHeadDim + 31) / 32, false>(
          rows, t.m0, t.rows_valid, nan_row, lane, row_of, put,
          [&](int64_t i, int64_t j) { return params.block_mask.visible(t.bidb, t.bidh, i, j); });
    } else {
      cuda::repair_nan_rows<Element, (kHeadDim + 31) / 32, false>(rows, t.m0, t.rows_valid, nan_row, lane, row_of, put);
    }
    __syncwarp();
  }

  // Varlen's O store: a TMA store of the tile would write its rows past the sequence into the
  // next one's, so after the consumers' sync each copies its own 64 rows of sO out (those its own
  // warps wrote, so a consumer ahead on its next tile never overwrites rows another still reads),
  // 16 bytes a thread at a time (8 consecutive elements stay contiguous under the swizzle),
  // skipping the rows past the sequence.
  template <class SO>
  static __device__ __forceinline__ void store_rows(const ForwardParams& params, const SO& sO, const Tile& t,
                                                    int consumer_wg, int consumer_tid) {
    using namespace cute;
    constexpr int kRows = Traits::kRowsPerConsumer;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a row
    consumer_sync(consumer_wg);
    Element* out =
        static_cast<Element*>(params.out.data) + t.bidb * params.out.batch_stride + t.bidh * params.out.head_stride;
    for (int i = consumer_tid % Traits::kWarpGroupThreads; i < kRows * kChunks; i += Traits::kWarpGroupThreads) {
      const int row = consumer_wg * kRows + i / kChunks;
      const int col = i % kChunks * 8;
      if (row < t.rows_valid) {
        *reinterpret_cast<uint4*>(out + (t.q_start + t.m0 + row) * params.out.row_stride + col) =
            *reinterpret_cast<const uint4*>(&sO(row, col));
      }
    }
    // These generic-proxy reads of sO before a later TMA load into the buffer (O staged in Q's),
    // which each thread's own release of Q's buffer then allows.
    cutlass::arch::fence_view_async_shared();
  }
};

}  // namespace flashattn::cuda::sm90

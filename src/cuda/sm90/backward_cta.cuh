// What every role of the sm90a backward kernel (backward_kernel.cuh) shares, as the base of its
// epilogue (backward_epilogue.cuh) and of the kernel: the kernel's parameters, the tile shapes and
// named barriers, the CTA's coordinates in the grid and its work (which query tiles see its keys,
// the steps), the Q / dO pipeline's consumer side, and the shared-memory views that more than one
// role reads.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <cstdint>

#include "../../core/mask.hpp"
#include "../common/backward_tiles.cuh"
#include "../common/mask.cuh"
#include "../common/sequence.cuh"
#include "../params.hpp"
#include "backward_traits.cuh"
#include "warpgroup.cuh"

namespace flashattn::cuda::sm90 {

// Kernel parameters: the library's BackwardParams and the TMA descriptors built from them on the
// host (one __grid_constant__ struct, so the descriptors are read from parameter memory).
template <class Traits>
struct BackwardKernelParams {
  BackwardParams params;
  typename Traits::TmaLoadQ tma_q;
  typename Traits::TmaLoadQ tma_do;
  typename Traits::TmaLoadKV tma_k;
  typename Traits::TmaLoadKV tma_v;
  typename Traits::TmaStoreKV tma_dk;
  typename Traits::TmaStoreKV tma_dv;
  typename Traits::ShapeRows shape_q;   // (seqlen_q, D, heads_q, batch)
  typename Traits::ShapeRows shape_kv;  // (seqlen_k, D, heads_kv, batch)
};

template <class Traits, MaskKind kMask, bool kVarlen>
struct BackwardCta {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineState = cutlass::PipelineState<Traits::kStages>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kConsumers = Traits::kConsumerWarpGroups;
  static constexpr int kWarpGroupThreads = Traits::kWarpGroupThreads;

  // Named barriers (ids past CUTLASS's reserved ones): both consumers, one per consumer, and per dQ
  // buffer the hand-over between the consumers and the dQ warp: full (the consumers arrive, the dQ
  // warp waits) and empty (the reverse).
  static constexpr uint32_t kConsumersBarrier = 0;
  static constexpr uint32_t kConsumerBarrier = 1;
  static constexpr uint32_t kDqFullBarrier = kConsumerBarrier + kConsumers;
  static constexpr uint32_t kDqEmptyBarrier = kDqFullBarrier + Traits::kDqBuffers;
  static_assert(kDqEmptyBarrier + Traits::kDqBuffers <= 8, "CUTLASS leaves 8 named barriers to its users");
  static constexpr uint32_t kDqHandOverThreads = Traits::kConsumerThreads + cutlass::NumThreadsPerWarp;
  // d192's consumers run bodies of their own (different blocks of dK / dV rows), so they reach
  // the barriers they share (with each other, and with the dQ warp) from different instructions:
  // those take the unaligned form.
  static constexpr bool kSameBodies = Traits::kDkvRowsFirst == Traits::kDkvRowsSecond;
  static __device__ __forceinline__ void consumers_sync() {
    named_barrier_sync<kSameBodies>(Traits::kConsumerThreads, kConsumersBarrier);
  }
  // True on every consumer thread when pred holds on one of them. With the same bodies, a
  // reduction on the consumers' barrier (barrier.red.or); d192's consumers reach it from
  // different instructions, which compute-sanitizer's synccheck reports for barrier.red as
  // divergent threads, so they vote through shared memory around the (unaligned) barrier.sync.
  static __device__ __forceinline__ bool consumers_any(SharedStorage& storage, bool pred) {
    if constexpr (kSameBodies) {
      return named_barrier_or(Traits::kConsumerThreads, kConsumersBarrier, pred);
    } else {
      volatile int& vote = storage.work.any_nan;  // 0 since the CTA's first barrier
      if (pred) vote = 1;
      consumers_sync();
      return vote != 0;
    }
  }
  static __device__ __forceinline__ void consumer_sync(int consumer_wg) {
    cutlass::arch::NamedBarrier::sync(kWarpGroupThreads, kConsumerBarrier + consumer_wg);
  }

  // The CTA's key tile, KV head and batch entry (read from the special registers at each use).
  // The grid is (key tiles, KV heads, batch), or in deterministic mode (KV heads, key tiles,
  // batch): backward_launch.cuh says why.
  static __device__ __forceinline__ int n_block(const BackwardParams& p) {
    return static_cast<int>(p.deterministic ? blockIdx.y : blockIdx.x);
  }
  static __device__ __forceinline__ int bidh_kv(const BackwardParams& p) {
    return static_cast<int>(p.deterministic ? blockIdx.x : blockIdx.y);
  }
  static __device__ __forceinline__ int bidb() { return static_cast<int>(blockIdx.z); }

  // The batch entry's sequence (dense: every entry's lengths are the shape's).
  static __device__ __forceinline__ Sequence sequence_of(const ForwardParams& fp) {
    if constexpr (kVarlen) {
      return sequence(fp, bidb());
    } else {
      return {0, 0, fp.shape.seqlen_q, fp.shape.seqlen_k};
    }
  }
  // Key rows of the CTA's batch entry that dK / dV cover.
  static __device__ __forceinline__ int64_t k_rows_of(const ForwardParams& fp) {
    return kVarlen ? key_rows(fp, bidb()) : fp.shape.seqlen_k;
  }

  static __device__ __forceinline__ BackwardWork make_work(const BackwardParams& params) {
    const ForwardParams& fp = params.fwd;
    const Sequence seq = sequence_of(fp);
    BackwardWork w;
    w.n0 = int64_t{n_block(params)} * kBlockN;
    w.seqlen_q = seq.seqlen_q;
    w.seqlen_k = seq.seqlen_k;
    w.scratch_base = backward_row_base(kVarlen ? fp.cu_seqlens_q : nullptr, fp.shape.seqlen_q, bidb());
    if constexpr (kVarlen) {
      w.q_start = seq.q_start;
      w.k_start = seq.k_start;
      w.k_rows = k_rows_of(fp);
    }
    const core::Mask mask = make_mask<kMask>(fp, w.seqlen_q, w.seqlen_k);
    const TileRange tiles = query_tiles<kMask, kBlockM>(mask, w.n0, cute::min(w.n0 + kBlockN, w.seqlen_k));
    const TileRange full = unmasked_query_tiles<kMask, kBlockM>(mask, w.n0, w.n0 + kBlockN);
    w.tiles_begin = tiles.begin;
    w.tiles_end = tiles.end;
    w.full_begin = full.begin;
    w.full_end = full.end;
    w.any_nan = 0;
    w.group = static_cast<int>(fp.shape.heads_q / fp.shape.heads_kv);
    w.steps = w.group * (tiles.end - tiles.begin);
    return w;
  }
  // The work in shared memory (written before the CTA's first barrier), its fields read at each
  // use (volatile: not held in registers).
  static __device__ __forceinline__ const volatile BackwardWork& work_of(const SharedStorage& storage) {
    return storage.work;
  }

  // The consumers' side of a Q / dO pipeline, on its barriers in shared memory (the stage state is
  // derived from the step, not carried in a pipeline object): wait for a stage's loads, and
  // release it (each consumer thread arrives: with one CTA a cluster, the empty barrier counts
  // every consumer thread, as PipelineTmaAsync sets it).
  static __device__ __forceinline__ void stage_wait(typename PipelineQ::SharedStorage& p, const PipelineState& s) {
    p.full_barrier_[s.index()].wait(s.phase());
  }
  static __device__ __forceinline__ void stage_release(typename PipelineQ::SharedStorage& p, const PipelineState& s) {
    p.empty_barrier_[s.index()].arrive();
  }

  // Step t's query head and tile: the heads of the GQA group in turn, each over the query tiles
  // that see the keys, last to first (as the sm80 backward walks them).
  static __device__ __forceinline__ StepPos step_pos(const BackwardParams& params, const volatile BackwardWork& w,
                                                     int t) {
    const int tiles = w.tiles_end - w.tiles_begin;
    return {bidh_kv(params) * w.group + t / tiles, w.tiles_end - 1 - t % tiles};
  }

  // By head dim: the consumer's kRows rows of a (head dim, x) tile (from row consumer_wg *
  // kDkvRowsFirst on: the first consumer's block, then the second's).
  template <int kRows, class Tile>
  static __device__ __forceinline__ auto dkv_rows(Tile&& tile) {
    constexpr int kCols = decltype(cute::size<1>(tile))::value;
    const int consumer_wg = (fresh_thread_idx() - kWarpGroupThreads) / kWarpGroupThreads;
    return cute::local_tile(tile, cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{},
                            cute::make_coord(consumer_wg * Traits::kDkvRowsFirst / kRows, cute::_0{}));
  }

  // dQ buffer `buffer`'s first float (the consumers stage into it, the dQ warp adds from it).
  static __device__ __forceinline__ float* dq_buffer(SharedStorage& storage, int buffer) {
    return storage.dq.data() + buffer * cute::cosize_v<typename Traits::SmemLayoutdQ>;
  }
};

}  // namespace flashattn::cuda::sm90

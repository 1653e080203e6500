// Compile-time description of the sm90a (Hopper) backward kernel for one (dtype, head dim): tile
// shapes, warpgroups and their register split, the WGMMA tiled MMAs of its five GEMMs, the
// shared-memory layouts, the TMA copy types and the shared-memory budget
// (docs/design/hopper-backward.md works the budget out per head dim).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <cstdint>
#include <type_traits>

#include "../params.hpp"
#include "forward_traits.cuh"

namespace flashattn::cuda::sm90 {

// Head dims with an sm90 backward kernel; the others run the sm80 backward on Hopper. (d96's half
// is no whole number of 64-byte swizzle atoms; d192 and d256 need smaller key tiles than one
// WGMMA's 64 rows a consumer.)
inline constexpr int kSm90BackwardHeadDims[] = {64, 128};

// A CTA's work, derived once and kept in shared memory (read where used rather than held in
// registers through the main loop, beside dK and dV): the query tiles that see its keys (tiles)
// and those of them that see every key (full: no per-element mask), and the steps, the query tiles
// of every head of its GQA group. Varlen: the sequence's lengths (seqlen_k: its keys up to
// seqused_k), its first rows in the packed tensors, and k_rows, the key rows dK / dV cover (those
// past seqused_k too, whose gradients are 0).
struct BackwardWork {
  int group, steps;
  int tiles_begin, tiles_end, full_begin, full_end;
  int64_t n0, seqlen_q, seqlen_k, scratch_base;
  int64_t q_start, k_start, k_rows;
};

template <ElemType kElem, int kHeadDim_>
struct BackwardTraits {
  using Element = typename ElementOf<kElem>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the tile shapes below are worked out for d64 and d128");

  // A CTA owns kBlockN keys: each of its two consumer warpgroups 64 of them (one WGMMA's M, the
  // keys being the rows of S^T, dP^T, dV and dK), and walks the query tiles of kBlockM rows.
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kWarpGroupThreads = cutlass::NumThreadsPerWarpGroup;
  static constexpr int kKeysPerConsumer = 64;
  static constexpr int kBlockN = kConsumerWarpGroups * kKeysPerConsumer;
  static constexpr int kBlockM = 64;
  static constexpr int kStages = 2;  // Q / dO tiles in flight
  static constexpr int kConsumerThreads = kConsumerWarpGroups * kWarpGroupThreads;
  static constexpr int kNThreads = kWarpGroupThreads + kConsumerThreads;
  static_assert(kBlockM % kBackwardMinBlockM == 0 && kBackwardRowPad % kBlockM == 0, "the scratch's row padding");

  // setmaxnreg (WarpGroupRegisters): the producer issues loads with 24 registers, the consumers
  // share the rest (240 each). A consumer holds dV and dK (64 keys x d fp32: 128 registers at
  // d128, 64 at d64), S^T and dP^T (64 keys x 64 queries: 64) and its half of the dQ product (32,
  // 16). (A 128-row query tile at d64, the design note's first plan, holds 64 more for S^T and
  // dP^T, and spilled 256 bytes.)
  static constexpr int kProducerRegs = WarpGroupRegisters<kConsumerWarpGroups>::kProducer;
  static constexpr int kConsumerRegs = WarpGroupRegisters<kConsumerWarpGroups>::kConsumer;

  using ConsumersAlongM = cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>;
  using ConsumersAlongN = cute::Layout<cute::Shape<cute::_1, cute::Int<kConsumerWarpGroups>, cute::_1>>;
  // S^T = K Q^T and dP^T = V dO^T: (keys, queries), both operands K-major in shared memory.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<
          Element, Element, float, cute::Shape<cute::Int<kKeysPerConsumer>, cute::Int<kBlockM>, cute::Int<kHeadDim>>>(),
      ConsumersAlongM{}));
  // dV += P^T dO and dK += dS^T Q: P^T and dS^T from registers (S^T's accumulator layout, in 16
  // bits), dO^T and Q^T transposed views of their tiles (MN-major B).
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<
          Element, Element, float, cute::Shape<cute::Int<kKeysPerConsumer>, cute::Int<kHeadDim>, cute::Int<kBlockM>>,
          cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      ConsumersAlongM{}));
  // dQ = dS K: (queries, head dim), each consumer half of the head dim's columns; dS from shared
  // memory (K-major: stored transposed from dS^T's registers by stmatrix.trans), K^T a transposed
  // view of K's tile (MN-major B).
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / kConsumerWarpGroups>, cute::Int<kBlockN>>,
          cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      ConsumersAlongN{}));

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  // K and V: the dQ GEMM reads K^T by halves of the head dim (MN-major B), a whole number of
  // swizzle atoms each: 128-byte ones at d128, 64-byte ones at d64 (whose half is 64 bytes wide).
  static constexpr int kDqHalfBytes = kHeadDim / kConsumerWarpGroups * static_cast<int>(sizeof(Element));
  using SmemAtomKV = std::conditional_t<kDqHalfBytes % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                        cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));  // (M, D, stages)
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));  // (D, M, stages)
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemAtomKV{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));  // (N, D)
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                cute::Step<cute::_2, cute::_1>{})));  // (D, N)
  // dS: (queries, keys), keys contiguous, two buffers (a step writes one while the other consumer
  // may still read the last step's in its dQ GEMM); dS^T the transposed view the consumers write,
  // 8 x 8 blocks at a time (stmatrix.trans).
  static constexpr int kDsBuffers = 2;
  using SmemLayoutdS = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kDsBuffers>>{}));  // (M, N, buffers)
  using SmemLayoutdSt = decltype(cute::composition(
      SmemLayoutdS{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kDsBuffers>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));  // (N, M, buffers)
  using SmemCopyAtomdSt = cute::Copy_Atom<cute::SM90_U16x8_STSM_T, Element>;
  // A consumer's 64 rows of dK or dV, the box of its TMA store (staged in K's and V's buffers).
  using SmemLayoutKVConsumer =
      decltype(cute::tile_to_shape(SmemAtomKV{}, cute::Shape<cute::Int<kKeysPerConsumer>, cute::Int<kHeadDim>>{}));
  using SmemCopyAtomKV = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  // dQ's fp32 product as the scratch lays it out (params.hpp dq_sum_offset: 8 x 8 blocks, each row
  // group of 8 rows contiguous), each consumer's half of the columns in its own part: a row group
  // of a consumer's half is then kHeadDim / 2 x 8 contiguous floats here and in the scratch, one
  // bulk reduce-add. (rows (8, M / 8), cols ((2, 4), D / 2 / 8, consumers)). kDqBuffers of them:
  // the consumers stage a step's product in one while the dQ warp's reduce-adds still read the
  // last step's (and, in deterministic mode, wait for the query tile's turn).
  static constexpr int kDqBuffers = 2;
  static constexpr int kDqHalf = kHeadDim / kConsumerWarpGroups;
  static constexpr int kDqGroupFloats = 8 * kDqHalf;  // one row group of a consumer's half
  using SmemLayoutdQ = cute::Layout<
      cute::Shape<cute::Shape<cute::_8, cute::Int<kBlockM / 8>>,
                  cute::Shape<cute::Shape<cute::_2, cute::_4>, cute::Int<kDqHalf / 8>, cute::Int<kConsumerWarpGroups>>>,
      cute::Stride<cute::Stride<cute::_4, cute::Int<kDqGroupFloats>>,
                   cute::Stride<cute::Stride<cute::_32, cute::_1>, cute::_64, cute::Int<kBlockM * kDqHalf>>>>;

  // Global tensors as TMA sees them: (seqlen, head_dim, heads, batch), strides in elements.
  using ShapeRows = cute::Shape<int32_t, cute::Int<kHeadDim>, int32_t, int32_t>;
  using StrideRows = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemIn =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeRows{}, StrideRows{}));
  using GmemOut =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeRows{}, StrideRows{}));
  using TmaLoadQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemIn{}, cute::take<0, 2>(SmemLayoutQ{})));
  using TmaLoadKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemIn{}, SmemLayoutKV{}));
  using TmaStoreKV = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemOut{}, SmemLayoutKVConsumer{}));

  // Bytes each stage's transaction delivers: the tile (rows out of bounds zero-filled, and
  // counted) and its rows' LSE2 (with Q) or D (with dO).
  static constexpr uint32_t kRowStatBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element) + kRowStatBytes;
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);

  using PipelineQ = cutlass::PipelineTmaAsync<kStages>;

  static constexpr int kSmemAlign = 1024;
  static constexpr int kSmemLimit = 227 * 1024;
  struct SharedStorage {
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> k;
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> v;
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> dout;
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>> ds;
    alignas(kSmemAlign) cute::array_aligned<float, kDqBuffers * cute::cosize_v<SmemLayoutdQ>> dq;
    alignas(16) float lse2[kStages][kBlockM];
    alignas(16) float delta[kStages][kBlockM];
    typename PipelineQ::SharedStorage pipeline_q;
    typename PipelineQ::SharedStorage pipeline_do;
    alignas(8) uint64_t kv_full;
    BackwardWork work;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit, "the backward's tiles exceed sm90's shared memory");
};

}  // namespace flashattn::cuda::sm90

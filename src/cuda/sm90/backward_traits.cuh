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

// Head dims with an sm90 backward kernel; the others run the sm80 backward on Hopper. The d96,
// d192 and d256 kernels have options of their own (sm90.cmake, on by default).
inline constexpr int kSm90BackwardHeadDims[] = {64, 96, 128, 192, 256};

// A CTA's work, derived once and kept in shared memory (read where used rather than held in
// registers through the main loop, beside dK and dV): the query tiles that see its keys (tiles)
// and those of them that see every key (full: no per-element mask), and the steps, the query tiles
// of every head of its GQA group. Varlen: the sequence's lengths (seqlen_k: its keys up to
// seqused_k), its first rows in the packed tensors, and k_rows, the key rows dK / dV cover (those
// past seqused_k too, whose gradients are 0).
struct BackwardWork {
  int group, steps;
  int tiles_begin, tiles_end, full_begin, full_end;
  int any_nan;  // the consumers' vote on a NaN in dK / dV where they run bodies of their own (d192)
  int64_t n0, seqlen_q, seqlen_k, scratch_base;
  int64_t q_start, k_start, k_rows;
};

template <ElemType kElem, int kHeadDim_>
struct BackwardTraits {
  using Element = typename ElementOf<kElem>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "the tile shapes below are worked out for d64, d96, d128, d192 and d256");

  // Two ways to split a CTA's work between its two consumer warpgroups:
  //   by keys (d64, d128): kBlockN = 128 keys, each consumer 64 of them (one WGMMA's M, the keys
  //     being the rows of S^T, dP^T, dV and dK); P^T and dS^T feed the dV / dK GEMMs from
  //     registers;
  //   by head dim (kSplitHeadDim, d192 and d256, where dV and dK of 64 keys would take a
  //     consumer's 192-256 registers): kBlockN = 64 keys, shared by both consumers; each computes
  //     S^T and dP^T for half of the query tile's columns and holds dV^T and dK^T (head dim x
  //     keys) for a block of the head dim's rows: the first 128 rows, and the rest (128 at d256,
  //     64 at d192: a head dim of three 64-row WGMMA blocks, which two consumers cannot share
  //     evenly). P^T and dS^T then pass through shared memory, where both consumers' halves meet
  //     before the dV^T / dK^T GEMMs.
  // Either way the CTA walks the query tiles of kBlockM rows.
  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kWarpGroupThreads = cutlass::NumThreadsPerWarpGroup;
  static constexpr int kKeysPerConsumer = 64;  // the rows of a consumer's S^T
  static constexpr int kBlockN = kSplitHeadDim ? kKeysPerConsumer : kConsumerWarpGroups * kKeysPerConsumer;
  static constexpr int kBlockM = 64;
  static constexpr int kQueriesPerConsumer = kSplitHeadDim ? kBlockM / kConsumerWarpGroups : kBlockM;
  // By head dim, the rows of dV^T and dK^T that the first and the second consumer hold (by keys
  // each holds every column of its keys' rows).
  static constexpr int kDkvRowsFirst = kSplitHeadDim ? 128 : kHeadDim;
  static constexpr int kDkvRowsSecond = kSplitHeadDim ? kHeadDim - kDkvRowsFirst : kHeadDim;
  // Q / dO tiles in flight: at d256 one of each (32 KiB apiece) beside K, V, dS and dQ's staging.
  static constexpr int kStages = kSplitHeadDim ? 1 : 2;
  static constexpr int kConsumerThreads = kConsumerWarpGroups * kWarpGroupThreads;
  static constexpr int kNThreads = kWarpGroupThreads + kConsumerThreads;
  static_assert(kBlockM % kBackwardMinBlockM == 0 && kBackwardRowPad % kBlockM == 0, "the scratch's row padding");

  // setmaxnreg (WarpGroupRegisters): the producer issues loads with 24 registers, the consumers
  // share the rest (240 each). A consumer holds dV and dK (64 keys x d fp32: 128 registers at
  // d128, 64 at d64), S^T and dP^T (64 keys x 64 queries: 64) and its half of the dQ product (32,
  // 16), and at d64 its keys of K and V (16 each, kKVInRegisters). (A 128-row query tile at d64,
  // the design note's first plan, holds 64 more for S^T and dP^T, and spilled 256 bytes.) At
  // d256 a consumer holds dV^T and dK^T (128 of the head dim x 64 keys: 64 each), S^T and dP^T
  // (64 keys x 32 queries: 16 each) and a pass of the dQ product (64 queries x 32: 16); at d192
  // the first consumer the same, the second 32 each of dV^T and dK^T.
  static constexpr int kProducerRegs = WarpGroupRegisters<kConsumerWarpGroups>::kProducer;
  static constexpr int kConsumerRegs = WarpGroupRegisters<kConsumerWarpGroups>::kConsumer;

  using ConsumersAlongM = cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>;
  using ConsumersAlongN = cute::Layout<cute::Shape<cute::_1, cute::Int<kConsumerWarpGroups>, cute::_1>>;
  // K and V as register operands (d64): a consumer's 64 keys of K and of V are 16 registers each,
  // read from shared memory once a CTA, so that S^T's and dP^T's GEMMs read only Q and dO there
  // each step (RS WGMMA). From d96 on they would not fit beside dK and dV.
  static constexpr bool kKVInRegisters = kHeadDim == 64;
  // S^T = K Q^T and dP^T = V dO^T: (keys, queries), both operands K-major (K and V in shared
  // memory or, kKVInRegisters, in registers); the consumers stacked along the keys, or
  // (kSplitHeadDim) side by side along the queries.
  using ShapeSdP = cute::Shape<cute::Int<kKeysPerConsumer>, cute::Int<kQueriesPerConsumer>, cute::Int<kHeadDim>>;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      std::conditional_t<kKVInRegisters,
                         decltype(cute::SM90::GMMA::rs_op_selector<Element, Element, float, ShapeSdP>()),
                         decltype(cute::SM90::GMMA::ss_op_selector<Element, Element, float, ShapeSdP>())>{},
      std::conditional_t<kSplitHeadDim, ConsumersAlongN, ConsumersAlongM>{}));
  // K's and V's tiles into the register operands (kKVInRegisters).
  using SmemCopyAtomKV_A = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  // By keys: dV += P^T dO and dK += dS^T Q, (keys, head dim), P^T and dS^T from registers (S^T's
  // accumulator layout, in 16 bits), dO^T and Q^T transposed views of their tiles (MN-major B).
  // By head dim: dV^T += dO^T P and dK^T += Q^T dS, (kRows of the head dim, keys), one
  // warpgroup's (each consumer its own rows), both operands in shared memory: dO^T and Q^T the
  // transposed views (MN-major A), P^T and dS^T as the consumers stored them (keys, queries:
  // K-major B).
  // (A member template, so that only the split in use is instantiated: the other's shapes need
  // not be WGMMA shapes, e.g. 96 rows at d96.)
  template <bool kByHeadDim, int kRows>
  struct TiledMmadKVFor {
    using type = decltype(cute::make_tiled_mma(
        cute::SM90::GMMA::rs_op_selector<
            Element, Element, float, cute::Shape<cute::Int<kKeysPerConsumer>, cute::Int<kHeadDim>, cute::Int<kBlockM>>,
            cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
        ConsumersAlongM{}));
  };
  template <int kRows>
  struct TiledMmadKVFor<true, kRows> {
    using type = decltype(cute::make_tiled_mma(
        cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                         cute::Shape<cute::Int<kRows>, cute::Int<kBlockN>, cute::Int<kBlockM>>,
                                         cute::GMMA::Major::MN, cute::GMMA::Major::K>()));
  };
  // The dK / dV GEMMs of a consumer holding kRows of the head dim (by keys: every column).
  template <int kRows>
  using TiledMmadKV = typename TiledMmadKVFor<kSplitHeadDim, kRows>::type;
  // The shape of a consumer's dK / dV accumulators: (keys, head dim) of both consumers' tiled MMA,
  // or (its kRows of the head dim, keys) transposed.
  template <int kRows>
  using ShapedKV = std::conditional_t<kSplitHeadDim, cute::Shape<cute::Int<kRows>, cute::Int<kBlockN>>,
                                      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>>;
  // dQ = dS K: (queries, head dim), each consumer half of the head dim's columns; dS from shared
  // memory (by keys K-major, stored transposed from dS^T's registers by stmatrix.trans; by head
  // dim MN-major, a view of dS^T as stored for the dK^T GEMM), K^T a transposed view of K's tile
  // (MN-major B).
  // By head dim the product is formed in passes of 64 of the head dim's columns (32 a consumer:
  // 16 registers; four at d256, three at d192), two in flight: each staged for the dQ warp while
  // the next runs.
  // Beside dV^T and dK^T (128 registers), ptxas spilled 128 bytes and serialized every WGMMA of
  // the kernel with passes of 32 registers (one at a time), and 256 bytes with the whole
  // 64 x 128 product (64 registers).
  static constexpr auto kMajordS = kSplitHeadDim ? cute::GMMA::Major::MN : cute::GMMA::Major::K;
  static constexpr int kDqPasses = kSplitHeadDim ? kHeadDim / 64 : 1;
  static constexpr int kDqPassCols = kHeadDim / kDqPasses;  // of the CTA's dQ tile, both consumers
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::Int<kBlockM>, cute::Int<kDqPassCols / kConsumerWarpGroups>, cute::Int<kBlockN>>, kMajordS,
          cute::GMMA::Major::MN>(),
      ConsumersAlongN{}));

  // Swizzle atoms: the widest (128 bytes) that tiles a layout's contiguous extent. The (keys,
  // queries) tiles of dS and P^T take 128-byte atoms; Q and dO, whose rows are the head dim,
  // 64-byte ones at d96 (192 bytes). K and V: the dQ GEMM reads K^T by halves of the head dim
  // (MN-major B), a whole number of swizzle atoms each (a WGMMA operand cannot start inside an
  // atom): 128-byte ones at d128 and d256, 64-byte ones at d64 (whose half is 64 bytes wide) and
  // d192 (192 bytes), 32-byte ones at d96 (96 bytes).
  template <int kBytes>
  using WidestAtom = std::conditional_t<kBytes % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                        std::conditional_t<kBytes % 64 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
                                                           cute::GMMA::Layout_K_SW32_Atom<Element>>>;
  static constexpr int kElementBytes = static_cast<int>(sizeof(Element));
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemAtomQ = WidestAtom<kHeadDim * kElementBytes>;
  static constexpr int kDqHalfBytes = kHeadDim / kConsumerWarpGroups * kElementBytes;
  using SmemAtomKV = WidestAtom<kDqHalfBytes>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtomQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));  // (M, D, stages)
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));  // (D, M, stages)
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemAtomKV{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));  // (N, D)
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                cute::Step<cute::_2, cute::_1>{})));  // (D, N)
  // dS, two buffers (a step writes one while the other consumer may still read the last step's in
  // its dQ GEMM). By keys: (queries, keys), keys contiguous; dS^T the transposed view the
  // consumers write, 8 x 8 blocks at a time (stmatrix.trans). By head dim: dS^T (keys, queries),
  // queries contiguous, written as the accumulators hold it (stmatrix); dS the transposed view.
  static constexpr int kDsBuffers = 2;
  using ShapedS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kDsBuffers>>;   // (M, N, buffers)
  using ShapedSt = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kDsBuffers>>;  // (N, M, buffers)
  using Transposed = cute::Step<cute::_2, cute::_1, cute::_3>;
  using SmemLayoutdS =
      std::conditional_t<kSplitHeadDim,
                         decltype(cute::composition(cute::tile_to_shape(SmemAtom{}, ShapedSt{}),
                                                    cute::make_ordered_layout(ShapedS{}, Transposed{}))),
                         decltype(cute::tile_to_shape(SmemAtom{}, ShapedS{}))>;
  using SmemLayoutdSt =
      std::conditional_t<kSplitHeadDim, decltype(cute::tile_to_shape(SmemAtom{}, ShapedSt{})),
                         decltype(cute::composition(cute::tile_to_shape(SmemAtom{}, ShapedS{}),
                                                    cute::make_ordered_layout(ShapedSt{}, Transposed{})))>;
  // Stores of the (keys, queries) accumulators into dS^T (and, by head dim, into P^T).
  using SmemCopyAtomdSt =
      cute::Copy_Atom<std::conditional_t<kSplitHeadDim, cute::SM90_U32x4_STSM_N, cute::SM90_U16x8_STSM_T>, Element>;
  // By head dim: P^T (keys, queries), queries contiguous, a buffer per Q / dO stage (its last
  // reader, the dV^T GEMM, is done before the consumers release the stage).
  using SmemLayoutPt = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kStages>>{}));  // (N, M, stages)
  // The box of dK's and dV's TMA stores (staged in K's and V's buffers): 64 key rows, by keys a
  // consumer's, by head dim the CTA's. The accumulators go there by stmatrix, by head dim
  // transposed.
  static constexpr int kStoreRows = kSplitHeadDim ? kBlockN : kKeysPerConsumer;
  using SmemLayoutKVStore =
      decltype(cute::tile_to_shape(SmemAtomKV{}, cute::Shape<cute::Int<kStoreRows>, cute::Int<kHeadDim>>{}));
  using SmemCopyAtomKV =
      cute::Copy_Atom<std::conditional_t<kSplitHeadDim, cute::SM90_U16x8_STSM_T, cute::SM90_U32x4_STSM_N>, Element>;

  // dQ's fp32 product as the scratch lays it out (params.hpp dq_sum_offset: 8 x 8 blocks, each row
  // group of 8 rows contiguous), in parts of kDqPartCols columns, each in a part of its own: a row
  // group of a part is then kDqPartCols x 8 contiguous floats here and in the scratch, one bulk
  // reduce-add. (rows (8, M / 8), cols ((2, 4), part cols / 8, parts)). The parts: by keys each
  // consumer's half of the columns; by head dim the passes (64 columns: a pass must lie in one
  // part, which at d192 no half of 96 columns does). kDqBuffers of them: the consumers stage a
  // step's product in one while the dQ warp's reduce-adds still read the last step's (and, in
  // deterministic mode, wait for the query tile's turn).
  static constexpr int kDqBuffers = kSplitHeadDim ? 1 : 2;  // d256: 64 KiB each
  static constexpr int kDqParts = kSplitHeadDim ? kDqPasses : kConsumerWarpGroups;
  static constexpr int kDqPartCols = kHeadDim / kDqParts;
  static constexpr int kDqGroupFloats = 8 * kDqPartCols;  // one row group of a part
  using SmemLayoutdQ = cute::Layout<
      cute::Shape<cute::Shape<cute::_8, cute::Int<kBlockM / 8>>,
                  cute::Shape<cute::Shape<cute::_2, cute::_4>, cute::Int<kDqPartCols / 8>, cute::Int<kDqParts>>>,
      cute::Stride<cute::Stride<cute::_4, cute::Int<kDqGroupFloats>>,
                   cute::Stride<cute::Stride<cute::_32, cute::_1>, cute::_64, cute::Int<kBlockM * kDqPartCols>>>>;
  static_assert(kDqPassCols % kDqPartCols == 0 || kDqPartCols % kDqPassCols == 0, "a pass within whole parts");

  // Global tensors as TMA sees them: (seqlen, head_dim, heads, batch), strides in elements.
  using ShapeRows = cute::Shape<int32_t, cute::Int<kHeadDim>, int32_t, int32_t>;
  using StrideRows = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemIn =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeRows{}, StrideRows{}));
  using GmemOut =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeRows{}, StrideRows{}));
  using TmaLoadQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemIn{}, cute::take<0, 2>(SmemLayoutQ{})));
  using TmaLoadKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemIn{}, SmemLayoutKV{}));
  using TmaStoreKV = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemOut{}, SmemLayoutKVStore{}));

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
    // By head dim only (last: the other kernels' members keep their offsets).
    std::conditional_t<kSplitHeadDim, cute::array_aligned<Element, cute::cosize_v<SmemLayoutPt>, kSmemAlign>, char> pt;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit, "the backward's tiles exceed sm90's shared memory");
};

}  // namespace flashattn::cuda::sm90

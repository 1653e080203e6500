// Compile-time shape of the sm80 backward kernel for one (dtype, head-dim bucket, mask kind, tuning
// target): tile sizes, the three warp arrangements of its five GEMMs, shared-memory layouts and
// copy plans.
//
// Per (query tile, key tile) step the kernel runs
//   S  = Q K^T, dP = dO V^T        (M x N, warps arranged by kAtomMSdP)
//   dV += P^T dO, dK += dS^T Q      (N x d, warps arranged by kAtomNdKV; dK/dV live in registers)
//   dQ  = dS K                      (M x d, warps arranged by kAtomMdQ; added to fp32 scratch)
// Each GEMM has its own TiledMMA, since the best warp arrangement differs with the operand
// shapes; P and dS go through shared memory to change hands between them.
#pragma once

#include <cute/tensor.hpp>

#include "forward_traits.cuh"

namespace flashattn::cuda::sm80 {

// What the kernel's query-tile loop needs of the CTA's sequence: kept in shared memory and read
// after each step's barrier rather than held in registers across the loop next to dK and dV.
struct BackwardCta {
  int64_t q_start, seqlen_q, seqlen_k, scratch_base;
  int tiles_begin, tiles_end;   // the query tiles the CTA walks
  int full_begin, full_end;     // those that see every key of the CTA's tile: no per-element mask
  int n_block, head_kv, batch;  // the CTA's coordinates (cta_coord), for the epilogue's cold path
};

template <ElemType kElem, int kHeadDim_, MaskKind kMask = MaskKind::kNone, TileTarget kTarget_ = TileTarget::kSm80>
struct BackwardTraits {
  using Element = typename ElementTypes<kElem>::Element;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr TileTarget kTarget = kTarget_;
  static constexpr BackwardTileShape kShape = backward_tile_shape(kHeadDim, kMask);
  static constexpr int kBlockM = kShape.block_m;  // query rows per step
  static constexpr int kBlockN = kShape.block_n;  // keys per CTA
  static constexpr int kNWarps = kShape.warps;
  static constexpr int kNThreads = kNWarps * 32;

  // --- tensor cores --------------------------------------------------------------------------
  // m16n8k16 atoms; a warp-tile of 16 columns lets one ldmatrix.x4 feed two n8 atoms of B.
  using MmaAtom = cute::MMA_Atom<typename ElementTypes<kElem>::MmaOp>;
  template <int kWarpsFirst>
  using WarpTiledMma =
      cute::TiledMMA<MmaAtom,
                     cute::Layout<cute::Shape<cute::Int<kWarpsFirst>, cute::Int<kNWarps / kWarpsFirst>, cute::_1>>,
                     cute::Tile<cute::Int<16 * kWarpsFirst>, cute::Int<16 * (kNWarps / kWarpsFirst)>, cute::_16>>;
  using TiledMmaSdP = WarpTiledMma<kShape.atom_m_sdp>;
  using TiledMmadKV = WarpTiledMma<kShape.atom_n_dkv>;
  using TiledMmadQ = WarpTiledMma<kShape.atom_m_dq>;

  // --- shared memory -------------------------------------------------------------------------
  // Q / dO / K / V rows as in the forward (ForwardTraits' swizzled atom); P and dS in (M, N)
  // tiles of 64- or 32-wide swizzled rows. Transposed views feed ldmatrix.trans.
  using Fwd = ForwardTraits<kElem, kHeadDim>;
  using SmemLayoutAtom = typename Fwd::SmemLayoutAtom;
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  static constexpr int kPRowElems = kBlockN % 64 == 0 ? 64 : 32;
  using SmemLayoutAtomP = decltype(cute::composition(
      cute::Swizzle < kPRowElems == 64 ? 3 : 2, 3, 3 > {},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kPRowElems>>, cute::Stride<cute::Int<kPRowElems>, cute::_1>>{}));
  using SmemLayoutP =
      decltype(cute::tile_to_shape(SmemLayoutAtomP{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPt = decltype(cute::composition(
      SmemLayoutP{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));

  // Query-tile stages and the shared-memory budget: tile_shapes.hpp (backward_stages).
  static constexpr int kSmemBudget = backward_smem_budget(kTarget);
  static constexpr int kSmemAlign = kBackwardSmemAlign;
  static constexpr int kQTileElems = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kKVTileElems = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kPTileElems = cute::cosize_v<SmemLayoutP>;
  static constexpr int kRowStatsBytes = 2 * kBlockM * 4;  // LSE2 and D of one query tile
  static constexpr int kStages = backward_stages(kHeadDim, kMask, kTarget);

  struct SharedStorage {
    alignas(kSmemAlign) Element q[kStages * kQTileElems];  // stage s at q + s * kQTileElems
    alignas(kSmemAlign) Element dout[kStages * kQTileElems];
    alignas(kSmemAlign) Element k[kKVTileElems];
    alignas(kSmemAlign) Element v[kKVTileElems];
    alignas(kSmemAlign) Element p[kPTileElems];
    alignas(kSmemAlign) Element ds[kPTileElems];
    alignas(kSmemAlign) float lse2[kStages][kBlockM];
    alignas(16) float delta[kStages][kBlockM];
    BackwardCta cta;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr int kSmemDefaultLimit = 48 * 1024;

  // --- copies --------------------------------------------------------------------------------
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomStore = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>;  // P, dS, dK, dV
  // gmem <-> smem in 16-byte chunks, as in the forward, spread over this kernel's threads.
  static constexpr int kChunkRowsPerPass = kNThreads / Fwd::kChunkThreadsPerRow;
  using ChunkThreadLayout = cute::Layout<cute::Shape<cute::Int<kChunkRowsPerPass>, cute::Int<Fwd::kChunkThreadsPerRow>>,
                                         cute::Stride<cute::Int<Fwd::kChunkThreadsPerRow>, cute::_1>>;
  using GmemTiledLoad =
      decltype(cute::make_tiled_copy(cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
                                     ChunkThreadLayout{}, typename Fwd::ChunkValueLayout{}));
  using GmemTiledStore =
      decltype(cute::make_tiled_copy(cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{},
                                     ChunkThreadLayout{}, typename Fwd::ChunkValueLayout{}));

  static_assert(kRowStatsBytes / 2 % 16 == 0, "LSE2 / D rows are copied in 16-byte chunks");
  static_assert(kBackwardRowPad % kBlockM == 0 && kBlockM >= kBackwardMinBlockM, "scratch padding");
  static_assert(kBlockM % (16 * kShape.atom_m_sdp) == 0 && kBlockN % (16 * (kNWarps / kShape.atom_m_sdp)) == 0,
                "S tile must be whole tiled-MMA tiles");
  static_assert(kBlockN % (16 * kShape.atom_n_dkv) == 0 && kHeadDim % (16 * (kNWarps / kShape.atom_n_dkv)) == 0,
                "dK/dV tile must be whole tiled-MMA tiles");
  static_assert(kBlockM % (16 * kShape.atom_m_dq) == 0 && kHeadDim % (16 * (kNWarps / kShape.atom_m_dq)) == 0,
                "dQ tile must be whole tiled-MMA tiles");
  static_assert(kBlockM % kChunkRowsPerPass == 0 && kBlockN % kChunkRowsPerPass == 0,
                "every thread copies the same number of chunks");
  static_assert(kSmemBytes <= kSmemBudget, "shared memory exceeds the target's budget");
  static_assert(kSmemBytes <= backward_smem_estimate(kHeadDim, kMask, kStages),
                "backward_smem_estimate (which picks the stages) must bound the real layout");
};

}  // namespace flashattn::cuda::sm80

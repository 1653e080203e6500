// Compile-time shape of the sm80 backward kernel for one (dtype, head-dim bucket, mask kind): tile sizes,
// the three warp arrangements of its five GEMMs, shared-memory layouts and copy plans.
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

struct BackwardTileShape {
  int block_m = 0, block_n = 0, warps = 0;
  int atom_m_sdp = 0, atom_n_dkv = 0, atom_m_dq = 0;  // warps along the GEMMs' first mode
};

// dK and dV take N x d fp32 registers per CTA each, S and dP M x N. Up to d64, 128 x 128 tiles
// (FA2's shape there) fit 255 registers without spilling: half the steps of 64 x 128, so half
// the per-step work (loads, barriers, addresses) per FLOP. Up to d128, 64 x 128. Dropout's Philox
// state needs room of its own: its kernels take 64 keys per tile (64 x 128 spilled 448 bytes at
// d128). Beyond d128 the tiles shrink to 64 x 64 (the issue allows spills there).
// The GEMMs over head_dim (dK/dV, dQ) split it over 4 warps (16 columns each) where 64 divides
// it, else over 2 (d32, d96, d160, d224).
constexpr BackwardTileShape backward_tile_shape(int head_dim, MaskKind mask) {
  const int warps_by_d = head_dim % 64 == 0 ? 2 : 4;  // warps along the other mode when d is split in 4
  if (head_dim <= 64 && mask != MaskKind::kMaskedDropout) return {128, 128, 8, 2, 4, 4};
  if (head_dim <= 128 && mask != MaskKind::kMaskedDropout) return {64, 128, 8, 2, 4, warps_by_d};
  return {64, 64, 8, 4, warps_by_d, warps_by_d};
}

// What the kernel's query-tile loop needs of the CTA's sequence: kept in shared memory and read
// after each step's barrier rather than held in registers across the loop next to dK and dV.
struct BackwardCta {
  int64_t q_start, seqlen_q, seqlen_k, scratch_base;
  int tiles_begin, tiles_end;
};

template <ElemType kElem, int kHeadDim_, MaskKind kMask = MaskKind::kNone>
struct BackwardTraits {
  using Element = typename ElementTypes<kElem>::Element;
  static constexpr int kHeadDim = kHeadDim_;
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
      cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kWarpsFirst>, cute::Int<kNWarps / kWarpsFirst>, cute::_1>>,
                     cute::Tile<cute::Int<16 * kWarpsFirst>, cute::Int<16 * (kNWarps / kWarpsFirst)>, cute::_16>>;
  using TiledMmaSdP = WarpTiledMma<kShape.atom_m_sdp>;
  using TiledMmadKV = WarpTiledMma<kShape.atom_n_dkv>;
  using TiledMmadQ = WarpTiledMma<kShape.atom_m_dq>;

  // --- shared memory -------------------------------------------------------------------------
  // Q / dO / K / V rows as in the forward (ForwardTraits' swizzled atom); P and dS in (M, N)
  // tiles of 64- or 32-wide swizzled rows. Transposed views feed ldmatrix.trans.
  using Fwd = ForwardTraits<kElem, kHeadDim>;
  using SmemLayoutAtom = typename Fwd::SmemLayoutAtom;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  static constexpr int kPRowElems = kBlockN % 64 == 0 ? 64 : 32;
  using SmemLayoutAtomP = decltype(cute::composition(
      cute::Swizzle<kPRowElems == 64 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kPRowElems>>, cute::Stride<cute::Int<kPRowElems>, cute::_1>>{}));
  using SmemLayoutP = decltype(cute::tile_to_shape(SmemLayoutAtomP{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPt = decltype(cute::composition(
      SmemLayoutP{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));

  // The opt-in shared memory of A100 (163 KB; H100 offers 227 KB): Q and dO get two stages
  // (the next query tile copied during this one's GEMMs) where they fit it, one otherwise.
  static constexpr int kSmemBudget = 163 * 1024;
  static constexpr int kSmemAlign = 128;
  static constexpr int kQTileElems = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kKVTileElems = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kPTileElems = cute::cosize_v<SmemLayoutP>;
  static constexpr int kRowStatsBytes = 2 * kBlockM * 4;  // LSE2 and D of one query tile
  static constexpr int kStages =
      int(sizeof(Element)) * (2 * 2 * kQTileElems + 2 * kKVTileElems + 2 * kPTileElems) + 2 * kRowStatsBytes +
                  6 * kSmemAlign <= kSmemBudget
          ? 2
          : 1;

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
  using GmemTiledLoad = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, ChunkThreadLayout{},
      typename Fwd::ChunkValueLayout{}));
  using GmemTiledStore = decltype(cute::make_tiled_copy(cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{},
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
  static_assert(kSmemBytes <= kSmemBudget, "shared memory exceeds the A100 budget");
};

}  // namespace flashattn::cuda::sm80

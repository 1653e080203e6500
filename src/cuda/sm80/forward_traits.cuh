// Compile-time shape of the sm80 forward kernel for one (dtype, head-dim bucket, mask kind, tuning
// target): the tile sizes of tile_shapes.hpp, the tensor-core atom, shared-memory layouts and the
// copy plans between memories. Every size is derived here and checked against the hardware
// budgets with static_asserts.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "../params.hpp"
#include "tile_shapes.hpp"

namespace flashattn::cuda::sm80 {

template <ElemType kElem>
struct ElementTypes;
template <>
struct ElementTypes<ElemType::kFloat16> {
  using Element = cutlass::half_t;
  using MmaOp = cute::SM80_16x8x16_F32F16F16F32_TN;  // fp32 accumulate
};
template <>
struct ElementTypes<ElemType::kBFloat16> {
  using Element = cutlass::bfloat16_t;
  using MmaOp = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};

// kBlockSparse: the block-sparse kernel's traits (block_sparse_tile_shape; kMask is kMasked).
template <ElemType kElem, int kHeadDim_, MaskKind kMask = MaskKind::kNone, TileTarget kTarget_ = TileTarget::kSm80,
          bool kBlockSparse = false>
struct ForwardTraits {
  using Element = typename ElementTypes<kElem>::Element;
  using ElementAccum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr TileTarget kTarget = kTarget_;
  static constexpr ForwardTileShape kShape =
      kBlockSparse ? block_sparse_tile_shape(kHeadDim) : forward_tile_shape(kHeadDim, kMask, kTarget);
  static constexpr int kBlockM = kShape.block_m;  // query rows per CTA
  static constexpr int kBlockN = kShape.block_n;  // keys per iteration
  static constexpr int kNWarps = kShape.warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;

  // --- registers ---------------------------------------------------------------------------
  // 32-bit registers per thread: the fp32 accumulators of O and S, and Q's fragments. Q stays in
  // registers for the whole key loop when that fits a budget that leaves room for K/V fragments
  // and addressing; otherwise its fragments are re-read from shared memory (ldmatrix) per tile.
  // The budget is measured: d192 (176 by this count) spilled with Q in registers, d160 (152 with
  // 64-key tiles) and d64 (160) did not.
  static constexpr int kAccumRegs = kRowsPerWarp * (kHeadDim + kBlockN) / 32;
  static constexpr int kQFragmentRegs = kRowsPerWarp * kHeadDim * int(sizeof(Element)) / 4 / 32;
  static constexpr int kQInRegsBudget = 160;
  static constexpr bool kQInRegs = kAccumRegs + kQFragmentRegs <= kQInRegsBudget;
  // Head-dim slices (16 wide) of Q held in registers across the key loop: all of them with
  // kQInRegs, else kQPartialSlices; the others are re-read per key tile. d256 keeps 4 of its 16
  // next to the accumulators (0 spills for sm_80 and sm_90a; 8 spilled): Q's re-reads are ~1/11
  // of the shared-memory traffic that bounds this kernel (bench/results/gpu/profile-d256-h100.txt),
  // and 4 slices measured +1-3% on H100. FLASHATTN_SM80_Q_PARTIAL_SLICES overrides it (tuning).
  static constexpr int kQSlices = kHeadDim / 16;
#if defined(FLASHATTN_SM80_Q_PARTIAL_SLICES)
  static constexpr int kQPartialSlices = FLASHATTN_SM80_Q_PARTIAL_SLICES;
#else
  static constexpr int kQPartialSlices = kHeadDim == 256 ? 4 : 0;
#endif
  static constexpr int kQRegSlices = kQInRegs ? kQSlices : (kQPartialSlices < kQSlices ? kQPartialSlices : kQSlices);

  // --- tensor cores ------------------------------------------------------------------------
  // mma.sync m16n8k16, the warps stacked along M. The 16-wide N tile lets one ldmatrix.x4 feed
  // two n8 atoms of B, and makes S's accumulator layout reusable as P's A-operand layout.
  using MmaAtom = cute::MMA_Atom<typename ElementTypes<kElem>::MmaOp>;
  static constexpr int kMmaM = 16 * kNWarps;
  using TiledMma = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<kMmaM>, cute::_16, cute::_16>>;

  // --- shared memory -------------------------------------------------------------------------
  // Rows of 64 elements (128 B) with a 3-bit XOR swizzle of the 16-byte chunks, or 32 elements
  // (64 B, 2-bit) for head dims that are not multiples of 64: ldmatrix of 8 rows and the 16-byte
  // cp.async writes then hit distinct banks.
  static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowElems == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(cute::composition(cute::Swizzle<kSwizzleBits, 3, 3>{},
                                                    cute::Layout<cute::Shape<cute::_8, cute::Int<kSmemRowElems>>,
                                                                 cute::Stride<cute::Int<kSmemRowElems>, cute::_1>>{}));
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as its transpose (head_dim, keys): the B operand of O += P V.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  // O is staged through Q's buffer for coalesced 16-byte stores.
  using SmemLayoutO = SmemLayoutQ;

  // The smallest opt-in shared memory per block among sm80+ GPUs (sm86 / sm89: 99 KB), so every
  // bucket runs on every Ampere-class and later GPU; sm90-tuned kernels run on sm_90 only, which
  // offers 227 KB.
  static constexpr int kSmemBudget = kTarget == TileTarget::kSm90 ? 227 * 1024 : 99 * 1024;
  static constexpr int kSmemAlign = 128;
  // K/V pipeline depth: with two stages, tile n - 1 is copied while tile n is computed on and
  // each step needs one barrier; with one (where two K and two V tiles would not fit the
  // budget), V[n] is copied during S = Q K^T and K[n - 1] during the softmax and O += P V, two
  // barriers a step.
  static constexpr int kKVTileElems = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kStages =
      int(sizeof(Element)) * (cute::cosize_v<SmemLayoutQ> + 2 * 2 * kKVTileElems) + kSmemAlign <= kSmemBudget ? 2 : 1;

  // Where ptxas runs out of registers holding the copy addresses (K / V cp.async, ldmatrix
  // sources), the steady-tile bounds and seqlen_k across the key loop (d128 at 128 x 64 x 4
  // spilled them for sm_90a), the loop re-forms them in every step from the thread index and
  // shared memory. Only there: elsewhere the extra work per step measured 5-7% slower.
  static constexpr bool kAddressesPerStep = kTarget == TileTarget::kSm90;
  // Two stages: the prologue copies the first two key tiles (the second behind its own
  // cp.async group), so the first step does not wait a whole load before the second is asked
  // for. Only in the kAddressesPerStep loop, which knows its first step without a register.
  // FLASHATTN_SM80_PREFETCH_TWO=0 turns it off (A/B builds).
#if defined(FLASHATTN_SM80_PREFETCH_TWO)
  static constexpr bool kPrefetchTwo = FLASHATTN_SM80_PREFETCH_TWO && kAddressesPerStep && kStages == 2;
#else
  static constexpr bool kPrefetchTwo = kAddressesPerStep && kStages == 2;
#endif

  struct SharedStorage {
    alignas(kSmemAlign) Element q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) Element k[kStages * kKVTileElems];  // stage s at k + s * kKVTileElems
    alignas(kSmemAlign) Element v[kStages * kKVTileElems];
    // The sequence's (seqlen_q, seqlen_k, q_start), for the masked steps and the epilogue, and
    // the first key tile of the loop: read back from shared memory rather than held in
    // registers across the key loop.
    int64_t seq[3];
    int first_key_tile;
    // The masked kernels' (query tile, head, batch entry) for the epilogue's addresses: computed
    // by the tile order, they would otherwise stay live across the loop (blockIdx is re-read free,
    // so the other kernels use it).
    int cta[3];
    // With kAddressesPerStep: this CTA's K / V bases and its steady key tiles [begin, end).
    const Element* k_ptr;
    const Element* v_ptr;
    int steady[2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr int kSmemDefaultLimit = 48 * 1024;  // above it, the kernel must opt in

  // --- copies --------------------------------------------------------------------------------
  // smem -> registers: ldmatrix (x4) for Q and K, the transposing variant for V.
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  // registers -> smem for O: the accumulator holds column pairs, 32 bits per store.
  using SmemCopyAtomO = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>;

  // gmem <-> smem: 16-byte chunks, consecutive threads on consecutive chunks of a row. Loads are
  // cp.async with zero fill (rows past the sequence, columns past head_dim read as 0).
  static constexpr int kChunkElems = int(sizeof(cute::uint128_t) / sizeof(Element));
  static constexpr int kChunkThreadsPerRow = kSmemRowElems / kChunkElems;
  static constexpr int kChunkRowsPerPass = kNThreads / kChunkThreadsPerRow;
  using ChunkThreadLayout = cute::Layout<cute::Shape<cute::Int<kChunkRowsPerPass>, cute::Int<kChunkThreadsPerRow>>,
                                         cute::Stride<cute::Int<kChunkThreadsPerRow>, cute::_1>>;
  using ChunkValueLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kChunkElems>>>;
  using GmemTiledLoad =
      decltype(cute::make_tiled_copy(cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
                                     ChunkThreadLayout{}, ChunkValueLayout{}));
  using GmemTiledStore = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{}, ChunkThreadLayout{}, ChunkValueLayout{}));

  static_assert(kBlockM % kMmaM == 0, "query tile must be a whole number of tiled-MMA rows");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "MMA K/N steps are 16 wide");
  static_assert(kHeadDim % kSmemRowElems == 0, "head dim must tile the swizzle atom");
  static_assert(kBlockM % kChunkRowsPerPass == 0 && kBlockN % kChunkRowsPerPass == 0,
                "every thread copies the same number of chunks");
  static_assert(kSmemBytes <= kSmemBudget, "shared memory exceeds the sm80+ per-block budget");
  static_assert(sizeof(Element) * cute::cosize_v<SmemLayoutO> <= sizeof(SharedStorage::q),
                "O staging must fit Q's buffer");
};

}  // namespace flashattn::cuda::sm80

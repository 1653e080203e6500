// Compile-time description of the sm90a (Hopper) forward kernel for one (dtype, head dim, mask
// kind): tile shapes, pipeline depth, warpgroups and the register split between their roles, the
// WGMMA tiled MMAs, the shared-memory layouts (128-byte swizzled, as WGMMA and TMA both read
// them), the TMA copy types and the shared-memory budget.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <cstdint>
#include <type_traits>

#include "../common/sparse_tiles.cuh"
#include "../params.hpp"
#include "forward_launch.hpp"
#include "tile_config.hpp"

namespace flashattn::cuda::sm90 {

// A work tile as the producer decoded it from its scheduler index (the divisions of the tile
// order and the head / batch split), handed to the consumers in shared memory beside its Q: they
// read it where they need it instead of decoding the index again (each decode a chain of integer
// divisions, ~500 cycles, several times a tile on a consumer's path between its tiles).
struct TileSlot {
  int32_t index, m_block, bidh, bidb, bidh_kv;
  int64_t q_start, k_start, seqlen_q, seqlen_k;  // the batch entry's sequence (varlen)
};

// The CTA's warpgroups: the producer, which issues TMA loads from one elected thread, then the
// consumers (kConsumerWarpGroupsFor), each owning 64 rows of the query tile (a WGMMA's M).
enum class WarpGroupRole : int { kProducer = 0, kFirstConsumer = 1 };

template <ElemType kElem>
struct ElementOf;
template <>
struct ElementOf<ElemType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<ElemType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};

// Consumer warpgroups, 64 query rows each. Two, but three at d64 without a mask: there the GEMMs
// are short next to the softmax, and three consumers taking turns (each one's softmax under the
// other two's GEMMs, on 192-row query tiles, as FA3) ran 1.09-1.19x the two at seqlen 1k-16k
// (H100, bf16, same run). A masked d64 call runs two (128-row tiles) or three (192-row tiles: the
// "tall" kernel, kTallConsumers), picked per call by its query length (forward_launch.hpp
// d64_tall).
template <int kHeadDim, MaskKind kMask>
inline constexpr int kConsumerWarpGroupsFor = kHeadDim == 64 && kMask == MaskKind::kNone ? 3 : 2;
inline constexpr int kTallConsumers = 3;
// Varlen batches: masked d64 on the tall kernel at every length, where its consumers skip the
// key tiles past their own rows: causal 1.05-1.10x the two-consumer kernel on short sequences,
// 1.15-1.17x on long ones (gpu_varlen.py mixes, H100, same run; sm90_forward_tuning.md).
template <int kHeadDim, MaskKind kMask>
inline constexpr int kVarlenConsumersFor =
    kHeadDim == 64 && kMask == MaskKind::kMasked ? kTallConsumers : kConsumerWarpGroupsFor<kHeadDim, kMask>;

// Head dims with sm90 kernels (the sm80 family's buckets that have a TileConfig); the others,
// and head dims padded up to a bucket, run the sm80 kernels on Hopper.
inline constexpr int kSm90HeadDims[] = {64, 96, 128, 192, 256};

// How setmaxnreg splits the register file between a CTA's producer warpgroup and its kConsumers
// consumer warpgroups (one CTA an SM), for the forward and backward kernels alike.
//
// The registers the CTA gets at launch (__launch_bounds__ of all its threads, 1: the register
// file split evenly, in steps of 8) are all setmaxnreg can hand out: setmaxnreg.inc waits until
// the CTA's pool has them, so asking for more hangs the consumers (32 / 240 did). The producer
// only issues TMA and gives its registers to the consumers, which hold the accumulators: the
// rest of the launch's registers, split evenly (240 with two consumers, as FA3: the forward's
// d256 O alone is 128 registers a thread, and 232 spilled there; 160 with three). The producer
// fits in 24 because its whole warp walks the loop (warp-uniform state in uniform registers; one
// lane issues); with one lane walking it, it spilled below 40.
template <int kConsumers, int kProducerRegs = 24>
struct WarpGroupRegisters {
  static constexpr int kThreads = (1 + kConsumers) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kRegisterFileWords = 64 * 1024;
  static constexpr int kLaunch = kRegisterFileWords / kThreads / 8 * 8;
  static constexpr int kProducer = kProducerRegs;
  static constexpr int kConsumer =
      (kLaunch * kThreads / cutlass::NumThreadsPerWarpGroup - kProducer) / kConsumers / 8 * 8;
  static_assert((kProducer + kConsumers * kConsumer) * cutlass::NumThreadsPerWarpGroup <= kLaunch * kThreads,
                "the warpgroups' register budgets exceed the CTA's registers at launch");
  static_assert(kProducer % 8 == 0 && kConsumer % 8 == 0, "setmaxnreg takes multiples of 8");
};

// The block-sparse kernel's own shared memory (kSparse, after the rest): the walk of each tile
// handed over (SparseKeyTiles, a ring beside the TileSlots), the producer's own copy of the
// tile it loads (its loads with one Q buffer start before the tile's publish), and the
// listed-block bitmaps that the producer checks a tile's lists with (IndexCheck::kDevice) and
// that a consumer checks broken ones with again, to record the rule.
template <int kSlots>
struct SparseStorage {
  SparseKeyTiles walks[kSlots];
  SparseKeyTiles producer_walk;
  uint32_t listed[kSparseCheckedKeyBlocks / 32];
  uint32_t recheck_listed[kSparseCheckedKeyBlocks / 32];
};
struct NoSparseStorage {};

// kSparse_: the block-sparse kernel (kMask kMasked; the key tiles a block mask lists,
// ForwardParams::block_mask).
template <ElemType kElem, int kHeadDim_, MaskKind kMask, int kConsumers = kConsumerWarpGroupsFor<kHeadDim_, kMask>,
          bool kSparse_ = false>
struct ForwardTraits {
  using Element = typename ElementOf<kElem>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSparse = kSparse_;
  static_assert(!kSparse || kMask == MaskKind::kMasked, "block-sparse: the masked kernel");
  static constexpr int kConsumerWarpGroups = kConsumers;
  static constexpr int kWarpGroupThreads = cutlass::NumThreadsPerWarpGroup;
  static constexpr int kRowsPerConsumer = 64;  // one WGMMA's M
  static constexpr int kBlockM = kConsumerWarpGroups * kRowsPerConsumer;
  static constexpr int kBlockN = TileConfig<kHeadDim>::kBlockN;
  static constexpr int kStages = TileConfig<kHeadDim>::kStages;
  static constexpr int kConsumerThreads = kConsumerWarpGroups * kWarpGroupThreads;
  static constexpr int kNThreads = kWarpGroupThreads + kConsumerThreads;

  // (The block-sparse producer also checks and walks the lists: in 24 registers it spilled
  // 108-504 bytes; in 40 none, and its consumers fit 232.)
  using Registers = WarpGroupRegisters<kConsumerWarpGroups, kSparse ? 40 : 24>;
  static constexpr int kProducerRegs = Registers::kProducer;
  static constexpr int kConsumerRegs = Registers::kConsumer;

  static_assert(kHeadDim % 32 == 0, "rows of whole 64-byte swizzle atoms (32 16-bit columns)");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "WGMMA N and the TMA box bound kBlockN");
  // (kBlockN % 16: P's k16 slices pair up neighbouring n8 blocks of S)

  // S = Q K^T: both operands from shared memory, K-major. O += P V: P from registers, V^T read
  // from V's buffer through a transposed view (MN-major B). Each consumer warpgroup computes 64
  // rows: the atom layout stacks kConsumerWarpGroups WGMMA atoms along M.
  using AtomLayoutMNK = cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<
          Element, Element, float, cute::Shape<cute::Int<kRowsPerConsumer>, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      AtomLayoutMNK{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<
          Element, Element, float, cute::Shape<cute::Int<kRowsPerConsumer>, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
          cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      AtomLayoutMNK{}));

  // 8 rows x 64 columns with the 128-byte swizzle where the head dim allows (fewest bank
  // conflicts), else 8 x 32 with the 64-byte one (d96).
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));  // (M, D)
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));  // (N, D, stages)
  // V^T: (D, N, stages) -> the same bytes as V's (N, D, stages); WGMMA reads it MN-major.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutO = SmemLayoutQ;  // O is staged for its store in its own buffer or in Q's
  // One consumer's 64 rows of O, the box of its TMA store: a TMA box of a swizzled layout is one
  // swizzle atom wide (64 columns with the 128-byte swizzle, 32 with the 64-byte one), and 64 rows
  // of one such column block of SmemLayoutO lie contiguous, laid out as here, so each consumer
  // stores its own rows when it is done, without waiting for the others.
  using SmemLayoutOConsumer =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kRowsPerConsumer>, cute::Int<kHeadDim>>{}));
  using SmemCopyAtomO = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  // Global tensors as TMA sees them: (seqlen, head_dim, heads, batch), strides in elements.
  using ShapeRows = cute::Shape<int32_t, cute::Int<kHeadDim>, int32_t, int32_t>;
  using StrideRows = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemIn =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeRows{}, StrideRows{}));
  using GmemOut =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeRows{}, StrideRows{}));
  using TmaLoadQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemIn{}, SmemLayoutQ{}));
  using TmaLoadKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemIn{}, cute::take<0, 2>(SmemLayoutKV{})));
  using TmaStoreO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemOut{}, SmemLayoutOConsumer{}));

  // Bytes each TMA transaction delivers (out-of-bounds rows are zero-filled and counted too).
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;

  // The swizzled tiles need 1024-byte alignment (the 128-byte swizzle repeats every 8 rows).
  static constexpr int kSmemAlign = 1024;
  static constexpr int kSmemLimit = 227 * 1024;  // sm90's opt-in maximum per block
  // Q buffers: two where shared memory has room (d64 - d128), so the producer loads the next
  // tile's Q while this one's last key tiles run (the consumers then start it without waiting for
  // a load); one at d192 / d256. O gets its own buffer where there is room (d64 - d128); else O is
  // staged in Q's buffer, and the next Q waits for the O stores.
  template <int kQBuffers_, int kOElements>
  struct Storage {
    alignas(kSmemAlign) cute::array_aligned<Element, kQBuffers_ * cute::cosize_v<SmemLayoutQ>> q;
    alignas(kSmemAlign) cute::array_aligned<Element, kOElements> o;
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> k;
    alignas(kSmemAlign) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> v;
    typename PipelineKV::SharedStorage pipeline_k;
    typename PipelineKV::SharedStorage pipeline_v;
    // Per Q buffer: "full" (Q's TMA completes it; the tile travels with it, written by the
    // producer before its arrive) and "empty" (every consumer thread arrives when done with it).
    alignas(8) uint64_t q_full[kQBuffers_];
    alignas(8) uint64_t q_empty[kQBuffers_];
    // The tiles handed over, a ring indexed by the Q load's count: one more entry than Q buffers,
    // so a tile's entry stays until every consumer is done with the next tile's Q (a consumer
    // reads it again for its epilogue, after releasing the tile's Q, or in the next tile).
    TileSlot tiles[kQBuffers_ + 1];
    std::conditional_t<kSparse, SparseStorage<kQBuffers_ + 1>, NoSparseStorage> sparse;
  };
  static constexpr int kOSize = cute::cosize_v<SmemLayoutO>;
  static constexpr bool kSeparateO = sizeof(Storage<1, kOSize>) <= kSmemLimit;
  static constexpr int kQBuffers = kSeparateO && sizeof(Storage<2, kOSize>) <= kSmemLimit ? 2 : 1;
  using SharedStorage = Storage<kQBuffers, kSeparateO ? kOSize : 8>;  // (8: a stub, unused)
  static constexpr int kTileSlots = kQBuffers + 1;
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit, "Q + kStages K/V stages exceed sm90's shared memory");
  static_assert(cute::cosize_v<SmemLayoutO> <= cute::cosize_v<SmemLayoutQ>, "O may be staged in Q's buffer");
};

}  // namespace flashattn::cuda::sm90

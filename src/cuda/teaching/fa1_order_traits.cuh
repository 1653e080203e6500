// Compile-time shape of the FA1-order teaching kernel for one (dtype, head_dim). The tensor-core
// atom, the warps' tiled MMA, the swizzled shared-memory atom and the copy plans are the sm80
// forward's (ForwardTraits); only the tile sizes (fa1_order_params.hpp) and the shared storage
// differ: FA1's order streams Q tiles through the inner loop, so Q is double-buffered like K/V.
#pragma once

#include <cute/tensor.hpp>

#include "../sm80/forward_traits.cuh"
#include "fa1_order_params.hpp"

namespace flashattn::cuda::teaching {

template <ElemType kElem, int kHeadDim_>
struct Fa1Traits : sm80::ForwardTraits<kElem, kHeadDim_, MaskKind::kNone, sm80::TileTarget::kSm80> {
  using Base = sm80::ForwardTraits<kElem, kHeadDim_, MaskKind::kNone, sm80::TileTarget::kSm80>;
  using Element = typename Base::Element;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr Fa1TileShape kShape = fa1_tile_shape(kHeadDim);
  static constexpr int kBlockM = kShape.block_m;  // query rows per step
  static constexpr int kBlockN = kShape.block_n;  // keys per step
  static constexpr int kNWarps = kShape.warps;
  static constexpr int kNThreads = kNWarps * 32;
  // Base's tiled MMA (warps stacked along M, 16 rows each) and copy thread layouts are built for
  // its own warp count.
  static_assert(kNWarps == Base::kNWarps, "the tiled MMA and copy layouts are ForwardTraits'");
  static_assert(kBlockM == 16 * kNWarps, "one m16 row block per warp");

  using SmemLayoutQ = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                    cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as its transpose (head_dim, keys): the B operand of O += P V.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

  // Two stages of everything: the next step's Q tile (and its K/V tile, when the key tile
  // changes) is copied while this step computes, behind one barrier a step.
  static constexpr int kStages = 2;
  static constexpr int kQTileElems = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kKVTileElems = cute::cosize_v<SmemLayoutKV>;
  struct SharedStorage {
    alignas(Base::kSmemAlign) Element q[kStages * kQTileElems];  // stage s at q + s * kQTileElems
    alignas(Base::kSmemAlign) Element k[kStages * kKVTileElems];
    alignas(Base::kSmemAlign) Element v[kStages * kKVTileElems];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr int kSmemBudget = 99 * 1024;  // every sm80+ GPU (sm86 / sm89 offer the least)

  static_assert(kSmemBytes <= kSmemBudget, "shared memory exceeds the sm80+ per-block budget");
  static_assert(kBlockM % Base::kChunkRowsPerPass == 0 && kBlockN % Base::kChunkRowsPerPass == 0,
                "every thread copies the same number of chunks");
  static_assert(kBlockN % 16 == 0, "P's k16 slices are pairs of n8 accumulator atoms");
};

}  // namespace flashattn::cuda::teaching

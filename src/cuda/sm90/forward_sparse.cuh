// The sm90a block-sparse forward's walks of its block mask's lists (Traits::kSparse;
// forward_kernel.cuh): the producer derives a tile's walk (common/sparse_tiles.cuh), checked
// first under IndexCheck::kDevice, into its own entry of shared memory, and publishes it with the
// tile into a ring beside the TileSlots (storage.sparse), where the consumers read it.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "../../core/block_mask.hpp"
#include "../common/sparse_tiles.cuh"
#include "../params.hpp"
#include "forward_traits.cuh"
#include "warpgroup.cuh"

namespace flashattn::cuda::sm90 {

template <class Traits>
struct SparseWalks {
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;

  // The walk of tile d's lists into the producer's entry (lane 0 writes it), checked first under
  // IndexCheck::kDevice by the producer's warp (the bitmap in storage.sparse; the verdict alone:
  // recording which rule broke took more than the producer's registers, so a consumer does that,
  // record_fault); returns its visits, -1 where the lists broke a rule. The consumers see no key
  // either where the mask's window hides every one (the tile's key range empty).
  static __device__ __forceinline__ int producer_walk(const ForwardParams& p, SharedStorage& storage,
                                                      const TileSlot& d) {
    const core::BlockMask& m = p.block_mask;
    const int lane = static_cast<int>(threadIdx.x % cutlass::NumThreadsPerWarp);
    const int64_t m0 = int64_t{d.m_block} * kBlockM;
    // (Before the tile's coordinates, and the check before the walk: either live across it
    // spilled the producer.)
    const bool ok = p.block_mask_fault.claim == nullptr ||
                    block_lists_ok<cutlass::NumThreadsPerWarp, WarpMeet, false>(
                        m, p.block_mask_fault, d.bidb, d.bidh, m0 / m.block_m, storage.sparse.listed, lane);
    SparseKeyTiles w = SparseKeyTiles::make<kBlockM, kBlockN>(m, d.bidb, d.bidh, m0);
    if (!ok) w.visits = -1;
    if (lane == 0) store(storage.sparse.producer_walk, w);
    __syncwarp();
    return w.visits;
  }
  // The producer's walk, published for the consumers with the tile of Q load `load` (before the
  // arrive on its Q's full barrier, which orders it for them).
  static __device__ __forceinline__ void publish(SharedStorage& storage, int load) {
    store(storage.sparse.walks[load % Traits::kTileSlots], load_all(storage.sparse.producer_walk));
  }
  // The walk the consumers read for the tile of Q load `load`.
  static __device__ __forceinline__ const SparseKeyTiles& of(SharedStorage& storage, int load) {
    return storage.sparse.walks[load % Traits::kTileSlots];
  }

  // A walk's fields read where they are used, from shared memory (volatile): the producer (40
  // registers) and the consumers (none to spare at d128) do not hold them through the key loop.
  static __device__ __forceinline__ int tile(const SparseKeyTiles& in_smem, int v) {
    const volatile SparseKeyTiles& f = in_smem;
    SparseKeyTiles w;
    w.partial = f.partial;
    w.full = f.full;
    w.partial_visits = f.partial_visits;
    w.per_block = f.per_block;
    return w.tile(v);
  }
  static __device__ __forceinline__ const uint32_t* bits(const SparseKeyTiles& in_smem, int v) {
    const volatile SparseKeyTiles& f = in_smem;
    SparseKeyTiles w;
    w.bits = f.bits;
    w.block_words = f.block_words;
    w.partial_visits = f.partial_visits;
    w.per_block = f.per_block;
    return w.template bits_of<kBlockN>(v);
  }
  static __device__ __forceinline__ int visits(const SparseKeyTiles& in_smem) {
    return static_cast<const volatile SparseKeyTiles&>(in_smem).visits;
  }
  static __device__ __forceinline__ int words_per_row(const SparseKeyTiles& in_smem) {
    return static_cast<const volatile SparseKeyTiles&>(in_smem).words_per_row;
  }

  // Lists the producer found broken (visits -1): the first consumer's 128 threads (meeting as
  // Meet says) check them again and record the first broken rule, with a bitmap of their own
  // (the producer may be checking the next tile's lists in the other). t: the tile (batch entry
  // bidb, head bidh, first row m0).
  template <class Meet, class Tile>
  static __device__ __forceinline__ void record_fault(const ForwardParams& p, SharedStorage& storage, const Tile& t) {
    if (fresh_thread_idx() / Traits::kWarpGroupThreads != static_cast<int>(WarpGroupRole::kFirstConsumer)) return;
    block_lists_ok<Traits::kWarpGroupThreads, Meet>(p.block_mask, p.block_mask_fault, t.bidb, t.bidh,
                                                    t.m0 / p.block_mask.block_m, storage.sparse.recheck_listed,
                                                    fresh_thread_idx() % Traits::kWarpGroupThreads);
  }

 private:
  template <class To, class From>
  static __device__ __forceinline__ void copy(To& to, From& from) {
    to.partial = from.partial;
    to.full = from.full;
    to.bits = from.bits;
    to.block_words = from.block_words;
    to.words_per_row = from.words_per_row;
    to.partial_visits = from.partial_visits;
    to.visits = from.visits;
    to.per_block = from.per_block;
  }
  static __device__ __forceinline__ void store(SparseKeyTiles& in_smem, const SparseKeyTiles& w) {
    volatile SparseKeyTiles& to = in_smem;
    copy(to, w);
    asm volatile("" ::: "memory");  // (the mbarrier operations after it declare no memory effects)
  }
  static __device__ __forceinline__ SparseKeyTiles load_all(const SparseKeyTiles& in_smem) {
    const volatile SparseKeyTiles& from = in_smem;
    SparseKeyTiles w;
    copy(w, from);
    return w;
  }
};

}  // namespace flashattn::cuda::sm90

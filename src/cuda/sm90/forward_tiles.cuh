// The sm90a forward kernel's parameters and its walk over work tiles: the order the CTAs take
// the (query tile, head, batch) tiles in (Scheduler), a tile's coordinates and the key tiles its
// rows see, and the rows each consumer owns. The producer and the consumers derive the same
// tiles from it (forward_kernel.cuh).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../../core/mask.hpp"
#include "../common/mask.cuh"
#include "../common/sequence.cuh"
#include "../params.hpp"
#include "../tile_order.hpp"
#include "forward_traits.cuh"

namespace flashattn::cuda::sm90 {

// Kernel parameters: the library's ForwardParams plus the TMA descriptors built on the host
// from its pointers and strides (passed as one __grid_constant__ struct, so the descriptors are
// read from parameter memory, where TMA wants them).
template <class Traits>
struct KernelParams {
  ForwardParams params;
  typename Traits::TmaLoadQ tma_q;
  typename Traits::TmaLoadKV tma_k;
  typename Traits::TmaLoadKV tma_v;
  typename Traits::TmaStoreO tma_o;
  typename Traits::ShapeRows shape_q;   // (seqlen_q, D, heads_q, batch)
  typename Traits::ShapeRows shape_kv;  // (max(seqlen_k, 1), D, heads_kv, batch)
};

// Key tiles [begin, end) that some row of the query tile [m0, m0 + rows) may see; the producer
// and the consumers derive the same range.
struct KeyTiles {
  int begin, end;
};
template <int kBlockN, MaskKind kMask>
__device__ __forceinline__ KeyTiles key_tiles(const core::Mask& mask, int64_t m0, int64_t rows) {
  const int n_tiles = static_cast<int>((mask.seqlen_k + kBlockN - 1) / kBlockN);
  KeyTiles t{0, n_tiles};
  if constexpr (kMask != MaskKind::kNone) {
    t.begin = static_cast<int>(mask.key_begin(m0) / kBlockN);
    const int64_t key_end = mask.key_end(m0 + rows);
    t.end = key_end <= 0 ? 0 : static_cast<int>(cute::min(int64_t{n_tiles}, (key_end + kBlockN - 1) / kBlockN));
  }
  if (t.end < t.begin) t.end = t.begin;
  return t;
}

// A read of the varlen arrays that the compiler must repeat: the consumers derive their tile
// again for the epilogue rather than hold it through the main loop, and with plain loads the
// compiler kept the first reads' values live across the loop instead (spilled at d64 and d256).
struct FreshLoad {
  __device__ __forceinline__ int32_t operator()(const int32_t* x) const {
    int32_t v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(x));
    return v;
  }
};

// The tile walk of ForwardKernel<Traits, kMask, kVarlen>, its base.
template <class Traits, MaskKind kMask, bool kVarlen>
struct ForwardTiles {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;

  // The tiles in the order the CTAs take them: without a mask a head's query tiles one after
  // another (the CTAs running at once share its K / V in L2), heads, then batches. Causal /
  // windowed query tiles differ in work: tile_order.hpp deals them heaviest (last) first across
  // a group of heads that share the L2, and the light ones fill the gaps. CTA b starts with tile
  // b; its producer picks the next (b + G, ... for the static walk; with a tile counter, G + the
  // counter's next value, so whichever CTA frees first takes the next tile in the order) and
  // hands it to the consumers with its Q.
  struct Scheduler {
    int m_blocks, tiles;
    __device__ __forceinline__ explicit Scheduler(const ForwardParams& p)
        : m_blocks(static_cast<int>((p.shape.seqlen_q + kBlockM - 1) / kBlockM)),
          tiles(m_blocks * static_cast<int>(p.shape.heads_q * p.shape.batch)) {}
    __device__ __forceinline__ int first() const { return static_cast<int>(blockIdx.x); }
    __device__ __forceinline__ bool valid(int index) const { return index < tiles; }
    // The CTA's next tile after `index`; called by the producer's whole warp (lane 0 takes the
    // counter's next value).
    __device__ __forceinline__ int next(int index, int* counter) const {
      if (counter == nullptr) return index + static_cast<int>(gridDim.x);
      int fetched = 0;
      if (threadIdx.x % cutlass::NumThreadsPerWarp == 0) fetched = atomicAdd(counter, 1);
      return static_cast<int>(gridDim.x) + __shfl_sync(0xffffffffu, fetched, 0);
    }
  };

  // The work tile of a scheduler index. Varlen: the tiling is the longest sequence's, so
  // rows_valid <= 0 for a tile past its own sequence's end; q_start / k_start are the sequence's
  // first rows (0 for dense batches).
  struct Tile {
    int m_block, bidh, bidb;
    int64_t bidh_kv, m0, rows_valid, q_start, k_start;
    core::Mask mask;
    KeyTiles n;
    // Block-sparse (Traits::kSparse): the tile's lists broke a rule (IndexCheck::kDevice), its rows
    // are NaN. Set by the consumers from the tile's walk; the epilogue reads it.
    bool lists_bad = false;
  };
  // The rows and keys of batch entry b (varlen: loaded afresh at each call).
  static __device__ __forceinline__ Sequence sequence(const ForwardParams& p, int bidb) {
    if constexpr (kVarlen) {
      return cuda::sequence(p, bidb, FreshLoad{});
    } else {
      return {0, 0, p.shape.seqlen_q, p.shape.seqlen_k};
    }
  }

  // A tile index's pair (batch entry x heads_q + head) and its rank among the pair's query tiles
  // in the order above (rank 0 first).
  static __device__ __forceinline__ TileOrder<int>::Slot slot(const ForwardParams& p, const Scheduler& sched,
                                                              int index) {
    if constexpr (kMask == MaskKind::kNone) {
      return {index % sched.m_blocks, index / sched.m_blocks};
    } else {
      return TileOrder<int>{sched.m_blocks, sched.tiles / sched.m_blocks, p.tile_group,
                            static_cast<int>(p.tile_last_first)}
          .at(index);
    }
  }

  // A scheduler index decoded (the producer's work; the consumers read the result, TileSlot).
  static __device__ __forceinline__ TileSlot decode(const ForwardParams& p, const Scheduler& sched, int index) {
    TileSlot d;
    const TileOrder<int>::Slot s = slot(p, sched, index);
    const int head_batch = s.pair;
    const int heads = static_cast<int>(p.shape.heads_q);
    d.index = index;
    d.m_block = kMask != MaskKind::kNone ? sched.m_blocks - 1 - s.rank : s.rank;
    d.bidh = head_batch % heads;
    d.bidb = head_batch / heads;
    d.bidh_kv = d.bidh / static_cast<int>(p.shape.heads_q / p.shape.heads_kv);
    const Sequence seq = sequence(p, d.bidb);
    d.q_start = seq.q_start;
    d.k_start = seq.k_start;
    d.seqlen_q = seq.seqlen_q;
    d.seqlen_k = seq.seqlen_k;
    return d;
  }
  // The tile of a decoded index: no division but by the tile sizes.
  static __device__ __forceinline__ Tile tile_of(const ForwardParams& p, const TileSlot& d) {
    Tile t;
    t.m_block = d.m_block;
    t.bidh = d.bidh;
    t.bidb = d.bidb;
    t.bidh_kv = d.bidh_kv;
    t.m0 = int64_t{t.m_block} * kBlockM;
    t.q_start = d.q_start;
    t.k_start = d.k_start;
    t.rows_valid = cute::min(int64_t{kBlockM}, d.seqlen_q - t.m0);
    t.mask = make_mask<kMask>(p, d.seqlen_q, d.seqlen_k);
    t.n = key_tiles<kBlockN, kMask>(t.mask, t.m0, t.rows_valid);
    return t;
  }
  static __device__ __forceinline__ Tile tile(const ForwardParams& p, const Scheduler& sched, int index) {
    return tile_of(p, decode(p, sched, index));
  }
  // Whether a consumer may skip key tiles of its tile: with a mask, where a consumer's 64 rows can
  // end a key tile before the tile's rows do on a square causal diagonal (the d64 tall kernel's
  // 192-row tiles over 128-key tiles; d192's 112, d256's 64). Elsewhere the kernels keep the
  // tile's range: built into the two-consumer d64 kernel, where it never skips, the skipping
  // code measured 4-6% slower at seqlen 1k-2k (same-run A/B, H100; cause not found).
  // The block-sparse kernel walks the lists, not key ranges: no skipping.
  static constexpr bool kSkipTiles = kMask != MaskKind::kNone && kBlockN < kBlockM && !Traits::kSparse;

  // The rows a consumer's key range and edge tiles are derived from: its own 64 (none past
  // seqlen_q: rows <= 0) where it may skip key tiles, else the whole tile's.
  struct Rows {
    int64_t m0, rows;
  };
  static __device__ __forceinline__ Rows own_rows(const Tile& t, int consumer_wg) {
    if constexpr (kSkipTiles) {
      const int64_t m0 = t.m0 + int64_t{consumer_wg} * Traits::kRowsPerConsumer;
      return {m0, cute::min(int64_t{Traits::kRowsPerConsumer}, t.m0 + t.rows_valid - m0)};
    } else {
      return {t.m0, t.rows_valid};
    }
  }
  // The key tiles of t that a consumer's rows r (own_rows) see: a part of t.n, empty for a
  // consumer without rows.
  static __device__ __forceinline__ KeyTiles own_key_tiles(const Tile& t, const Rows& r) {
    if constexpr (kSkipTiles) {
      if (r.rows <= 0) return {t.n.begin, t.n.begin};
      const KeyTiles k = key_tiles<kBlockN, kMask>(t.mask, r.m0, r.rows);
      const int begin = cute::min(cute::max(k.begin, t.n.begin), t.n.end);
      return {begin, cute::max(begin, cute::min(k.end, t.n.end))};
    } else {
      return t.n;
    }
  }
};

}  // namespace flashattn::cuda::sm90

// A query tile's key tiles under a block-sparse mask (core::BlockMask), for the kernels that walk
// its lists instead of a key range: which tiles to visit, which of them need the element bits,
// and where those bits are.
//
// The kernels read the user's lists as they are, which needs the user's blocks to hold whole
// kernel tiles: block_m a multiple of the query tile, block_n of the key tile (the dispatcher's
// rule, supports_forward; FlexAttention's default 128 x 128 holds every sm80 tile). A query
// tile then lies in one query block qb, and each listed key block covers `per_block` key tiles.
// The walk counts visits, not tiles: visit v < tiles() is key tile tile(v), the partial blocks'
// tiles first, then the full ones'. A kernel that walked its key tiles downwards walks the visits
// downwards the same way, so its stage parity and prefetch follow the visit count unchanged.
// 32-bit tile arithmetic (supports_forward bounds seqlen_k).
#pragma once

#include <cstdint>

#include "../../core/block_mask.hpp"
#include "../../core/host_device.hpp"
#include "../index_faults.hpp"
#include "mask.cuh"

namespace flashattn::cuda {

struct SparseKeyTiles {
  const int32_t* partial = nullptr;  // (b, h, qb)'s partial key blocks
  const int32_t* full = nullptr;     // ... and its full ones (null: none)
  // The element bits of the first partial block, at the query tile's row 0 (null: the partial
  // blocks have none, every element of theirs is visible); block_words apart block to block,
  // words_per_row apart row to row.
  const uint32_t* bits = nullptr;
  int64_t block_words = 0;
  int words_per_row = 0;
  int partial_visits = 0, visits = 0;
  int per_block = 1;  // block_n / the kernel's key tile

  // The walk of query tile m0 (rows [m0, m0 + kBlockM)) of (batch entry b, head h).
  template <int kBlockM, int kBlockN>
  FA_HOST_DEVICE static SparseKeyTiles make(const core::BlockMask& m, int64_t b, int64_t h, int64_t m0) {
    SparseKeyTiles w;
    const int64_t qb = m0 / m.block_m;
    w.per_block = static_cast<int>(m.block_n / kBlockN);
    w.partial = m.partial_index_data + m.index_at(b, h, qb);
    const int partial_blocks = static_cast<int>(m.partial_count(b, h, qb));
    const int full_blocks = static_cast<int>(m.full_count(b, h, qb));
    if (full_blocks > 0) w.full = m.full_index_data + m.index_at(b, h, qb);
    w.partial_visits = partial_blocks * w.per_block;
    w.visits = (partial_blocks + full_blocks) * w.per_block;
    if (m.bits != nullptr && partial_blocks > 0) {
      w.words_per_row = static_cast<int>(m.words_per_row());
      w.block_words = m.block_m * m.words_per_row();
      w.bits = m.bits + m.bits_at(b, h, qb, 0) + (m0 % m.block_m) * m.words_per_row();
    }
    return w;
  }

  FA_HOST_DEVICE int tiles() const { return visits; }
  // Visit v's key tile.
  FA_HOST_DEVICE int tile(int v) const {
    const bool in_partial = v < partial_visits;
    const int u = in_partial ? v : v - partial_visits;
    const int e = u / per_block;
    return (in_partial ? partial[e] : full[e]) * per_block + (u - e * per_block);
  }
  // The bit words of visit v's tile at its row 0 (row r at + r * words_per_row, the tile's key c
  // at bit c % 32 of word c / 32), or null where the tile needs no element test.
  template <int kBlockN>
  FA_HOST_DEVICE const uint32_t* bits_of(int v) const {
    if (bits == nullptr || v >= partial_visits) return nullptr;
    const int e = v / per_block;
    return bits + e * block_words + (v - e * per_block) * (kBlockN / 32);
  }
};

// The visible columns of an accumulator row (columns_before's form: bit c for the row's element c,
// at tile column col0 + (c / 2) * 8 + c % 2) by a row of block-mask bit words. Every accumulator
// layout of ours starts a thread's columns at col0 = 2 * (lane % 4) < 8, so element group g
// (c in [8g, 8g + 8)) reads bits col0 + {0, 1, 8, 9, 16, 17, 24, 25} of word g: two shift-and-mask
// steps pack them (a test per element took several instructions an element).
template <int kCols>
CUTE_HOST_DEVICE ColumnBits<kCols> block_bits_columns(const uint32_t* row_words, int col0) {
  static_assert(kCols % 8 == 0, "whole groups of 8 columns (4 column pairs) a thread");
  ColumnBits<kCols> visible = 0;
  CUTE_UNROLL
  for (int g = 0; g < kCols / 8; ++g) {
    uint32_t x = (row_words[g] >> col0) & 0x03030303u;  // pairs at bits 0, 8, 16, 24
    x = (x | (x >> 6)) & 0x000F000Fu;                   // ... at 0, 2, 16, 18
    x = (x | (x >> 12)) & 0xFFu;                        // ... at 0, 2, 4, 6
    visible |= static_cast<ColumnBits<kCols>>(x) << (8 * g);
  }
  return visible;
}

// How the threads that check one tile's lists meet (block_lists_ok's Meet): barrier(), and
// any(pred), true on every thread when pred holds on one (a barrier too). The CTA's threads, or
// one warp's.
struct CtaMeet {
  static __device__ __forceinline__ void barrier() { __syncthreads(); }
  static __device__ __forceinline__ bool any(bool pred) { return __syncthreads_or(pred) != 0; }
};
struct WarpMeet {
  static __device__ __forceinline__ void barrier() { __syncwarp(); }
  static __device__ __forceinline__ bool any(bool pred) {
    const bool result = __any_sync(0xffffffffu, pred);
    __syncwarp();  // (memory order: the bitmap's marks before a next call's zeroing)
    return result;
  }
};

// IndexCheck::kDevice: whether (b, h, qb)'s lists keep core::block_mask_error's rules (counts
// within [0, key_blocks], entries within [0, key_blocks) and listed once, bits_block's run within
// the bits), checked by the kThreads threads that meet as Meet says before any of them walks the
// lists; with kRecord the first broken rule found is recorded in `sink` (without, the check needs
// few registers: the sm90 producer's). `listed` is shared memory for a bitmap of the key blocks
// (key_blocks bits; the caller bounds key_blocks by its bitmap and by 2^31), free until the call
// returns. Every thread returns the same verdict.
template <int kThreads, class Meet = CtaMeet, bool kRecord = true>
__device__ __forceinline__ bool block_lists_ok(const core::BlockMask& m, const IndexFaultSink& sink, int64_t b,
                                               int64_t h, int64_t qb, uint32_t* listed, int tid) {
  const int key_blocks = static_cast<int>(m.key_blocks);
  for (int w = tid; w < (key_blocks + 31) / 32; w += kThreads) listed[w] = 0u;
  auto fault = [&](IndexArgument argument, bool full, int64_t value, int64_t low, int64_t high) {
    if constexpr (kRecord) {
      IndexFault f;
      f.argument = static_cast<int32_t>(argument);
      f.batch = b;
      f.column = h;
      f.row = qb;
      f.value = value;
      f.low = low;
      f.high = high;
      f.rule = full ? 1 : 0;
      f.call = static_cast<int32_t>(FaultingCall::kBlockSparseForward);
      record_index_fault(sink, f);
    }
  };
  const int64_t counts = m.count_at(b, h, qb);
  const int32_t partial = m.partial_count_data[counts];
  const int32_t full = m.full_count_data == nullptr ? 0 : m.full_count_data[counts];
  bool bad = false;
  if (partial < 0 || partial > key_blocks) {
    if (tid == 0) fault(IndexArgument::kBlockCount, false, partial, 0, key_blocks);
    bad = true;
  } else if (full < 0 || full > key_blocks) {
    if (tid == 0) fault(IndexArgument::kBlockCount, true, full, 0, key_blocks);
    bad = true;
  } else if (m.bits != nullptr) {
    const int64_t first = m.bits_block[counts];
    if (first < 0 || first + partial > m.bits_blocks) {
      if (tid == 0) fault(IndexArgument::kBlockBitsFirst, false, first, partial, m.bits_blocks);
      bad = true;
    }
  }
  Meet::barrier();  // the bitmap zeroed
  if (!bad) {
    const int64_t lists = m.index_at(b, h, qb);
    for (int e = tid; e < partial + full; e += kThreads) {
      const bool in_full = e >= partial;
      const int32_t kb = in_full ? m.full_index_data[lists + (e - partial)] : m.partial_index_data[lists + e];
      if (kb < 0 || kb >= key_blocks) {
        fault(IndexArgument::kBlockIndex, in_full, kb, 0, key_blocks - 1);
        bad = true;
      } else {
        const uint32_t bit = 1u << (kb % 32);
#if defined(__CUDA_ARCH__)
        const uint32_t before = atomicOr(listed + kb / 32, bit);
#else  // the kernels' code run on CPU threads (tests)
        const uint32_t before = __atomic_fetch_or(listed + kb / 32, bit, __ATOMIC_RELAXED);
#endif
        if (before & bit) {
          fault(IndexArgument::kBlockTwice, in_full, kb, 0, key_blocks - 1);
          bad = true;
        }
      }
    }
  }
  return !Meet::any(bad);
}

}  // namespace flashattn::cuda

// Block-sparse masks in FlexAttention's form, and how a kernel's tiles see them
// (docs/design/programmable-attention.md). A block mask at block size (block_m, block_n) says,
// for each (batch entry b, head h, query block qb):
//   partial key blocks: the first partial_count(b, h, qb) entries of its partial index list
//                       (FlexAttention's kv_num_blocks / kv_indices): some of their elements
//                       are visible, and their element bits say which;
//   full key blocks:    the first full_count(b, h, qb) entries of its full index list
//                       (full_kv_num_blocks / full_kv_indices): every element is visible;
// every other key block is hidden. Row i sees key j iff that says so and both are within the
// sequence. The element bits of a partial block are block_m rows of words_per_row() 32-bit
// words, bit j % 32 of word j / 32 for key j of the block (its own coordinates); only partial
// blocks have bits (bits_at).
//
// A kernel does not read this form in its key loop: its tiles are not the user's blocks. The
// library turns it, once per mask and tile shape, into each query tile's list of key tiles to
// visit (kernel_tiles): a tile is hidden when every block cell it overlaps is hidden, full when
// every one is full, else partial (the element bits decide). A full tile needs no element test
// for the block mask; the sequence's own bounds and core::Mask's window still apply.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "host_device.hpp"

namespace flashattn::core {

struct BlockMask {
  int64_t block_m = 128, block_n = 128;
  int64_t query_blocks = 0, key_blocks = 0;  // the lists' extents: blocks of the longest sequence
  // [batch, heads, query_blocks] counts and [batch, heads, query_blocks, key_blocks] indices
  // (int32, as PyTorch's BlockMask holds them), addressed by element strides; a batch or head
  // stride of 0 broadcasts one mask over every batch entry or head.
  const int32_t* partial_count_data = nullptr;
  const int32_t* partial_index_data = nullptr;
  const int32_t* full_count_data = nullptr;  // null: no full blocks
  const int32_t* full_index_data = nullptr;
  int64_t count_batch_stride = 0, count_head_stride = 0;  // counts: query block stride 1
  int64_t index_batch_stride = 0, index_head_stride = 0;  // indices: query block stride key_blocks
  const uint32_t* bits = nullptr;       // element bits of the partial blocks; null: every element visible
  const int32_t* bits_block = nullptr;  // [batch, heads, query_blocks] as the counts: bits_at
  int64_t bits_blocks = 0;              // the partial blocks `bits` holds (block_mask_error checks)
  // The most key blocks a CUDA kernel checks the lists of itself (IndexCheck::kDevice): a bitmap
  // of them fits the smallest K / V stage (4 KB; cuda/common/sparse_tiles.cuh block_lists_ok).
  static constexpr int64_t kDeviceCheckedKeyBlocks = 32768;

  FA_HOST_DEVICE bool present() const { return partial_count_data != nullptr; }

  FA_HOST_DEVICE int64_t words_per_row() const { return (block_n + 31) / 32; }
  FA_HOST_DEVICE int64_t count_at(int64_t b, int64_t h, int64_t qb) const {
    return b * count_batch_stride + h * count_head_stride + qb;
  }
  FA_HOST_DEVICE int64_t index_at(int64_t b, int64_t h, int64_t qb) const {
    return b * index_batch_stride + h * index_head_stride + qb * key_blocks;
  }
  FA_HOST_DEVICE int64_t partial_count(int64_t b, int64_t h, int64_t qb) const {
    return partial_count_data[count_at(b, h, qb)];
  }
  FA_HOST_DEVICE int64_t full_count(int64_t b, int64_t h, int64_t qb) const {
    return full_count_data == nullptr ? 0 : full_count_data[count_at(b, h, qb)];
  }

  // What block (qb, kb) of (b, h) is, and for a partial block its slot in the list.
  enum class Cell { kHidden, kPartial, kFull };
  FA_HOST_DEVICE Cell cell(int64_t b, int64_t h, int64_t qb, int64_t kb, int64_t* slot = nullptr) const {
    for (int64_t s = 0, n = full_count(b, h, qb); s < n; ++s) {  // (n is 0 without full lists)
      if (full_index_data[index_at(b, h, qb) + s] == kb) return Cell::kFull;
    }
    const int32_t* partial = partial_index_data + index_at(b, h, qb);
    for (int64_t s = 0, n = partial_count(b, h, qb); s < n; ++s) {
      if (partial[s] == kb) {
        if (slot != nullptr) *slot = s;
        return Cell::kPartial;
      }
    }
    return Cell::kHidden;
  }

  // Whether row i sees key j by the block mask alone (the sequence bounds are the caller's).
  FA_HOST_DEVICE bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    int64_t slot = 0;
    const int64_t qb = i / block_m, kb = j / block_n;
    switch (cell(b, h, qb, kb, &slot)) {
      case Cell::kFull:
        return true;
      case Cell::kHidden:
        return false;
      case Cell::kPartial:
        break;
    }
    if (bits == nullptr) return true;
    const uint32_t word = bits[bits_at(b, h, qb, slot) + (i % block_m) * words_per_row() + (j % block_n) / 32];
    return (word >> (j % block_n % 32)) & 1u;
  }

  // First word of the element bits of the s-th partial block of (b, h, qb): the partial blocks'
  // bits lie block after block, those of (b, h, qb) from block bits_block[count_at(b, h, qb)] on.
  FA_HOST_DEVICE int64_t bits_at(int64_t b, int64_t h, int64_t qb, int64_t slot) const {
    return (int64_t{bits_block[count_at(b, h, qb)]} + slot) * block_m * words_per_row();
  }

  // What rows [i0, i1) x keys [j0, j1) (both non-empty) are by the blocks they overlap: hidden
  // when every one is hidden, full when every one is full, else partial.
  FA_HOST_DEVICE Cell range(int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    bool any = false, all_full = true;
    for (int64_t qb = i0 / block_m; qb <= (i1 - 1) / block_m; ++qb) {
      for (int64_t kb = j0 / block_n; kb <= (j1 - 1) / block_n; ++kb) {
        const Cell c = cell(b, h, qb, kb);
        any = any || c != Cell::kHidden;
        all_full = all_full && c == Cell::kFull;
      }
    }
    return !any ? Cell::kHidden : all_full ? Cell::kFull : Cell::kPartial;
  }
};

// The backward's view of a block mask: its transpose, which the key-tile walks read. One int32
// cell per (batch entry, query head, key block, query block) of the call, row(b, h, kb)[qb]:
//   kCellHidden (0)   block (qb, kb) is hidden;
//   kCellWhole (-1)   every element of it is visible by the block mask (a full block, or a
//                     partial one of a mask without element bits);
//   c > 0             partial: its element bits are block c - 1 of BlockMask::bits.
// The caller zeroes the cells, then fill_block_cells marks each list entry's (the CUDA backend
// does both on the device, before the backward kernel).
struct BlockCells {
  int32_t* data = nullptr;
  int64_t heads = 0, key_blocks = 0, query_blocks = 0;  // heads_q; the lists' extents

  FA_HOST_DEVICE bool present() const { return data != nullptr; }
  FA_HOST_DEVICE int64_t size(int64_t batch) const { return batch * heads * key_blocks * query_blocks; }
  FA_HOST_DEVICE int32_t* row(int64_t b, int64_t h, int64_t kb) const {
    return data + ((b * heads + h) * key_blocks + kb) * query_blocks;
  }
};
inline constexpr int32_t kCellHidden = 0, kCellWhole = -1;

// Marks the cells of (b, h, qb)'s listed key blocks, entries first, first + stride, ... (a
// thread's share; entries outside [0, key_blocks) are skipped: validation refuses them).
FA_HOST_DEVICE void fill_block_cells(const BlockMask& m, const BlockCells& cells, int64_t b, int64_t h, int64_t qb,
                                     int64_t first, int64_t stride) {
  const int64_t partial = m.partial_count(b, h, qb), full = m.full_count(b, h, qb);
  const int64_t lists = m.index_at(b, h, qb);
  for (int64_t e = first; e < partial + full; e += stride) {
    const bool in_full = e >= partial;
    const int32_t kb = in_full ? m.full_index_data[lists + (e - partial)] : m.partial_index_data[lists + e];
    if (kb < 0 || kb >= cells.key_blocks) continue;
    const int32_t code =
        in_full || m.bits == nullptr ? kCellWhole : static_cast<int32_t>(m.bits_block[m.count_at(b, h, qb)] + e) + 1;
    cells.row(b, h, kb)[qb] = code;
  }
}

// The first thing wrong with a block mask for sequences of at most (seqlen_q, seqlen_k), named
// by its argument; empty when it is well formed: positive block sizes, lists covering the
// sequences' blocks, counts within [0, key_blocks], indices within [0, key_blocks) and no key
// block listed twice for one query block (in one list or both).
inline std::string block_mask_error(const BlockMask& m, int64_t batch, int64_t heads, int64_t seqlen_q,
                                    int64_t seqlen_k) {
  if (m.block_m < 1 || m.block_n < 1) {
    return "block_mask: block size (" + std::to_string(m.block_m) + ", " + std::to_string(m.block_n) +
           ") must be positive";
  }
  if (m.partial_count_data == nullptr || m.partial_index_data == nullptr) {
    return "block_mask: kv_num_blocks and kv_indices are required";
  }
  if ((m.full_count_data == nullptr) != (m.full_index_data == nullptr)) {
    return "block_mask: full_kv_num_blocks and full_kv_indices come together";
  }
  const int64_t need_q = (seqlen_q + m.block_m - 1) / m.block_m, need_k = (seqlen_k + m.block_n - 1) / m.block_n;
  if (m.query_blocks < need_q || m.key_blocks < need_k) {
    return "block_mask: " + std::to_string(m.query_blocks) + " x " + std::to_string(m.key_blocks) +
           " blocks do not cover seqlen_q " + std::to_string(seqlen_q) + " x seqlen_k " + std::to_string(seqlen_k) +
           " in blocks of (" + std::to_string(m.block_m) + ", " + std::to_string(m.block_n) + ")";
  }
  std::vector<int64_t> seen(static_cast<size_t>(m.key_blocks), -1);
  int64_t stamp = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t qb = 0; qb < m.query_blocks; ++qb, ++stamp) {
        const auto where = " at (batch " + std::to_string(b) + ", head " + std::to_string(h) + ", query block " +
                           std::to_string(qb) + ")";
        for (const bool full : {false, true}) {
          if (full && m.full_count_data == nullptr) continue;
          const char* name = full ? "full_kv" : "kv";
          const int64_t n = full ? m.full_count(b, h, qb) : m.partial_count(b, h, qb);
          if (n < 0 || n > m.key_blocks) {
            return std::string("block_mask: ") + name + "_num_blocks " + std::to_string(n) + where + " outside [0, " +
                   std::to_string(m.key_blocks) + "]";
          }
          const int32_t* index = (full ? m.full_index_data : m.partial_index_data) + m.index_at(b, h, qb);
          for (int64_t s = 0; s < n; ++s) {
            if (index[s] < 0 || index[s] >= m.key_blocks) {
              return std::string("block_mask: ") + name + "_indices entry " + std::to_string(index[s]) + where +
                     " outside [0, " + std::to_string(m.key_blocks) + ")";
            }
            if (seen[static_cast<size_t>(index[s])] == stamp) {
              return "block_mask: key block " + std::to_string(index[s]) + " listed twice" + where;
            }
            seen[static_cast<size_t>(index[s])] = stamp;
          }
          if (!full && m.bits != nullptr) {
            const int64_t first = m.bits_block[m.count_at(b, h, qb)];
            if (first < 0 || first + n > m.bits_blocks) {
              return "block_mask: bits_block entry " + std::to_string(first) + where + " with " + std::to_string(n) +
                     " partial blocks is outside the " + std::to_string(m.bits_blocks) + " blocks of bits";
            }
          }
        }
      }
    }
  }
  return {};
}

// A query tile's key tiles to visit, in ascending order: tile index and whether the block mask
// shows it whole.
struct KernelTile {
  int64_t key_tile;
  bool full;
};

// The kernel's view of one (batch entry, head) of a mask block_mask_error accepts: for each
// query tile of tile_m rows (of seqlen_q), the key tiles of tile_n keys (of seqlen_k) that any
// of its rows may see by the block mask, entries [offsets[t], offsets[t + 1]) of `tiles`: the
// host's form of the conversion.
struct KernelTiles {
  std::vector<int64_t> offsets;
  std::vector<KernelTile> tiles;
};
inline KernelTiles kernel_tiles(const BlockMask& m, int64_t b, int64_t h, int64_t seqlen_q, int64_t seqlen_k,
                                int64_t tile_m, int64_t tile_n) {
  KernelTiles out;
  const int64_t query_tiles = (seqlen_q + tile_m - 1) / tile_m, key_tiles = (seqlen_k + tile_n - 1) / tile_n;
  const int64_t key_blocks = (seqlen_k + m.block_n - 1) / m.block_n;
  // Per key block, over the query blocks a tile's rows overlap: seen in some (partial or full),
  // and full in all.
  std::vector<char> seen(static_cast<size_t>(key_blocks)), full_in_all(static_cast<size_t>(key_blocks)),
      full_here(static_cast<size_t>(key_blocks));
  out.offsets.reserve(static_cast<size_t>(query_tiles + 1));
  out.offsets.push_back(0);
  for (int64_t t = 0; t < query_tiles; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    std::fill(full_in_all.begin(), full_in_all.end(), 1);
    const int64_t qb_begin = t * tile_m / m.block_m,
                  qb_end = (std::min(seqlen_q, (t + 1) * tile_m) - 1) / m.block_m + 1;
    for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
      std::fill(full_here.begin(), full_here.end(), 0);
      for (int64_t s = 0, n = m.full_count(b, h, qb); s < n; ++s) {  // (n is 0 without full lists)
        const int32_t kb = m.full_index_data[m.index_at(b, h, qb) + s];
        if (kb < key_blocks) full_here[static_cast<size_t>(kb)] = seen[static_cast<size_t>(kb)] = 1;
      }
      const int32_t* partial = m.partial_index_data + m.index_at(b, h, qb);
      for (int64_t s = 0, n = m.partial_count(b, h, qb); s < n; ++s) {
        if (partial[s] < key_blocks) seen[static_cast<size_t>(partial[s])] = 1;
      }
      for (int64_t kb = 0; kb < key_blocks; ++kb)
        full_in_all[static_cast<size_t>(kb)] &= full_here[static_cast<size_t>(kb)];
    }
    for (int64_t k = 0; k < key_tiles; ++k) {
      const int64_t kb_begin = k * tile_n / m.block_n,
                    kb_end = (std::min(seqlen_k, (k + 1) * tile_n) - 1) / m.block_n + 1;
      bool any = false, all_full = true;
      for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
        any = any || seen[static_cast<size_t>(kb)];
        all_full = all_full && seen[static_cast<size_t>(kb)] && full_in_all[static_cast<size_t>(kb)];
      }
      if (any) out.tiles.push_back({k, all_full});
    }
    out.offsets.push_back(static_cast<int64_t>(out.tiles.size()));
  }
  return out;
}

}  // namespace flashattn::core

// Where the keys of a KV cache live, one definition for every backend (the CPU's Operand::offset
// and the CUDA decode kernels): key j of sequence b is position pos = leftpad[b] + j of that
// sequence, which is row pos of cache entry batch_idx[b] (a contiguous cache; b when batch_idx is
// absent), or, paged, row pos % page_size of block block_table[b][pos / page_size]. Plain data:
// the pointers are host or device memory as the backend's tensors are.
#pragma once

#include <cstdint>

#include "host_device.hpp"

namespace flashattn::core {

struct CacheRows {
  const int32_t* batch_idx = nullptr;    // [batch]
  const int32_t* leftpad = nullptr;      // [batch]
  const int32_t* block_table = nullptr;  // [batch, blocks per sequence]
  int64_t block_table_stride = 0;        // elements between batch rows of block_table
  int64_t page_size = 0;                 // rows per block; 0 = not paged

  FA_HOST_DEVICE bool active() const { return batch_idx || leftpad || block_table; }
  FA_HOST_DEVICE bool paged() const { return block_table != nullptr; }
  FA_HOST_DEVICE int64_t first_position(int64_t b) const { return leftpad ? leftpad[b] : 0; }

  // Offset in elements of position `pos` (leftpad not applied) of sequence b, head h, in a
  // cache whose rows have `l`'s batch / row / head strides.
  template <class Layout>
  FA_HOST_DEVICE int64_t position_offset(const Layout& l, int64_t b, int64_t pos, int64_t h) const {
    if (block_table) {
      const int64_t block = block_table[b * block_table_stride + pos / page_size];
      return block * l.batch_stride + (pos % page_size) * l.row_stride + h * l.head_stride;
    }
    const int64_t entry = batch_idx ? batch_idx[b] : b;
    return entry * l.batch_stride + pos * l.row_stride + h * l.head_stride;
  }
};

}  // namespace flashattn::core

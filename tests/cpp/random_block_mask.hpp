// A random block mask (core/block_mask.hpp) with its truth table, for the tests of the mask's
// own functions and of the backends that honour it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/block_mask.hpp"
#include "flashattn/flashattn.hpp"

namespace fa_test {

namespace core = flashattn::core;

// A block mask's arrays, in the layout core::BlockMask and BlockMaskOptions address: [batch,
// heads, query_blocks] counts and bits_block, [.., key_blocks] index rows, bits block after block.
struct BlockMaskStorage {
  core::BlockMask mask;
  std::vector<int32_t> partial_count, partial_index, full_count, full_index;
  std::vector<int32_t> bits_block;
  std::vector<uint32_t> bits;
  int64_t batch = 0, heads = 0, sq = 0, sk = 0;

  BlockMaskStorage(const BlockMaskStorage&) = delete;  // `mask` points into the vectors
  BlockMaskStorage(int64_t batch_, int64_t heads_, int64_t sq_, int64_t sk_, int64_t bm, int64_t bn,
                   int64_t query_blocks)
      : batch(batch_), heads(heads_), sq(sq_), sk(sk_) {
    mask.block_m = bm;
    mask.block_n = bn;
    mask.query_blocks = query_blocks;
    mask.key_blocks = (sk + bn - 1) / bn;
    const int64_t cells = batch * heads * query_blocks;
    partial_count.assign(static_cast<size_t>(cells), 0);
    full_count.assign(static_cast<size_t>(cells), 0);
    partial_index.assign(static_cast<size_t>(cells * mask.key_blocks), -7);
    full_index.assign(static_cast<size_t>(cells * mask.key_blocks), -7);
    bits_block.assign(static_cast<size_t>(cells), 0);
  }
  int64_t block_words() const { return mask.block_m * mask.words_per_row(); }
  // Lists key block kb of cell c (= (b * heads + h) * query_blocks + qb) as full or partial; a
  // partial one takes the next block of bits, which the caller appends.
  void list(int64_t c, int32_t kb, bool full) {
    auto& count = full ? full_count : partial_count;
    auto& index = full ? full_index : partial_index;
    index[static_cast<size_t>(c * mask.key_blocks + count[static_cast<size_t>(c)]++)] = kb;
  }
  // Points `mask` at the vectors (once they are final).
  void point() {
    core::BlockMask& m = mask;
    m.partial_count_data = partial_count.data();
    m.partial_index_data = partial_index.data();
    m.full_count_data = full_count.data();
    m.full_index_data = full_index.data();
    m.count_head_stride = m.query_blocks;
    m.count_batch_stride = heads * m.query_blocks;
    m.index_head_stride = m.query_blocks * m.key_blocks;
    m.index_batch_stride = heads * m.query_blocks * m.key_blocks;
    m.bits = bits.data();
    m.bits_block = bits_block.data();
    m.bits_blocks = static_cast<int64_t>(bits.size()) / block_words();
  }
  // The public API's view of the arrays.
  flashattn::BlockMaskOptions options() const {
    using flashattn::DType;
    using flashattn::TensorView;
    const int64_t qb = mask.query_blocks, kb = mask.key_blocks;
    flashattn::BlockMaskOptions o;
    o.block_m = mask.block_m;
    o.block_n = mask.block_n;
    o.kv_num_blocks = TensorView::contiguous(partial_count.data(), DType::kInt32, {batch, heads, qb});
    o.kv_indices = TensorView::contiguous(partial_index.data(), DType::kInt32, {batch, heads, qb, kb});
    o.full_kv_num_blocks = TensorView::contiguous(full_count.data(), DType::kInt32, {batch, heads, qb});
    o.full_kv_indices = TensorView::contiguous(full_index.data(), DType::kInt32, {batch, heads, qb, kb});
    o.bits =
        TensorView::contiguous(bits.data(), DType::kInt32,
                               {static_cast<int64_t>(bits.size()) / block_words(), mask.block_m, mask.words_per_row()});
    o.bits_block = TensorView::contiguous(bits_block.data(), DType::kInt32, {batch, heads, qb});
    return o;
  }
};

// A random block mask with its truth table: every (b, h, query block, key block) cell hidden,
// partial (random bits; some blocks all zeros or all ones) or full, listed in a random order.
struct RandomBlockMask : BlockMaskStorage {
  std::vector<char> truth;  // [batch, heads, seqlen_q, seqlen_k]

  RandomBlockMask(std::mt19937_64& rng, int64_t batch_, int64_t heads_, int64_t sq_, int64_t sk_, int64_t bm,
                  int64_t bn)  // one spare query block: lists may be longer than needed
      : BlockMaskStorage(batch_, heads_, sq_, sk_, bm, bn, (sq_ + bm - 1) / bm + 1) {
    const core::BlockMask& m = mask;
    const int64_t words = m.words_per_row(), cells = batch * heads * m.query_blocks;
    truth.assign(static_cast<size_t>(batch * heads * sq * sk), 0);
    std::uniform_int_distribution<int> kind(0, 3);
    for (int64_t c = 0; c < cells; ++c) {
      const int64_t b = c / (heads * m.query_blocks), h = c / m.query_blocks % heads, qb = c % m.query_blocks;
      std::vector<int32_t> order(static_cast<size_t>(m.key_blocks));
      for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int32_t>(k);
      std::shuffle(order.begin(), order.end(), rng);
      bits_block[static_cast<size_t>(c)] = static_cast<int32_t>(static_cast<int64_t>(bits.size()) / block_words());
      for (const int32_t kb : order) {
        const int k = kind(rng);  // 0 hidden, 1 full, 2-3 partial
        if (k == 0) continue;
        list(c, kb, k == 1);
        if (k >= 2) {
          const int pattern = static_cast<int>(rng() % 4);  // all zeros, all ones, random twice
          for (int64_t w = 0; w < block_words(); ++w) {
            bits.push_back(pattern == 0 ? 0u : pattern == 1 ? ~0u : static_cast<uint32_t>(rng()));
          }
        }
        for (int64_t i = qb * bm; i < std::min(sq, (qb + 1) * bm); ++i) {
          for (int64_t j = int64_t{kb} * bn; j < std::min(sk, (kb + 1) * bn); ++j) {
            bool v = true;
            if (k >= 2) {
              const size_t at = bits.size() - static_cast<size_t>(block_words()) +
                                static_cast<size_t>((i - qb * bm) * words + (j - kb * bn) / 32);
              v = (bits[at] >> ((j - kb * bn) % 32)) & 1u;
            }
            truth[static_cast<size_t>(((b * heads + h) * sq + i) * sk + j)] = v;
          }
        }
      }
    }
    point();
  }
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return truth[static_cast<size_t>(((b * heads + h) * sq + i) * sk + j)];
  }
};

// The block mask of a predicate visible(b, h, i, j), as FlexAttention's create_block_mask builds
// one: blocks wholly visible listed full, wholly hidden ones left out, the rest partial with
// their bits.
struct PredicateBlockMask : BlockMaskStorage {
  template <class Visible>
  PredicateBlockMask(int64_t batch_, int64_t heads_, int64_t sq_, int64_t sk_, int64_t bm, int64_t bn,
                     Visible&& visible)
      : BlockMaskStorage(batch_, heads_, sq_, sk_, bm, bn, (sq_ + bm - 1) / bm) {
    const int64_t words = mask.words_per_row();
    for (int64_t c = 0; c < batch * heads * mask.query_blocks; ++c) {
      const int64_t b = c / (heads * mask.query_blocks), h = c / mask.query_blocks % heads, qb = c % mask.query_blocks;
      bits_block[static_cast<size_t>(c)] = static_cast<int32_t>(static_cast<int64_t>(bits.size()) / block_words());
      for (int64_t kb = 0; kb < mask.key_blocks; ++kb) {
        std::vector<uint32_t> block(static_cast<size_t>(block_words()), 0u);
        bool any = false, all = true;
        for (int64_t i = qb * bm; i < std::min(sq, (qb + 1) * bm); ++i) {
          for (int64_t j = kb * bn; j < std::min(sk, (kb + 1) * bn); ++j) {
            const bool v = visible(b, h, i, j);
            any = any || v;
            all = all && v;
            if (v) block[static_cast<size_t>((i - qb * bm) * words + (j - kb * bn) / 32)] |= 1u << ((j - kb * bn) % 32);
          }
        }
        if (!any) continue;
        list(c, static_cast<int32_t>(kb), all);
        if (!all) bits.insert(bits.end(), block.begin(), block.end());
      }
    }
    if (bits.empty()) bits.assign(static_cast<size_t>(block_words()), 0u);  // (a non-empty tensor)
    point();
  }
};

}  // namespace fa_test

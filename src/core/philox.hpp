// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// dropout keep-mask convention every backend follows. A query row's keys go in chunks of 32;
// within a chunk, the 8 keys j with the same (j % 8) / 2 share one Philox call, 16 bits each:
//   key       = (lo32(seed), hi32(seed))
//   counter   = (group(j), i, lo32(bh + offset), hi32(bh + offset)),  bh = batch * heads_q + head
//   group(j)  = 4 * (j / 32) + (j % 8) / 2
//   bits      = 16-bit half (j % 2) of output word (j % 32) / 8  (half 0: the low 16 bits)
//   keep      = bits >= threshold,  threshold = min(ceil(p * 2^16), 2^16 - 1)
// where (i, j) are the query and key positions inside their sequence. Why these groups: in the
// tensor-core accumulator layouts (mma.sync m16n8 and WGMMA alike) a thread holds keys 2t, 2t + 1
// of every 8, so one call serves 8 of a thread's elements; with a call per 4 consecutive keys (the
// first convention), a thread used 2 of its 4 words, and the kernels with dropout ran at 0.2x of
// those without (H100, d64). p is applied in steps of 2^-16 (rounded up); O is scaled by 1 / (1 - p).
#pragma once

#include <cstdint>

#include "host_device.hpp"

namespace flashattn::core {

struct Philox4 {
  uint32_t x[4];
};

FA_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * ctr.x[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * ctr.x[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = {{hi1 ^ ctr.x[1] ^ k0, lo1, hi0 ^ ctr.x[3] ^ k1, lo0}};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// The dropout threshold for probability p in [0, 1): a 16-bit value r is kept iff r >= it.
FA_HOST_DEVICE uint32_t dropout_threshold(double p) {
  constexpr double kSteps = 65536.0;
  const double t = p * kSteps;
  const auto up = static_cast<uint32_t>(t);
  const uint32_t ceil_t = static_cast<double>(up) < t ? up + 1 : up;
  return ceil_t > 65535u ? 65535u : ceil_t;
}

// The Philox call (its counter's first word) that serves key j.
FA_HOST_DEVICE uint32_t dropout_group(int64_t j) { return static_cast<uint32_t>(4 * (j >> 5) + ((j >> 1) & 3)); }

// The four Philox words of one group of query row i of (batch, head) bh.
FA_HOST_DEVICE Philox4 dropout_words(uint64_t seed, uint64_t offset, uint64_t bh, uint32_t i, uint32_t group) {
  const uint64_t stream = bh + offset;
  const Philox4 ctr = {{group, i, static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Key j's 16 random bits from its group's words (selects: no dynamic register indexing on GPUs).
FA_HOST_DEVICE uint32_t dropout_bits(const Philox4& w, int64_t j) {
  const int64_t b = (j >> 3) & 3;
  const uint32_t word = b == 0 ? w.x[0] : b == 1 ? w.x[1] : b == 2 ? w.x[2] : w.x[3];
  return (j & 1) != 0 ? word >> 16 : word & 0xFFFFu;
}

// The keep bits of the 8 keys j0 + 8b + e (b < 4, e < 2) of one group, bit 2b + e, where j0 is
// the group's first key (j0 % 32 < 8, even): one call, and each word's halves compared without
// unpacking (the high half is >= t iff the word is >= t * 2^16).
FA_HOST_DEVICE uint32_t dropout_keep8(uint64_t seed, uint64_t offset, uint64_t bh, uint32_t i, int64_t j0,
                                      uint32_t threshold) {
  const Philox4 w = dropout_words(seed, offset, bh, i, dropout_group(j0));
  uint32_t bits = 0;
  for (int b = 0; b < 4; ++b) {
    bits |= static_cast<uint32_t>((w.x[b] & 0xFFFFu) >= threshold) << (2 * b);
    bits |= static_cast<uint32_t>(w.x[b] >= (threshold << 16)) << (2 * b + 1);
  }
  return bits;
}

// The keep bits of the 32 keys 32 * chunk .. 32 * chunk + 31 of query row i (bit j % 32): the
// chunk's four calls, for code that walks keys in order (the CPU backend).
FA_HOST_DEVICE uint32_t dropout_keep32(uint64_t seed, uint64_t offset, uint64_t bh, uint32_t i, int64_t chunk,
                                       uint32_t threshold) {
  uint32_t keep = 0;
  for (int t = 0; t < 4; ++t) {
    const uint32_t bits = dropout_keep8(seed, offset, bh, i, 32 * chunk + 2 * t, threshold);
    for (int b = 0; b < 4; ++b) keep |= ((bits >> (2 * b)) & 3u) << (8 * b + 2 * t);
  }
  return keep;
}

FA_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t bh, int64_t i, int64_t j,
                                 uint32_t threshold) {
  const Philox4 w = dropout_words(seed, offset, bh, static_cast<uint32_t>(i), dropout_group(j));
  return dropout_bits(w, j) >= threshold;
}

}  // namespace flashattn::core

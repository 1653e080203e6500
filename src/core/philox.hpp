// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// dropout keep-mask convention every backend follows:
//   key     = (lo32(seed), hi32(seed))
//   counter = (j / 4, i, lo32(bh + offset), hi32(bh + offset)),  bh = batch * heads_q + head
//   word    = output[j % 4]
//   keep    = word >= threshold,  threshold = min(ceil(p * 2^32), 2^32 - 1)
// where (i, j) are the query and key positions inside their sequence.
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

// The four Philox words covering keys j4*4 .. j4*4+3 of query row i of (batch, head) bh.
FA_HOST_DEVICE Philox4 dropout_words(uint64_t seed, uint64_t offset, uint64_t bh, uint32_t i,
                                     uint32_t j4) {
  const uint64_t stream = bh + offset;
  const Philox4 ctr = {{j4, i, static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

FA_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t bh, int64_t i, int64_t j,
                                 uint32_t threshold) {
  const Philox4 w = dropout_words(seed, offset, bh, static_cast<uint32_t>(i),
                                  static_cast<uint32_t>(j >> 2));
  return w.x[j & 3] >= threshold;
}

}  // namespace flashattn::core

// Division of 31-bit unsigned numbers by a divisor fixed per call (a KV cache's page size) with a
// multiply and a shift: a GPU has no integer divide, and the compiler's division by a run-time
// divisor costs tens of instructions, which the decode kernels would pay for every key they read.
// The round-up method of Granlund and Montgomery: with l = ceil(log2 d) and
// m = floor(2^32 (2^l - d) / d) + 1, n / d = (umulhi(m, n) + n) >> l for every n < 2^31 (the sum
// stays below 2^32 there).
#pragma once

#include <cstdint>

#include "host_device.hpp"

namespace flashattn::core {

struct FastDivmod {
  uint32_t divisor = 1, multiplier = 1, shift = 0;

  FastDivmod() = default;
  // d in [1, 2^31).
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }

  // n / divisor for n < 2^31.
  FA_HOST_DEVICE uint32_t div(uint32_t n) const {
    const auto high = static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> 32);
    return (high + n) >> shift;
  }
  // n / divisor and n % divisor.
  FA_HOST_DEVICE uint32_t divmod(uint32_t n, uint32_t* remainder) const {
    const uint32_t q = div(n);
    *remainder = n - q * divisor;
    return q;
  }
};

}  // namespace flashattn::core

// FP8 elements: OCP e4m3 ("e4m3fn": no infinities, max 448) and e5m2 (IEEE-like, max 57344) <->
// float, and the descale factors that give FP8 inputs their values (FlashAttention-3's
// q_descale / k_descale / v_descale). Beside half.hpp's 16-bit conversions, for every backend.
#pragma once

#include <cstdint>

#include "half.hpp"
#include "host_device.hpp"

namespace flashattn::core {

// One FP8 format: kMantissaBits explicit mantissa bits, exponent bias kBias, the largest finite
// encoding kMaxBits (sign clear), the NaN written for a NaN input.
struct E4M3Format {
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 7;
  static constexpr uint32_t kMaxBits = 0x7e;  // 448 (0x7f is NaN: e4m3fn spends no code on inf)
  static constexpr uint32_t kNaNBits = 0x7f;
  static constexpr bool kHasInfinity = false;
};
struct E5M2Format {
  static constexpr int kMantissaBits = 2;
  static constexpr int kBias = 15;
  static constexpr uint32_t kMaxBits = 0x7b;  // 57344 (0x7c is inf, 0x7d-0x7f NaN)
  static constexpr uint32_t kNaNBits = 0x7f;
  static constexpr bool kHasInfinity = true;
};

// Exact: every FP8 value is a float.
template <typename Format>
FA_HOST_DEVICE float float8_to_float(uint8_t bits) {
  constexpr int m = Format::kMantissaBits;
  constexpr uint32_t exp_mask = (0x7fu >> m);
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exp = (bits >> m) & exp_mask;
  const uint32_t mant = bits & ((1u << m) - 1u);
  if ((bits & 0x7fu) > Format::kMaxBits) {  // past the largest finite code: inf or NaN
    const bool inf = Format::kHasInfinity && mant == 0;
    return bits_to_float(sign | 0x7f800000u | (inf ? 0u : 0x400000u));
  }
  if (exp != 0) return bits_to_float(sign | ((exp + 127u - Format::kBias) << 23) | (mant << (23 - m)));
  // Subnormal (or zero): mant * 2^(1 - bias - m), exact in float.
  const float v = static_cast<float>(mant) * bits_to_float(static_cast<uint32_t>(127 + 1 - Format::kBias - m) << 23);
  return sign ? -v : v;
}

// Round to nearest, ties to even, saturating: a finite value beyond the largest one, and an
// infinity, become the largest finite value of its sign (CUDA's __NV_SATFINITE conversion);
// NaN stays NaN.
template <typename Format>
FA_HOST_DEVICE uint8_t float_to_float8(float f) {
  constexpr int m = Format::kMantissaBits;
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | Format::kNaNBits);
  constexpr uint32_t min_normal_bits = static_cast<uint32_t>(127 + 1 - Format::kBias) << 23;
  uint32_t q;
  if (abs < min_normal_bits) {
    // Subnormal (or zero): round abs / 2^(1 - bias - m) to an integer; 2^m is the smallest
    // normal's code, so a carry lands there by itself.
    const float scaled = bits_to_float(abs) * bits_to_float(static_cast<uint32_t>(127 - 1 + Format::kBias + m) << 23);
    q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
  } else {
    // Normal: rebias the exponent, round the mantissa from 23 to m bits (a carry moves the
    // exponent up, as it should).
    uint32_t v = abs - (static_cast<uint32_t>(127 - Format::kBias) << 23);
    v += (1u << (22 - m)) - 1u + ((v >> (23 - m)) & 1u);
    q = v >> (23 - m);
  }
  if (q > Format::kMaxBits) q = Format::kMaxBits;
  return static_cast<uint8_t>(sign | q);
}

// Per (batch entry, KV head) fp32 factors [batch, heads_kv]: an FP8 element stands for
// fp8_value * factor. `heads_per_kv_head` maps the operand's own head to its KV head (q's GQA
// group size; 1 for k and v). Absent (data null): every factor is 1.
struct Descale {
  const float* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0;
  int64_t heads_per_kv_head = 1;

  FA_HOST_DEVICE float at(int64_t b, int64_t h) const {
    return data ? data[b * batch_stride + (h / heads_per_kv_head) * head_stride] : 1.0f;
  }
};

}  // namespace flashattn::core

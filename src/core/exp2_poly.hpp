// 2^x from FP32 adds and FMAs alone: a degree-5 polynomial on the fraction, the integer part
// added to its exponent bits. A kernel whose exponentials keep the MUFU unit as busy as its GEMMs
// keep the tensor cores can move part of them here (Hopper: MUFU.EX2 at 16 per clock per SM, FP32
// FMAs at 128; the sm90 forward at d64 does one exponential per 128 FMAs of its two GEMMs, and
// the tensor cores' ~2 K FMAs per clock need 16 exponentials a clock).
//
// Accuracy: relative error below 3e-7 for x in [-125.5, 127) (MUFU.EX2: about 2^-22); below that,
// a result under 2^-125 (0 from -127.5 down, and for -inf), which a softmax numerator cannot tell
// from 0 next to its row's maximum term 2^0, as with ex2.approx.ftz's flush of results below
// 2^-126. NaN gives 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.hpp"

namespace flashattn::core {

FA_HOST_DEVICE float exp2_poly(float x) {
  x = fmaxf(x, -127.5f);  // (NaN -> -127.5)
  // x = j + f, j an integer, f in [-0.5, 0.5]: adding 1.5 x 2^23 rounds x to j (to nearest), which
  // lands in t's low mantissa bits as a two's-complement integer.
  constexpr float kRound = 12582912.0f;
  const float t = x + kRound;
  const float f = x - (t - kRound);
  // 2^f on [-0.5, 0.5], minimax for relative error (fitted in fp64; 7.5e-8 before fp32 rounding).
  float p = 1.32764725e-3f;
  p = fmaf(p, f, 9.67554189e-3f);
  p = fmaf(p, f, 5.55071309e-2f);
  p = fmaf(p, f, 2.40221202e-1f);
  p = fmaf(p, f, 6.93146944e-1f);
  p = fmaf(p, f, 1.00000012f);
  // 2^j x p: j added to p's biased exponent (p in [0.70, 1.42]: exponent 126 or 127). Past the
  // bottom of the range the exponent field goes below 0, a negative integer: clamped to 0.
  int32_t p_bits, t_bits;
  std::memcpy(&p_bits, &p, sizeof p);
  std::memcpy(&t_bits, &t, sizeof t);
  int32_t bits = p_bits + static_cast<int32_t>(static_cast<uint32_t>(t_bits) << 23);
  bits = bits > 0 ? bits : 0;
  float y;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}

}  // namespace flashattn::core

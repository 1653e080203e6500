// The sm90a forward's tile shapes per head dim (key tile, K / V stages): plain C++, so the
// launch checks (forward_launch.hpp) read them without CuTe; the kernel's traits build on them.
#pragma once

namespace flashattn::cuda::sm90 {

// Key tile and K/V pipeline depth per head dim: first choices (FA3 runs 128 x 128 tiles at d64
// and d128), to be tuned by measurement. More stages hide more TMA latency while the budget
// allows: at d128 two stages leave room for nothing else past Q; at d64 three are cheap.
template <int kHeadDim>
struct TileConfig;
template <>
struct TileConfig<64> {
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 3;
};
template <>
struct TileConfig<96> {
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 3;
};
// (FLASHATTN_SM90_D128_BLOCK_N: another d128 key tile for same-run A/Bs, scripts/gpu_ab.sh;
// 176 and 160 measured in sm90_forward_tuning.md.)
#ifndef FLASHATTN_SM90_D128_BLOCK_N
#define FLASHATTN_SM90_D128_BLOCK_N 128
#endif
template <>
struct TileConfig<128> {
  static constexpr int kBlockN = FLASHATTN_SM90_D128_BLOCK_N;
  static constexpr int kStages = 2;
};
// d192 / d256: O alone takes 96 / 128 registers a consumer thread, and Q plus two K / V stages
// fill shared memory, so the key tile shrinks: 112 at d192 (FA3's choice); 64 at d256, where
// FA3's 80 spilled 8 bytes in the masked kernel (Q's 16 k-block descriptors stay in registers).
template <>
struct TileConfig<192> {
  static constexpr int kBlockN = 112;
  static constexpr int kStages = 2;
};
template <>
struct TileConfig<256> {
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 2;
};

}  // namespace flashattn::cuda::sm90

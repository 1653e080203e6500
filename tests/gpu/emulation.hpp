// The sm80 kernels' own code, run on the CPU: each CUDA thread a fiber (emulation_threads.hpp),
// CTAs one after another, with the warp-collective pieces emulated -- mma.sync m16n8k16 (through the real
// atom's register layouts), __shfl_xor_sync, __any_sync, __syncthreads -- and the copies made
// synchronous (cp.async with zero fill) and ldmatrix emulated lane by lane. The tests built on it
// check the kernels' logic against the fp64 reference without a GPU; what they cannot see is what
// only the hardware does (cp.async timing, shared-memory races: compute-sanitizer's job).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "cuda/params.hpp"
#include "flashattn/flashattn.hpp"

#include "emulation_threads.hpp"

#include "cuda/common/sink_tokens.cuh"
#include "cuda/sm80/backward_kernel.cuh"
#include "cuda/sm80/backward_rows.cuh"
#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::cuda::sm80 {
// The kernels' `extern __shared__ char smem_raw[]`: one CTA at a time uses it.
alignas(128) inline char smem_raw[232448];
}  // namespace flashattn::cuda::sm80

// --- emulated atoms --------------------------------------------------------------------------------
namespace emu {

// mma.sync.m16n8k16 with fp32 accumulation: every lane deposits its A/B registers, then computes
// its own D values from the whole warp's, using the real atom's (thread, value) layouts.
template <class RealOp, class Element>
struct Mma16816 {
  using DRegisters = float[4];
  using ARegisters = uint32_t[4];
  using BRegisters = uint32_t[2];
  using CRegisters = float[4];
  using Traits = cute::MMA_Traits<RealOp>;

  static float value(const uint32_t* regs, int v) {
    const uint16_t bits = static_cast<uint16_t>(regs[v / 2] >> (16 * (v % 2)));
    return static_cast<float>(Element::bitcast(bits));
  }

  static void fma(float& d0, float& d1, float& d2, float& d3, uint32_t const& a0, uint32_t const& a1,
                  uint32_t const& a2, uint32_t const& a3, uint32_t const& b0, uint32_t const& b1, float const& c0,
                  float const& c1, float const& c2, float const& c3) {
    using namespace cute;
    // (row, k) -> (lane, value) of A (16 x 16) and (col, k) -> (lane, value) of B (8 x 16).
    static const auto tables = [] {
      struct T {
        int a_lane[16][16], a_val[16][16], b_lane[8][16], b_val[8][16];
      } t{};
      for (int lane = 0; lane < 32; ++lane) {
        for (int v = 0; v < 8; ++v) {
          const int ia = typename Traits::ALayout{}(lane, v);
          t.a_lane[ia % 16][ia / 16] = lane;
          t.a_val[ia % 16][ia / 16] = v;
        }
        for (int v = 0; v < 4; ++v) {
          const int ib = typename Traits::BLayout{}(lane, v);
          t.b_lane[ib % 8][ib / 8] = lane;
          t.b_val[ib % 8][ib / 8] = v;
        }
      }
      return t;
    }();
    auto& slot = cta->slots[static_cast<size_t>(tid())];
    slot.a[0] = a0, slot.a[1] = a1, slot.a[2] = a2, slot.a[3] = a3;
    slot.b[0] = b0, slot.b[1] = b1;
    warp_sync();
    const int lane = tid() & 31, base = tid() - lane;
    const float c[4] = {c0, c1, c2, c3};
    float d[4];
    for (int v = 0; v < 4; ++v) {
      const int ic = typename Traits::CLayout{}(lane, v);
      const int m = ic % 16, n = ic / 16;
      float acc = c[v];
      for (int k = 0; k < 16; ++k) {
        const float x = value(cta->slots[static_cast<size_t>(base + tables.a_lane[m][k])].a, tables.a_val[m][k]);
        const float y = value(cta->slots[static_cast<size_t>(base + tables.b_lane[n][k])].b, tables.b_val[n][k]);
        acc += x * y;
      }
      d[v] = acc;
    }
    warp_sync();
    d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3];
  }
};

// ldmatrix.x4 (.trans): lane l gives the address of row l % 8 of matrix l / 8 (8 16-bit values)
// and receives, from each matrix i, the pair (row l / 4, columns 2 (l % 4) + {0, 1}) -- or, for
// .trans, (rows 2 (l % 4) + {0, 1}, column l / 4) -- in register i, first value in the low half.
template <bool kTransposed>
struct Ldsm {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[4];
  static void copy(cute::uint128_t const& smem_src, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
    cta->slots[static_cast<size_t>(tid())].row = reinterpret_cast<const uint16_t*>(&smem_src);
    warp_sync();
    const int lane = tid() & 31, base = tid() - lane;
    uint32_t d[4];
    for (int i = 0; i < 4; ++i) {
      uint16_t lo, hi;
      if (kTransposed) {
        lo = cta->slots[static_cast<size_t>(base + i * 8 + 2 * (lane % 4))].row[lane / 4];
        hi = cta->slots[static_cast<size_t>(base + i * 8 + 2 * (lane % 4) + 1)].row[lane / 4];
      } else {
        const uint16_t* row = cta->slots[static_cast<size_t>(base + i * 8 + lane / 4)].row;
        lo = row[2 * (lane % 4)];
        hi = row[2 * (lane % 4) + 1];
      }
      d[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    warp_sync();
    d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3];
  }
};

// cp.async of 16 bytes with zero fill, done at once.
struct CopyZfill16 {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = cute::uint128_t[1];
};

}  // namespace emu

namespace cute {
template <class RealOp, class Element>
struct MMA_Traits<emu::Mma16816<RealOp, Element>> : MMA_Traits<RealOp> {};

template <>
struct Copy_Traits<emu::Ldsm<false>> : Copy_Traits<SM75_U32x4_LDSM_N> {};
template <>
struct Copy_Traits<emu::Ldsm<true>> : Copy_Traits<SM75_U16x8_LDSM_T> {};

template <>
struct Copy_Traits<emu::CopyZfill16> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, Int<128>>>;
  using DstLayout = Layout<Shape<_1, Int<128>>>;
  using RefLayout = SrcLayout;
  bool pred = true;
  Copy_Traits with(bool p) const { return {p}; }
  template <class TS, class SLayout, class TD, class DLayout>
  friend void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src, Tensor<TD, DLayout>& dst) {
    void* d = raw_pointer_cast(dst.data());
    if (traits.pred) {
      std::memcpy(d, raw_pointer_cast(src.data()), 16);
    } else {
      std::memset(d, 0, 16);
    }
  }
};
}  // namespace cute

// --- shared by the emulated tests ------------------------------------------------------------------
namespace emu {

// The run's random seed: fresh, or FLASHATTN_TEST_SEED's; printed once so a failure can be replayed.
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("FLASHATTN_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("[flashattn tests] seed %llu (replay with FLASHATTN_TEST_SEED=%llu)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// ScoreParams as src/cuda/backend.cpp builds them for scale 1 / sqrt(d), softcap (0 = off) and
// ALiBi slopes [heads] (nullptr = off).
inline flashattn::cuda::ScoreParams score_params(int64_t head_dim, float softcap, const float* alibi_slopes) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  flashattn::cuda::ScoreParams sp;
  sp.scale_log2 = static_cast<float>(scale * flashattn::core::kLog2e);
  if (softcap > 0) {
    sp.tanh_scale = static_cast<float>(scale / softcap);
    sp.softcap_log2 = static_cast<float>(softcap * flashattn::core::kLog2e);
  }
  sp.raw_scores = softcap == 0 && alibi_slopes == nullptr;
  sp.alibi = alibi_slopes;
  sp.alibi_head_stride = alibi_slopes != nullptr ? 1 : 0;
  return sp;
}

// DropoutParams as src/cuda/problem_params.cpp builds them from the options (p = 0: off).
inline flashattn::cuda::DropoutParams dropout_params(const flashattn::DropoutOptions& d) {
  return {d.seed, d.offset, flashattn::core::dropout_threshold(d.p), static_cast<float>(1.0 / (1.0 - d.p))};
}

}  // namespace emu

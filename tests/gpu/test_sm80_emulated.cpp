// The sm80 forward kernel's own code, run on the CPU: one host thread per CUDA thread, CTAs one
// after another, with the warp-collective pieces emulated -- mma.sync m16n8k16 (through the real
// atom's register layouts), __shfl_xor_sync, __any_sync, __syncthreads -- and the copies made synchronous
// (cp.async with zero fill) and ldmatrix emulated lane by lane. It
// checks the kernel's logic (tile ranges, masks, score mods, online softmax, epilogue, empty
// rows, strides) against the fp64 reference without a GPU; what it cannot see is what only the
// hardware does (cp.async timing, ldmatrix, shared-memory races: compute-sanitizer's job).
#include <gtest/gtest.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/params.hpp"
#include "flashattn/flashattn.hpp"

// --- the CUDA built-ins the kernel uses, for host threads ------------------------------------------
namespace emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 thread_idx, block_idx, grid_dim;

// The CTA being run: its barriers and the per-thread exchange slots of the warp collectives.
struct Cta {
  explicit Cta(int threads) : block(threads), slots(static_cast<size_t>(threads)) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  struct Slot {
    float f = 0;
    uint32_t a[4] = {}, b[2] = {};
    const uint16_t* row = nullptr;
  };
  std::vector<Slot> slots;
};
inline Cta* cta = nullptr;

inline int tid() { return static_cast<int>(thread_idx.x); }
inline void warp_sync() { cta->warps[static_cast<size_t>(tid() / 32)]->arrive_and_wait(); }
inline void syncthreads() { cta->block.arrive_and_wait(); }
inline float shfl_xor(float x, int lane_mask) {
  cta->slots[static_cast<size_t>(tid())].f = x;
  warp_sync();
  const float r = cta->slots[static_cast<size_t>((tid() & ~31) | ((tid() & 31) ^ lane_mask))].f;
  warp_sync();
  return r;
}
inline bool any(bool predicate) {
  cta->slots[static_cast<size_t>(tid())].f = predicate ? 1.0f : 0.0f;
  warp_sync();
  bool result = false;
  for (int lane = 0; lane < 32; ++lane) result = result || cta->slots[static_cast<size_t>((tid() & ~31) | lane)].f != 0.0f;
  warp_sync();
  return result;
}

}  // namespace emu

// (The CUDA headers CuTe includes define some of these for host compilers; redefine them all.)
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __shared__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define gridDim emu::grid_dim
#define __syncthreads() emu::syncthreads()
#define __shfl_xor_sync(mask, x, lane_mask) emu::shfl_xor(x, lane_mask)
#define __any_sync(mask, predicate) emu::any(predicate)

#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::cuda::sm80 {
// The kernel's `extern __shared__ char smem_raw[]`: one CTA at a time uses it.
alignas(128) char smem_raw[232448];
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
                  uint32_t const& a2, uint32_t const& a3, uint32_t const& b0, uint32_t const& b1,
                  float const& c0, float const& c1, float const& c2, float const& c3) {
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

namespace {

using namespace cute;
using flashattn::DType;
using flashattn::cuda::ElemType;
using flashattn::cuda::ForwardParams;
using flashattn::cuda::MaskKind;
using flashattn::cuda::sm80::ElementTypes;
using flashattn::cuda::sm80::ForwardTraits;
using flashattn::cuda::sm80::TileTarget;

// The kernel's traits with the hardware-only atoms swapped for the emulated ones (same layouts).
// The mask kinds share one tile shape here: the emulation checks the kernel's logic per shape.
template <ElemType kElem, int kHeadDim, TileTarget kTarget>
struct EmulatedTraits : ForwardTraits<kElem, kHeadDim, MaskKind::kNone, kTarget> {
  using Base = ForwardTraits<kElem, kHeadDim, MaskKind::kNone, kTarget>;
  using Element = typename Base::Element;
  using TiledMma = TiledMMA<MMA_Atom<emu::Mma16816<typename ElementTypes<kElem>::MmaOp, Element>>,
                            Layout<Shape<Int<Base::kNWarps>, _1, _1>>, Tile<Int<Base::kMmaM>, _16, _16>>;
  using SmemCopyAtom = Copy_Atom<emu::Ldsm<false>, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<emu::Ldsm<true>, Element>;
  using GmemTiledLoad = decltype(make_tiled_copy(Copy_Atom<emu::CopyZfill16, Element>{},
                                                 typename Base::ChunkThreadLayout{},
                                                 typename Base::ChunkValueLayout{}));
};

template <class Traits, MaskKind kMask>
void emulate_launch(const ForwardParams& p) {
  const unsigned blocks_m = static_cast<unsigned>((p.shape.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
  for (unsigned z = 0; z < p.shape.batch; ++z) {
    for (unsigned y = 0; y < p.shape.heads_q; ++y) {
      for (unsigned x = 0; x < blocks_m; ++x) {
        emu::Cta cta(Traits::kNThreads);
        emu::cta = &cta;
        std::vector<std::thread> threads;
        for (int t = 0; t < Traits::kNThreads; ++t) {
          threads.emplace_back([&, t] {
            emu::thread_idx = {static_cast<unsigned>(t), 0, 0};
            emu::block_idx = {x, y, z};
            emu::grid_dim = {blocks_m, static_cast<unsigned>(p.shape.heads_q), static_cast<unsigned>(p.shape.batch)};
            flashattn::cuda::sm80::forward_kernel<Traits, kMask>(p);
          });
        }
        for (auto& th : threads) th.join();
      }
    }
  }
}

struct Case {
  DType dtype = DType::kFloat16;
  int64_t batch = 1, sq = 1, sk = 1, hq = 2, hkv = 1, d = 64;
  bool causal = false;
  int64_t wl = -1, wr = -1;
  float softcap = 0;
  bool alibi = false;
  bool strided = false;
  std::string name() const {
    return std::string(flashattn::dtype_name(dtype)) + " b" + std::to_string(batch) + " sq" + std::to_string(sq) +
           " sk" + std::to_string(sk) + " h" + std::to_string(hq) + "/" + std::to_string(hkv) + " d" +
           std::to_string(d) + (causal ? " causal" : "") +
           (wl >= 0 || wr >= 0 ? " window(" + std::to_string(wl) + "," + std::to_string(wr) + ")" : "") +
           (softcap > 0 ? " softcap" : "") + (alibi ? " alibi" : "") + (strided ? " strided" : "");
  }
};

uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("FLASHATTN_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("[flashattn tests] seed %llu (replay with FLASHATTN_TEST_SEED=%llu)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

template <ElemType kElem, int kBucket, TileTarget kTarget>
void run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  using Element = typename ElementTypes<kElem>::Element;
  std::mt19937_64 rng(test_seed() ^ std::hash<std::string>{}(c.name()));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // [b, s, h, d] buffers; strided: a gap of 8 elements after every head and one head per row.
  const int64_t gap = c.strided ? 8 : 0;
  auto layout = [&](int64_t s, int64_t h) {
    const int64_t hs = c.d + gap, rs = (h + (c.strided ? 1 : 0)) * hs, bs = s * rs;
    return std::array<int64_t, 4>{bs, rs, hs, c.batch * bs};
  };
  const auto lq = layout(c.sq, c.hq), lk = layout(c.sk, c.hkv);
  std::vector<Element> q(static_cast<size_t>(lq[3])), k(static_cast<size_t>(lk[3])), v(k.size()),
      out(q.size(), Element::bitcast(0xFFFF));
  std::vector<float> lse(static_cast<size_t>(c.batch * c.hq * c.sq), NAN);
  for (auto* t : {&q, &k, &v}) {
    for (Element& x : *t) x = Element(normal(rng));
  }
  std::vector<float> slopes(static_cast<size_t>(c.hq));
  for (float& s : slopes) s = std::uniform_real_distribution<float>(0.0f, 0.3f)(rng);

  const DType dt = c.dtype;
  auto view = [&](void* p, int64_t s, int64_t h, const std::array<int64_t, 4>& l) {
    return flashattn::TensorView::strided(p, dt, {c.batch, s, h, c.d}, {l[0], l[1], l[2], 1});
  };
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.wl;
  o.mask.window_right = c.wr;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = flashattn::TensorView::contiguous(slopes.data(), DType::kFloat32, {c.hq});
  std::vector<Element> ref(q.size());
  std::vector<float> lse_ref(lse.size());
  flashattn::reference_forward({view(q.data(), c.sq, c.hq, lq), view(k.data(), c.sk, c.hkv, lk),
                                view(v.data(), c.sk, c.hkv, lk), view(ref.data(), c.sq, c.hq, lq),
                                flashattn::TensorView::contiguous(lse_ref.data(), DType::kFloat32,
                                                                  {c.batch, c.hq, c.sq})},
                               o);

  // The params exactly as src/cuda/backend.cpp builds them.
  ForwardParams p;
  p.q = {q.data(), lq[0], lq[1], lq[2]};
  p.k = {k.data(), lk[0], lk[1], lk[2]};
  p.v = {v.data(), lk[0], lk[1], lk[2]};
  p.out = {out.data(), lq[0], lq[1], lq[2]};
  p.lse = {lse.data(), c.hq * c.sq, 1, c.sq};
  p.shape = {c.batch, c.hq, c.hkv, c.d, c.sq, c.sk};
  p.window = {c.wl, c.causal ? 0 : c.wr};
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  p.score.scale_log2 = static_cast<float>(scale * flashattn::core::kLog2e);
  if (c.softcap > 0) {
    p.score.tanh_scale = static_cast<float>(scale / c.softcap);
    p.score.softcap_log2 = static_cast<float>(c.softcap * flashattn::core::kLog2e);
  }
  p.score.raw_scores = c.softcap == 0 && !c.alibi;
  if (c.alibi) {
    p.score.alibi = slopes.data();
    p.score.alibi_head_stride = 1;
  }
  const bool masked = p.window.left >= 0 || p.window.right >= 0;
  if (masked) {
    emulate_launch<EmulatedTraits<kElem, kBucket, kTarget>, MaskKind::kMasked>(p);
  } else {
    emulate_launch<EmulatedTraits<kElem, kBucket, kTarget>, MaskKind::kNone>(p);
  }

  // Logic errors are O(1); rounding is ~1e-3 (fp16) / 1e-2 (bf16) of the output's scale.
  const double tol = kElem == ElemType::kFloat16 ? 4e-3 : 3e-2;
  double max_err = 0, max_ref = 1e-3, max_lse_err = 0;
  int64_t bad = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.sq; ++i) {
      for (int64_t h = 0; h < c.hq; ++h) {
        for (int64_t x = 0; x < c.d; ++x) {
          const size_t e = static_cast<size_t>(b * lq[0] + i * lq[1] + h * lq[2] + x);
          const double got = static_cast<float>(out[e]), want = static_cast<float>(ref[e]);
          if (!std::isfinite(got)) ++bad;
          max_err = std::max(max_err, std::abs(got - want));
          max_ref = std::max(max_ref, std::abs(want));
        }
        const size_t l = static_cast<size_t>((b * c.hq + h) * c.sq + i);
        if (std::isinf(lse_ref[l]) || std::isinf(lse[l])) {
          if (lse[l] != lse_ref[l]) ++bad;
        } else {
          max_lse_err = std::max(max_lse_err, static_cast<double>(std::abs(lse[l] - lse_ref[l])));
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "non-finite outputs or LSE (-inf) mismatches";
  EXPECT_LE(max_err, tol * max_ref) << "out";
  EXPECT_LE(max_lse_err, 1e-3) << "lse";
  if (c.strided) {  // the gaps between heads and rows stay untouched
    int64_t written = 0;
    for (size_t e = 0; e < out.size(); ++e) {
      const int64_t in_row = static_cast<int64_t>(e) % lq[1];
      const bool in_view = in_row < c.hq * lq[2] && in_row % lq[2] < c.d;
      if (!in_view && out[e].raw() != 0xFFFF) ++written;
    }
    EXPECT_EQ(written, 0) << "gap elements written";
  }
}

template <ElemType kElem, int kBucket, TileTarget kTarget = TileTarget::kSm80>
void run_set(int64_t d) {
  Case base;
  base.dtype = kElem == ElemType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  base.d = d;
  std::vector<Case> cases;
  auto add = [&](auto f) {
    Case c = base;
    f(c);
    cases.push_back(c);
  };
  add([](Case& c) { c.sq = 130, c.sk = 150; });                                  // tails
  add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true; });                  // diagonal tiles
  add([](Case& c) { c.sq = 200, c.sk = 70, c.causal = true; });                   // empty rows and CTAs
  add([](Case& c) { c.sq = 70, c.sk = 200, c.causal = true, c.batch = 2; });
  add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7; });              // window: n_begin > 0
  add([](Case& c) { c.sq = 100, c.sk = 100, c.wl = 0, c.wr = 0, c.alibi = true; });
  add([](Case& c) { c.sq = 90, c.sk = 160, c.causal = true, c.alibi = true, c.softcap = 30; });
  add([](Case& c) { c.sq = 66, c.sk = 130, c.strided = true, c.causal = true, c.hq = 3, c.hkv = 3; });
  add([](Case& c) { c.sq = 40, c.sk = 0; });                                     // seqlen_k 0
  for (const Case& c : cases) run_case<kElem, kBucket, kTarget>(c);
}

// Every tile shape: 128x64 (4 warps, Q in registers; Q from smem at d128 with sm90 tiles),
// 128x32 (Q from smem), 64x64, 64x32; with a padded head dim (40 -> 64, 200 -> 224).
TEST(Sm80Emulated, Fp16D64) { run_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80Emulated, Fp16D40Padded) { run_set<ElemType::kFloat16, 64>(40); }
TEST(Sm80Emulated, Bf16D96) { run_set<ElemType::kBFloat16, 96>(96); }
TEST(Sm80Emulated, Fp16D128) { run_set<ElemType::kFloat16, 128>(128); }
TEST(Sm80Emulated, Bf16D128Sm90Tiles) { run_set<ElemType::kBFloat16, 128, TileTarget::kSm90>(128); }
TEST(Sm80Emulated, Bf16D200Padded) { run_set<ElemType::kBFloat16, 224>(200); }
TEST(Sm80Emulated, Fp16D256) { run_set<ElemType::kFloat16, 256>(256); }

}  // namespace

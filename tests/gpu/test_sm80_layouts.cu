// Host-only checks (no GPU needed) of what the sm80 forward kernel relies on, for every head-dim
// bucket: the layout algebra (S's accumulator reused as P's A operand, the (row, col) views of
// the accumulators, quads owning rows, the transposed V view, every copy plan covering its tile
// exactly once), walked thread by thread through CuTe's coordinate maps; the kernel's score
// step (scale or softcap, ALiBi, mask per row) against core::Mask and core/variant.hpp; and the
// kernels' ScoreVariant against core/variant.hpp's definitions.
#include <gtest/gtest.h>

#include <cute/tensor.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "core/mask.hpp"
#include "core/variant.hpp"
#include "cuda/common/score_tile.cuh"
#include "cuda/sm80/forward_traits.cuh"
#include "cuda/sm80/tile_ops.cuh"

namespace {

using namespace cute;
using flashattn::cuda::ElemType;
using flashattn::cuda::MaskKind;
using flashattn::cuda::sm80::accum_as_a_operand;
using flashattn::cuda::sm80::accum_rowcol;
using flashattn::cuda::sm80::ForwardTraits;
using flashattn::cuda::sm80::TileTarget;

// Fresh seed each run, printed; FLASHATTN_TEST_SEED replays one (as tests/cpp/test_util does).
uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("FLASHATTN_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10)
                           : std::random_device{}() ^
                                 static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("[flashattn tests] seed %llu (replay with FLASHATTN_TEST_SEED=%llu)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

template <class Coord>
std::pair<int, int> rc(const Coord& c) {
  return {static_cast<int>(get<0>(c)), static_cast<int>(get<1>(c))};
}

template <class Traits>
void check_traits() {
  constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kNThreads;
  SCOPED_TRACE("head_dim " + std::to_string(kD));
  typename Traits::TiledMma mma;
  auto idS = make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{}));  // (M, N) of S and P
  auto idO = make_identity_tensor(make_shape(Int<kM>{}, Int<kD>{}));  // (M, D) of Q and O

  std::vector<int> owner(kM, -1);  // the quad that owns each row
  std::set<std::pair<int, int>> s_seen;
  for (int t = 0; t < kThreads; ++t) {
    auto thr = mma.get_thread_slice(t);
    // P = convert(S) as the A operand of O += P V: element i of the converted accumulator must
    // be the (row, key) the MMA expects in A's register i.
    Tensor cS = thr.partition_C(idS);                                     // (MMA, MMA_M, MMA_N)
    Tensor cP = make_tensor(cS.data(), accum_as_a_operand(cS.layout()));  // (MMA, MMA_M, MMA_N/2)
    Tensor cA = thr.partition_A(idS);                                     // (MMA, MMA_M, MMA_K)
    ASSERT_EQ(size(cP), size(cA));
    ASSERT_EQ(size<1>(cP), size<1>(cA));
    ASSERT_EQ(size<2>(cP), size<2>(cA));
    for (int i = 0; i < size(cP); ++i) ASSERT_EQ(rc(cP(i)), rc(cA(i))) << "thread " << t << " value " << i;

    // (row, col) views: one row index per view row, rows shared by S and O.
    Tensor cS_rc = make_tensor(cS.data(), accum_rowcol(cS.layout()));
    Tensor cO = thr.partition_C(idO);
    Tensor cO_rc = make_tensor(cO.data(), accum_rowcol(cO.layout()));
    ASSERT_EQ(size<0>(cS_rc), size<0>(cO_rc));
    for (int r = 0; r < size<0>(cS_rc); ++r) {
      const int row = rc(cS_rc(r, 0)).first;
      for (int c = 0; c < size<1>(cS_rc); ++c) {
        ASSERT_EQ(rc(cS_rc(r, c)).first, row);
        ASSERT_TRUE(s_seen.insert(rc(cS_rc(r, c))).second) << "S element held twice";
      }
      for (int c = 0; c < size<1>(cO_rc); ++c) ASSERT_EQ(rc(cO_rc(r, c)).first, row);
      // The 4 lanes of a quad (lane / 4 equal) share the row: quad_max / quad_sum are row-wide.
      const int quad = t / 4;
      if (owner[row] < 0) owner[row] = quad;
      ASSERT_EQ(owner[row], quad) << "row " << row << " spread over more than one quad";
    }
  }
  EXPECT_EQ(static_cast<int>(s_seen.size()), kM * kN) << "S tile not covered";
  for (int row = 0; row < kM; ++row) EXPECT_GE(owner[row], 0) << "row " << row << " has no owner";

  // V^T is V: sVt(d, n) and sV(n, d) are the same shared-memory element.
  const auto vt = typename Traits::SmemLayoutVt{};
  const auto kv = typename Traits::SmemLayoutKV{};
  for (int d = 0; d < kD; ++d) {
    for (int n = 0; n < kN; ++n) ASSERT_EQ(vt(d, n), kv(n, d));
  }
  // Swizzled layouts are bijections onto their buffers.
  auto check_bijection = [](auto layout) {
    std::set<int> offsets;
    for (int i = 0; i < size(layout); ++i) offsets.insert(static_cast<int>(layout(i)));
    EXPECT_EQ(static_cast<int>(offsets.size()), int(size(layout)));
    EXPECT_EQ(int(cosize(layout)), int(size(layout)));
  };
  check_bijection(typename Traits::SmemLayoutQ{});
  check_bijection(kv);

  // gmem <-> smem plans: every element of a Q/O tile and of a K/V tile once, in 16-byte chunks
  // of one row.
  auto check_chunks = [&](auto tiled_copy, auto id, int rows) {
    std::set<std::pair<int, int>> seen;
    for (int t = 0; t < kThreads; ++t) {
      Tensor c = tiled_copy.get_thread_slice(t).partition_S(id);  // (CPY, CPY_M, CPY_D)
      for (int m = 0; m < size<1>(c); ++m) {
        for (int k = 0; k < size<2>(c); ++k) {
          const auto first = rc(c(0, m, k));
          ASSERT_EQ(first.second % Traits::kChunkElems, 0);
          for (int e = 0; e < size<0>(c); ++e) {
            ASSERT_EQ(rc(c(e, m, k)), std::make_pair(first.first, first.second + e));
            ASSERT_TRUE(seen.insert(rc(c(e, m, k))).second);
          }
        }
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), rows * kD);
  };
  check_chunks(typename Traits::GmemTiledLoad{}, idO, kM);
  check_chunks(typename Traits::GmemTiledLoad{}, make_identity_tensor(make_shape(Int<kN>{}, Int<kD>{})), kN);
  check_chunks(typename Traits::GmemTiledStore{}, idO, kM);

  // Registers -> smem for O: every element once.
  auto o_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, mma);
  std::set<std::pair<int, int>> o_seen;
  for (int t = 0; t < kThreads; ++t) {
    Tensor c = o_copy.get_thread_slice(t).partition_D(idO);
    for (int i = 0; i < size(c); ++i) ASSERT_TRUE(o_seen.insert(rc(c(i))).second);
  }
  EXPECT_EQ(static_cast<int>(o_seen.size()), kM * kD);
}

// score_tile on every thread's fragment of one (query tile, key tile) equals the definition:
// raw * scale_log2 + alibi_bias * log2(e), or -inf where core::Mask hides the key.
template <class Traits>
void check_score_tile(std::mt19937_64& rng) {
  constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN;
  typename Traits::TiledMma mma;
  auto idS = make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{}));
  std::uniform_int_distribution<int64_t> len(1, 700), win(-1, 300);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t sq = len(rng), sk = len(rng);
    const flashattn::core::Mask mask{sq, sk, win(rng), win(rng)};
    const int64_t m0 = std::uniform_int_distribution<int64_t>(0, (sq - 1) / kM)(rng) * kM;
    const int64_t n0 = std::uniform_int_distribution<int64_t>(0, (sk - 1) / kN)(rng) * kN;
    const float slope = trial % 2 ? 0.0f : 0.37f * static_cast<float>(flashattn::core::kLog2e);
    const float dummy_slopes[1] = {0.37f};
    const bool softcap = trial % 4 >= 2;  // each with and without ALiBi
    flashattn::cuda::ScoreParams sp;
    sp.scale_log2 = 0.125f * static_cast<float>(flashattn::core::kLog2e);
    sp.alibi = trial % 2 ? nullptr : dummy_slopes;
    if (softcap) {  // a cap of 2 on scores up to 3 * 0.125: tanh's curve, not its linear part
      sp.tanh_scale = 0.125f / 0.25f;
      sp.softcap_log2 = 0.25f * static_cast<float>(flashattn::core::kLog2e);
    }
    SCOPED_TRACE("sq " + std::to_string(sq) + " sk " + std::to_string(sk) + " window (" +
                 std::to_string(mask.window_left) + "," + std::to_string(mask.window_right) + ") m0 " +
                 std::to_string(m0) + " n0 " + std::to_string(n0));
    for (int t = 0; t < Traits::kNThreads; ++t) {
      Tensor cS = mma.get_thread_slice(t).partition_C(idS);
      Tensor cS_rc = make_tensor(cS.data(), accum_rowcol(cS.layout()));
      Tensor scores = make_tensor<float>(cS.shape());
      for (int i = 0; i < size(scores); ++i) scores(i) = static_cast<float>(i % 7) - 3.0f;
      Tensor scores_rc = make_tensor(scores.data(), accum_rowcol(scores.layout()));
      flashattn::cuda::score_tile<kN>(scores_rc, cS_rc, flashattn::cuda::ScoreVariant{sp, slope}, mask, m0, n0, true);
      for (int r = 0; r < size<0>(scores_rc); ++r) {
        for (int c = 0; c < size<1>(scores_rc); ++c) {
          const int64_t i = m0 + get<0>(cS_rc(r, c)), j = n0 + get<1>(cS_rc(r, c));
          const int e = static_cast<int>(scores_rc.layout()(r, c));
          const double raw = static_cast<double>(e % 7) - 3.0;
          float expect =
              softcap ? static_cast<float>(flashattn::core::softcap_apply(0.125 * raw, 0.25) * flashattn::core::kLog2e)
                      : static_cast<float>(raw) * sp.scale_log2;
          if (sp.alibi) expect += flashattn::core::alibi_bias(slope, i, j, sq, sk);
          if (!mask.visible(i, j)) expect = -INFINITY;
          if (std::isinf(expect)) {
            ASSERT_EQ(scores_rc(r, c), expect) << "i " << i << " j " << j;
          } else {
            ASSERT_NEAR(scores_rc(r, c), expect, 1e-4f * (1.0f + std::abs(expect))) << "i " << i << " j " << j;
          }
        }
      }
    }
  }
}

template <ElemType kElem, MaskKind kMask>
void check_all_buckets() {
  check_traits<ForwardTraits<kElem, 32, kMask>>();
  check_traits<ForwardTraits<kElem, 64, kMask>>();
  check_traits<ForwardTraits<kElem, 96, kMask>>();
  check_traits<ForwardTraits<kElem, 128, kMask>>();
  check_traits<ForwardTraits<kElem, 160, kMask>>();
  check_traits<ForwardTraits<kElem, 192, kMask>>();
  check_traits<ForwardTraits<kElem, 224, kMask>>();
  check_traits<ForwardTraits<kElem, 256, kMask>>();
}

TEST(Sm80Layouts, ScoreTileMatchesCoreMask) {
  std::mt19937_64 rng(test_seed());
  check_score_tile<ForwardTraits<ElemType::kFloat16, 64>>(rng);                             // 128 x 64, 4 warps
  check_score_tile<ForwardTraits<ElemType::kFloat16, 64, MaskKind::kMaskedDropout>>(rng);   // 64 x 64
  check_score_tile<ForwardTraits<ElemType::kFloat16, 96>>(rng);                             // 128 x 32
  check_score_tile<ForwardTraits<ElemType::kFloat16, 128>>(rng);                            // 128 x 32, 4 warps
  check_score_tile<ForwardTraits<ElemType::kFloat16, 128, MaskKind::kMaskedDropout>>(rng);  // 128 x 32, 8 warps
  check_score_tile<ForwardTraits<ElemType::kFloat16, 128, MaskKind::kMasked>>(rng);         // 64 x 128
  check_score_tile<ForwardTraits<ElemType::kFloat16, 224>>(rng);                            // 64 x 32
  check_score_tile<ForwardTraits<ElemType::kFloat16, 256, MaskKind::kMasked>>(rng);         // 64 x 64
  check_score_tile<ForwardTraits<ElemType::kBFloat16, 128, MaskKind::kMasked, TileTarget::kSm90>>(rng);  // 128 x 64
}

// ScoreVariant (the kernels' exp2-domain interface) against core/variant.hpp: score() is the
// scaled or capped score times log2(e), with_bias / without_bias add and remove core::alibi_bias,
// and grad_factor(t) / capped_grad_factor(s) are d(score) / d(q.k) / scale (central differences).
TEST(Sm80Layouts, ScoreVariantMatchesCoreVariant) {
  using flashattn::core::kLog2e;
  const double scale = 0.09, cap = 1.5, slope = 0.21;
  const float slopes[1] = {static_cast<float>(slope)};
  for (const bool capped : {false, true}) {
    flashattn::cuda::ScoreParams sp;
    sp.scale_log2 = static_cast<float>(scale * kLog2e);
    sp.alibi = slopes;
    if (capped) {
      sp.tanh_scale = static_cast<float>(scale / cap);
      sp.softcap_log2 = static_cast<float>(cap * kLog2e);
    }
    const flashattn::cuda::ScoreVariant v = flashattn::cuda::score_variant(sp, 0, 0);
    ASSERT_NEAR(v.alibi_slope_log2, slope * kLog2e, 1e-6);
    EXPECT_FALSE(v.raw());
    EXPECT_TRUE(v.has_bias());
    for (const double qk : {-40.0, -3.0, -0.5, 0.0, 0.7, 9.0, 35.0}) {
      SCOPED_TRACE("capped " + std::to_string(capped) + " qk " + std::to_string(qk));
      const double s = capped ? flashattn::core::softcap_apply(scale * qk, cap) : scale * qk;
      float t = 0.0f;
      const float got = v.score(static_cast<float>(qk), &t);
      EXPECT_NEAR(got, s * kLog2e, 1e-5 * (1.0 + std::abs(s * kLog2e)));
      for (const int64_t i : {0, 5, 17}) {
        for (const int64_t j : {0, 3, 30}) {
          const int64_t sq = 20, sk = 40;  // distance i + sk - sq - j, as mask.hpp's diag(i) - j
          const float biased = v.with_bias(got, static_cast<float>(i + sk - sq - j));
          EXPECT_NEAR(biased, got + flashattn::core::alibi_bias(slope, i, j, sq, sk) * kLog2e, 1e-5);
          EXPECT_NEAR(v.without_bias(biased, static_cast<float>(i + sk - sq - j)), got, 1e-5);
        }
      }
      const double h = 1e-4;
      const double ds = ((capped ? flashattn::core::softcap_apply(scale * (qk + h), cap) : scale * (qk + h)) -
                         (capped ? flashattn::core::softcap_apply(scale * (qk - h), cap) : scale * (qk - h))) /
                        (2 * h) / scale;
      EXPECT_NEAR(v.grad_factor(t), ds, 1e-4);
      if (capped) EXPECT_NEAR(v.capped_grad_factor(got), ds, 1e-4);
    }
  }
}

TEST(Sm80Layouts, Float16) { check_all_buckets<ElemType::kFloat16, MaskKind::kNone>(); }
TEST(Sm80Layouts, BFloat16) { check_all_buckets<ElemType::kBFloat16, MaskKind::kNone>(); }
TEST(Sm80Layouts, DropoutTiles) {  // the dropout kernels' own tile shapes
  check_all_buckets<ElemType::kFloat16, MaskKind::kMaskedDropout>();
  check_all_buckets<ElemType::kBFloat16, MaskKind::kMaskedDropout>();
}
TEST(Sm80Layouts, MaskedTiles) {  // the masked kernels' own tile shapes
  check_all_buckets<ElemType::kFloat16, MaskKind::kMasked>();
}
TEST(Sm80Layouts, Sm90Tiles) {  // the shapes tuned for sm90, where tile_shapes.hpp lists them
  check_traits<ForwardTraits<ElemType::kFloat16, 128, MaskKind::kNone, TileTarget::kSm90>>();
  check_traits<ForwardTraits<ElemType::kBFloat16, 128, MaskKind::kMasked, TileTarget::kSm90>>();
}

}  // namespace

// src/core: Philox known answers, fp16/bf16 conversions, mask tile ranges, block-sparse masks and
// their kernel tiles, softmax merging, the fast divider of page lookups, the polynomial 2^x.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/block_mask.hpp"
#include "core/fast_divmod.hpp"
#include "core/half.hpp"
#include "core/mask.hpp"
#include "core/philox.hpp"
#include "core/softmax.hpp"
#include "cuda/tile_order.hpp"
#include "random_block_mask.hpp"
#include "test_util.hpp"

namespace core = flashattn::core;
using fa_test::RandomBlockMask;
namespace cuda = flashattn::cuda;

TEST(Philox, KnownAnswerVectors) {
  // Random123's published known-answer vectors for philox4x32-10.
  struct Kat {
    core::Philox4 ctr;
    uint32_t k0, k1;
    core::Philox4 expected;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
       0xffffffff,
       0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
       0xa4093822,
       0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    const core::Philox4 out = core::philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out.x[i], k.expected.x[i]) << "word " << i;
  }
}

TEST(Dropout, KeepRateMatchesProbability) {
  auto rng = fa_test::rng_for("dropout-rate");
  for (double p : {0.1, 0.17, 0.5, 0.9}) {
    const uint32_t threshold = core::dropout_threshold(p);
    const uint64_t seed = rng(), offset = rng() % 100;
    int64_t kept = 0, n = 0;
    for (int64_t i = 0; i < 300; ++i) {
      for (int64_t j = 0; j < 300; ++j, ++n) kept += core::dropout_keep(seed, offset, 7, i, j, threshold);
    }
    const double rate = static_cast<double>(kept) / static_cast<double>(n);
    const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(n));
    EXPECT_NEAR(rate, 1 - p, 5 * sigma) << "p " << p;
  }
}

// The kernels' group-at-a-time forms give each key the bits the per-element definition does.
TEST(Dropout, GroupFormsMatchThePerKeyDefinition) {
  const uint32_t t = core::dropout_threshold(0.3);
  for (int64_t chunk = 0; chunk < 5; ++chunk) {
    const uint32_t keep32 = core::dropout_keep32(11, 3, 5, 9, chunk, t);
    for (int64_t k = 0; k < 32; ++k) {
      const int64_t j = 32 * chunk + k;
      const bool kept = core::dropout_keep(11, 3, 5, 9, j, t);
      EXPECT_EQ(((keep32 >> k) & 1) != 0, kept) << "j " << j;
      // dropout_keep8 from the group's first key j0: bit 2b + e is key j0 + 8b + e.
      const int64_t j0 = 32 * chunk + (k % 8) / 2 * 2;
      const uint32_t keep8 = core::dropout_keep8(11, 3, 5, 9, j0, t);
      EXPECT_EQ(((keep8 >> ((k / 8) * 2 + k % 2)) & 1) != 0, kept) << "j " << j;
      EXPECT_EQ(core::dropout_group(j), core::dropout_group(j0));
    }
  }
  EXPECT_EQ(core::dropout_threshold(0.0), 0u);
  EXPECT_EQ(core::dropout_threshold(1e-9), 1u);  // any p > 0 drops something
  EXPECT_EQ(core::dropout_threshold(0.5), 32768u);
  EXPECT_EQ(core::dropout_threshold(0.9999999), 65535u);
}

TEST(Dropout, MaskDependsOnEveryCoordinate) {
  const uint32_t t = core::dropout_threshold(0.5);
  int differ_seed = 0, differ_offset = 0, differ_bh = 0, differ_i = 0, differ_j = 0;
  for (int64_t j = 0; j < 256; ++j) {
    const bool base = core::dropout_keep(1, 0, 0, 0, j, t);
    differ_seed += base != core::dropout_keep(2, 0, 0, 0, j, t);
    differ_offset += base != core::dropout_keep(1, 1, 0, 0, j, t);
    differ_bh += base != core::dropout_keep(1, 0, 1, 0, j, t);
    differ_i += base != core::dropout_keep(1, 0, 0, 1, j, t);
    differ_j += base != core::dropout_keep(1, 0, 0, 0, j + 256, t);
  }
  for (int d : {differ_seed, differ_offset, differ_bh, differ_i, differ_j}) {
    EXPECT_GT(d, 80);  // ~128 expected for independent streams
    EXPECT_LT(d, 176);
  }
}

TEST(HalfConversion, EveryFp16RoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = core::fp16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(core::fp16_to_float(core::float_to_fp16(f))));
      continue;
    }
    EXPECT_EQ(core::float_to_fp16(f), h) << std::hex << h;
  }
}

TEST(HalfConversion, Fp16RoundingMatchesCompiler) {
  // GCC's _Float16 conversion rounds to nearest even (IEEE); ours must agree bit for bit.
  auto rng = fa_test::rng_for("fp16-round");
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    const float f = core::bits_to_float(bits(rng));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(core::float_to_fp16(f), expected) << f;
  }
}

TEST(HalfConversion, Bf16RoundsToNearestEven) {
  EXPECT_EQ(core::float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(core::float_to_bf16(core::bits_to_float(0x3f808000)), 0x3f80);  // tie -> even
  EXPECT_EQ(core::float_to_bf16(core::bits_to_float(0x3f818000)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(core::float_to_bf16(core::bits_to_float(0x3f808001)), 0x3f81);  // above tie
  EXPECT_EQ(core::float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(core::bf16_to_float(core::float_to_bf16(std::nanf("")))));
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = core::bf16_to_float(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(core::float_to_bf16(f), h);
    }
  }
}

TEST(Mask, TileRangesAgreeWithVisibility) {
  auto rng = fa_test::rng_for("mask-ranges");
  std::uniform_int_distribution<int64_t> len(0, 70), win(-1, 30), sinks(0, 20);
  for (int trial = 0; trial < 4000; ++trial) {
    const core::SinkTokenMask m({len(rng), len(rng), win(rng), win(rng)}, trial % 2 == 0 ? 0 : sinks(rng));
    for (int64_t i = 0; i < m.seqlen_q; ++i) {  // visible() is the documented rule
      for (int64_t j = 0; j < m.seqlen_k; ++j) {
        const int64_t diag = i + m.seqlen_k - m.seqlen_q;
        const bool right = m.window_right < 0 || j <= diag + m.window_right;
        const bool left = m.window_left < 0 || j >= diag - m.window_left || j < m.sink_tokens;
        ASSERT_EQ(m.visible(i, j), right && left) << i << ", " << j;
        // The keys the CUDA kernels leave to the sink-token pass: exactly those visible through
        // the sink tokens alone, [0, keys_left_of_window(i)).
        const bool window_alone = static_cast<const core::Mask&>(m).visible(i, j);
        ASSERT_EQ(m.visible(i, j) && !window_alone, j < m.keys_left_of_window(i)) << i << ", " << j;
      }
    }
    for (int64_t i0 = 0; i0 < m.seqlen_q; i0 += 8) {
      const int64_t i1 = std::min<int64_t>(i0 + 8, m.seqlen_q);
      // The sink range [0, sink_key_end) and the window [key_begin, key_end) cover every
      // visible key of rows [i0, i1).
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = 0; j < m.seqlen_k; ++j) {
          if (!m.visible(i, j)) continue;
          ASSERT_TRUE(j < m.sink_key_end(i1) || j >= m.key_begin(i0));
          ASSERT_LT(j, m.key_end(i1));
          ASSERT_GE(i, m.row_begin(j));
          ASSERT_LT(i, m.row_end(j, j + 1));
          if (m.sink_tokens == 0) {
            ASSERT_LT(i, static_cast<const core::Mask&>(m).row_end(j + 1));
          }
        }
      }
      for (int64_t j0 = 0; j0 < m.seqlen_k; j0 += 8) {
        const int64_t j1 = std::min<int64_t>(j0 + 8, m.seqlen_k);
        // rows_seeing_all: exactly the rows that see all of [j0, j1).
        const core::Mask::Rows all = m.rows_seeing_all(j0, j1);
        for (int64_t i = 0; i < m.seqlen_q; ++i) {
          bool sees_all = true;
          for (int64_t j = j0; j < j1; ++j) sees_all = sees_all && m.visible(i, j);
          ASSERT_EQ(sees_all, i >= all.begin && i < all.end) << "row " << i << " keys [" << j0 << ", " << j1 << ")";
        }
        if (!m.tile_fully_visible(i0, i1, j0, j1)) continue;
        for (int64_t i = i0; i < i1; ++i) {
          for (int64_t j = j0; j < j1; ++j) ASSERT_TRUE(m.visible(i, j));
        }
      }
    }
  }
}

TEST(Softmax, MergeOfPartialsEqualsWhole) {
  using S = core::SoftmaxState<double>;
  auto accumulate = [](const std::vector<double>& x) {
    S s;
    for (double v : x) {
      s.rescale_to(std::max(s.max, v));
      s.sum += std::exp2(v - core::safe_max(s.max));
    }
    return s;
  };
  const double ninf = -std::numeric_limits<double>::infinity();
  const std::vector<double> a = {1.0, -3.0, 2.5}, b = {-200.0, 0.5}, empty = {}, masked = {ninf, ninf};
  const S whole = accumulate({1.0, -3.0, 2.5, -200.0, 0.5});
  double fa, fb;
  const S merged = core::merge(accumulate(a), accumulate(b), &fa, &fb);
  EXPECT_NEAR(merged.lse(), whole.lse(), 1e-12);
  // Empty and fully masked partials: weight 0, never NaN.
  for (const auto& e : {empty, masked}) {
    const S m = core::merge(accumulate(a), accumulate(e), &fa, &fb);
    EXPECT_EQ(fb, 0.0);
    EXPECT_NEAR(m.lse(), accumulate(a).lse(), 1e-12);
    const S both = core::merge(accumulate(e), accumulate(e), &fa, &fb);
    EXPECT_EQ(both.lse(), ninf);
    EXPECT_EQ(fa, 0.0);
    EXPECT_EQ(fb, 0.0);
  }
  // A first score far below zero must not overflow the rescale factor.
  const S far = accumulate({-1000.0, 5.0});
  EXPECT_TRUE(std::isfinite(far.lse()));
}

TEST(FastDivmod, EqualsDivisionBelow2To31) {
  // Every divisor up to 1100 and large ones of each bit width, against numerators at the edges
  // (multiples and their neighbours, 2^31 - 1) and random ones.
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (int bits = 11; bits <= 31; ++bits) {
    const uint32_t p = uint32_t{1} << (bits - 1);
    for (uint32_t d : {p - 1, p, p + 1, p + p / 2, (bits < 31 ? 2 * p - 1 : 0x7fffffffu)}) divisors.push_back(d);
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any(0, 0x7fffffffu);
  for (uint32_t d : divisors) {
    const core::FastDivmod f(d);
    std::vector<uint32_t> numerators = {0, 1, d - 1, d, d + 1, 0x7fffffffu, 0x7fffffffu - d};
    for (uint32_t m : {2u, 3u, 1000u, 0x7fffffffu / d}) {
      const uint64_t n = uint64_t{m} * d;
      if (n < 0x80000000u) numerators.insert(numerators.end(), {uint32_t(n - 1), uint32_t(n)});
    }
    for (int i = 0; i < 200; ++i) numerators.push_back(any(rng));
    for (uint32_t n : numerators) {
      uint32_t r = 0;
      const uint32_t q = f.divmod(n, &r);
      ASSERT_EQ(q, n / d) << n << " / " << d;
      ASSERT_EQ(r, n % d) << n << " % " << d;
    }
  }
}

TEST(TileOrder, EachTileOnceHeaviestFirstWithinGroups) {
  // Every (rank, pair) is dealt exactly once; within a group ranks never go down; groups go in
  // pair order, whole ones of `group` pairs, then the last from last_first (short, exact or long).
  for (int64_t tiles : {1, 3, 8}) {
    for (int64_t pairs : {1, 5, 16, 17}) {
      for (int64_t group : {int64_t{1}, int64_t{2}, int64_t{4}, pairs}) {
        for (int64_t tail_pairs : {int64_t{0}, int64_t{1}, int64_t{6}, pairs}) {
          const int64_t last_first =
              cuda::last_group_first(pairs, tiles, static_cast<int>(group), 1, tail_pairs * tiles);
          ASSERT_EQ(last_first % group, 0);
          ASSERT_GE(pairs - last_first, std::min({pairs, tail_pairs, group}));
          const cuda::TileOrder<int64_t> order{tiles, pairs, group, last_first};
          std::vector<int> seen(static_cast<size_t>(tiles * pairs), 0);
          int64_t last_rank = -1, last_group = 0;
          for (int64_t i = 0; i < tiles * pairs; ++i) {
            const auto s = order.at(i);
            ASSERT_TRUE(s.rank >= 0 && s.rank < tiles && s.pair >= 0 && s.pair < pairs) << i;
            ++seen[static_cast<size_t>(s.pair * tiles + s.rank)];
            const int64_t g = std::min(s.pair, last_first) / group;  // the last group counts as one
            ASSERT_GE(g, last_group) << "groups in order";
            if (g != last_group) last_rank = -1;
            ASSERT_GE(s.rank, last_rank) << "heaviest first within a group";
            last_rank = s.rank;
            last_group = g;
          }
          for (int n : seen) {
            ASSERT_EQ(n, 1) << tiles << " tiles, " << pairs << " pairs, group " << group << ", tail " << tail_pairs;
          }
        }
      }
    }
  }
  // A group of 1 without a tail is each pair's tiles in turn.
  const cuda::TileOrder<int> one{4, 3, 1, static_cast<int>(cuda::last_group_first(3, 4, 1, 0, 132))};
  EXPECT_EQ(one.at(5).pair, 1);
  EXPECT_EQ(one.at(5).rank, 1);
}

TEST(TileOrder, GroupKeepsKeyValueInHalfTheL2) {
  constexpr int64_t kL2 = 50 << 20;
  // 1k keys of d128: 512 KiB of K / V a head, 50 of them in half of 50 MiB.
  EXPECT_EQ(cuda::forward_tile_group(kL2, 1024, 128, 1, 256), 50);
  EXPECT_EQ(cuda::forward_tile_group(kL2, 1024, 128, 4, 1024), 200);  // GQA: 4 heads share one
  EXPECT_EQ(cuda::forward_tile_group(kL2, 1024, 128, 1, 16), 16);     // no more than the pairs
  EXPECT_EQ(cuda::forward_tile_group(kL2, 1 << 20, 256, 1, 8), 1);    // at least 1
  EXPECT_EQ(cuda::forward_tile_group(0, 1024, 128, 1, 8), 1);         // L2 unknown
  EXPECT_EQ(cuda::forward_tile_group(kL2, 0, 128, 1, 8), 8);          // no keys
}

TEST(TileOrder, LastGroupSpansTheTailWaves) {
  // 256 pairs of 8 tiles in groups of 50, 2 waves of 132 CTAs: 33 pairs at least, so 56 from
  // pair 200 (the 6 left after 4 whole groups and one more group).
  EXPECT_EQ(cuda::last_group_first(256, 8, 50, 2, 132), 200);
  EXPECT_EQ(cuda::last_group_first(16, 128, 3, 2, 132), 12);  // 3 pairs at least: 12..15
  EXPECT_EQ(cuda::last_group_first(16, 128, 3, 0, 132), 15);  // no tail: the 1 left after 5 groups
  EXPECT_EQ(cuda::last_group_first(8, 16, 8, 2, 528), 0);     // more waves than pairs: one group
  EXPECT_EQ(cuda::last_group_first(8, 128, 1, 2, 132), 7);    // a tail of a group's worth at most
  EXPECT_EQ(cuda::last_group_first(16, 32, 6, 2, 132), 6);    // 9 pairs wanted, 6 allowed: 6..15
}

// visible() reads the lists and the bits as they were written; kernel_tiles lists, per query
// tile, exactly the key tiles that overlap a listed block, ascending, and marks full only tiles
// whose every element (within the sequence) is visible, for tile shapes that do and do not
// align with the blocks.
TEST(BlockMask, KernelTilesAgreeWithTheElements) {
  auto rng = fa_test::rng_for("BlockMask.KernelTilesAgreeWithTheElements");
  const int64_t block_sizes[][2] = {{128, 128}, {16, 64}, {64, 16}, {32, 48}};
  const int64_t tile_sizes[][2] = {{64, 64}, {128, 112}, {64, 176}, {16, 32}, {128, 128}};
  for (int trial = 0; trial < 12; ++trial) {
    const auto& bs = block_sizes[trial % 4];
    std::uniform_int_distribution<int64_t> len(1, 300);
    const RandomBlockMask r(rng, 2, 2, len(rng), len(rng), bs[0], bs[1]);
    const core::BlockMask& m = r.mask;
    ASSERT_EQ(core::block_mask_error(m, 2, 2, r.sq, r.sk), "");
    SCOPED_TRACE("sq " + std::to_string(r.sq) + " sk " + std::to_string(r.sk) + " blocks " + std::to_string(bs[0]) +
                 "x" + std::to_string(bs[1]));
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t i = 0; i < r.sq; ++i) {
          for (int64_t j = 0; j < r.sk; ++j) ASSERT_EQ(m.visible(b, h, i, j), r.visible(b, h, i, j)) << i << " " << j;
        }
        for (const auto& ts : tile_sizes) {
          const int64_t tm = ts[0], tn = ts[1];
          const core::KernelTiles kt = core::kernel_tiles(m, b, h, r.sq, r.sk, tm, tn);
          const int64_t query_tiles = (r.sq + tm - 1) / tm, key_tiles = (r.sk + tn - 1) / tn;
          ASSERT_EQ(static_cast<int64_t>(kt.offsets.size()), query_tiles + 1);
          for (int64_t t = 0; t < query_tiles; ++t) {
            std::vector<int> listed(static_cast<size_t>(key_tiles), -1);  // -1 not listed, 0 partial, 1 full
            for (int64_t e = kt.offsets[t]; e < kt.offsets[t + 1]; ++e) {
              const core::KernelTile tile = kt.tiles[static_cast<size_t>(e)];
              if (e > kt.offsets[t]) {
                ASSERT_LT(kt.tiles[static_cast<size_t>(e - 1)].key_tile, tile.key_tile);
              }
              listed[static_cast<size_t>(tile.key_tile)] = tile.full ? 1 : 0;
            }
            for (int64_t k = 0; k < key_tiles; ++k) {
              bool overlaps_listed = false, all_visible = true, any_visible = false;
              for (int64_t i = t * tm; i < std::min(r.sq, (t + 1) * tm); ++i) {
                for (int64_t j = k * tn; j < std::min(r.sk, (k + 1) * tn); ++j) {
                  const bool v = r.visible(b, h, i, j);
                  all_visible = all_visible && v;
                  any_visible = any_visible || v;
                  overlaps_listed =
                      overlaps_listed || m.cell(b, h, i / m.block_m, j / m.block_n) != core::BlockMask::Cell::kHidden;
                }
              }
              const int got = listed[static_cast<size_t>(k)];
              ASSERT_EQ(got >= 0, overlaps_listed) << "query tile " << t << " key tile " << k;
              // range() classes the same rectangle as kernel_tiles does.
              const auto cls =
                  m.range(b, h, t * tm, std::min(r.sq, (t + 1) * tm), k * tn, std::min(r.sk, (k + 1) * tn));
              ASSERT_EQ(static_cast<int>(cls), got < 0 ? 0 : got == 0 ? 1 : 2) << "range " << t << " " << k;
              if (any_visible) {
                ASSERT_GE(got, 0) << "a visible element's tile is skipped: " << t << " " << k;
              }
              if (got == 1) {
                ASSERT_TRUE(all_visible) << "a full tile has a hidden element: " << t << " " << k;
              }
            }
          }
        }
      }
    }
  }
}

// A malformed mask is named by its argument.
TEST(BlockMask, ErrorsNameTheArgument) {
  auto rng = fa_test::rng_for("BlockMask.ErrorsNameTheArgument");
  auto fresh = [&] { return RandomBlockMask(rng, 1, 1, 200, 200, 64, 64); };
  EXPECT_EQ(core::block_mask_error(fresh().mask, 1, 1, 200, 200), "");
  {
    RandomBlockMask r = fresh();
    r.mask.block_n = 0;
    EXPECT_NE(core::block_mask_error(r.mask, 1, 1, 200, 200).find("block size"), std::string::npos);
  }
  {
    RandomBlockMask r = fresh();
    EXPECT_NE(core::block_mask_error(r.mask, 1, 1, 200, 300).find("do not cover seqlen_q 200 x seqlen_k 300"),
              std::string::npos);
  }
  {
    RandomBlockMask r = fresh();
    r.partial_count[1] = -1;
    EXPECT_NE(
        core::block_mask_error(r.mask, 1, 1, 200, 200).find("kv_num_blocks -1 at (batch 0, head 0, query block 1)"),
        std::string::npos);
  }
  {
    RandomBlockMask r = fresh();
    r.full_count[0] = 1;
    r.full_index[0] = static_cast<int32_t>(r.mask.key_blocks);
    EXPECT_NE(core::block_mask_error(r.mask, 1, 1, 200, 200).find("full_kv_indices entry 4"), std::string::npos);
  }
  {
    RandomBlockMask r = fresh();
    r.partial_count[2] = 1;
    r.partial_index[static_cast<size_t>(2 * r.mask.key_blocks)] = 3;
    r.full_count[2] = 1;
    r.full_index[static_cast<size_t>(2 * r.mask.key_blocks)] = 3;
    EXPECT_NE(core::block_mask_error(r.mask, 1, 1, 200, 200).find("key block 3 listed twice"), std::string::npos);
  }
  {
    RandomBlockMask r = fresh();
    r.mask.full_index_data = nullptr;
    EXPECT_NE(core::block_mask_error(r.mask, 1, 1, 200, 200).find("full_kv_indices come together"), std::string::npos);
  }
  {
    RandomBlockMask r = fresh();
    r.partial_count[0] = 1;
    r.partial_index[0] = 0;
    r.full_count[0] = 0;
    r.bits_block[0] = static_cast<int32_t>(r.mask.bits_blocks);
    EXPECT_NE(core::block_mask_error(r.mask, 1, 1, 200, 200).find("bits_block entry"), std::string::npos);
  }
}

// The Hopper backward's dropout keep bits (src/cuda/common/dropout.cuh dropout_keep_transposed) on
// the CPU: the consumer warpgroups' threads as fibers (emulation_threads.hpp, with
// __shfl_xor_sync), each holding its part of a WGMMA accumulator of S^T (keys x queries) as CuTe
// partitions it, for the two splits the kernel uses: the consumers stacked along the keys (d64 -
// d128) and side by side along the queries (d256). Every bit is checked against
// core/philox.hpp's dropout_keep, the one definition of which elements are kept, over tiles at
// several (query, key) offsets, streams and probabilities.
#include <gtest/gtest.h>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "cuda/params.hpp"

#include "emulation_threads.hpp"

#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"

namespace {

using namespace cute;

struct TileCase {
  int64_t m0, n0;  // the tile's first query and key (n0 a multiple of 32)
  uint64_t seed, offset, bh;
  double p;
};

// Runs dropout_keep_transposed on every consumer thread of a (kKeys, kQueries) tile split by
// `Consumers` and returns the mismatches against dropout_keep, as text.
template <int kKeys, int kQueries, class Consumers>
std::vector<std::string> mismatches(const TileCase& tile) {
  constexpr int kThreads = 2 * 128;
  using TiledMma = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<bfloat16_t, bfloat16_t, float,
                                 Shape<Int<kKeys / size<0>(Consumers{})>, Int<kQueries / size<1>(Consumers{})>, _64>>(),
      Consumers{}));
  const flashattn::cuda::DropoutParams dp{tile.seed, tile.offset, flashattn::core::dropout_threshold(tile.p),
                                          static_cast<float>(1.0 / (1.0 - tile.p))};
  std::vector<std::string> errors;
  int checked = 0;
  emu::launch({1, 1, 1}, kThreads, [&] {
    const int tid = static_cast<int>(threadIdx.x);
    TiledMma mma;
    auto thr = mma.get_thread_slice(tid);
    Tensor acc = partition_fragment_C(mma, Shape<Int<kKeys>, Int<kQueries>>{});
    Tensor st = make_tensor(acc.data(), flashattn::cuda::gmma_accum_rowcol(acc.layout()));
    Tensor tScS = thr.partition_C(make_identity_tensor(Shape<Int<kKeys>, Int<kQueries>>{}));
    Tensor coord = make_tensor(tScS.data(), flashattn::cuda::gmma_accum_rowcol(tScS.layout()));
    const uint32_t keep = flashattn::cuda::dropout_keep_transposed(st, coord, dp, tile.bh, tile.m0, tile.n0);
    for (int c = 0; c < size<1>(st); ++c) {
      for (int r = 0; r < size<0>(st); ++r) {
        const int key = get<0>(coord(r, c)), query = get<1>(coord(r, c));
        const bool expected =
            flashattn::core::dropout_keep(dp.seed, dp.offset, tile.bh, tile.m0 + query, tile.n0 + key, dp.threshold);
        ++checked;
        if (((keep >> (2 * c + r)) & 1u) != static_cast<uint32_t>(expected) && errors.size() < 8) {
          errors.push_back("thread " + std::to_string(tid) + " key " + std::to_string(key) + " query " +
                           std::to_string(query) + ": kept " + std::to_string((keep >> (2 * c + r)) & 1u) +
                           ", the convention says " + std::to_string(expected));
        }
      }
    }
  });
  if (checked != kKeys * kQueries) errors.push_back("checked " + std::to_string(checked) + " elements");
  return errors;
}

const TileCase kTiles[] = {
    {0, 0, 1234, 0, 0, 0.1},
    {64, 128, 42, 7, 3, 0.5},
    {4032, 8064, 0xDEADBEEFCAFEull, 1000, 77, 0.17},
    {192, 32, 9, 0, 5, 0.9},
    {1 << 20, 1 << 19, 3, 123456789, 1u << 20, 0.25},
};

using ConsumersAlongKeys = Layout<Shape<_2, _1, _1>>;
using ConsumersAlongQueries = Layout<Shape<_1, _2, _1>>;

// By keys (d64 - d128): 128 keys, each consumer 64 of them, x 64 queries.
TEST(DropoutTransposed, ConsumersAlongTheKeysMatchTheConvention) {
  for (const TileCase& tile : kTiles) {
    SCOPED_TRACE("m0 " + std::to_string(tile.m0) + " n0 " + std::to_string(tile.n0));
    EXPECT_EQ((mismatches<128, 64, ConsumersAlongKeys>(tile)), std::vector<std::string>{});
  }
}

// By head dim (d256): 64 keys x 64 queries, each consumer 32 of the queries.
TEST(DropoutTransposed, ConsumersAlongTheQueriesMatchTheConvention) {
  for (const TileCase& tile : kTiles) {
    SCOPED_TRACE("m0 " + std::to_string(tile.m0) + " n0 " + std::to_string(tile.n0));
    EXPECT_EQ((mismatches<64, 64, ConsumersAlongQueries>(tile)), std::vector<std::string>{});
  }
}

// A probability of 0 keeps everything (threshold 0), whatever the bits.
TEST(DropoutTransposed, ZeroProbabilityKeepsEveryElement) {
  TileCase tile{128, 256, 5, 6, 7, 0.0};
  EXPECT_EQ((mismatches<128, 64, ConsumersAlongKeys>(tile)), std::vector<std::string>{});
}

}  // namespace

// The FA1-order teaching kernel's own code run on the CPU (emulation.hpp) against the fp64
// reference, with the tolerance rule of docs/CONVENTIONS.md: the schedule of (key tile, query
// tile) steps, the workspace round trip (poisoned with NaN first: nothing may be read before it
// is written), the causal skips, the query groups and the control mode, without a GPU.
#include <gtest/gtest.h>

#include <limits>
#include <set>
#include <utility>

#include "emulation.hpp"
#include "cuda/teaching/fa1_order_kernel.cuh"
#include "naive_attention.hpp"
#include "test_util.hpp"

namespace flashattn::cuda::teaching {
// The kernel's `extern __shared__ char smem_raw[]`: one CTA at a time uses it.
alignas(128) inline char smem_raw[99 * 1024];
}  // namespace flashattn::cuda::teaching

namespace {

using namespace cute;
using flashattn::DType;
using flashattn::cuda::ElemType;
using flashattn::cuda::sm80::ElementTypes;
using flashattn::cuda::teaching::fa1_tile_shape;
using flashattn::cuda::teaching::Fa1Schedule;
using flashattn::cuda::teaching::Fa1Traits;

// The kernel's traits with the hardware-only atoms swapped for the emulated ones (same layouts).
template <ElemType kElem, int kHeadDim>
struct EmulatedTraits : Fa1Traits<kElem, kHeadDim> {
  using Base = Fa1Traits<kElem, kHeadDim>;
  using Element = typename Base::Element;
  using TiledMma = TiledMMA<MMA_Atom<emu::Mma16816<typename ElementTypes<kElem>::MmaOp, Element>>,
                            Layout<Shape<Int<Base::kNWarps>, _1, _1>>, Tile<Int<Base::kMmaM>, _16, _16>>;
  using SmemCopyAtom = Copy_Atom<emu::Ldsm<false>, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<emu::Ldsm<true>, Element>;
  using GmemTiledLoad = decltype(make_tiled_copy(
      Copy_Atom<emu::CopyZfill16, Element>{}, typename Base::ChunkThreadLayout{}, typename Base::ChunkValueLayout{}));
};

// Every step of every CTA in order: key tiles ascending, within each the CTA's query tiles that
// see it; each visible (query tile, key tile) pair exactly once; a query tile's first step at key
// tile 0 and its last at last_key_tile.
TEST(Fa1Schedule, VisitsEveryVisiblePairOnceInFa1Order) {
  for (const auto& [bm, bn] : {std::pair{64, 128}, std::pair{64, 64}, std::pair{128, 64}}) {
    for (int q_tiles : {1, 2, 3, 8}) {
      const int64_t seqlen = int64_t{q_tiles} * bm;
      if (seqlen % bn != 0) continue;
      for (bool causal : {false, true}) {
        for (int groups = 1; groups <= q_tiles; ++groups) {
          SCOPED_TRACE(testing::Message()
                       << bm << "x" << bn << " seqlen " << seqlen << " groups " << groups << (causal ? " causal" : ""));
          std::set<std::pair<int, int>> seen;
          for (int g = 0; g < groups; ++g) {
            Fa1Schedule s;
            s.i_begin = g * q_tiles / groups;
            s.i_end = (g + 1) * q_tiles / groups;
            s.k_tiles = static_cast<int>(seqlen / bn);
            s.block_m = bm;
            s.block_n = bn;
            s.causal = causal;
            int j = 0, i = s.i_begin, prev_j = -1, prev_i = -1;
            std::set<int> started;
            do {
              EXPECT_TRUE(j > prev_j || (j == prev_j && i > prev_i)) << "out of FA1 order at " << j << "," << i;
              EXPECT_TRUE(i >= s.i_begin && i < s.i_end);
              EXPECT_TRUE(!causal || int64_t{i + 1} * bm - 1 >= int64_t{j} * bn) << "invisible tile " << i << "," << j;
              EXPECT_TRUE(seen.insert({i, j}).second) << "pair visited twice";
              if (started.insert(i).second) {
                EXPECT_EQ(j, 0) << "query tile " << i << " starts late";
              }
              EXPECT_LE(j, s.last_key_tile(i));
              prev_j = j, prev_i = i;
            } while (s.next(j, i));
          }
          size_t visible = 0;
          for (int i = 0; i < q_tiles; ++i) {
            for (int64_t j = 0; j < seqlen / bn; ++j) visible += !causal || int64_t{i + 1} * bm - 1 >= j * bn;
          }
          EXPECT_EQ(seen.size(), visible);
        }
      }
    }
  }
}

struct Case {
  DType dtype = DType::kFloat16;
  int batch = 1, seqlen = 128, heads = 1;
  bool causal = false;
  int q_groups = 1;  // 0: the control (O in registers)
};

// Runs one case and checks it; returns the output's values.
template <ElemType kElem, int kHeadDim>
std::vector<double> run_case(const Case& c) {
  fa_test::Case tc;
  tc.dtype = c.dtype;
  tc.batch = c.batch;
  tc.seqlen_q = tc.seqlen_k = c.seqlen;
  tc.heads_q = tc.heads_kv = c.heads;
  tc.head_dim = kHeadDim;
  tc.causal = c.causal;
  tc.backward = false;
  const std::string name = tc.name() + " q_groups " + std::to_string(c.q_groups);
  SCOPED_TRACE(name);
  using Traits = EmulatedTraits<kElem, kHeadDim>;

  const std::vector<int64_t> shape = {c.batch, c.seqlen, c.heads, kHeadDim};
  const std::vector<int64_t> lse_shape = {c.batch, c.heads, c.seqlen};
  auto rng = fa_test::rng_for(tc.name());  // the same inputs for every q_groups
  fa_test::HostTensor q(c.dtype, shape), k(c.dtype, shape), v(c.dtype, shape), out(c.dtype, shape), ref(c.dtype, shape);
  fa_test::HostTensor lse(DType::kFloat32, lse_shape), lse_ref(DType::kFloat32, lse_shape);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  out.fill_storage_nan();
  lse.fill_storage_nan();
  std::vector<float> workspace(
      static_cast<size_t>(flashattn::cuda::teaching::fa1_workspace_floats(c.batch, c.seqlen, c.heads, kHeadDim)),
      std::numeric_limits<float>::quiet_NaN());  // nothing may be read before the kernel wrote it
  flashattn::AttentionOptions opts;
  opts.mask.causal = c.causal;
  flashattn::reference_forward({q.view(), k.view(), v.view(), ref.view(), lse_ref.view()}, opts);

  const auto launch = flashattn::cuda::teaching::fa1_launch(
      q.data(), k.data(), v.data(), out.data(), static_cast<float*>(lse.data()),
      c.q_groups == 0 ? nullptr : workspace.data(), c.batch, c.seqlen, c.heads, kHeadDim, c.causal, c.q_groups);
  const emu::Dim3 grid{static_cast<unsigned>(launch.q_groups), static_cast<unsigned>(c.heads),
                       static_cast<unsigned>(c.batch)};
  emu::launch(grid, Traits::kNThreads, [&] { flashattn::cuda::teaching::fa1_order_kernel<Traits>(launch.params); });

  const fa_test::NaiveResult naive = fa_test::naive_attention(tc, fa_test::make_geometry(tc), q.to_vector(),
                                                              k.to_vector(), v.to_vector(), {}, {}, 0, 0);
  double err = 0, bound = 0;
  fa_test::expect_close("out", out.to_vector(), ref.to_vector(), naive.out, 2.0, c.dtype, name, &err, &bound);
  fa_test::expect_close("lse", lse.to_vector(), lse_ref.to_vector(), naive.lse, 2.0, DType::kFloat32, name, &err,
                        &bound);
  return out.to_vector();
}

// Per (dtype, head_dim), causal or not: one key tile (the state never leaves the registers),
// and three (a middle step that loads and stores the state) in batch 2 x 2 heads with FA1's
// q_groups 1, then in one head with 2 groups, one query tile per CTA and the control. The
// round-trip runs of one head must agree bitwise: each query tile's steps are the same
// operations whatever the grouping.
template <ElemType kElem, int kHeadDim>
void run_set() {
  const DType dtype = kElem == ElemType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  const auto tiles = fa1_tile_shape(kHeadDim);
  const int unit = std::max(tiles.block_m, tiles.block_n), seqlen = 3 * unit, q_tiles = seqlen / tiles.block_m;
  for (bool causal : {false, true}) {
    run_case<kElem, kHeadDim>({dtype, 1, unit, 1, causal, 1});
    run_case<kElem, kHeadDim>({dtype, 2, seqlen, 2, causal, 1});
    const std::vector<double> fa1 = run_case<kElem, kHeadDim>({dtype, 1, seqlen, 1, causal, 1});
    for (int q_groups : {2, q_tiles}) {
      const std::vector<double> grouped = run_case<kElem, kHeadDim>({dtype, 1, seqlen, 1, causal, q_groups});
      EXPECT_TRUE(grouped == fa1) << "q_groups " << q_groups << " differs from q_groups 1";
    }
    run_case<kElem, kHeadDim>({dtype, 1, seqlen, 1, causal, 0});
  }
}

// The MMA atom and conversions are the only dtype-dependent code: one dtype per head dim.
TEST(Fa1OrderEmulated, Fp16D64) { run_set<ElemType::kFloat16, 64>(); }
TEST(Fa1OrderEmulated, Bf16D128) { run_set<ElemType::kBFloat16, 128>(); }

}  // namespace

// The sm90a forward kernels (src/cuda/sm90), called directly through run_sm90_forward,
// against the fp64 CPU reference with the tolerance rule of docs/CONVENTIONS.md: fp16 / bf16 x
// every sm90 head dim (64, 96, 128, 192, 256) x no mask / causal / sliding window, tails, seqlen_q !=
// seqlen_k, GQA, batch 2,
// outputs poisoned with NaN; grids of many tiles per CTA (the persistent scheduler) and of one;
// varlen through the public API. Also the launcher's refusals (cu_seqlens_q without cu_seqlens_k,
// dropout, misaligned strides)
// and the registry's choice between the sm90 and sm80 kernels (Sm90Dispatch: no GPU needed; CI
// runs it). The rest skips without an sm_90 GPU; through the public API the sm90 kernels are
// covered by test_gpu_forward's whole matrix on an H100.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "cuda/kernel_registry.hpp"
#include "cuda/params.hpp"
#include "cuda/sm90/forward_launch.hpp"
#include "device_buffer.hpp"
#include "gpu_case.hpp"
#include "naive_attention.hpp"
#include "test_util.hpp"

namespace {

using fa_gpu_test::cuda_ok;
using fa_gpu_test::DeviceBuffer;
using fa_gpu_test::have_sm90_device;
using fa_gpu_test::ScopedEnv;
using flashattn::DType;
using flashattn::cuda::ElemType;
using flashattn::cuda::ForwardParams;
using flashattn::cuda::MaskKind;

#define SKIP_WITHOUT_SM90() \
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0"

// The registry's sm90 kernel for (dtype, head dim, mask kind), or nullptr when this build lacks
// it (FLASHATTN_CUDA_HEAD_DIMS without that head dim; dropout without FLASHATTN_CUDA_SM90_DROPOUT).
const flashattn::cuda::ForwardKernel* sm90_kernel(DType dtype, int64_t head_dim, MaskKind mask) {
  const flashattn::cuda::KernelKey key{90,
                                       dtype == DType::kFloat16 ? ElemType::kFloat16 : ElemType::kBFloat16,
                                       static_cast<int>(head_dim),
                                       flashattn::detail::Direction::kForward,
                                       mask,
                                       90};
  for (const auto& k : flashattn::cuda::forward_kernels()) {
    if (k.key == key) return &k;
  }
  return nullptr;
}
const flashattn::cuda::ForwardKernel* sm90_kernel(DType dtype, int64_t head_dim, bool masked) {
  return sm90_kernel(dtype, head_dim, masked ? MaskKind::kMasked : MaskKind::kNone);
}

#define SKIP_WITHOUT_KERNEL(dtype, d)                                                    \
  if (sm90_kernel(dtype, d, false) == nullptr || sm90_kernel(dtype, d, true) == nullptr) \
  GTEST_SKIP() << "this build has no sm90 kernels of head dim " << (d)

// Runs the sm90 launcher directly (no fallback to sm80).
cudaError_t run(DType dtype, int64_t head_dim, bool masked, const ForwardParams& p) {
  return sm90_kernel(dtype, head_dim, masked)->launch(p, nullptr);
}

// Contiguous [b, s, h, d] tensors on the device and the params that describe them.
struct Problem {
  fa_test::Case c;
  fa_test::HostTensor q, k, v;
  DeviceBuffer dq, dk, dv, dout, dlse;
  DeviceBuffer tile_counter;  // the forward workspace (filled with 0x7F: the launcher must zero it)
  ForwardParams params;
};

// Inputs other than random normal ones: rewrites q, k, v (host tensors) before the upload.
using Inputs = void (*)(Problem&);

void setup(Problem& pr, Inputs inputs = nullptr) {
  const fa_test::Case& c = pr.c;
  auto rng = fa_test::rng_for("sm90 " + c.name());
  pr.q = fa_test::HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
  pr.k = fa_test::HostTensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim});
  pr.v = fa_test::HostTensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim});
  pr.q.fill_normal(rng, c.input_scale);
  pr.k.fill_normal(rng, c.input_scale);
  pr.v.fill_normal(rng, 1.0);
  if (inputs != nullptr) inputs(pr);
  const size_t elem = flashattn::dtype_size(c.dtype);
  pr.dq = DeviceBuffer(static_cast<size_t>(pr.q.numel()) * elem);
  pr.dk = DeviceBuffer(static_cast<size_t>(pr.k.numel()) * elem);
  pr.dv = DeviceBuffer(static_cast<size_t>(pr.v.numel()) * elem);
  pr.dout = DeviceBuffer(static_cast<size_t>(pr.q.numel()) * elem);
  pr.dlse = DeviceBuffer(static_cast<size_t>(c.batch * c.heads_q * c.seqlen_q) * sizeof(float));
  pr.dq.upload(pr.q.data());
  pr.dk.upload(pr.k.data());
  pr.dv.upload(pr.v.data());

  ForwardParams& p = pr.params;
  const int64_t d = c.head_dim;
  p.q = {pr.dq.get(), c.seqlen_q * c.heads_q * d, c.heads_q * d, d};
  p.k = {pr.dk.get(), c.seqlen_k * c.heads_kv * d, c.heads_kv * d, d};
  p.v = {pr.dv.get(), c.seqlen_k * c.heads_kv * d, c.heads_kv * d, d};
  p.out = {pr.dout.get(), c.seqlen_q * c.heads_q * d, c.heads_q * d, d};
  p.lse = {static_cast<float*>(pr.dlse.get()), c.heads_q * c.seqlen_q, 1, c.seqlen_q};
  p.shape = {c.batch, c.heads_q, c.heads_kv, d, c.seqlen_q, c.seqlen_k};
  p.window = {c.window_left, c.causal ? 0 : c.window_right};
  // As the dispatcher builds it (backend.cpp forward_params) for plain scores.
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  p.score.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.score.raw_scores = true;
}

// with_workspace: the params carry the tile counter, as the dispatcher passes the caller's
// forward workspace (masked calls then take the counter-fed grid); without, no counter (one CTA
// per tile for them).
void run_case(const fa_test::Case& c, bool with_workspace = true, Inputs inputs = nullptr) {
  SCOPED_TRACE(c.name() + (with_workspace ? "" : " (no workspace)"));
  Problem pr;
  pr.c = c;
  setup(pr, inputs);
  pr.dout.poison();
  pr.dlse.poison();
  if (with_workspace) {
    pr.tile_counter = DeviceBuffer(flashattn::kForwardWorkspaceBytes);
    pr.tile_counter.fill(0x7F);  // unzeroed, it would end every CTA's walk after its first tile
    pr.params.tile_counter = static_cast<int*>(pr.tile_counter.get());
  }
  const bool masked = c.causal || c.window_left >= 0 || c.window_right >= 0;
  cuda_ok(run(c.dtype, c.head_dim, masked, pr.params), "run_sm90_forward");
  cuda_ok(cudaDeviceSynchronize(), "sm90 forward kernel");

  fa_test::HostTensor out(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
  fa_test::HostTensor lse(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q});
  pr.dout.download(out.data());
  pr.dlse.download(lse.data());

  fa_test::HostTensor ref_out(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
  fa_test::HostTensor ref_lse(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q});
  flashattn::AttentionOptions opts;
  opts.mask.causal = c.causal;
  opts.mask.window_left = c.window_left;
  opts.mask.window_right = c.window_right;
  flashattn::reference_forward({pr.q.view(), pr.k.view(), pr.v.view(), ref_out.view(), ref_lse.view()}, opts);
  const fa_test::Geometry g = fa_test::make_geometry(c);
  const fa_test::NaiveResult naive =
      fa_test::naive_attention(c, g, pr.q.to_vector(), pr.k.to_vector(), pr.v.to_vector(), {}, {}, 0, 0);
  double err = 0, bound = 0;
  fa_test::expect_close("out", out.to_vector(), ref_out.to_vector(), naive.out, 2.0, c.dtype, c.name(), &err, &bound);
  fa_test::expect_close("lse", lse.to_vector(), ref_lse.to_vector(), naive.lse, 2.0, DType::kFloat32, c.name(), &err,
                        &bound);
}

// A forward case of dtype and head dim d (the rest Case's defaults).
fa_test::Case forward_case(DType dtype, int64_t d) {
  fa_test::Case c;
  c.dtype = dtype;
  c.backward = false;
  c.head_dim = d;
  return c;
}

struct Shape {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv;
};
const std::vector<Shape> kShapes = {
    {1, 1, 1, 2, 2},       {2, 77, 300, 8, 2},   {1, 300, 77, 4, 4},   {2, 128, 128, 8, 2},
    {1, 1000, 1000, 2, 1}, {2, 300, 1000, 8, 2}, {1, 1000, 300, 4, 2}, {1, 1, 1000, 8, 2},
};

struct MaskCase {
  bool causal;
  int64_t left, right;
};
// No mask; causal (bottom-right); a sliding window; a window that leaves rows empty.
const std::vector<MaskCase> kMasks = {{false, -1, -1}, {true, -1, -1}, {false, 100, 20}, {true, 0, -1}};

void set_mask(fa_test::Case& c, const MaskCase& m) {
  c.causal = m.causal;
  c.window_left = m.left;
  c.window_right = m.right;
}

// Every (shape, mask) pair; stops at the first failing case. Each case is named on stderr before
// it runs, so a hang (a lost mbarrier phase) shows which one.
void run_matrix(DType dtype, int64_t d, const std::vector<Shape>& shapes, const std::vector<MaskCase>& masks,
                bool with_workspace = true) {
  for (const Shape& s : shapes) {
    for (const MaskCase& m : masks) {
      fa_test::Case c = forward_case(dtype, d);
      c.batch = s.batch;
      c.seqlen_q = s.seqlen_q;
      c.seqlen_k = s.seqlen_k;
      c.heads_q = s.heads_q;
      c.heads_kv = s.heads_kv;
      set_mask(c, m);
      std::fprintf(stderr, "sm90 case %s\n", c.name().c_str());
      run_case(c, with_workspace);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

class Sm90Forward : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(Sm90Forward, MatchesReference) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  run_matrix(dtype, d, kShapes, kMasks);
}

// More work tiles (query tiles x heads x batch) than an H100 has SMs, so each CTA of the
// persistent grid takes 2-3 tiles in turn: Q's buffers (and the tile index beside each) handed
// between the producer and consumers that run apart (one may start its next tile while another
// finishes this one), the K / V stages and the pingpong turns carried across tiles.
// 385 query rows: 4 tiles of 128 rows (3 of 192 at d64), the last of 1 row; x 48 heads x 2
// batches = 384 (288) tiles.
const Shape kManyTiles = {2, 385, 64, 48, 8};

// FLASHATTN_SM90_PERSISTENT for the test's scope, whatever the mask: "0" one CTA per tile, "1"
// one CTA per SM walking the tiles statically, "2" one CTA per SM taking tiles from a counter.
struct GridMode : ScopedEnv {
  explicit GridMode(const char* persistent) : ScopedEnv("FLASHATTN_SM90_PERSISTENT", persistent) {}
};

// The sanitizers' filter: tails on both sides, GQA, no mask and causal; several tiles per CTA.
TEST_P(Sm90Forward, Small) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  run_matrix(dtype, d, {{2, 77, 300, 8, 2}, {1, 300, 77, 4, 4}}, {kMasks[0], kMasks[1]});
  for (const char* persistent : {"1", "2"}) {  // both persistent grids, for the causal case too
    GridMode mode(persistent);
    run_matrix(dtype, d, {kManyTiles}, {kMasks[0], kMasks[1]});
  }
}

// FLASHATTN_SM90_D64_TALL for the test's scope: "1" runs every dense masked d64 call on the tall
// kernel (three consumers, 192-row tiles), "0" none.
struct D64Tall : ScopedEnv {
  explicit D64Tall(const char* v) : ScopedEnv("FLASHATTN_SM90_D64_TALL", v) {}
};

// The tall kernel, which dense masked d64 calls run from sm90::kD64TallMinSeqlenQ query rows on,
// on short ones (part of the sanitizers' filter): tails, GQA, causal, a window, empty rows, and
// many tiles per CTA on both persistent grids and one CTA per tile.
TEST_P(Sm90Forward, SmallTall) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  if (d != 64) GTEST_SKIP() << "only d64 has a tall kernel";
  SKIP_WITHOUT_KERNEL(dtype, d);
  const D64Tall tall("1");
  run_matrix(dtype, d, {{2, 77, 300, 8, 2}, {1, 300, 77, 4, 4}}, {kMasks[1], kMasks[2], kMasks[3]});
  for (const char* persistent : {"2", "0"}) {
    GridMode mode(persistent);
    run_matrix(dtype, d, {kManyTiles, {2, 1000, 40, 16, 4}}, {kMasks[1]});
  }
}

// Every grid gives the reference's result on many tiles, whatever the mask: one CTA per SM
// looping over tiles (statically or from the counter), and one CTA per tile (also what masked
// calls without a workspace run by default). Also tiles whose rows see no key (causal, seqlen_q
// >> seqlen_k: the CTA loads Q, skips the key loop and writes 0 / -inf) between tiles that do.
TEST_P(Sm90Forward, PersistentAndOneTilePerCtaGrids) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  for (const char* persistent : {"2", "1", "0"}) {
    SCOPED_TRACE(std::string("FLASHATTN_SM90_PERSISTENT=") + persistent);
    GridMode mode(persistent);
    run_matrix(dtype, d, {kManyTiles}, kMasks);
    run_matrix(dtype, d, {{2, 1000, 40, 16, 4}}, {kMasks[1]});  // 8 (6) x 16 x 2 tiles, most empty
  }
  run_matrix(dtype, d, {kManyTiles}, {kMasks[1]}, false);
}

// FLASHATTN_TILE_ORDER for the test's scope: "<group>,<waves>", the (head, batch) pairs whose
// masked tiles are dealt together, heaviest first, and the waves of CTAs the last group spans at
// least (tile_order.hpp).
struct TileOrderEnv : ScopedEnv {
  explicit TileOrderEnv(const char* v) : ScopedEnv("FLASHATTN_TILE_ORDER", v) {}
};

// Masked tiles in groups of 5 pairs (kManyTiles' 96 pairs: a short last group), with a tail group
// of two waves, and a pair at a time, on the counter-fed grid and one CTA per tile: every tile
// once, wherever it lands.
TEST_P(Sm90Forward, TileGroups) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  for (const char* order : {"5,0", "5,2", "1,0"}) {
    const TileOrderEnv tile_order(order);
    for (const char* persistent : {"2", "0"}) {
      SCOPED_TRACE(std::string("FLASHATTN_TILE_ORDER=") + order + ", FLASHATTN_SM90_PERSISTENT=" + persistent);
      GridMode mode(persistent);
      run_matrix(dtype, d, {kManyTiles}, {kMasks[1], kMasks[2]});
    }
  }
}

// FLASHATTN_SM90_VARLEN for the test's scope: "0" varlen calls run the sm80 kernels, "1" the sm90
// ones wherever they can (also d64 batches of short sequences, which the dispatch leaves to sm80).
struct Sm90Varlen : ScopedEnv {
  explicit Sm90Varlen(const char* v) : ScopedEnv("FLASHATTN_SM90_VARLEN", v) {}
};

// Varlen through the public API on the sm90 kernels (forced: Sm90Dispatch checks the registry picks
// them): sequences of different lengths, zero-length ones, many of them (70), tails of every
// tile, seqused_k, masks, GQA, decode-like single rows; the input rows no sequence reads hold
// NaN, so neither a tail tile's rows from the next sequence nor the keys past seqused_k may leak
// into a result. Rows of no sequence come back 0 / -inf (the library's fill).
TEST_P(Sm90Forward, Varlen) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  const Sm90Varlen sm90("1");
  std::vector<int32_t> many_q, many_k;  // 70 sequences, every seventh empty
  for (int32_t i = 0; i < 70; ++i) {
    many_q.push_back(i % 7 == 3 ? 0 : 1 + i * 37 % 300);
    many_k.push_back(1 + i * 53 % 400);
  }
  const std::vector<fa_gpu_test::VarlenSpec> specs = {
      {{130, 0, 1, 257}, {200, 5, 0, 300}, {}, false, -1, -1, 0.0f},
      {{300, 17, 64}, {40, 300, 64}, {}, true, -1, -1, 0.0f},
      {{33, 129, 0}, {150, 77, 9}, {100, 0, 9}, true, -1, -1, 0.0f},
      {{65, 200}, {65, 180}, {}, false, 20, 5, 0.0f},
      {{1, 1, 1}, {500, 129, 64}, {300, 129, 1}, false, -1, -1, 0.0f},
      {many_q, many_k, {}, true, -1, -1, 0.0f},
  };
  for (const fa_gpu_test::VarlenSpec& sp : specs) {
    fa_gpu_test::GpuCase c = fa_gpu_test::varlen_forward_case(dtype, 4, 2, d, sp);
    c.nan_outside_sequences = true;
    fa_gpu_test::run_gpu_varlen_case(c);
    if (::testing::Test::HasFailure()) return;
  }
}

// Dropout on the sm90 kernels (built with FLASHATTN_CUDA_SM90_DROPOUT), through the public API
// (Sm90Dispatch checks the registry picks them): the CPU backend's keep-mask for the same seed
// and offset (the reference applies it), tails, GQA, causal and not, a varlen batch with NaN in
// the rows no sequence reads; reruns bitwise identical.
TEST_P(Sm90Forward, Dropout) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  if (sm90_kernel(dtype, d, MaskKind::kMaskedDropout) == nullptr) {
    GTEST_SKIP() << "this build has no sm90 dropout kernel of head dim " << d;
  }
  for (bool causal : {false, true}) {
    fa_gpu_test::GpuCase c;
    c.dtype = dtype;
    c.batch = 2;
    c.seqlen_q = 300;
    c.seqlen_k = 257;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = d;
    c.causal = causal;
    c.dropout = 0.2f;
    c.reruns = 2;
    fa_gpu_test::run_gpu_case(c);
  }
  fa_gpu_test::GpuCase v =
      fa_gpu_test::varlen_forward_case(dtype, 4, 2, d, {{130, 0, 257}, {200, 5, 300}, {}, true, -1, -1, 0.15f});
  v.nan_outside_sequences = true;
  fa_gpu_test::run_gpu_varlen_case(v);
}

// Rows that see no key (bottom-right causal with seqlen_q > seqlen_k; seqlen_k = 0): out 0,
// LSE -inf; large logits (x5) must neither overflow nor lose the row max.
TEST_P(Sm90Forward, EmptyRowsAndLargeLogits) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  fa_test::Case c = forward_case(dtype, d);
  c.seqlen_q = 300;
  c.seqlen_k = 70;
  c.causal = true;
  run_case(c);
  c.causal = false;
  c.seqlen_q = 500;
  c.seqlen_k = 700;
  c.input_scale = 5.0;
  run_case(c);
}

// Scores that climb key after key towards key 0, so that every key tile after a row's first
// (the kernels walk them last to first) raises its max: by ~0.1 per key in the exponent's log2
// units (~13-18 a key tile: past the lazy rescale's threshold, P against the old max finite), and
// by ~1.5 per key (past 2^128: P against the old max is Inf). The steady steps that take the
// exponentials against the current max must find that and redo the step (their fallback);
// causal and windowed too.
template <int kSlopeTenths>
void climbing_scores(Problem& pr) {
  const fa_test::Case& c = pr.c;
  const double slope = kSlopeTenths / 10.0;
  const double per_unit = std::sqrt(static_cast<double>(c.head_dim)) * 1.4426950408889634;  // q = 1: log2 units
  pr.q.fill(1.0);
  const int64_t row = c.heads_kv * c.head_dim;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < c.seqlen_k; ++j) {
      const double value = slope * static_cast<double>(c.seqlen_k - j) / per_unit;
      for (int64_t e = 0; e < row; ++e) pr.k.set((b * c.seqlen_k + j) * row + e, value);
    }
  }
}

TEST_P(Sm90Forward, MaxClimbingEveryKeyTile) {
  SKIP_WITHOUT_SM90();
  const auto [dtype, d] = GetParam();
  SKIP_WITHOUT_KERNEL(dtype, d);
  fa_test::Case c = forward_case(dtype, d);
  c.batch = 2;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.seqlen_q = 700;
  c.seqlen_k = 1000;
  for (const MaskCase& m : {kMasks[0], kMasks[1], kMasks[2]}) {
    set_mask(c, m);
    run_case(c, true, climbing_scores<1>);
    run_case(c, true, climbing_scores<15>);
    if (::testing::Test::HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesHeadDims, Sm90Forward,
                         ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(int64_t{64}, int64_t{96}, int64_t{128}, int64_t{192},
                                                              int64_t{256})));

// What the launcher refuses, before touching the device: cu_seqlens_q alone, dropout (for a kernel
// without it), a head dim other than the kernel's, and TMA's 16-byte rules for pointers and
// strides.
TEST(Sm90ForwardLauncher, RefusesWhatItCannotRun) {
  SKIP_WITHOUT_SM90();
  SKIP_WITHOUT_KERNEL(DType::kFloat16, 64);
  fa_test::Case c;
  c.dtype = DType::kFloat16;
  c.backward = false;
  c.seqlen_q = 64;
  c.seqlen_k = 64;
  c.head_dim = 64;
  Problem pr;
  pr.c = c;
  setup(pr);
  using flashattn::cuda::sm90::forward_unsupported_reason;
  EXPECT_EQ(forward_unsupported_reason(pr.params, 2, 64), nullptr);
  auto refused = [&](ForwardParams p) {
    EXPECT_NE(forward_unsupported_reason(p, 2, 64), nullptr);
    EXPECT_EQ(run(DType::kFloat16, 64, false, p), cudaErrorNotSupported);
  };
  ForwardParams p = pr.params;
  const int32_t cu[2] = {0, 64};
  p.cu_seqlens_q = cu;
  refused(p);
  p = pr.params;
  p.dropout.threshold = flashattn::core::dropout_threshold(0.25);
  refused(p);
  p = pr.params;
  p.shape.head_dim = 63;
  refused(p);
  p = pr.params;
  p.q.data = static_cast<const char*>(p.q.data) + 2;
  refused(p);
  p = pr.params;
  p.k.row_stride = 68;  // 136 bytes
  refused(p);
  p = pr.params;
  p.window = {10, 0};  // a window for the kernel without mask logic
  EXPECT_EQ(run(DType::kFloat16, 64, false, p), cudaErrorInvalidValue);
}

}  // namespace

namespace {

// The registry's choice (select_forward_kernel), with the device and code arch given: no GPU.
TEST(Sm90Dispatch, PicksTheHopperKernelWhereItRuns) {
  using flashattn::cuda::find_forward_kernel;
  using flashattn::cuda::kernel_name;
  using flashattn::cuda::KernelKey;
  using flashattn::cuda::select_forward_kernel;
  const int d = sm90_kernel(DType::kBFloat16, 128, true) != nullptr ? 128 : 64;  // what this build has
  ASSERT_NE(sm90_kernel(DType::kBFloat16, d, true), nullptr);
  const std::string sm90_name = "sm90_fwd_bf16_d" + std::to_string(d) + "_masked";
  // A 16-byte aligned address for TMA's check; nothing is read through it.
  alignas(16) static uint16_t storage[64 * 128];
  ForwardParams p;
  p.q = p.k = p.v = {storage, 64 * d, d, d};
  p.out = {storage, 64 * d, d, d};
  p.shape = {1, 1, 1, d, 64, 64};
  const KernelKey key{80, ElemType::kBFloat16, d, flashattn::detail::Direction::kForward, MaskKind::kMasked};
  auto picked = [&](int code_arch, int cc, const ForwardParams& params, bool allow) {
    const auto* k = select_forward_kernel(key, code_arch, cc, params, allow);
    return k == nullptr ? std::string("none") : kernel_name(k->key);
  };
  const std::string sm80_name = "sm80_fwd_bf16_d" + std::to_string(d) + "_masked";
  const std::string sm80_on_sm90 = kernel_name(find_forward_kernel(key, 90)->key);
  EXPECT_EQ(sm80_on_sm90.rfind(sm80_name, 0), 0u) << sm80_on_sm90;
  EXPECT_EQ(picked(90, 90, p, true), sm90_name);
  EXPECT_EQ(picked(90, 90, p, false), sm80_on_sm90);  // FLASHATTN_DISABLE_SM90=1
  EXPECT_EQ(picked(80, 90, p, true), sm80_name);      // a build for "80" on an H100
  EXPECT_EQ(picked(80, 89, p, true), sm80_name);
  ForwardParams varlen = p;
  const int32_t cu[2] = {0, 64};
  varlen.cu_seqlens_q = cu;
  varlen.cu_seqlens_k = cu;
  varlen.total_q = flashattn::cuda::sm90::kVarlenD64MinRowsPerSequenceMasked;  // long enough for sm90 at d64
  varlen.total_k = 64;
  varlen.q.batch_stride = varlen.k.batch_stride = varlen.v.batch_stride = varlen.out.batch_stride = 0;
  EXPECT_EQ(picked(90, 90, varlen, true), sm90_name);
  ForwardParams one_sided = varlen;
  one_sided.cu_seqlens_k = nullptr;
  EXPECT_EQ(picked(90, 90, one_sided, true), sm80_on_sm90);
  {
    const Sm90Varlen off("0");
    EXPECT_EQ(picked(90, 90, varlen, true), sm80_on_sm90);
  }
  // A d64 batch of short sequences goes to sm80 (varlen_prefers_sm80), unless forced.
  ForwardParams short_rows = varlen;
  short_rows.total_q = flashattn::cuda::sm90::kVarlenD64MinRowsPerSequence - 1;  // short for either mask
  EXPECT_EQ(picked(90, 90, short_rows, true), d == 64 ? sm80_on_sm90 : sm90_name);
  {
    const Sm90Varlen forced("1");
    EXPECT_EQ(picked(90, 90, short_rows, true), sm90_name);
  }
  // Dropout: the sm90 dropout kernel where this build has it, else sm80's.
  const KernelKey dropout_key{80, ElemType::kBFloat16, d, flashattn::detail::Direction::kForward,
                              MaskKind::kMaskedDropout};
  ForwardParams dropout = p;
  dropout.dropout.threshold = flashattn::core::dropout_threshold(0.25);
  const auto* dropout_kernel = select_forward_kernel(dropout_key, 90, 90, dropout, true);
  ASSERT_NE(dropout_kernel, nullptr);
  EXPECT_EQ(kernel_name(dropout_kernel->key), sm90_kernel(DType::kBFloat16, d, MaskKind::kMaskedDropout) != nullptr
                                                  ? "sm90_fwd_bf16_d" + std::to_string(d) + "_dropout"
                                                  : kernel_name(find_forward_kernel(dropout_key, 90)->key));
  ForwardParams padded = p;
  padded.shape.head_dim = d - 8;  // the same bucket, padded: sm80 only
  EXPECT_EQ(picked(90, 90, padded, true), sm80_on_sm90);
  ForwardParams unaligned = p;
  unaligned.k.row_stride = d + 8;  // a multiple of 16 bytes: fine
  EXPECT_EQ(picked(90, 90, unaligned, true), sm90_name);
  unaligned.k.row_stride = d + 4;  // 8 bytes off: not for TMA
  EXPECT_EQ(picked(90, 90, unaligned, true), sm80_on_sm90);
}

// A block mask runs the Hopper block-sparse kernel where this build has it and its blocks hold
// whole 128-row tiles of the head dim's key tile; else, and with device-checked lists of more
// key blocks than its bitmap holds, the sm80 block-sparse kernel.
TEST(Sm90Dispatch, BlockSparseKernelWhereTheBlocksHoldItsTiles) {
  using flashattn::cuda::find_forward_kernel;
  using flashattn::cuda::IndexFaultSink;
  using flashattn::cuda::kernel_name;
  using flashattn::cuda::KernelKey;
  using flashattn::cuda::select_forward_kernel;
  using flashattn::cuda::sm90::kSparseCheckedKeyBlocks;
  alignas(16) static uint16_t storage[64 * 128];
  alignas(16) static int32_t lists[64];  // never read: the dispatch reads the mask's shape alone
  alignas(16) static uint32_t claim;
  for (const int d : {64, 128}) {
    const KernelKey key{
        80, ElemType::kBFloat16, d, flashattn::detail::Direction::kForward, MaskKind::kMasked, 80, false, true};
    const std::string sm90_name = "sm90_fwd_bf16_d" + std::to_string(d) + "_masked_blocksparse";
    const auto* sm80 = find_forward_kernel(key, 90);
    bool built = false;
    for (const auto& k : flashattn::cuda::forward_kernels()) built = built || kernel_name(k.key) == sm90_name;
    if (!built || sm80 == nullptr) continue;  // (a build without one of them)
    ForwardParams p;
    p.q = p.k = p.v = {storage, 64 * d, d, d};
    p.out = {storage, 64 * d, d, d};
    p.shape = {1, 1, 1, d, 256, 256};
    p.window.left = p.window.right = -1;
    p.block_mask.partial_count_data = p.block_mask.partial_index_data = lists;
    p.block_mask.query_blocks = p.block_mask.key_blocks = 2;
    auto picked = [&](const ForwardParams& params, bool allow = true) {
      return kernel_name(select_forward_kernel(key, 90, 90, params, allow)->key);
    };
    EXPECT_EQ(picked(p), sm90_name);
    EXPECT_EQ(picked(p, false), kernel_name(sm80->key));  // FLASHATTN_DISABLE_SM90=1
    ForwardParams small = p;
    small.block_mask.block_m = 64;  // half a query tile
    EXPECT_EQ(picked(small), kernel_name(sm80->key));
    small = p;
    small.block_mask.block_n = 32;  // a quarter key tile
    EXPECT_EQ(picked(small), kernel_name(sm80->key));
    ForwardParams large = p;
    large.block_mask.block_m = large.block_mask.block_n = 256;
    EXPECT_EQ(picked(large), sm90_name);
    // Lists checked by the kernel: at most kSparseCheckedKeyBlocks key blocks.
    ForwardParams checked = p;
    checked.block_mask_fault = IndexFaultSink{&claim, nullptr};
    EXPECT_EQ(picked(checked), sm90_name);
    checked.block_mask.key_blocks = kSparseCheckedKeyBlocks + 1;
    EXPECT_EQ(picked(checked), kernel_name(sm80->key));
    checked.block_mask_fault = IndexFaultSink{};  // checked on the host: any count
    EXPECT_EQ(picked(checked), sm90_name);
  }
}

// Which dense masked d64 calls run the tall kernel: long ones, unless FLASHATTN_SM90_D64_TALL says.
TEST(Sm90Dispatch, TallKernelFromItsQueryLength) {
  using flashattn::cuda::sm90::d64_tall;
  using flashattn::cuda::sm90::kD64TallMinSeqlenQ;
  EXPECT_FALSE(d64_tall(1));
  EXPECT_FALSE(d64_tall(kD64TallMinSeqlenQ - 1));
  EXPECT_TRUE(d64_tall(kD64TallMinSeqlenQ));
  {
    const D64Tall always("1");
    EXPECT_TRUE(d64_tall(1));
  }
  {
    const D64Tall never("0");
    EXPECT_FALSE(d64_tall(kD64TallMinSeqlenQ * 4));
  }
  const D64Tall other("yes");  // not "0" or "1": the length decides
  EXPECT_FALSE(d64_tall(1));
  EXPECT_TRUE(d64_tall(kD64TallMinSeqlenQ));
}

// Which varlen batches the dispatch leaves to the sm80 kernels: d64 ones of short sequences
// without dropout (shorter without a mask than with one), unless FLASHATTN_SM90_VARLEN says.
TEST(Sm90Dispatch, ShortVarlenD64OnSm80) {
  using flashattn::cuda::sm90::kVarlenD64MinRowsPerSequence;
  using flashattn::cuda::sm90::kVarlenD64MinRowsPerSequenceMasked;
  using flashattn::cuda::sm90::varlen_prefers_sm80;
  const int32_t cu[2] = {0, 0};  // never read
  ForwardParams p;
  p.shape = {3, 1, 1, 64, 500, 500};  // 3 sequences
  constexpr MaskKind kNone = MaskKind::kNone;
  EXPECT_FALSE(varlen_prefers_sm80(p, kNone));  // dense
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  p.total_q = 3 * kVarlenD64MinRowsPerSequence - 1;
  EXPECT_TRUE(varlen_prefers_sm80(p, kNone));
  p.total_q += 1;
  EXPECT_FALSE(varlen_prefers_sm80(p, kNone));
  ForwardParams causal = p;
  causal.window.right = 0;
  EXPECT_TRUE(varlen_prefers_sm80(causal, MaskKind::kMasked));
  causal.total_q = 3 * kVarlenD64MinRowsPerSequenceMasked;
  EXPECT_FALSE(varlen_prefers_sm80(causal, MaskKind::kMasked));
  p.total_q -= 1;
  ForwardParams d128 = p;
  d128.shape.head_dim = 128;
  EXPECT_FALSE(varlen_prefers_sm80(d128, kNone));
  ForwardParams dropout = p;
  dropout.dropout.threshold = flashattn::core::dropout_threshold(0.25);
  EXPECT_FALSE(varlen_prefers_sm80(dropout, MaskKind::kMaskedDropout));
  {
    const Sm90Varlen forced("1");
    EXPECT_FALSE(varlen_prefers_sm80(p, kNone));
  }
  {
    const Sm90Varlen off("0");  // every varlen batch to sm80, by forward_unsupported_reason instead
    EXPECT_FALSE(varlen_prefers_sm80(p, kNone));
    EXPECT_NE(flashattn::cuda::sm90::forward_unsupported_reason(p, 2, 64), nullptr);
  }
  const Sm90Varlen other("yes");  // not "0" or "1": the rule decides
  EXPECT_TRUE(varlen_prefers_sm80(p, kNone));
}

}  // namespace

// The sm90a backward kernel (src/cuda/sm90/backward_kernel.cuh) through the public API, against
// the fp64 CPU reference with the backward's tolerance rule (docs/CONVENTIONS.md), on an sm_90
// GPU: fp16 / bf16 x the kernel's head dims (64, 96, 128, 192, 256) x no mask / causal / sliding window /
// softcap / ALiBi, key and query tails of every tile, seqlen_q != seqlen_k, GQA and MQA, batches,
// strided, packed and dout[:, ::2] layouts, empty rows, large logits; varlen batches (zero-length
// sequences, seqused_k, NaN in the rows no sequence owns); deterministic mode; dropout (the
// dropout kernels, where built); 250 reruns bitwise; the same cases
// with FLASHATTN_SM90_BACKWARD=0 (the sm80 kernels) must pass too. Sm90BackwardDispatch (no GPU
// needed; CI runs it) checks which calls the registry gives the sm90 kernel.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "core/philox.hpp"
#include "cuda/kernel_registry.hpp"
#include "cuda/params.hpp"
#include "cuda/sm90/backward_launch.hpp"
#include "gpu_case.hpp"
#include "gpu_matrix.hpp"

namespace {

using fa_gpu_test::GpuCase;
using fa_gpu_test::have_sm90_device;
using fa_gpu_test::Layout;
using fa_gpu_test::ScopedEnv;
using flashattn::DType;
using flashattn::cuda::BackwardKernel;
using flashattn::cuda::BackwardParams;
using flashattn::cuda::ElemType;
using flashattn::cuda::KernelKey;
using flashattn::cuda::MaskKind;

const BackwardKernel* sm90_backward_kernel(ElemType elem, int head_dim, MaskKind mask) {
  const KernelKey key{90, elem, head_dim, flashattn::detail::Direction::kBackward, mask, 90};
  for (const BackwardKernel& k : flashattn::cuda::backward_kernels()) {
    if (k.key == key) return &k;
  }
  return nullptr;
}

// A dense, aligned d128 call: the params the dispatch sees.
BackwardParams d128_params() {
  BackwardParams p;
  alignas(16) static char buffer[16];
  auto rows = [&](auto& r) {
    r.data = buffer;
    r.row_stride = 8 * 128;
    r.head_stride = 128;
    r.batch_stride = 1024 * 8 * 128;
  };
  rows(p.fwd.q);
  rows(p.fwd.k);
  rows(p.fwd.v);
  rows(p.dout);
  rows(p.dq);
  rows(p.dk);
  rows(p.dv);
  p.fwd.shape = {2, 8, 8, 128, 1024, 1024};  // batch, heads_q, heads_kv, head_dim, seqlen_q, seqlen_k
  p.fwd.score.scale_log2 = 0.1f;
  p.fwd.score.raw_scores = true;
  return p;
}

TEST(Sm90BackwardDispatch, SupportedCallsRunTheSm90Kernel) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kFloat16, 128, MaskKind::kNone);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward kernel of fp16 d128 without a mask";
  const KernelKey key{80, ElemType::kFloat16, 128, flashattn::detail::Direction::kBackward, MaskKind::kNone, 80};
  BackwardParams p = d128_params();
  EXPECT_EQ(flashattn::cuda::select_backward_kernel(key, 90, 90, p, true), k);
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, p, false), k) << "FLASHATTN_DISABLE_SM90";
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 80, 90, p, true), k) << "sm_80 code";
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 100, p, true), k) << "not compute capability 9.0";
  {
    const ScopedEnv off("FLASHATTN_SM90_BACKWARD", "0");
    EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, p, true), k);
  }
  BackwardParams q = p;
  q.deterministic = true;
  EXPECT_EQ(flashattn::cuda::select_backward_kernel(key, 90, 90, q, true), k) << "deterministic mode";
  // What the kernel leaves to sm80: dropout, other head dims, misaligned strides.
  q = p;
  q.fwd.dropout.threshold = 1000;
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, q, true), k);
  q = p;
  q.fwd.shape.head_dim = 120;
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, q, true), k);
  q = p;
  q.dk.row_stride = 8 * 128 + 1;
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, q, true), k);
  // Softcap / ALiBi: the score-modifier kernel where the build has it (its own instantiation
  // file), else sm80.
  q = p;
  q.fwd.score.raw_scores = false;
  q.fwd.score.softcap_log2 = 1.0f;
  EXPECT_EQ(flashattn::cuda::select_backward_kernel(key, 90, 90, q, true) == k, k->unsupported(q) == nullptr);
}

// A dense call of head_dim runs `k` (the sm90 kernel of that head dim), and one of other_head_dim
// (the same bucket padded, or a head dim without an sm90 kernel) does not.
void expect_own_kernel(const BackwardKernel* k, ElemType elem, int head_dim, MaskKind mask, int other_head_dim) {
  const KernelKey key{80, elem, head_dim, flashattn::detail::Direction::kBackward, mask, 80};
  BackwardParams p = d128_params();
  p.fwd.shape.head_dim = head_dim;
  EXPECT_EQ(flashattn::cuda::select_backward_kernel(key, 90, 90, p, true), k);
  p.fwd.shape.head_dim = other_head_dim;
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, p, true), k);
}

TEST(Sm90BackwardDispatch, HeadDim64RunsItsOwnKernel) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kFloat16, 64, MaskKind::kNone);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward kernel of fp16 d64 without a mask";
  EXPECT_NE(sm90_backward_kernel(ElemType::kFloat16, 128, MaskKind::kNone), k);
  expect_own_kernel(k, ElemType::kFloat16, 64, MaskKind::kNone, 40);  // 40: padded to 64 by the API
}

// d96 has a kernel of its own (K and V in 32-byte swizzle atoms); d80, padded to 96, keeps the sm80
// kernels.
TEST(Sm90BackwardDispatch, HeadDim96RunsItsOwnKernel) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kBFloat16, 96, MaskKind::kMasked);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward kernel of bf16 d96 with a mask";
  expect_own_kernel(k, ElemType::kBFloat16, 96, MaskKind::kMasked, 80);
}

// Calls with dropout run the dropout kernel where the build has it, and no other sm90 kernel.
TEST(Sm90BackwardDispatch, DropoutRunsTheDropoutKernel) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kBFloat16, 128, MaskKind::kMaskedDropout);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward dropout kernel of bf16 d128";
  const KernelKey key{80, ElemType::kBFloat16, 128, flashattn::detail::Direction::kBackward, MaskKind::kMaskedDropout,
                      80};
  BackwardParams p = d128_params();
  p.fwd.dropout = {1234, 0, flashattn::core::dropout_threshold(0.1), static_cast<float>(1.0 / 0.9)};
  EXPECT_EQ(flashattn::cuda::select_backward_kernel(key, 90, 90, p, true), k);
  EXPECT_EQ(k->unsupported(p), nullptr);
  BackwardParams no_dropout = d128_params();
  EXPECT_NE(k->unsupported(no_dropout), nullptr);
  const BackwardKernel* masked = sm90_backward_kernel(ElemType::kBFloat16, 128, MaskKind::kMasked);
  if (masked != nullptr) {
    EXPECT_NE(masked->unsupported(p), nullptr);
  }
}

// d192 and d256 have kernels of their own (the consumers split the head dim); d160, padded to
// 192, keeps the sm80 kernels.
TEST(Sm90BackwardDispatch, HeadDim192RunsItsOwnKernel) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kBFloat16, 192, MaskKind::kNone);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward kernel of bf16 d192 without a mask";
  expect_own_kernel(k, ElemType::kBFloat16, 192, MaskKind::kNone, 160);
}

TEST(Sm90BackwardDispatch, HeadDim256RunsItsOwnKernel) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kBFloat16, 256, MaskKind::kNone);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward kernel of bf16 d256 without a mask";
  expect_own_kernel(k, ElemType::kBFloat16, 256, MaskKind::kNone, 224);
}

// Varlen batches run the varlen kernel where the build has it (batch stride 0: the tensors are
// [total, heads, d]); a half-given varlen description does not.
TEST(Sm90BackwardDispatch, VarlenRunsTheSm90KernelWhenBuilt) {
  const BackwardKernel* k = sm90_backward_kernel(ElemType::kFloat16, 64, MaskKind::kNone);
  if (k == nullptr) GTEST_SKIP() << "this build has no sm90 backward kernel of fp16 d64 without a mask";
  const KernelKey key{80, ElemType::kFloat16, 64, flashattn::detail::Direction::kBackward, MaskKind::kNone, 80};
  BackwardParams p = d128_params();
  p.fwd.shape.head_dim = 64;
  static int32_t cu[3] = {0, 1, 2};
  p.fwd.cu_seqlens_q = cu;
  p.fwd.cu_seqlens_k = cu;
  p.fwd.total_q = p.fwd.total_k = 2;
  p.fwd.q.batch_stride = p.fwd.k.batch_stride = p.fwd.v.batch_stride = p.dout.batch_stride = 0;
  p.dq.batch_stride = p.dk.batch_stride = p.dv.batch_stride = 0;
  const char* reason = k->unsupported(p);
  EXPECT_EQ(flashattn::cuda::select_backward_kernel(key, 90, 90, p, true) == k, reason == nullptr);
  if (reason != nullptr) {
    EXPECT_NE(std::string(reason).find("varlen"), std::string::npos) << reason;
  }
  BackwardParams q = p;
  q.fwd.cu_seqlens_k = nullptr;
  EXPECT_NE(k->unsupported(q), nullptr);
  EXPECT_NE(flashattn::cuda::select_backward_kernel(key, 90, 90, q, true), k);
}

GpuCase case_of(DType dtype, int head_dim, int64_t batch, int64_t sq, int64_t sk, int64_t hq, int64_t hkv) {
  return fa_gpu_test::backward_case(dtype, batch, sq, sk, hq, hkv, head_dim);
}

constexpr int kHeadDims[] = {64, 96, 128, 192, 256};  // sm90::kSm90BackwardHeadDims

// The cases: every mask and score modifier over shapes with tails of both tiles (64 query rows;
// 128 keys, 64 at d192 and d256), GQA / MQA, layouts.
std::vector<GpuCase> cases(DType dtype, int head_dim) {
  std::vector<GpuCase> list;
  const std::vector<std::vector<int64_t>> shapes = {// batch, seqlen_q, seqlen_k, heads_q, heads_kv
                                                    {1, 1, 1, 2, 2},       {2, 64, 128, 4, 4},   {1, 77, 145, 4, 2},
                                                    {2, 128, 64, 6, 3},    {1, 513, 1000, 8, 1}, {3, 1000, 333, 4, 4},
                                                    {1, 2048, 2048, 2, 2}, {1, 190, 700, 12, 4}};
  int i = 0;
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 6; ++variant, ++i) {
      GpuCase c = case_of(dtype, head_dim, s[0], s[1], s[2], s[3], s[4]);
      c.causal = variant == 1 || variant == 4;
      if (variant == 2) {
        c.window_left = 100;
        c.window_right = 17;
      }
      c.softcap = variant == 3 ? 30.0f : 0.0f;
      c.alibi = variant == 4 || variant == 5;
      c.layout = i % 5 == 1 ? Layout::kStrided : Layout::kContiguous;
      if (i % 7 == 2 && c.seqlen_q == c.seqlen_k) c.layout = Layout::kPacked;
      c.dout_every_other_row = i % 4 == 3;
      list.push_back(c);
    }
  }
  GpuCase large = case_of(dtype, head_dim, 1, 300, 300, 2, 2);
  large.input_scale = 5.0;  // large logits
  list.push_back(large);
  GpuCase empty = case_of(dtype, head_dim, 1, 200, 100, 2, 2);
  empty.causal = true;  // bottom-right aligned: rows 0..99 see no key (zero gradients)
  list.push_back(empty);
  return list;
}

bool have_kernels(DType dtype, int head_dim) {
  const ElemType elem = dtype == DType::kFloat16 ? ElemType::kFloat16 : ElemType::kBFloat16;
  return sm90_backward_kernel(elem, head_dim, MaskKind::kNone) != nullptr &&
         sm90_backward_kernel(elem, head_dim, MaskKind::kMasked) != nullptr;
}

// (dtype, head dim)
class Sm90Backward : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  int head_dim() const { return std::get<1>(GetParam()); }
};

TEST_P(Sm90Backward, MatchesReference) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  if (!have_kernels(dtype(), head_dim())) GTEST_SKIP() << "this build has no sm90 backward kernels of this head dim";
  for (const GpuCase& c : cases(dtype(), head_dim())) {
    SCOPED_TRACE(c.name());
    fa_gpu_test::run_gpu_case(c);
  }
}

// The same cases on the sm80 kernels (the fallback the dispatch takes).
TEST_P(Sm90Backward, Sm80FallbackMatchesReference) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  const ScopedEnv off("FLASHATTN_SM90_BACKWARD", "0");
  for (const GpuCase& c : cases(dtype(), head_dim())) {
    SCOPED_TRACE(c.name());
    fa_gpu_test::run_gpu_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesHeadDims, Sm90Backward,
                         ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16),
                                            ::testing::ValuesIn(kHeadDims)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, int>>& p) {
                           return std::string(std::get<0>(p.param) == DType::kFloat16 ? "Fp16" : "Bf16") + "D" +
                                  std::to_string(std::get<1>(p.param));
                         });

// Varlen batches on the varlen kernel: zero-length sequences, seqused_k, NaN in the rows no
// sequence owns (the kernel zeroes the rows its tail tiles read past a sequence), tails of both
// tiles, seqlen_q >> seqlen_k and the reverse, every mask and score modifier, GQA / MQA, and
// deterministic mode.
TEST_P(Sm90Backward, VarlenMatchesReference) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  if (!have_kernels(dtype(), head_dim())) GTEST_SKIP() << "this build has no sm90 backward kernels of this head dim";
  using fa_gpu_test::varlen_backward_case;
  const DType dt = dtype();
  const int d = head_dim();
  std::vector<GpuCase> list = {
      varlen_backward_case(dt, 4, 2, d, {130, 0, 1, 257}, {200, 5, 0, 300}),
      varlen_backward_case(dt, 4, 1, d, {300, 17, 64}, {40, 300, 64}),
      varlen_backward_case(dt, 4, 2, d, {33, 129, 0}, {150, 77, 9}, {100, 0, 9}),
      varlen_backward_case(dt, 4, 2, d, {65, 200}, {65, 180}),
      varlen_backward_case(dt, 6, 2, d, {1000, 700, 5}, {16, 3, 1}),  // seqlen_q >> seqlen_k
      varlen_backward_case(dt, 6, 6, d, {257, 64, 128}, {600, 200, 129}, {333, 0, 64}),
      varlen_backward_case(dt, 2, 2, d, {1, 64, 700}, {1000, 128, 2}),  // seqlen_k >> seqlen_q
  };
  list[1].causal = true;
  list[2].causal = true;
  list[3].window_left = 20;
  list[3].window_right = 5;
  list[4].causal = true;
  list[5].alibi = true;
  list[5].softcap = 50.0f;
  list[6].softcap = 20.0f;
  for (size_t i = 0; i < list.size(); ++i) {
    list[i].nan_outside_sequences = i % 2 == 0;
    list[i].deterministic = i % 3 == 1;
    if (list[i].deterministic) list[i].reruns = 2;
    fa_gpu_test::run_gpu_varlen_case(list[i]);
  }
}

// Deterministic mode (the key tiles take turns at each query tile's dQ sums): every mask and
// score modifier, tails, GQA / MQA, against the reference, and dq bitwise equal over reruns.
TEST_P(Sm90Backward, DeterministicMatchesReference) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  if (!have_kernels(dtype(), head_dim())) GTEST_SKIP() << "this build has no sm90 backward kernels of this head dim";
  const std::vector<GpuCase> all = cases(dtype(), head_dim());
  for (size_t i = 0; i < all.size(); i += 3) {
    GpuCase c = all[i];
    c.deterministic = true;
    c.reruns = 3;
    SCOPED_TRACE(c.name());
    fa_gpu_test::run_gpu_case(c);
  }
}

bool have_dropout_kernels(DType dtype, int head_dim) {
  const ElemType elem = dtype == DType::kFloat16 ? ElemType::kFloat16 : ElemType::kBFloat16;
  return sm90_backward_kernel(elem, head_dim, MaskKind::kMaskedDropout) != nullptr;
}

// Dropout on the dropout kernels: the forward's keep-mask replayed in the transposed layout (the
// reference draws it from core/philox.hpp), with every mask and score modifier, tails, GQA / MQA,
// varlen batches and deterministic mode.
TEST_P(Sm90Backward, DropoutMatchesReference) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  if (!have_dropout_kernels(dtype(), head_dim())) GTEST_SKIP() << "this build has no sm90 backward dropout kernels";
  const std::vector<GpuCase> all = cases(dtype(), head_dim());
  for (size_t i = 0; i < all.size(); ++i) {
    GpuCase c = all[i];
    c.dropout = i % 2 == 0 ? 0.17f : 0.5f;
    c.deterministic = i % 7 == 3;
    SCOPED_TRACE(c.name());
    fa_gpu_test::run_gpu_case(c);
  }
  using fa_gpu_test::varlen_backward_case;
  GpuCase v = varlen_backward_case(dtype(), 4, 2, head_dim(), {130, 0, 1, 257}, {200, 5, 0, 300});
  v.dropout = 0.25f;
  v.causal = true;
  v.nan_outside_sequences = true;
  SCOPED_TRACE(v.name());
  fa_gpu_test::run_gpu_varlen_case(v);
}

// Races show up as run-to-run differences: 250 reruns must reproduce out, lse, dk, dv bitwise,
// and dq too in deterministic mode.
TEST(Sm90BackwardRace, BitwiseOver250Reruns) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  for (int head_dim : kHeadDims) {
    if (!have_kernels(DType::kBFloat16, head_dim)) continue;  // (a build of some head dims only)
    for (bool deterministic : {false, true}) {
      GpuCase c = case_of(DType::kBFloat16, head_dim, 2, 1000, 1000, 6, 2);
      c.causal = true;
      c.deterministic = deterministic;
      c.reruns = 250;
      SCOPED_TRACE(c.name());
      fa_gpu_test::run_gpu_case(c);
    }
    if (have_dropout_kernels(DType::kBFloat16, head_dim)) {
      GpuCase c = case_of(DType::kBFloat16, head_dim, 2, 1000, 1000, 6, 2);
      c.dropout = 0.2f;
      c.reruns = 250;
      SCOPED_TRACE(c.name());
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// A small filter for compute-sanitizer: tails, a mask, GQA, strided layout, deterministic mode,
// a varlen batch (a zero-length sequence, seqused_k, NaN outside the sequences).
TEST(Sm90BackwardSanitizerSmall, Backward) {
  if (!have_sm90_device()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
  int head_dims_run = 0;
  for (int head_dim : kHeadDims) {
    // Each case where the build has its dtype's kernels (a build of one dtype still checks it).
    const bool bf16 = have_kernels(DType::kBFloat16, head_dim);
    const bool fp16 = have_kernels(DType::kFloat16, head_dim);
    head_dims_run += bf16 || fp16;
    GpuCase c = case_of(DType::kFloat16, head_dim, 2, 77, 145, 4, 2);
    c.layout = Layout::kStrided;
    if (fp16) fa_gpu_test::run_gpu_case(c);
    if (!bf16) continue;
    GpuCase v =
        fa_gpu_test::varlen_backward_case(DType::kBFloat16, 4, 2, head_dim, {70, 0, 150}, {90, 33, 140}, {90, 20, 100});
    v.causal = true;
    v.nan_outside_sequences = true;
    fa_gpu_test::run_gpu_varlen_case(v);
    c.causal = true;
    c.softcap = 20.0f;
    c.dtype = DType::kBFloat16;
    fa_gpu_test::run_gpu_case(c);
    c.softcap = 0.0f;
    c.deterministic = true;
    fa_gpu_test::run_gpu_case(c);
    c.deterministic = false;
    c.sink = true;  // the learnable sink: its LSE through the kernel, d sink after it
    fa_gpu_test::run_gpu_case(c);
    if (have_dropout_kernels(DType::kBFloat16, head_dim)) {
      c.sink = false;
      c.dropout = 0.3f;
      fa_gpu_test::run_gpu_case(c);
    }
  }
  if (head_dims_run == 0) GTEST_SKIP() << "the build has no sm90 backward kernels";
}

}  // namespace

// The CUDA backward pass against the fp64 CPU reference (docs/CONVENTIONS.md's test matrix,
// reduced):
// every case runs our CUDA forward, then the CUDA backward on its out and lse with a random dout,
// and compares dq, dk, dv with the reference backward (factor 3 of the tolerance rule). Outputs
// and the workspace (sized by the query) are NaN-poisoned before every run; each case runs twice
// and out, lse, dk, dv (dq too in deterministic mode) must match bitwise. Covered: shapes x head
// dims x MHA / GQA / MQA x masks / score mods / dropout in both 16-bit dtypes; strided, packed
// and dout[:, ::2] layouts; varlen with zero-length sequences and seqused_k; 250 reruns for
// races; the workspace contract.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/half.hpp"
#include "device_buffer.hpp"
#include "gpu_case.hpp"
#include "gpu_matrix.hpp"

namespace {

using fa_gpu_test::backward_case;
using fa_gpu_test::GpuCase;
using fa_gpu_test::Layout;
using fa_gpu_test::Variant;
using fa_gpu_test::varlen_backward_case;
using flashattn::DType;

const std::vector<Variant> kVariants = {Variant::kPlain, Variant::kCausal,  Variant::kLocal, Variant::kSoftcap,
                                        Variant::kAlibi, Variant::kDropout, Variant::kSink};

class GpuBackward : public ::testing::TestWithParam<DType> {};

TEST_P(GpuBackward, ShapeMatrix) {
  SKIP_WITHOUT_DEVICE();
  for (const GpuCase& c : fa_gpu_test::shape_matrix(GetParam(), kVariants, true)) {
    fa_gpu_test::run_gpu_case(c);
    if (HasFatalFailure()) return;
  }
}

// Every head-dim bucket (and a padded one) with and without the mask, at a shape with tails.
// The sink's gradient too (bitwise over reruns: a fixed-order reduction).
TEST_P(GpuBackward, LearnableSink) {
  SKIP_WITHOUT_DEVICE();
  for (const GpuCase& c : fa_gpu_test::sink_matrix(GetParam(), true)) {
    fa_gpu_test::run_gpu_case(c);
    if (HasFatalFailure()) return;
  }
}

TEST_P(GpuBackward, EveryHeadDim) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : fa_gpu_test::kHeadDims) {
    for (bool causal : {false, true}) {
      GpuCase c = backward_case(GetParam(), 2, 239, 387, 4, 2, d);
      c.causal = causal;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// Key counts that are no multiple of any key tile (64, 128): the tail tile's keys past seqlen_k
// must add nothing to dQ and get no dK / dV rows (a peer's NaN dQ came from unmasked tail keys);
// query tails likewise.
TEST_P(GpuBackward, TailKeys) {
  SKIP_WITHOUT_DEVICE();
  struct Spec {
    int64_t sq, sk, d;
  };
  const Spec specs[] = {{96, 65, 64}, {200, 127, 128}, {130, 129, 96}, {257, 383, 256}, {64, 1, 160}};
  for (const Spec& s : specs) {
    for (bool causal : {false, true}) {
      GpuCase c = backward_case(GetParam(), 2, s.sq, s.sk, 4, 2, s.d);
      c.causal = causal;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// GQA and MQA: the query heads of a group all add to one dK / dV row.
TEST_P(GpuBackward, GroupedHeads) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t hkv : {2, 1}) {
    for (bool causal : {false, true}) {
      GpuCase c = backward_case(GetParam(), 2, 257, 600, 6, hkv, hkv == 1 ? 128 : 64);
      c.causal = causal;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// q, k, v as views of one packed qkv buffer, and dq, dk, dv written into one dqkv buffer.
TEST_P(GpuBackward, PackedQkv) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      GpuCase c = backward_case(GetParam(), 2, 333, 333, 6, 2, d);
      c.causal = causal;
      c.layout = Layout::kPacked;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// dout[:, ::2] (a row stride twice out's; the skipped rows hold NaN): a kernel that reads dO with
// O's strides fails. With strided q, k, v, out and gradients too, and in a varlen batch.
TEST_P(GpuBackward, DoutView) {
  SKIP_WITHOUT_DEVICE();
  for (Layout layout : {Layout::kContiguous, Layout::kStrided}) {
    GpuCase c = backward_case(GetParam(), 2, 190, 250, 6, 2, layout == Layout::kStrided ? 128 : 64);
    c.layout = layout;
    c.causal = layout == Layout::kStrided;
    c.dout_every_other_row = true;
    fa_gpu_test::run_gpu_case(c);
  }
  GpuCase v = varlen_backward_case(GetParam(), 4, 2, 96, {70, 0, 150}, {90, 33, 140});
  v.dout_every_other_row = true;
  fa_gpu_test::run_gpu_varlen_case(v);
}

// Large logits (q, k x5): P recomputed from the LSE must neither overflow nor lose precision.
TEST_P(GpuBackward, LargeLogits) {
  SKIP_WITHOUT_DEVICE();
  for (float softcap : {0.0f, 50.0f}) {
    GpuCase c = backward_case(GetParam(), 1, 300, 500, 6, 2, 128);
    c.input_scale = 5.0;
    c.softcap = softcap;
    c.causal = true;
    fa_gpu_test::run_gpu_case(c);
  }
}

// Rows that see no key have zero dq (never 0/0), keys no row sees zero dk / dv, and with no
// queries at all dk and dv are 0.
TEST_P(GpuBackward, EmptyRows) {
  SKIP_WITHOUT_DEVICE();
  GpuCase c = backward_case(GetParam(), 1, 200, 70, 6, 6, 64);
  c.causal = true;  // bottom-right: the first 130 rows see nothing
  fa_gpu_test::run_gpu_case(c);
  c.causal = false;
  c.window_left = 0;
  c.window_right = 0;  // one key per row at most
  fa_gpu_test::run_gpu_case(c);
  c.window_left = c.window_right = -1;
  c.seqlen_k = 0;
  fa_gpu_test::run_gpu_case(c);
  c.seqlen_q = 0;  // no query: dk and dv are 0
  c.seqlen_k = 5;
  fa_gpu_test::run_gpu_case(c);
}

// Dropout: the backward must replay the forward's keep-mask, which is the CPU backend's
// (core/philox.hpp; the naive oracle applies it with the same seed and offset).
TEST_P(GpuBackward, Dropout) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : {32, 64, 96, 128, 160, 256}) {
    GpuCase c = backward_case(GetParam(), 2, 131, 257, 4, 2, d);
    c.dropout = d == 128 ? 0.5f : 0.17f;
    c.causal = d % 64 == 0;
    c.softcap = d == 96 ? 20.0f : 0.0f;
    c.alibi = d == 160;
    fa_gpu_test::run_gpu_case(c);
  }
}

// Deterministic mode: dq too must reproduce bitwise, over a few reruns, where many key tiles
// (and, with GQA, many heads) add to the same dQ rows.
TEST_P(GpuBackward, Deterministic) {
  SKIP_WITHOUT_DEVICE();
  std::vector<GpuCase> cases;
  GpuCase mqa = backward_case(GetParam(), 2, 300, 900, 6, 1, 64);
  mqa.causal = true;
  cases.push_back(mqa);
  GpuCase gqa = backward_case(GetParam(), 1, 513, 700, 6, 2, 128);
  gqa.dropout = 0.17f;
  cases.push_back(gqa);
  GpuCase mods = backward_case(GetParam(), 2, 200, 640, 4, 4, 96);
  mods.alibi = true;
  mods.softcap = 50.0f;
  mods.window_left = 100;
  mods.window_right = 300;
  cases.push_back(mods);
  for (GpuCase& c : cases) {
    c.deterministic = true;
    c.reruns = 4;
    fa_gpu_test::run_gpu_case(c);
  }
  GpuCase v = varlen_backward_case(GetParam(), 4, 2, 64, {130, 0, 300}, {500, 7, 260}, {480, 0, 260});
  v.deterministic = true;
  v.reruns = 4;
  fa_gpu_test::run_gpu_varlen_case(v);
}

TEST_P(GpuBackward, OwnStream) {
  SKIP_WITHOUT_DEVICE();
  for (bool deterministic : {false, true}) {
    GpuCase c = backward_case(GetParam(), 2, 300, 700, 6, 2, 96);
    c.own_stream = true;
    c.deterministic = deterministic;
    fa_gpu_test::run_gpu_case(c);
  }
}

// Varlen: sequences of different lengths (zero-length ones too) packed along the tokens, rows
// that belong to no sequence and keys past seqused_k (dq, dk, dv 0 there), seqlen_q >> seqlen_k,
// masks, GQA / MQA, ALiBi, dropout, tails of every tile size.
TEST_P(GpuBackward, Varlen) {
  SKIP_WITHOUT_DEVICE();
  const DType dt = GetParam();
  std::vector<GpuCase> cases = {
      varlen_backward_case(dt, 4, 2, 64, {130, 0, 1, 257}, {200, 5, 0, 300}),
      varlen_backward_case(dt, 4, 1, 128, {300, 17, 64}, {40, 300, 64}),
      varlen_backward_case(dt, 4, 2, 96, {33, 129, 0}, {150, 77, 9}, {100, 0, 9}),
      varlen_backward_case(dt, 4, 2, 256, {65, 200}, {65, 180}),
      varlen_backward_case(dt, 4, 2, 40, {90, 3}, {90, 100}),
      varlen_backward_case(dt, 6, 2, 128, {1000, 700, 5}, {16, 3, 1}),  // seqlen_q >> seqlen_k
      varlen_backward_case(dt, 6, 6, 64, {257, 64, 128}, {600, 200, 129}, {333, 0, 64}),
  };
  cases[1].causal = true;
  cases[2].causal = true;
  cases[3].window_left = 20;
  cases[3].window_right = 5;
  cases[4].causal = true;
  cases[4].dropout = 0.17f;
  cases[5].causal = true;
  cases[6].alibi = true;
  cases[6].softcap = 50.0f;
  for (const GpuCase& c : cases) fa_gpu_test::run_gpu_varlen_case(c);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuBackward, ::testing::Values(DType::kFloat16, DType::kBFloat16),
                         fa_gpu_test::dtype_param_name);

// Races show up as run-to-run differences: 250 reruns (forward and backward each time) must
// reproduce out, lse, dk, dv bitwise, and dq too in deterministic mode.
TEST(GpuBackwardRace, BitwiseOver250Reruns) {
  SKIP_WITHOUT_DEVICE();
  for (bool deterministic : {false, true}) {
    GpuCase c = backward_case(DType::kBFloat16, 2, 1000, 1000, 6, 6, 128);
    c.causal = true;
    c.deterministic = deterministic;
    c.reruns = 250;
    fa_gpu_test::run_gpu_case(c);
  }
}

// A small matrix for compute-sanitizer (scripts/gpu_check.sh runs it under memcheck, racecheck,
// synccheck, initcheck): tails, masks, padding (d 40), the largest shared memory (d 256), GQA,
// strided, packed and dout[:, ::2] layouts, dropout, deterministic mode, varlen with seqused_k.
TEST(GpuBackwardSanitizerSmall, Backward) {
  SKIP_WITHOUT_DEVICE();
  std::vector<GpuCase> cases;
  for (int64_t d : {40, 64, 128, 256}) {
    GpuCase c = backward_case(d == 64 ? DType::kBFloat16 : DType::kFloat16, 2, 77, 145, 4, 2, d);
    c.layout = d == 128 ? Layout::kStrided : Layout::kContiguous;
    c.dout_every_other_row = d == 128;
    cases.push_back(c);
    c.causal = true;
    c.alibi = d == 40;
    c.softcap = d == 256 ? 30.0f : 0.0f;
    c.deterministic = d == 64;
    cases.push_back(c);
  }
  GpuCase dropout = cases.front();
  dropout.dropout = 0.2f;
  cases.push_back(dropout);
  GpuCase sink = cases[3];  // d64 causal deterministic, with a learnable sink and its gradient
  sink.sink = true;
  cases.push_back(sink);
  GpuCase packed = backward_case(DType::kFloat16, 1, 90, 90, 2, 1, 64);
  packed.layout = Layout::kPacked;
  packed.window_left = 10;
  packed.window_right = 3;
  cases.push_back(packed);
  for (const GpuCase& c : cases) fa_gpu_test::run_gpu_case(c);
  GpuCase varlen = varlen_backward_case(DType::kFloat16, 2, 1, 64, {70, 0, 9}, {33, 12, 140}, {30, 12, 100});
  varlen.causal = true;
  fa_gpu_test::run_gpu_varlen_case(varlen);
}

// A NaN in one row of q, dout, k or v reaches exactly the gradients the CPU backend's has NaN
// in (it follows docs/CONVENTIONS.md's rule), element by element: not the dK / dV of the keys of
// its tiles that the row does not see, nor (a key or value row) the dQ of rows that do not see
// its key. Causal (diagonal tiles), a window with softcap, dropout; GQA; fp16 and bf16; d64 (two
// element passes), d128 and d256. Each case runs with the backward as dispatched (on Hopper the
// d128 cases without dropout take the sm90a kernel, raw scores or softcap) and with the sm80 one.
TEST(GpuNan, BackwardRowReachesOnlyTheGradientsItShould) {
  SKIP_WITHOUT_DEVICE();
  struct Spec {
    DType dtype;
    int64_t d, s;
    char nan_in;  // 'q', 'o' (dout), 'k', 'v'
    int64_t nan_at, window_left, window_right;
    float softcap, dropout;
  };
  const Spec specs[] = {{DType::kFloat16, 128, 300, 'v', 70, -1, 0, 0.0f, 0.0f},
                        {DType::kBFloat16, 64, 300, 'q', 200, -1, 0, 0.0f, 0.0f},
                        {DType::kFloat16, 64, 400, 'o', 250, 30, 10, 20.0f, 0.0f},
                        {DType::kBFloat16, 128, 257, 'k', 130, 40, 0, 0.0f, 0.0f},
                        {DType::kFloat16, 256, 200, 'o', 100, -1, 0, 0.0f, 0.0f},
                        {DType::kBFloat16, 128, 300, 'v', 150, -1, 0, 0.0f, 0.1f},
                        {DType::kBFloat16, 128, 300, 'q', 200, -1, 0, 0.0f, 0.0f},
                        {DType::kFloat16, 128, 400, 'o', 250, 30, 10, 20.0f, 0.0f},
                        {DType::kBFloat16, 128, 333, 'k', 100, -1, 0, 0.0f, 0.0f},
                        {DType::kFloat16, 128, 333, 'v', 200, 50, 50, 30.0f, 0.0f}};
  const int64_t hq = 4, hkv = 2;
  for (const char* sm90_backward : {"1", "0"}) {
    for (const Spec& sp : specs) {
      const fa_gpu_test::ScopedEnv family("FLASHATTN_SM90_BACKWARD", sm90_backward);
      SCOPED_TRACE(std::string(sm90_backward[0] == '1' ? "as dispatched" : "sm80") + " " +
                   std::string(flashattn::dtype_name(sp.dtype)) + " d" + std::to_string(sp.d) + " nan in " +
                   std::string(1, sp.nan_in) + " row " + std::to_string(sp.nan_at));
      const int64_t q_elems = sp.s * hq * sp.d, kv_elems = sp.s * hkv * sp.d;
      std::mt19937 rng(static_cast<unsigned>(sp.s + sp.d + sp.nan_in));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      auto bits_of = [&](float f) {
        return sp.dtype == DType::kFloat16 ? flashattn::core::float_to_fp16(f) : flashattn::core::float_to_bf16(f);
      };
      auto random_bits = [&](int64_t n) {
        std::vector<uint16_t> x(static_cast<size_t>(n));
        for (uint16_t& e : x) e = bits_of(normal(rng));
        return x;
      };
      std::vector<uint16_t> q = random_bits(q_elems), k = random_bits(kv_elems), v = random_bits(kv_elems),
                            dout = random_bits(q_elems);
      const uint16_t nan = sp.dtype == DType::kFloat16 ? 0x7E00 : 0x7FC0;
      if (sp.nan_in == 'q' || sp.nan_in == 'o') {  // query head 1
        (sp.nan_in == 'q' ? q : dout)[static_cast<size_t>((sp.nan_at * hq + 1) * sp.d + 5)] = nan;
      } else {
        for (int64_t h = 0; h < hkv; ++h)
          (sp.nan_in == 'k' ? k : v)[static_cast<size_t>((sp.nan_at * hkv + h) * sp.d + 5)] = nan;
      }
      flashattn::AttentionOptions o;
      o.mask = {false, sp.window_left, sp.window_right};
      o.score.softcap = sp.softcap;
      o.dropout.p = sp.dropout;
      o.dropout.seed = 1234;
      auto view = [&](void* data, int64_t heads, flashattn::Device dev) {
        return flashattn::TensorView::contiguous(data, sp.dtype, {1, sp.s, heads, sp.d}, dev);
      };
      auto lse_view = [&](float* data, flashattn::Device dev) {
        return flashattn::TensorView::contiguous(data, DType::kFloat32, {1, hq, sp.s}, dev);
      };
      // The CPU backend: its forward's out and lse, its gradients.
      std::vector<uint16_t> out(static_cast<size_t>(q_elems)), dq_cpu(q.size()), dk_cpu(k.size()), dv_cpu(v.size());
      std::vector<float> lse(static_cast<size_t>(hq * sp.s));
      const flashattn::Device host{};
      flashattn::forward({view(q.data(), hq, host), view(k.data(), hkv, host), view(v.data(), hkv, host),
                          view(out.data(), hq, host), lse_view(lse.data(), host)},
                         o);
      const flashattn::BackwardArgs cpu_args{
          view(dout.data(), hq, host),   view(q.data(), hq, host),       view(k.data(), hkv, host),
          view(v.data(), hkv, host),     view(out.data(), hq, host),     lse_view(lse.data(), host),
          view(dq_cpu.data(), hq, host), view(dk_cpu.data(), hkv, host), view(dv_cpu.data(), hkv, host)};
      std::vector<float> cpu_ws(flashattn::backward_workspace_size(cpu_args, o) / sizeof(float) + 4);
      flashattn::backward(cpu_args, o, {nullptr, cpu_ws.data(), cpu_ws.size() * sizeof(float)});
      // The CUDA backward on the same out and lse.
      const flashattn::Device gpu{flashattn::DeviceType::kCUDA, 0};
      fa_gpu_test::DeviceBuffer d_q(q.size() * 2), d_k(k.size() * 2), d_v(v.size() * 2), d_out(out.size() * 2),
          d_dout(dout.size() * 2), d_lse(lse.size() * 4), d_dq(q.size() * 2), d_dk(k.size() * 2), d_dv(v.size() * 2);
      d_q.upload(q.data());
      d_k.upload(k.data());
      d_v.upload(v.data());
      d_out.upload(out.data());
      d_dout.upload(dout.data());
      d_lse.upload(lse.data());
      for (auto* b : {&d_dq, &d_dk, &d_dv}) b->poison();
      const flashattn::BackwardArgs gpu_args{
          view(d_dout.get(), hq, gpu), view(d_q.get(), hq, gpu),   view(d_k.get(), hkv, gpu),
          view(d_v.get(), hkv, gpu),   view(d_out.get(), hq, gpu), lse_view(static_cast<float*>(d_lse.get()), gpu),
          view(d_dq.get(), hq, gpu),   view(d_dk.get(), hkv, gpu), view(d_dv.get(), hkv, gpu)};
      fa_gpu_test::DeviceBuffer ws(std::max<size_t>(flashattn::backward_workspace_size(gpu_args, o), 16));
      ws.poison();
      flashattn::backward(gpu_args, o, {nullptr, ws.get(), ws.bytes()});
      auto value = [&](uint16_t bits) {
        return sp.dtype == DType::kFloat16 ? flashattn::core::fp16_to_float(bits)
                                           : flashattn::core::bf16_to_float(bits);
      };
      int64_t nan_grads = 0;
      auto compare = [&](const char* what, const fa_gpu_test::DeviceBuffer& got_dev,
                         const std::vector<uint16_t>& want) {
        std::vector<uint16_t> got(want.size());
        got_dev.download(got.data());
        int64_t mismatch = 0;
        double max_err = 0, max_ref = 1e-3;
        for (size_t e = 0; e < got.size(); ++e) {
          const float g = value(got[e]), w = value(want[e]);
          nan_grads += std::isnan(w) && what[1] != 'q';
          if (std::isnan(g) != std::isnan(w)) {
            ++mismatch;
          } else if (!std::isnan(w)) {
            max_err = std::max(max_err, static_cast<double>(std::abs(g - w)));
            max_ref = std::max(max_ref, static_cast<double>(std::abs(w)));
          }
        }
        EXPECT_EQ(mismatch, 0) << what << ": elements NaN on one side only";
        EXPECT_LE(max_err, (sp.dtype == DType::kFloat16 ? 3e-2 : 1.5e-1) * max_ref) << what;
      };
      compare("dq", d_dq, dq_cpu);
      compare("dk", d_dk, dk_cpu);
      compare("dv", d_dv, dv_cpu);
      EXPECT_GT(nan_grads, 0) << "the NaN must reach the dK / dV of the keys its row sees (or of its key)";
    }
  }
}

// The workspace contract: the query asks for scratch memory, and a call given less is an error
// that names the workspace and writes nothing.
TEST(GpuBackwardErrors, WorkspaceTooSmall) {
  SKIP_WITHOUT_DEVICE();
  const int64_t b = 1, s = 64, h = 2, d = 64;
  const size_t bytes = static_cast<size_t>(b * s * h * d) * 2;
  fa_gpu_test::DeviceBuffer q(bytes), k(bytes), v(bytes), out(bytes), dout(bytes), dq(bytes), dk(bytes), dv(bytes);
  fa_gpu_test::DeviceBuffer lse(static_cast<size_t>(b * h * s) * sizeof(float));
  for (fa_gpu_test::DeviceBuffer* x : {&q, &k, &v, &out, &dout, &lse}) {
    fa_gpu_test::cuda_ok(cudaMemset(x->get(), 0x11, x->bytes()), "cudaMemset");  // finite values
  }
  for (fa_gpu_test::DeviceBuffer* x : {&dq, &dk, &dv}) x->poison();
  const flashattn::Device dev{flashattn::DeviceType::kCUDA, 0};
  auto view = [&](const fa_gpu_test::DeviceBuffer& x) {
    return flashattn::TensorView::contiguous(x.get(), DType::kFloat16, {b, s, h, d}, dev);
  };
  const flashattn::BackwardArgs args{
      view(dout), view(q),   view(k),
      view(v),    view(out), flashattn::TensorView::contiguous(lse.get(), DType::kFloat32, {b, h, s}, dev),
      view(dq),   view(dk),  view(dv)};
  const flashattn::AttentionOptions opts;
  const size_t needed = flashattn::backward_workspace_size(args, opts);
  ASSERT_GT(needed, 0u) << "the CUDA backward keeps its dQ sums in the caller's workspace";
  const fa_gpu_test::DeviceBuffer workspace(needed);
  for (size_t given : {size_t{0}, needed - 1}) {
    flashattn::RunContext ctx;
    ctx.workspace = given ? workspace.get() : nullptr;
    ctx.workspace_bytes = given;
    try {
      flashattn::backward(args, opts, ctx);
      ADD_FAILURE() << "a workspace of " << given << " < " << needed << " bytes was accepted";
    } catch (const flashattn::Error& e) {
      EXPECT_EQ(e.code(), flashattn::ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
    }
  }
  fa_gpu_test::cuda_ok(cudaDeviceSynchronize(), "backward");
  std::vector<unsigned char> host(bytes);
  for (const fa_gpu_test::DeviceBuffer* x : {&dq, &dk, &dv}) {
    x->download(host.data());
    EXPECT_EQ(std::count(host.begin(), host.end(), 0xFF), static_cast<std::ptrdiff_t>(bytes))
        << "a refused call wrote a gradient";
  }
}

}  // namespace

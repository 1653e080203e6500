// The CUDA forward kernels against the fp64 CPU reference (docs/CONVENTIONS.md's test matrix,
// reduced):
// shapes x head dims x head layouts x batch x masks / score mods, both 16-bit dtypes, every case
// run twice (bitwise identical) with NaN-poisoned outputs; strided and packed-qkv layouts; and the
// clear errors for what the CUDA backend does not run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "device_buffer.hpp"
#include "gpu_case.hpp"
#include "gpu_matrix.hpp"

namespace {

using fa_gpu_test::GpuCase;
using fa_gpu_test::Layout;
using fa_gpu_test::Variant;
using flashattn::DType;
using flashattn::ErrorCode;

const std::vector<Variant> kVariants = {Variant::kPlain,   Variant::kCausal, Variant::kLocal,
                                        Variant::kSoftcap, Variant::kAlibi,  Variant::kSink};

class GpuShapeMatrix : public ::testing::TestWithParam<DType> {};

TEST_P(GpuShapeMatrix, ForwardMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  for (const GpuCase& c : fa_gpu_test::shape_matrix(GetParam(), kVariants, false)) {
    fa_gpu_test::run_gpu_case(c);
    if (HasFatalFailure()) return;
  }
}

TEST_P(GpuShapeMatrix, LearnableSink) {
  SKIP_WITHOUT_DEVICE();
  for (const GpuCase& c : fa_gpu_test::sink_matrix(GetParam(), false)) {
    fa_gpu_test::run_gpu_case(c);
    if (HasFatalFailure()) return;
  }
}

// Every head-dim bucket (and a padded one) with and without the mask, at a shape with tails.
TEST_P(GpuShapeMatrix, EveryHeadDim) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : fa_gpu_test::kHeadDims) {
    for (bool causal : {false, true}) {
      GpuCase c;
      c.dtype = GetParam();
      c.batch = 2;
      c.seqlen_q = 239;
      c.seqlen_k = 387;
      c.heads_q = 6;
      c.heads_kv = 2;
      c.head_dim = d;
      c.causal = causal;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

TEST_P(GpuShapeMatrix, PackedQkv) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      GpuCase c;
      c.dtype = GetParam();
      c.batch = 2;
      c.seqlen_q = c.seqlen_k = 333;
      c.heads_q = 6;
      c.heads_kv = 2;
      c.head_dim = d;
      c.causal = causal;
      c.layout = Layout::kPacked;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// Large logits (q, k x5): the exp2-domain softmax must neither overflow nor lose the row max.
TEST_P(GpuShapeMatrix, LargeLogits) {
  SKIP_WITHOUT_DEVICE();
  for (float softcap : {0.0f, 50.0f}) {
    GpuCase c;
    c.dtype = GetParam();
    c.seqlen_q = 300;
    c.seqlen_k = 500;
    c.head_dim = 128;
    c.input_scale = 5.0;
    c.softcap = softcap;
    c.causal = true;
    fa_gpu_test::run_gpu_case(c);
  }
}

// Row maxima that climb while the key loop runs (last key tile to first): ALiBi without a causal
// mask raises each row's scores toward its diagonal by slope x 32..128 per key tile, below and
// above the kernels' lazy-rescale threshold (2^8) depending on the head's slope; large random
// logits (x5) jump past it at random tiles. Both the stale-max and the rescale paths must agree
// with the reference.
TEST_P(GpuShapeMatrix, ClimbingRowMax) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : {64, 128, 256}) {
    for (bool alibi : {true, false}) {
      GpuCase c;
      c.dtype = GetParam();
      c.seqlen_q = 700;
      c.seqlen_k = 900;
      c.head_dim = d;
      c.alibi = alibi;
      c.input_scale = alibi ? 1.0 : 5.0;
      fa_gpu_test::run_gpu_case(c);
    }
  }
}

// Rows that see no key (windows beyond the sequence, seqlen_k 0) give out 0 and LSE -inf.
TEST_P(GpuShapeMatrix, EmptyRows) {
  SKIP_WITHOUT_DEVICE();
  GpuCase c;
  c.dtype = GetParam();
  c.seqlen_q = 200;
  c.seqlen_k = 70;
  c.head_dim = 64;
  c.causal = true;  // bottom-right: the first 130 rows see nothing
  fa_gpu_test::run_gpu_case(c);
  c.causal = false;
  c.window_left = 0;
  c.window_right = 0;  // one key per row at most
  fa_gpu_test::run_gpu_case(c);
  c.window_left = c.window_right = -1;
  c.seqlen_k = 0;
  fa_gpu_test::run_gpu_case(c);
  c.seqlen_q = 0;  // nothing to do
  c.seqlen_k = 5;
  fa_gpu_test::run_gpu_case(c);
}

TEST_P(GpuShapeMatrix, OwnStream) {
  SKIP_WITHOUT_DEVICE();
  GpuCase c;
  c.dtype = GetParam();
  c.batch = 3;
  c.seqlen_q = 513;
  c.seqlen_k = 700;
  c.head_dim = 96;
  c.own_stream = true;
  fa_gpu_test::run_gpu_case(c);
}

// Dropout: the naive oracle applies core::dropout_keep with the same seed and offset, and the
// fp64 reference is the CPU backend's, so a kernel with any other keep-mask fails by far.
TEST_P(GpuShapeMatrix, DropoutSameMaskAsCpu) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t d : {32, 64, 96, 128, 160, 256}) {
    GpuCase c;
    c.dtype = GetParam();
    c.batch = 2;
    c.seqlen_q = 131;
    c.seqlen_k = 257;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = d;
    c.dropout = d == 128 ? 0.5f : 0.17f;
    c.causal = d % 64 == 0;
    c.softcap = d == 96 ? 20.0f : 0.0f;
    c.alibi = d == 160;
    fa_gpu_test::run_gpu_case(c);
  }
}

// Races show up as run-to-run differences: 250 reruns of the same call must match bitwise (with
// and without dropout, whose kernel has other tile shapes).
TEST_P(GpuShapeMatrix, BitwiseOver250Reruns) {
  SKIP_WITHOUT_DEVICE();
  for (float dropout : {0.0f, 0.1f}) {
    GpuCase c;
    c.dtype = GetParam();
    c.batch = 2;
    c.seqlen_q = 1000;
    c.seqlen_k = 1000;
    c.heads_q = 8;
    c.heads_kv = 4;
    c.head_dim = 128;
    c.causal = true;
    c.dropout = dropout;
    c.reruns = 250;
    fa_gpu_test::run_gpu_case(c);
  }
}

// Varlen: sequences of different lengths (zero-length ones too), packed along the tokens, with
// rows that belong to no sequence (out 0, LSE -inf); seqlen_q >> seqlen_k, seqused_k, masks,
// GQA, dropout, tails of every tile size.
TEST_P(GpuShapeMatrix, Varlen) {
  SKIP_WITHOUT_DEVICE();
  struct Spec {
    int64_t d, heads_kv;
    fa_gpu_test::VarlenSpec batch;
  };
  const std::vector<Spec> specs = {
      {64, 2, {{130, 0, 1, 257}, {200, 5, 0, 300}, {}, false, -1, -1, 0.0f}},
      {128, 1, {{300, 17, 64}, {40, 300, 64}, {}, true, -1, -1, 0.0f}},
      {96, 2, {{33, 129, 0}, {150, 77, 9}, {100, 0, 9}, true, -1, -1, 0.0f}},
      {256, 2, {{65, 200}, {65, 180}, {}, false, 20, 5, 0.0f}},
      {40, 2, {{90, 3}, {90, 100}, {}, true, -1, -1, 0.2f}},
  };
  for (const Spec& sp : specs) {
    const GpuCase c = fa_gpu_test::varlen_forward_case(GetParam(), 4, sp.heads_kv, sp.d, sp.batch);
    fa_gpu_test::run_gpu_varlen_case(c);
  }
}

// Varlen with K / V in pages (block_table; chunked prefill): pages of whole key tiles (128, 256)
// and smaller ones read a row at a time (16, 48, 1), partial last pages, sequences of one page
// and of none, GQA, seqused_k, masks; the page rows no key fills hold NaN.
TEST_P(GpuShapeMatrix, PagedVarlen) {
  SKIP_WITHOUT_DEVICE();
  struct Spec {
    int64_t d, heads_kv, page;
    fa_gpu_test::VarlenSpec batch;
  };
  const std::vector<Spec> specs = {
      {64, 2, 128, {{130, 1, 257}, {600, 128, 300}, {}, true, -1, -1, 0.0f}},
      {128, 1, 256, {{300, 17, 64}, {700, 300, 0}, {650, 1, 0}, false, -1, -1, 0.0f}},
      {256, 2, 128, {{65, 200}, {129, 390}, {}, false, 20, 5, 0.0f}},
      {40, 2, 128, {{90, 3}, {90, 257}, {}, true, -1, -1, 0.0f}},
      {64, 2, 16, {{130, 1, 257}, {600, 128, 300}, {}, true, -1, -1, 0.0f}},
      {128, 1, 48, {{300, 17, 64}, {700, 300, 0}, {650, 1, 0}, false, -1, -1, 0.0f}},
      {96, 2, 1, {{33, 70}, {150, 77}, {}, true, -1, -1, 0.0f}},
  };
  for (const Spec& sp : specs) {
    GpuCase c = fa_gpu_test::varlen_forward_case(GetParam(), 4, sp.heads_kv, sp.d, sp.batch);
    c.page_size = sp.page;
    fa_gpu_test::run_gpu_varlen_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuShapeMatrix, ::testing::Values(DType::kFloat16, DType::kBFloat16),
                         fa_gpu_test::dtype_param_name);

// A small matrix for compute-sanitizer (scripts/gpu_check.sh runs it under memcheck, racecheck,
// synccheck, initcheck): tails, masks, padding (d 40), the largest shared memory (d 256), GQA,
// strided and packed layouts, dropout, varlen.
TEST(GpuSanitizerSmall, Forward) {
  SKIP_WITHOUT_DEVICE();
  std::vector<GpuCase> cases;
  for (int64_t d : {40, 64, 128, 256}) {
    GpuCase c;
    c.dtype = d == 64 ? DType::kBFloat16 : DType::kFloat16;
    c.batch = 2;
    c.seqlen_q = 77;
    c.seqlen_k = 145;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = d;
    c.layout = d == 128 ? Layout::kStrided : Layout::kContiguous;
    cases.push_back(c);
    c.causal = true;
    c.alibi = d == 40;
    c.softcap = d == 256 ? 30.0f : 0.0f;
    cases.push_back(c);
  }
  GpuCase dropout = cases.front();
  dropout.dropout = 0.2f;
  cases.push_back(dropout);
  GpuCase sink = cases[3];  // d64 causal, with a learnable sink (the epilogue's join)
  sink.sink = true;
  cases.push_back(sink);
  GpuCase packed;
  packed.seqlen_q = packed.seqlen_k = 90;
  packed.heads_q = 2;
  packed.heads_kv = 1;
  packed.layout = Layout::kPacked;
  packed.window_left = 10;
  packed.window_right = 3;
  cases.push_back(packed);
  for (const GpuCase& c : cases) fa_gpu_test::run_gpu_case(c);
  GpuCase varlen;
  varlen.heads_q = 2;
  varlen.heads_kv = 1;
  varlen.lens_q = {70, 0, 9};
  varlen.lens_k = {33, 12, 140};
  varlen.causal = true;
  fa_gpu_test::run_gpu_varlen_case(varlen);
  varlen.lens_k = {33, 12, 300};
  for (int64_t page : {128, 16}) {  // whole tiles a page; a row at a time
    varlen.page_size = page;
    fa_gpu_test::run_gpu_varlen_case(varlen);
  }
}

// =============================================================================================
// What the CUDA backend does not run: kUnsupported with a message that names the argument.
// =============================================================================================
struct DeviceArgs {
  fa_gpu_test::DeviceBuffer buf;
  flashattn::ForwardArgs args;
  DeviceArgs(DType dtype, int64_t d, int64_t offset_elems = 0, int64_t row_pad = 0)
      : buf(static_cast<size_t>(4 * 16 * 2 * (d + row_pad) + 64) * flashattn::dtype_size(dtype)) {
    auto* base = static_cast<std::byte*>(buf.get());
    const int64_t rs = 2 * d + row_pad;
    const int64_t es = static_cast<int64_t>(flashattn::dtype_size(dtype));
    const flashattn::Device dev{flashattn::DeviceType::kCUDA, 0};
    auto view = [&](int64_t slot) {
      return flashattn::TensorView::strided(base + (slot * 16 * rs + offset_elems) * es, dtype, {1, 16, 2, d},
                                            {16 * rs, rs, d, 1}, dev);
    };
    args = {view(0), view(1), view(2), view(3), {}};
  }
};

void expect_unsupported(const flashattn::ForwardArgs& a, const flashattn::AttentionOptions& o,
                        const std::string& needle) {
  try {
    flashattn::forward(a, o);
    ADD_FAILURE() << "expected kUnsupported containing '" << needle << "'";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GpuUnsupported, ClearErrors) {
  SKIP_WITHOUT_DEVICE();
  const flashattn::AttentionOptions none;
  expect_unsupported(DeviceArgs(DType::kFloat32, 64).args, none, "q: dtype float32");
  expect_unsupported(DeviceArgs(DType::kFloat16, 60).args, none, "q: head_dim 60 must be a multiple of 8");
  expect_unsupported(DeviceArgs(DType::kFloat16, 64, 1).args, none, "16-byte aligned");
  expect_unsupported(DeviceArgs(DType::kFloat16, 64, 0, 4).args, none, "seqlen stride");
}

// Paged varlen on CUDA: no dropout (the CPU backend runs it).
TEST(GpuUnsupported, PagedVarlen) {
  SKIP_WITHOUT_DEVICE();
  const flashattn::Device dev{flashattn::DeviceType::kCUDA, 0};
  const int64_t d = 64, page = 64;
  fa_gpu_test::DeviceBuffer q(8 * 2 * d * 2), out(8 * 2 * d * 2), k(2 * page * d * 2), v(2 * page * d * 2),
      ints(6 * sizeof(int32_t));
  const int32_t host_ints[6] = {0, 8, 0, 20, 0, 1};  // cu_seqlens_q, cu_seqlens_k, block_table [1, 2]
  ints.upload(host_ints);
  auto* i32 = static_cast<int32_t*>(ints.get());
  const flashattn::ForwardArgs args{flashattn::TensorView::contiguous(q.get(), DType::kFloat16, {8, 2, d}, dev),
                                    flashattn::TensorView::contiguous(k.get(), DType::kFloat16, {2, page, 1, d}, dev),
                                    flashattn::TensorView::contiguous(v.get(), DType::kFloat16, {2, page, 1, d}, dev),
                                    flashattn::TensorView::contiguous(out.get(), DType::kFloat16, {8, 2, d}, dev),
                                    {}};
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = flashattn::TensorView::contiguous(i32, DType::kInt32, {2}, dev);
  vl.cu_seqlens_k = flashattn::TensorView::contiguous(i32 + 2, DType::kInt32, {2}, dev);
  vl.block_table = flashattn::TensorView::contiguous(i32 + 4, DType::kInt32, {1, 2}, dev);
  vl.max_seqlen_q = 8;
  vl.max_seqlen_k = 20;
  auto expect = [&](const flashattn::AttentionOptions& o, const std::string& needle) {
    try {
      flashattn::forward_varlen(args, vl, o);
      ADD_FAILURE() << "expected kUnsupported containing '" << needle << "'";
    } catch (const flashattn::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  flashattn::AttentionOptions dropout;
  dropout.dropout.p = 0.1;
  expect(dropout, "block_table: paged K/V with dropout");
}

// The forward's workspace is optional, but one that is given is checked like the backward's:
// the query's size, 16-byte aligned; an undersized or misaligned one is kInvalidArgument naming
// `workspace`, before any launch.
TEST(GpuForwardWorkspace, OptionalButChecked) {
  SKIP_WITHOUT_DEVICE();
  const DeviceArgs d(DType::kFloat16, 64);
  flashattn::AttentionOptions causal;
  causal.mask.causal = true;
  const size_t bytes = flashattn::forward_workspace_size(d.args, causal);
  EXPECT_EQ(bytes, flashattn::kForwardWorkspaceBytes);
  fa_gpu_test::DeviceBuffer ws(2 * bytes);
  flashattn::forward(d.args, causal, {nullptr, nullptr, 0});  // none: runs
  flashattn::forward(d.args, causal, {nullptr, ws.get(), bytes});
  auto expect_rejected = [&](void* ptr, size_t n, const std::string& needle) {
    try {
      flashattn::forward(d.args, causal, {nullptr, ptr, n});
      ADD_FAILURE() << "expected kInvalidArgument containing '" << needle << "'";
    } catch (const flashattn::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_rejected(ws.get(), bytes - 1, "workspace: 15 bytes given, 16 needed");
  expect_rejected(static_cast<std::byte*>(ws.get()) + 8, bytes, "workspace: must be 16-byte aligned");
  fa_gpu_test::cuda_ok(cudaDeviceSynchronize(), "forward with a workspace");
}

// A NaN in the value row of one key reaches exactly the rows that see that key (the CPU
// backend's result, NaN for NaN), not the other rows of its tiles: causal (the key inside the
// diagonal tile), a sliding window and softcap, GQA, fp16 and bf16, d64 and d128, on the kernels
// as dispatched (Hopper's where they run) and on the sm80 ones.
TEST(GpuNan, ValueRowReachesOnlyTheRowsThatSeeIt) {
  SKIP_WITHOUT_DEVICE();
  struct Spec {
    DType dtype;
    int64_t d, s, nan_key, window_left, window_right;
    float softcap;
  };
  const Spec specs[] = {{DType::kFloat16, 128, 300, 6, -1, 0, 0.0f},
                        {DType::kBFloat16, 64, 300, 200, -1, 0, 0.0f},
                        {DType::kFloat16, 64, 400, 250, 30, 10, 20.0f},
                        {DType::kBFloat16, 128, 257, 130, 40, 0, 0.0f}};
  const int64_t hq = 4, hkv = 2;
  for (const bool sm80 : {false, true}) {
    if (sm80) setenv("FLASHATTN_DISABLE_SM90", "1", 1);
    for (const Spec& sp : specs) {
      SCOPED_TRACE(std::string(flashattn::dtype_name(sp.dtype)) + " d" + std::to_string(sp.d) + " key " +
                   std::to_string(sp.nan_key) + (sm80 ? " (sm80 kernels)" : " (as dispatched)"));
      const int64_t q_elems = sp.s * hq * sp.d, kv_elems = sp.s * hkv * sp.d;
      std::mt19937 rng(static_cast<unsigned>(sp.s + sp.d));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      auto random_bits = [&](int64_t n) {
        std::vector<uint16_t> x(static_cast<size_t>(n));
        for (uint16_t& e : x) {
          const float f = normal(rng);
          e = sp.dtype == DType::kFloat16 ? flashattn::core::float_to_fp16(f) : flashattn::core::float_to_bf16(f);
        }
        return x;
      };
      std::vector<uint16_t> q = random_bits(q_elems), k = random_bits(kv_elems), v = random_bits(kv_elems);
      const uint16_t nan = sp.dtype == DType::kFloat16 ? 0x7E00 : 0x7FC0;
      for (int64_t h = 0; h < hkv; ++h) v[static_cast<size_t>((sp.nan_key * hkv + h) * sp.d + 5)] = nan;
      flashattn::AttentionOptions o;
      o.mask = {false, sp.window_left, sp.window_right};
      o.score.softcap = sp.softcap;
      auto view = [&](void* data, int64_t heads, flashattn::Device dev) {
        return flashattn::TensorView::contiguous(data, sp.dtype, {1, sp.s, heads, sp.d}, dev);
      };
      // The CPU backend's result (it keeps NaN to the rows that see it).
      std::vector<uint16_t> cpu_out(static_cast<size_t>(q_elems));
      flashattn::forward(
          {view(q.data(), hq, {}), view(k.data(), hkv, {}), view(v.data(), hkv, {}), view(cpu_out.data(), hq, {}), {}},
          o);
      const flashattn::Device gpu{flashattn::DeviceType::kCUDA, 0};
      fa_gpu_test::DeviceBuffer dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2), dout(q.size() * 2),
          ws(flashattn::kForwardWorkspaceBytes);
      dq.upload(q.data());
      dk.upload(k.data());
      dv.upload(v.data());
      dout.poison();
      flashattn::forward(
          {view(dq.get(), hq, gpu), view(dk.get(), hkv, gpu), view(dv.get(), hkv, gpu), view(dout.get(), hq, gpu), {}},
          o, {nullptr, ws.get(), ws.bytes()});
      std::vector<uint16_t> out(q.size());
      dout.download(out.data());
      auto value = [&](uint16_t bits) {
        return sp.dtype == DType::kFloat16 ? flashattn::core::fp16_to_float(bits)
                                           : flashattn::core::bf16_to_float(bits);
      };
      int64_t nan_mismatch = 0, nan_rows = 0;
      double max_err = 0;
      for (size_t e = 0; e < out.size(); ++e) {
        const float got = value(out[e]), want = value(cpu_out[e]);
        if (std::isnan(want) != std::isnan(got)) ++nan_mismatch;
        if (std::isnan(want)) {
          ++nan_rows;
        } else if (!std::isnan(got)) {
          max_err = std::max(max_err, static_cast<double>(std::abs(got - want)));
        }
      }
      EXPECT_EQ(nan_mismatch, 0) << "elements NaN on one side only";
      EXPECT_GT(nan_rows, 0) << "the NaN must reach the rows that see its key";
      EXPECT_LT(max_err, sp.dtype == DType::kFloat16 ? 1e-2 : 5e-2);
    }
    if (sm80) unsetenv("FLASHATTN_DISABLE_SM90");
  }
}

// Outputs whose elements overlap are refused on CUDA tensors too, before any launch.
TEST(GpuOverlap, SelfOverlappingOutputIsAnError) {
  SKIP_WITHOUT_DEVICE();
  DeviceArgs d(DType::kFloat16, 64);
  d.args.out.strides[1] = 64;  // seq stride = head_dim with 2 heads: rows overlap
  try {
    flashattn::forward(d.args, flashattn::AttentionOptions{});
    ADD_FAILURE() << "an overlapping out was accepted";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("out:"), std::string::npos) << e.what();
  }
}

}  // namespace

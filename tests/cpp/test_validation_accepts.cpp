// Validation tests, the accepting side: valid edge cases (empty batches and sequences, head dims
// 1 and 256, MQA, windows, dropout near 1, ALiBi shapes, packed and broadcast views, empty
// tensors without data) run on every entry point and write every output element.
#include <gtest/gtest.h>

#include "validation_harness.hpp"

namespace {

using namespace fa_validation;

// =============================================================================================
// Valid edge cases: must not throw, and must write every output element
// =============================================================================================
TEST(ValidationAccepts, ZeroBatch) {
  Dims d;
  d.batch = 0;
  d.lens_q = {};
  d.lens_k = {};
  d.pad_q = 0;
  each_mode(
      [](Call& s) {
        if (s.varlen()) {
          EXPECT_EQ(s.vl.cu_seqlens_q.shape[0], 1);
        }
        s.expect_all_run();
      },
      d);
  d.pad_q = 2;  // varlen: no sequences, but rows (all unused)
  d.pad_k = 3;
  d.varlen = true;
  Call s(d);
  s.expect_all_run();
}

TEST(ValidationAccepts, SeqlenZero) {
  Dims d;
  d.seqlen_q = 0;
  d.lens_q = {0, 0};
  each_mode([](Call& s) { s.expect_all_run(); }, d);
  d = Dims{};
  d.seqlen_k = 0;  // rows that see no key: out 0, lse -inf, zero gradients
  d.lens_k = {0, 0};
  each_mode([](Call& s) { s.expect_all_run(); }, d);
  d = Dims{};
  d.lens_q = {0, 3};
  d.lens_k = {4, 0};
  d.varlen = true;
  Call s(d);
  s.expect_all_run();
}

TEST(ValidationAccepts, HeadDim1And256) {
  for (int64_t hd : {1, 256}) {
    SCOPED_TRACE(hd);
    Dims d;
    d.head_dim = hd;
    each_mode([](Call& s) { s.expect_all_run(); }, d);
  }
}

// A learnable sink, with and without its gradient, also where sequences (or their keys) are
// empty: every output is written.
TEST(ValidationAccepts, LearnableSink) {
  for (bool empty : {false, true}) {
    Dims d;
    if (empty) d.seqlen_k = 0, d.lens_q = {0, 3}, d.lens_k = {4, 0};
    each_mode(
        [](Call& s) {
          s.opt.score.learnable_sink = s.tensor(DType::kFloat32, {4});
          s.expect_all_run();
          s.opt.mask.window_left = 1;
          s.opt.mask.sink_tokens = kInt64Max;             // past every key: clamped, no overflow
          s.dsink = s.output(DType::kFloat32, {4}, {2});  // strided
          s.expect_all_run();
        },
        d);
  }
}

TEST(ValidationAccepts, MultiQuery) {
  Dims d;
  d.heads_kv = 1;
  each_mode([](Call& s) { s.expect_all_run(); }, d);
}

TEST(ValidationAccepts, WindowsAndCausal) {
  each_mode([](Call& s) {
    s.opt.mask.window_left = 0;
    s.opt.mask.window_right = 0;
    s.expect_all_run();
    s.opt.mask = {};
    s.opt.mask.causal = true;  // window_right -1 (default) with causal
    s.expect_all_run();
    s.opt.mask.window_right = 0;
    s.opt.mask.window_left = 1;
    s.expect_all_run();
  });
}

TEST(ValidationAccepts, DropoutNearOne) {
  each_mode([](Call& s) {
    s.opt.dropout.p = 0.999f;
    s.opt.dropout.seed = 42;
    s.expect_all_run();
  });
}

TEST(ValidationAccepts, SoftcapZeroAndScaleExplicit) {
  each_mode([](Call& s) {
    s.opt.score.softcap = 0.0f;
    s.opt.score.softmax_scale = -0.25;  // any finite scale
    s.expect_all_run();
  });
}

TEST(ValidationAccepts, AlibiShapes) {
  each_mode([](Call& s) {
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat32, {4});
    s.expect_all_run();
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat32, {2, 4});
    s.expect_all_run();
  });
}

TEST(ValidationAccepts, SequsedKEdges) {
  Call s(varlen_dims());  // lens_k {4, 5}
  s.vl.seqused_k = s.ints({0, 5});
  s.expect_all_run();
  s.vl.seqused_k = s.ints({4, 0});
  s.expect_all_run();
}

TEST(ValidationAccepts, ForwardWithoutLse) {
  each_mode([](Call& s) {
    s.lse = TensorView{};
    s.expect_all_run(/*backward=*/false);
  });
}

TEST(ValidationAccepts, InterleavedPackedViews) {
  // q, k, v and out are slices of one packed [tokens, 4, h, d] buffer and dq, dk, dv of one
  // packed [tokens, 3, h, d] buffer: their byte ranges interleave but no element is shared.
  Dims d;
  d.seqlen_k = 3;
  d.heads_kv = 4;
  d.lens_k = d.lens_q;
  d.pad_k = 1;
  each_mode(
      [](Call& s) {
        const int64_t b = 2, sl = 3, h = 4, hd = 8, rows = s.varlen() ? s.total_q : b * sl;
        auto* qkvo = static_cast<float*>(s.tensor(DType::kFloat32, {rows * 4 * h * hd}).data);
        auto* dqkv = static_cast<float*>(s.output(DType::kFloat32, {rows * 3 * h * hd}).data);
        auto slice = [&](float* base, int64_t parts, int64_t i) {
          const int64_t row = parts * h * hd;
          if (s.varlen()) {
            return TensorView::strided(base + i * h * hd, DType::kFloat32, {rows, h, hd}, {row, hd, 1});
          }
          return TensorView::strided(base + i * h * hd, DType::kFloat32, {b, sl, h, hd}, {sl * row, row, hd, 1});
        };
        s.q = slice(qkvo, 4, 0);
        s.k = slice(qkvo, 4, 1);
        s.v = slice(qkvo, 4, 2);
        s.out = slice(qkvo, 4, 3);
        s.dq = slice(dqkv, 3, 0);
        s.dk = slice(dqkv, 3, 1);
        s.dv = slice(dqkv, 3, 2);
        s.expect_all_run();
      },
      d);
}

// Zero query rows in every mode (no padding rows either): q, out, lse, dout and dq are empty.
Dims no_query_rows() {
  Dims d;
  d.seqlen_q = 0;
  d.lens_q = {0, 0};
  d.pad_q = 0;
  return d;
}
constexpr const char* kEmptyWithoutQueries[] = {"q", "out", "lse", "dout", "dq"};

TEST(ValidationAccepts, NullDataForEmptyTensors) {
  each_mode(
      [](Call& s) {
        for (const char* n : kEmptyWithoutQueries) s[n].data = nullptr;
        s.expect_all_run();
      },
      no_query_rows());
}

// numpy's DLPack export gives an empty array all-zero strides: harmless when nothing is read.
TEST(ValidationAccepts, AnyStridesForEmptyTensors) {
  each_mode(
      [](Call& s) {
        for (const char* n : kEmptyWithoutQueries) std::fill(s[n].strides, s[n].strides + s[n].ndim, 0);
        s.expect_all_run();
      },
      no_query_rows());
}

TEST(ValidationAccepts, ArbitraryLeadingStridesAndBroadcastInputs) {
  Call s;
  // q stored as [b, h, s, d] and viewed as [b, s, h, d]; lse stored as [b, s, h].
  TensorView qt = s.tensor(DType::kFloat32, {2, 4, 3, 8});
  s.q = TensorView::strided(qt.data, DType::kFloat32, {2, 3, 4, 8}, {96, 8, 24, 1});
  TensorView lt = s.output(DType::kFloat32, {2, 3, 4});
  s.lse = TensorView::strided(lt.data, DType::kFloat32, {2, 4, 3}, {12, 1, 4});
  // k and v shared by both batch entries (batch stride 0): inputs may broadcast.
  s.k.strides[0] = 0;
  s.v.strides[0] = 0;
  s.expect_all_run();
}

TEST(ValidationAccepts, HalfPrecision) {
  for (DType dt : {DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
    SCOPED_TRACE(flashattn::dtype_name(dt));
    Dims d;
    d.dtype = dt;
    each_mode([](Call& s) { s.expect_all_run(); }, d);
  }
}

}  // namespace

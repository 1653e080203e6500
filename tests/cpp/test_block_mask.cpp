// Block-sparse masks (AttentionOptions::block_mask) on the CPU backend, forward and backward:
// - the flash path against the fp64 reference under random masks (hidden, full and partial
//   blocks, block sizes that do and do not align with the backend's tiles), alone and with
//   causal / window masks, GQA, a learnable sink;
// - second oracles: a causal predicate's block mask gives exactly causal=true's results, a
//   document mask's gives varlen's over the documents, an all-full mask gives the unmasked ones,
//   an empty one rows that see nothing (out 0, LSE -inf, zero gradients);
// - the errors of malformed masks, each naming its argument, with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "random_block_mask.hpp"
#include "test_util.hpp"

namespace {

using fa_test::BlockMaskStorage;
using fa_test::HostTensor;
using fa_test::PredicateBlockMask;
using fa_test::RandomBlockMask;
using flashattn::AttentionOptions;
using flashattn::DType;

struct Shape {
  int64_t batch, sq, sk, hq, hkv, d;
};

// Inputs of one problem, dense [b, s, h, d].
struct Inputs {
  Shape s;
  DType dtype;
  HostTensor q, k, v, dout, sink;

  Inputs(const Shape& s_, DType dtype_, std::mt19937_64& rng)
      : s(s_),
        dtype(dtype_),
        q(dtype, {s.batch, s.sq, s.hq, s.d}),
        k(dtype, {s.batch, s.sk, s.hkv, s.d}),
        v(dtype, {s.batch, s.sk, s.hkv, s.d}),
        dout(dtype, {s.batch, s.sq, s.hq, s.d}),
        sink(DType::kFloat32, {s.hq}) {
    for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
    sink.fill_normal(rng);
  }
};

struct Results {
  std::vector<double> out, lse, dq, dk, dv;
};

// Forward then backward through the public API: the CPU flash path, or the fp64 reference.
Results run(const Inputs& in, const AttentionOptions& o, bool reference) {
  const Shape& s = in.s;
  HostTensor out(in.dtype, {s.batch, s.sq, s.hq, s.d}), lse(DType::kFloat32, {s.batch, s.hq, s.sq});
  HostTensor dq(in.dtype, {s.batch, s.sq, s.hq, s.d}), dk(in.dtype, {s.batch, s.sk, s.hkv, s.d}),
      dv(in.dtype, {s.batch, s.sk, s.hkv, s.d});
  const flashattn::ForwardArgs fa{in.q.view(), in.k.view(), in.v.view(), out.view(), lse.view()};
  const flashattn::BackwardArgs ba{in.dout.view(), in.q.view(), in.k.view(), in.v.view(), out.view(),
                                   lse.view(),     dq.view(),   dk.view(),   dv.view()};
  if (reference) {
    flashattn::reference_forward(fa, o);
    flashattn::reference_backward(ba, o);
  } else {
    flashattn::forward(fa, o);
    flashattn::backward(ba, o);
  }
  return {out.to_vector(), lse.to_vector(), dq.to_vector(), dk.to_vector(), dv.to_vector()};
}

// max |a - b| over b's scale (at least scale_floor), with -inf entries matched exactly.
double rel_diff(const std::vector<double>& a, const std::vector<double>& b, double scale_floor = 1e-30) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = scale_floor;
  for (size_t e = 0; e < a.size(); ++e) {
    if (std::isinf(a[e]) || std::isinf(b[e])) {
      EXPECT_EQ(a[e], b[e]) << "entry " << e;
      continue;
    }
    EXPECT_FALSE(std::isnan(a[e]) || std::isnan(b[e])) << "entry " << e;
    diff = std::max(diff, std::abs(a[e] - b[e]));
    scale = std::max(scale, std::abs(b[e]));
  }
  return diff / scale;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::isfinite(x) ? std::max(m, std::abs(x)) : m;
  return m;
}

// The gradients at one shared scale, as the tolerance rule takes them: a gradient that is ~0
// (dq and dk where every visible row sees a single key: dS = P (dP - D) cancels) holds rounding
// noise relative to the others, not to itself.
void expect_near(const Results& got, const Results& want, double tol) {
  EXPECT_LE(rel_diff(got.out, want.out), tol) << "out";
  EXPECT_LE(rel_diff(got.lse, want.lse), tol) << "lse";
  const double grads = std::max({max_abs(want.dq), max_abs(want.dk), max_abs(want.dv), 1e-30});
  EXPECT_LE(rel_diff(got.dq, want.dq, grads), tol) << "dq";
  EXPECT_LE(rel_diff(got.dk, want.dk, grads), tol) << "dk";
  EXPECT_LE(rel_diff(got.dv, want.dv, grads), tol) << "dv";
}

void expect_equal(const Results& got, const Results& want) {
  EXPECT_EQ(got.out, want.out);
  EXPECT_EQ(got.lse, want.lse);
  EXPECT_EQ(got.dq, want.dq);
  EXPECT_EQ(got.dk, want.dk);
  EXPECT_EQ(got.dv, want.dv);
}

std::string name(const Shape& s, int64_t bm, int64_t bn, const char* what = "") {
  std::ostringstream n;
  n << "b" << s.batch << " sq" << s.sq << " sk" << s.sk << " h" << s.hq << "/" << s.hkv << " d" << s.d << " blocks "
    << bm << "x" << bn << " " << what;
  return n.str();
}

// fp64 inputs: the flash path's tiles (64 x 64) against the reference's dense rows, each
// honouring the mask, agree to rounding.
TEST(BlockMaskCpu, RandomMasksMatchTheReference) {
  auto rng = fa_test::rng_for("BlockMaskCpu.RandomMasksMatchTheReference");
  const int64_t block_sizes[][2] = {{128, 128}, {16, 64}, {64, 16}, {32, 48}, {1, 200}};
  std::uniform_int_distribution<int64_t> len(1, 260);
  for (int trial = 0; trial < 10; ++trial) {
    const Shape s{1 + trial % 2, len(rng), len(rng), 4, trial % 3 == 0 ? 1 : 2, trial % 2 ? 40 : 64};
    const auto& bs = block_sizes[trial % 5];
    SCOPED_TRACE(name(s, bs[0], bs[1]));
    const Inputs in(s, DType::kFloat64, rng);
    const RandomBlockMask mask(rng, s.batch, s.hq, s.sq, s.sk, bs[0], bs[1]);
    AttentionOptions o;
    o.block_mask = mask.options();
    if (trial % 4 == 1) o.mask.causal = true;
    if (trial % 4 == 2) o.mask.window_left = 40, o.mask.window_right = 7, o.mask.sink_tokens = 3;
    if (trial % 3 == 2) o.score.learnable_sink = in.sink.view();
    expect_near(run(in, o, false), run(in, o, true), 1e-11);
  }
}

// A causal predicate's block mask is causal=true, element for element: the same results to the
// bit (a masked score is -inf either way, and the visited tiles hold the same scores).
TEST(BlockMaskCpu, CausalPredicateIsCausal) {
  auto rng = fa_test::rng_for("BlockMaskCpu.CausalPredicateIsCausal");
  for (const DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (const auto& bs : {std::pair<int64_t, int64_t>{64, 64}, {32, 96}, {128, 128}}) {
      const Shape s{2, 150, 190, 2, 1, 32};
      SCOPED_TRACE(name(s, bs.first, bs.second, flashattn::dtype_name(dtype)));
      const Inputs in(s, dtype, rng);
      const PredicateBlockMask mask(s.batch, s.hq, s.sq, s.sk, bs.first, bs.second,
                                    [&](int64_t, int64_t, int64_t i, int64_t j) { return j <= i + s.sk - s.sq; });
      AttentionOptions causal, blocks;
      causal.mask.causal = true;
      blocks.block_mask = mask.options();
      expect_equal(run(in, blocks, false), run(in, causal, false));
      expect_equal(run(in, blocks, true), run(in, causal, true));
    }
  }
}

// Documents packed in one sequence (each row sees the keys of its own document, causally) are
// varlen's sequences.
TEST(BlockMaskCpu, DocumentMaskIsVarlen) {
  auto rng = fa_test::rng_for("BlockMaskCpu.DocumentMaskIsVarlen");
  const std::vector<int32_t> cu = {0, 37, 37, 140, 141, 230};  // an empty and a one-token document
  const int64_t total = cu.back(), hq = 4, hkv = 2, d = 48;
  std::vector<int32_t> doc(static_cast<size_t>(total));
  for (size_t s = 0; s + 1 < cu.size(); ++s) std::fill(doc.begin() + cu[s], doc.begin() + cu[s + 1], int32_t(s));
  const Inputs in({1, total, total, hq, hkv, d}, DType::kFloat64, rng);
  const PredicateBlockMask mask(1, hq, total, total, 64, 64, [&](int64_t, int64_t, int64_t i, int64_t j) {
    return doc[static_cast<size_t>(i)] == doc[static_cast<size_t>(j)] && j <= i;
  });
  AttentionOptions blocks;
  blocks.block_mask = mask.options();
  const Results got = run(in, blocks, false);

  // The same rows as a varlen batch: [total, h, d] views of the dense tensors' only batch entry.
  auto rows = [&](const HostTensor& t, int64_t h) {
    return flashattn::TensorView::contiguous(t.data(), t.dtype(), {total, h, d});
  };
  HostTensor out(DType::kFloat64, {total, hq, d}), lse(DType::kFloat32, {hq, total});
  HostTensor dq(DType::kFloat64, {total, hq, d}), dk(DType::kFloat64, {total, hkv, d}),
      dv(DType::kFloat64, {total, hkv, d});
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = vl.cu_seqlens_k = flashattn::TensorView::contiguous(cu.data(), DType::kInt32, {6});
  vl.max_seqlen_q = vl.max_seqlen_k = 103;
  AttentionOptions causal;
  causal.mask.causal = true;
  flashattn::forward_varlen({rows(in.q, hq), rows(in.k, hkv), rows(in.v, hkv), out.view(), lse.view()}, vl, causal);
  flashattn::backward_varlen({rows(in.dout, hq), rows(in.q, hq), rows(in.k, hkv), rows(in.v, hkv), out.view(),
                              lse.view(), dq.view(), dk.view(), dv.view()},
                             vl, causal);
  // lse: [1, hq, total] against [hq, total], the same order.
  expect_near(got, {out.to_vector(), lse.to_vector(), dq.to_vector(), dk.to_vector(), dv.to_vector()}, 1e-12);
}

// Every block full is no mask; no block listed is rows that see nothing.
TEST(BlockMaskCpu, AllFullAndAllHidden) {
  auto rng = fa_test::rng_for("BlockMaskCpu.AllFullAndAllHidden");
  const Shape s{1, 100, 130, 2, 2, 32};
  const Inputs in(s, DType::kFloat32, rng);
  const PredicateBlockMask all(1, s.hq, s.sq, s.sk, 48, 48, [](int64_t, int64_t, int64_t, int64_t) { return true; });
  AttentionOptions none, full, hidden;
  full.block_mask = all.options();
  expect_equal(run(in, full, false), run(in, none, false));

  const PredicateBlockMask empty(1, s.hq, s.sq, s.sk, 48, 48, [](int64_t, int64_t, int64_t, int64_t) { return false; });
  hidden.block_mask = empty.options();
  const Results r = run(in, hidden, false);
  for (double x : r.out) ASSERT_EQ(x, 0.0);
  for (double x : r.lse) ASSERT_EQ(x, -std::numeric_limits<double>::infinity());
  for (const auto* g : {&r.dq, &r.dk, &r.dv}) {
    for (double x : *g) ASSERT_EQ(x, 0.0);
  }
}

// A malformed mask fails naming the argument, and writes nothing.
TEST(BlockMaskCpu, ErrorsNameTheArgument) {
  auto rng = fa_test::rng_for("BlockMaskCpu.ErrorsNameTheArgument");
  const Shape s{2, 70, 90, 2, 1, 32};
  const Inputs in(s, DType::kFloat32, rng);
  RandomBlockMask mask(rng, s.batch, s.hq, s.sq, s.sk, 32, 32);
  HostTensor out(DType::kFloat32, {s.batch, s.sq, s.hq, s.d});
  auto expect_error = [&](const flashattn::BlockMaskOptions& bm, const std::string& what) {
    SCOPED_TRACE(what);
    out.fill_storage_nan();
    AttentionOptions o;
    o.block_mask = bm;
    try {
      flashattn::forward({in.q.view(), in.k.view(), in.v.view(), out.view(), {}}, o);
      ADD_FAILURE() << "no error";
    } catch (const flashattn::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    for (int64_t e = 0; e < out.numel(); ++e) ASSERT_TRUE(std::isnan(out.get(e))) << "written";
  };
  flashattn::BlockMaskOptions bm = mask.options();
  bm.kv_indices.dtype = DType::kFloat32;
  expect_error(bm, "block_mask.kv_indices: dtype float32 must be int32");
  bm = mask.options();
  bm.kv_num_blocks.shape[1] = 3;  // heads
  expect_error(bm, "block_mask.kv_num_blocks: shape [2, 3, 4] dim 1 must be 1 or 2");
  bm = mask.options();
  bm.kv_num_blocks.device = {flashattn::DeviceType::kCUDA, 0};
  expect_error(bm, "block_mask.kv_num_blocks: on cuda:0, but q is on cpu");
  bm = mask.options();
  bm.bits_block = {};
  expect_error(bm, "bits and bits_block come together");
  bm = mask.options();
  bm.block_n = 16;
  expect_error(bm, "do not cover seqlen_q 70 x seqlen_k 90");  // 3 key blocks of 16 keys
  bm = mask.options();
  bm.bits.shape[1] = 16;
  expect_error(bm, "block_mask.bits: shape");
  bm = mask.options();
  bm.index_check = static_cast<flashattn::IndexCheck>(7);
  expect_error(bm, "block_mask.index_check: 7 is neither kHost nor kDevice");
  mask.partial_count[3] = 1;
  mask.partial_index[static_cast<size_t>(3 * mask.mask.key_blocks)] = 9;
  mask.full_count[3] = 0;
  expect_error(mask.options(), "kv_indices entry 9 at (batch 0, head 0, query block 3) outside [0, 3)");
  bm = mask.options();  // host arrays are checked on the host under kDevice too
  bm.index_check = flashattn::IndexCheck::kDevice;
  expect_error(bm, "kv_indices entry 9 at (batch 0, head 0, query block 3) outside [0, 3)");
  // An output overlapping the mask's arrays.
  bm = mask.options();
  bm.kv_indices.data = out.data();
  try {
    AttentionOptions o;
    o.block_mask = bm;
    flashattn::forward({in.q.view(), in.k.view(), in.v.view(), out.view(), {}}, o);
    ADD_FAILURE() << "no error";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_mask.kv_indices"), std::string::npos) << e.what();
  }
}

}  // namespace

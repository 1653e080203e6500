// C ABI tests: results equal the C++ API bit for bit, every failure maps to the right status
// with a message naming the argument, and the last-error message is per thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "random_block_mask.hpp"

namespace {

using flashattn::DType;
using flashattn::TensorView;

// Fresh seed each run, printed; FLASHATTN_TEST_SEED replays one.
uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("FLASHATTN_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("test_c_api: FLASHATTN_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

std::vector<float> random_floats(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Poisoned, so an output nobody wrote cannot compare equal to a computed one.
std::vector<float> nan_floats(size_t n) { return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()); }

fa_tensor c_tensor(const std::vector<float>& data, std::vector<int64_t> shape) {
  fa_tensor t;
  EXPECT_EQ(fa_tensor_contiguous(&t, data.data(), FA_DTYPE_FLOAT32, static_cast<int32_t>(shape.size()), shape.data()),
            FA_OK);
  return t;
}

TensorView cpp_tensor(const std::vector<float>& data, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(data.data(), DType::kFloat32, shape);
}

void expect_bitwise_equal(const std::vector<float>& c, const std::vector<float>& cpp, const char* name) {
  ASSERT_EQ(c.size(), cpp.size()) << name;
  for (size_t i = 0; i < c.size(); ++i) {
    ASSERT_FALSE(std::isnan(c[i])) << name << "[" << i << "] was not written";
    ASSERT_EQ(std::memcmp(&c[i], &cpp[i], sizeof(float)), 0)
        << name << "[" << i << "]: C " << c[i] << " vs C++ " << cpp[i];
  }
}

// A small dense fp32 problem, filled with random data: causal GQA (4 query heads, 2 kv heads).
struct DenseCase {
  static constexpr int64_t kBatch = 2, kSeqQ = 37, kSeqK = 53, kHeadsQ = 4, kHeadsKV = 2, kHeadDim = 32;
  std::vector<float> q, k, v, dout;

  DenseCase() {
    std::mt19937_64 rng(test_seed());
    q = random_floats(kBatch * kSeqQ * kHeadsQ * kHeadDim, rng);
    k = random_floats(kBatch * kSeqK * kHeadsKV * kHeadDim, rng);
    v = random_floats(kBatch * kSeqK * kHeadsKV * kHeadDim, rng);
    dout = random_floats(q.size(), rng);
  }
  size_t lse_size() const { return kBatch * kHeadsQ * kSeqQ; }

  // C views of q, k, v and an out/lse pair; callers break one field to test a failure.
  fa_forward_args c_forward(const std::vector<float>& out, const std::vector<float>& lse) const {
    fa_forward_args a{};
    a.q = c_tensor(q, {kBatch, kSeqQ, kHeadsQ, kHeadDim});
    a.k = c_tensor(k, {kBatch, kSeqK, kHeadsKV, kHeadDim});
    a.v = c_tensor(v, {kBatch, kSeqK, kHeadsKV, kHeadDim});
    a.out = c_tensor(out, {kBatch, kSeqQ, kHeadsQ, kHeadDim});
    a.lse = c_tensor(lse, {kBatch, kHeadsQ, kSeqQ});
    return a;
  }
  // The same as C++ views.
  flashattn::ForwardArgs cpp_forward(const std::vector<float>& out, const std::vector<float>& lse) const {
    flashattn::ForwardArgs a;
    a.q = cpp_tensor(q, {kBatch, kSeqQ, kHeadsQ, kHeadDim});
    a.k = cpp_tensor(k, {kBatch, kSeqK, kHeadsKV, kHeadDim});
    a.v = cpp_tensor(v, {kBatch, kSeqK, kHeadsKV, kHeadDim});
    a.out = cpp_tensor(out, {kBatch, kSeqQ, kHeadsQ, kHeadDim});
    a.lse = cpp_tensor(lse, {kBatch, kHeadsQ, kSeqQ});
    return a;
  }
};

fa_options causal_options() {
  fa_options o;
  fa_options_default(&o);
  o.causal = true;
  o.deterministic = true;
  return o;
}

// Sizes whose product passes 64 bits are an error, not wrapped strides; the tensor is left zeroed.
TEST(CApi, ContiguousShapeOverflowIsAnError) {
  float x = 0;
  fa_tensor t;
  const int64_t huge[4] = {2, int64_t{1} << 40, int64_t{1} << 20, int64_t{1} << 10};  // stride[0] 2^70
  EXPECT_EQ(fa_tensor_contiguous(&t, &x, FA_DTYPE_FLOAT32, 4, huge), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("shape: the product of the sizes overflows 64 bits"), std::string::npos)
      << fa_last_error();
  EXPECT_EQ(t.ndim, 0);
  const int64_t big[4] = {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 20, 4};  // strides fit
  EXPECT_EQ(fa_tensor_contiguous(&t, &x, FA_DTYPE_FLOAT32, 4, big), FA_OK);
  EXPECT_EQ(t.strides[0], int64_t{1} << 42);
}

// The fp64 reference materialises S and P: an allocation that fails is FA_ERROR_OUT_OF_MEMORY
// (flashattn::Error in C++), not an escaping std::bad_alloc. 2^40 keys over one stride-0 row.
TEST(CApi, ReferenceOutOfMemoryIsAnError) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer aborts on an allocation this size instead of throwing std::bad_alloc";
#endif
  std::vector<float> qd(8, 0.5f), kvd(8, 0.25f), out(8), lse(1);
  const int64_t keys = int64_t{1} << 40;
  flashattn::ForwardArgs a;
  a.q = TensorView::contiguous(qd.data(), DType::kFloat32, {1, 1, 1, 8});
  a.k = TensorView::strided(kvd.data(), DType::kFloat32, {1, keys, 1, 8}, {0, 0, 0, 1});
  a.v = a.k;
  a.out = TensorView::contiguous(out.data(), DType::kFloat32, {1, 1, 1, 8});
  a.lse = TensorView::contiguous(lse.data(), DType::kFloat32, {1, 1, 1});
  try {
    flashattn::reference_forward(a, {});
    ADD_FAILURE() << "a reference of 2^40 keys ran";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), flashattn::ErrorCode::kOutOfMemory) << e.what();
  }
}

TEST(CApi, ForwardBackwardEqualsCppBitwise) {
  const DenseCase p;
  using P = DenseCase;
  const std::vector<int64_t> q_shape{P::kBatch, P::kSeqQ, P::kHeadsQ, P::kHeadDim};
  const std::vector<int64_t> kv_shape{P::kBatch, P::kSeqK, P::kHeadsKV, P::kHeadDim};

  // C++ API.
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  std::vector<float> dq = nan_floats(p.q.size()), dk = nan_floats(p.k.size()), dv = nan_floats(p.v.size());
  // With a learnable sink: its option and gradient cross the ABI too.
  const std::vector<float> sink{0.5f, -1.0f, 2.0f, 0.0f};
  std::vector<float> dsink = nan_floats(P::kHeadsQ);
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  o.deterministic = true;
  o.score.learnable_sink = cpp_tensor(sink, {P::kHeadsQ});
  {
    const flashattn::ForwardArgs a = p.cpp_forward(out, lse);
    flashattn::forward(a, o);
    flashattn::BackwardArgs b;
    b.q = a.q;
    b.k = a.k;
    b.v = a.v;
    b.out = a.out;
    b.lse = a.lse;
    b.dout = cpp_tensor(p.dout, {P::kBatch, P::kSeqQ, P::kHeadsQ, P::kHeadDim});
    b.dq = cpp_tensor(dq, {P::kBatch, P::kSeqQ, P::kHeadsQ, P::kHeadDim});
    b.dk = cpp_tensor(dk, {P::kBatch, P::kSeqK, P::kHeadsKV, P::kHeadDim});
    b.dv = cpp_tensor(dv, {P::kBatch, P::kSeqK, P::kHeadsKV, P::kHeadDim});
    b.dsink = cpp_tensor(dsink, {P::kHeadsQ});
    flashattn::backward(b, o);
  }

  // C ABI, on separate outputs.
  std::vector<float> c_out = nan_floats(p.q.size()), c_lse = nan_floats(p.lse_size());
  std::vector<float> c_dq = nan_floats(p.q.size()), c_dk = nan_floats(p.k.size()), c_dv = nan_floats(p.v.size());
  std::vector<float> c_dsink = nan_floats(P::kHeadsQ);
  fa_options co = causal_options();
  co.learnable_sink = c_tensor(sink, {P::kHeadsQ});
  const fa_forward_args fa = p.c_forward(c_out, c_lse);
  size_t bytes = 123;
  ASSERT_EQ(fa_forward_workspace_size(&fa, &co, &bytes), FA_OK) << fa_last_error();
  EXPECT_EQ(bytes, 0u);  // the CPU backend needs no workspace
  ASSERT_EQ(fa_forward(&fa, &co, nullptr), FA_OK) << fa_last_error();
  fa_backward_args ba{};
  ba.q = fa.q;
  ba.k = fa.k;
  ba.v = fa.v;
  ba.out = fa.out;
  ba.lse = fa.lse;
  ba.dout = c_tensor(p.dout, q_shape);
  ba.dq = c_tensor(c_dq, q_shape);
  ba.dk = c_tensor(c_dk, kv_shape);
  ba.dv = c_tensor(c_dv, kv_shape);
  ba.dsink = c_tensor(c_dsink, {P::kHeadsQ});
  const fa_run_context ctx{};  // an explicit, empty context is the same as NULL
  bytes = 123;
  ASSERT_EQ(fa_backward_workspace_size(&ba, &co, &bytes), FA_OK) << fa_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(fa_backward(&ba, &co, &ctx), FA_OK) << fa_last_error();
  EXPECT_STREQ(fa_last_error(), "");

  expect_bitwise_equal(c_out, out, "out");
  expect_bitwise_equal(c_lse, lse, "lse");
  expect_bitwise_equal(c_dq, dq, "dq");
  expect_bitwise_equal(c_dk, dk, "dk");
  expect_bitwise_equal(c_dv, dv, "dv");
  expect_bitwise_equal(c_dsink, dsink, "dsink");
}

// The reference entry points reach the reference (not the flash path): outputs agree with the
// C++ reference bitwise, and with the flash path closely.
TEST(CApi, ReferenceForwardEqualsCppReference) {
  const DenseCase p;
  using P = DenseCase;
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  flashattn::ForwardArgs a;
  a.q = cpp_tensor(p.q, {P::kBatch, P::kSeqQ, P::kHeadsQ, P::kHeadDim});
  a.k = cpp_tensor(p.k, {P::kBatch, P::kSeqK, P::kHeadsKV, P::kHeadDim});
  a.v = cpp_tensor(p.v, {P::kBatch, P::kSeqK, P::kHeadsKV, P::kHeadDim});
  a.out = cpp_tensor(out, {P::kBatch, P::kSeqQ, P::kHeadsQ, P::kHeadDim});
  a.lse = cpp_tensor(lse, {P::kBatch, P::kHeadsQ, P::kSeqQ});
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  flashattn::reference_forward(a, o);

  std::vector<float> c_out = nan_floats(p.q.size()), c_lse = nan_floats(p.lse_size());
  const fa_options co = causal_options();
  const fa_forward_args fa = p.c_forward(c_out, c_lse);
  ASSERT_EQ(fa_reference_forward(&fa, &co), FA_OK) << fa_last_error();
  expect_bitwise_equal(c_out, out, "out");
  expect_bitwise_equal(c_lse, lse, "lse");
}

// Varlen goes through its own conversion (cu_seqlens, seqused_k, max_seqlen_*).
TEST(CApi, VarlenForwardEqualsCpp) {
  std::mt19937_64 rng(test_seed() + 1);
  const int64_t total_q = 20, total_k = 30, hq = 4, hkv = 2, d = 16;
  const std::vector<int32_t> cu_q{0, 7, 7, 20}, cu_k{0, 12, 18, 30}, used_k{10, 6, 12};
  const std::vector<float> q = random_floats(total_q * hq * d, rng), k = random_floats(total_k * hkv * d, rng),
                           v = random_floats(total_k * hkv * d, rng);
  std::vector<float> out = nan_floats(q.size()), lse = nan_floats(hq * total_q);
  std::vector<float> c_out = nan_floats(q.size()), c_lse = nan_floats(hq * total_q);

  flashattn::ForwardArgs a;
  a.q = cpp_tensor(q, {total_q, hq, d});
  a.k = cpp_tensor(k, {total_k, hkv, d});
  a.v = cpp_tensor(v, {total_k, hkv, d});
  a.out = cpp_tensor(out, {total_q, hq, d});
  a.lse = cpp_tensor(lse, {hq, total_q});
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = TensorView::contiguous(cu_q.data(), DType::kInt32, {4});
  vl.cu_seqlens_k = TensorView::contiguous(cu_k.data(), DType::kInt32, {4});
  vl.seqused_k = TensorView::contiguous(used_k.data(), DType::kInt32, {3});
  vl.max_seqlen_q = 13;
  vl.max_seqlen_k = 12;
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  flashattn::forward_varlen(a, vl, o);

  fa_forward_args fa{};
  fa.q = c_tensor(q, {total_q, hq, d});
  fa.k = c_tensor(k, {total_k, hkv, d});
  fa.v = c_tensor(v, {total_k, hkv, d});
  fa.out = c_tensor(c_out, {total_q, hq, d});
  fa.lse = c_tensor(c_lse, {hq, total_q});
  fa_varlen cvl{};
  const int64_t n_cu = 4, n_used = 3;
  ASSERT_EQ(fa_tensor_contiguous(&cvl.cu_seqlens_q, cu_q.data(), FA_DTYPE_INT32, 1, &n_cu), FA_OK);
  ASSERT_EQ(fa_tensor_contiguous(&cvl.cu_seqlens_k, cu_k.data(), FA_DTYPE_INT32, 1, &n_cu), FA_OK);
  ASSERT_EQ(fa_tensor_contiguous(&cvl.seqused_k, used_k.data(), FA_DTYPE_INT32, 1, &n_used), FA_OK);
  cvl.max_seqlen_q = 13;
  cvl.max_seqlen_k = 12;
  const fa_options co = causal_options();
  size_t bytes = 123;
  ASSERT_EQ(fa_forward_varlen_workspace_size(&fa, &cvl, &co, &bytes), FA_OK) << fa_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(fa_forward_varlen(&fa, &cvl, &co, nullptr), FA_OK) << fa_last_error();
  expect_bitwise_equal(c_out, out, "out");
  expect_bitwise_equal(c_lse, lse, "lse");

  // max_seqlen_k reaches the validation: too small is an error naming it.
  cvl.max_seqlen_k = 11;
  EXPECT_EQ(fa_forward_varlen(&fa, &cvl, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("max_seqlen_k"), std::string::npos) << fa_last_error();
  cvl.index_check = FA_INDEX_CHECK_DEVICE;  // host memory: checked on the host all the same
  EXPECT_EQ(fa_forward_varlen(&fa, &cvl, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  cvl.max_seqlen_k = 12;
  cvl.index_check = 2;
  EXPECT_EQ(fa_forward_varlen(&fa, &cvl, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("index_check: 2 is neither FA_INDEX_CHECK_HOST (0) nor"),
            std::string::npos)
      << fa_last_error();
}

// v with a head_dim of its own (multi-head latent attention) crosses the ABI as the C++ API takes
// it: forward and backward equal bitwise; an out of q's head_dim is an error naming it.
TEST(CApi, ValueHeadDimEqualsCppBitwise) {
  std::mt19937_64 rng(test_seed() + 3);
  const int64_t b = 2, sq = 19, sk = 23, hq = 4, hkv = 2, d = 24, dv = 16;
  const std::vector<float> q = random_floats(b * sq * hq * d, rng), k = random_floats(b * sk * hkv * d, rng),
                           v = random_floats(b * sk * hkv * dv, rng), dout = random_floats(b * sq * hq * dv, rng);
  struct Outputs {
    std::vector<float> out, lse, dq, dk, dv;
  };
  auto poisoned = [&] {
    return Outputs{nan_floats(dout.size()), nan_floats(b * hq * sq), nan_floats(q.size()), nan_floats(k.size()),
                   nan_floats(v.size())};
  };
  Outputs cpp = poisoned(), c = poisoned();
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  flashattn::ForwardArgs a;
  a.q = cpp_tensor(q, {b, sq, hq, d});
  a.k = cpp_tensor(k, {b, sk, hkv, d});
  a.v = cpp_tensor(v, {b, sk, hkv, dv});
  a.out = cpp_tensor(cpp.out, {b, sq, hq, dv});
  a.lse = cpp_tensor(cpp.lse, {b, hq, sq});
  flashattn::forward(a, o);
  flashattn::backward(
      {cpp_tensor(dout, {b, sq, hq, dv}), a.q, a.k, a.v, a.out, a.lse, cpp_tensor(cpp.dq, {b, sq, hq, d}),
       cpp_tensor(cpp.dk, {b, sk, hkv, d}), cpp_tensor(cpp.dv, {b, sk, hkv, dv})},
      o);

  const fa_options co = causal_options();
  fa_forward_args fa{};
  fa.q = c_tensor(q, {b, sq, hq, d});
  fa.k = c_tensor(k, {b, sk, hkv, d});
  fa.v = c_tensor(v, {b, sk, hkv, dv});
  fa.out = c_tensor(c.out, {b, sq, hq, dv});
  fa.lse = c_tensor(c.lse, {b, hq, sq});
  ASSERT_EQ(fa_forward(&fa, &co, nullptr), FA_OK) << fa_last_error();
  fa_backward_args ba{};
  ba.q = fa.q;
  ba.k = fa.k;
  ba.v = fa.v;
  ba.out = fa.out;
  ba.lse = fa.lse;
  ba.dout = c_tensor(dout, {b, sq, hq, dv});
  ba.dq = c_tensor(c.dq, {b, sq, hq, d});
  ba.dk = c_tensor(c.dk, {b, sk, hkv, d});
  ba.dv = c_tensor(c.dv, {b, sk, hkv, dv});
  ASSERT_EQ(fa_backward(&ba, &co, nullptr), FA_OK) << fa_last_error();
  expect_bitwise_equal(c.out, cpp.out, "out");
  expect_bitwise_equal(c.lse, cpp.lse, "lse");
  expect_bitwise_equal(c.dq, cpp.dq, "dq");
  expect_bitwise_equal(c.dk, cpp.dk, "dk");
  expect_bitwise_equal(c.dv, cpp.dv, "dv");

  std::vector<float> wide_out = nan_floats(b * sq * hq * d);
  fa.out = c_tensor(wide_out, {b, sq, hq, d});
  EXPECT_EQ(fa_forward(&fa, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(
      std::string(fa_last_error()).find("out: shape [2, 19, 4, 24] != [2, 19, 4, 16], q's shape with v's head_dim"),
      std::string::npos)
      << fa_last_error();
  EXPECT_TRUE(std::all_of(wide_out.begin(), wide_out.end(), [](float x) { return std::isnan(x); }));  // not written
}

// A paged cache (page 4) with one new token, rotary and leftpad: the C call equals the C++ one
// bit for bit, cache included, and a bad block_table entry is an error naming it.
TEST(CApi, KvCacheForwardEqualsCpp) {
  std::mt19937_64 rng(test_seed() + 2);
  const int64_t b = 2, sq = 1, hq = 4, hkv = 2, d = 16, page = 4, blocks = 6, max_blocks = 3;
  const std::vector<int32_t> table{4, 1, 0, 2, 5, -1}, seqlens{9, 5}, leftpad{1, 0};
  const std::vector<float> q = random_floats(b * sq * hq * d, rng), k_new = random_floats(b * hkv * d, rng),
                           v_new = random_floats(b * hkv * d, rng), cos_sin = random_floats(16 * 4, rng);
  const std::vector<float> cache = random_floats(blocks * page * hkv * d, rng);
  std::vector<float> k_cache = cache, v_cache = cache, c_k_cache = cache, c_v_cache = cache;
  std::vector<float> out = nan_floats(q.size()), lse = nan_floats(b * hq * sq);
  std::vector<float> c_out = nan_floats(q.size()), c_lse = nan_floats(b * hq * sq);

  flashattn::KvCacheArgs a;
  a.q = cpp_tensor(q, {b, sq, hq, d});
  a.k_cache = cpp_tensor(k_cache, {blocks, page, hkv, d});
  a.v_cache = cpp_tensor(v_cache, {blocks, page, hkv, d});
  a.k_new = cpp_tensor(k_new, {b, 1, hkv, d});
  a.v_new = cpp_tensor(v_new, {b, 1, hkv, d});
  a.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {b});
  a.cache_leftpad = TensorView::contiguous(leftpad.data(), DType::kInt32, {b});
  a.block_table = TensorView::contiguous(table.data(), DType::kInt32, {b, max_blocks});
  a.rotary_cos = cpp_tensor(cos_sin, {16, 4});
  a.rotary_sin = cpp_tensor(cos_sin, {16, 4});
  a.rotary_interleaved = false;
  a.out = cpp_tensor(out, {b, sq, hq, d});
  a.lse = cpp_tensor(lse, {b, hq, sq});
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  flashattn::forward_kvcache(a, o);

  fa_kvcache_args ca{};
  ca.q = c_tensor(q, {b, sq, hq, d});
  ca.k_cache = c_tensor(c_k_cache, {blocks, page, hkv, d});
  ca.v_cache = c_tensor(c_v_cache, {blocks, page, hkv, d});
  ca.k_new = c_tensor(k_new, {b, 1, hkv, d});
  ca.v_new = c_tensor(v_new, {b, 1, hkv, d});
  const int64_t n_b = b, table_shape[2] = {b, max_blocks};
  ASSERT_EQ(fa_tensor_contiguous(&ca.cache_seqlens, seqlens.data(), FA_DTYPE_INT32, 1, &n_b), FA_OK);
  ASSERT_EQ(fa_tensor_contiguous(&ca.cache_leftpad, leftpad.data(), FA_DTYPE_INT32, 1, &n_b), FA_OK);
  ASSERT_EQ(fa_tensor_contiguous(&ca.block_table, table.data(), FA_DTYPE_INT32, 2, table_shape), FA_OK);
  ca.rotary_cos = c_tensor(cos_sin, {16, 4});
  ca.rotary_sin = c_tensor(cos_sin, {16, 4});
  ca.rotary_interleaved = false;
  ca.out = c_tensor(c_out, {b, sq, hq, d});
  ca.lse = c_tensor(c_lse, {b, hq, sq});
  const fa_options co = causal_options();
  size_t bytes = 123;
  ASSERT_EQ(fa_forward_kvcache_workspace_size(&ca, &co, &bytes), FA_OK) << fa_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(fa_forward_kvcache(&ca, &co, nullptr), FA_OK) << fa_last_error();
  expect_bitwise_equal(c_out, out, "out");
  expect_bitwise_equal(c_lse, lse, "lse");
  EXPECT_EQ(std::memcmp(c_k_cache.data(), k_cache.data(), cache.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(c_v_cache.data(), v_cache.data(), cache.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(c_k_cache.data(), cache.data(), cache.size() * sizeof(float)), 0)
      << "the new keys were not written";

  ASSERT_EQ(fa_reference_forward_kvcache(&ca, &co), FA_OK) << fa_last_error();
  // Sequence 1 ends at position 6: its table entry 2 (-1) is never read, entry 1 is.
  std::vector<int32_t> bad = table;
  bad[4] = 6;
  ASSERT_EQ(fa_tensor_contiguous(&ca.block_table, bad.data(), FA_DTYPE_INT32, 2, table_shape), FA_OK);
  EXPECT_EQ(fa_forward_kvcache(&ca, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("block_table: entry [1, 1] is 6, outside [0, 6)"), std::string::npos)
      << fa_last_error();
  ca.index_check = FA_INDEX_CHECK_DEVICE;  // host memory: checked on the host all the same
  EXPECT_EQ(fa_forward_kvcache(&ca, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  ca.index_check = 2;
  EXPECT_EQ(fa_forward_kvcache(&ca, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("index_check: 2 is neither FA_INDEX_CHECK_HOST (0) nor"),
            std::string::npos)
      << fa_last_error();
  EXPECT_EQ(fa_forward_kvcache(nullptr, &co, nullptr), FA_ERROR_NULL_ARGUMENT);
}

TEST(CApi, OptionsDefaultMatchesCpp) {
  fa_options o;
  std::memset(&o, 0x5a, sizeof(o));
  fa_options_default(&o);
  const flashattn::AttentionOptions d;
  EXPECT_EQ(o.causal, d.mask.causal);
  EXPECT_EQ(o.window_left, -1);
  EXPECT_EQ(o.window_right, -1);
  EXPECT_EQ(o.softmax_scale, 0.0);
  EXPECT_EQ(o.softcap, 0.0f);
  EXPECT_EQ(o.alibi_slopes.data, nullptr);
  EXPECT_EQ(o.alibi_slopes.ndim, 0);
  EXPECT_EQ(o.dropout_p, 0.0f);
  EXPECT_EQ(o.dropout_seed, 0u);
  EXPECT_EQ(o.dropout_offset, 0u);
  EXPECT_FALSE(o.deterministic);
  EXPECT_FALSE(o.precise);
  EXPECT_EQ(o.learnable_sink.data, nullptr);
  EXPECT_EQ(o.learnable_sink.ndim, 0);
  EXPECT_EQ(o.sink_tokens, 0);
  EXPECT_EQ(o.block_mask.block_m, d.block_mask.block_m);
  EXPECT_EQ(o.block_mask.block_n, d.block_mask.block_n);
  EXPECT_EQ(o.block_mask.kv_num_blocks.data, nullptr);
  EXPECT_EQ(o.block_mask.kv_num_blocks.ndim, 0);
  EXPECT_EQ(o.block_mask.index_check, FA_INDEX_CHECK_HOST);
  fa_options_default(nullptr);  // documented as a no-op
}

// A block mask crosses the ABI: the C call's results are the C++ call's, bit for bit.
TEST(CApi, BlockMaskEqualsCppBitwise) {
  const DenseCase p;
  using P = DenseCase;
  const fa_test::PredicateBlockMask mask(
      P::kBatch, P::kHeadsQ, P::kSeqQ, P::kSeqK, 16, 32,
      [](int64_t b, int64_t h, int64_t i, int64_t j) { return (i + j + b + h) % 3; });
  auto c_int = [](const flashattn::TensorView& t) {
    fa_tensor c{};
    c.data = t.data;
    c.dtype = FA_DTYPE_INT32;
    c.device_type = FA_DEVICE_CPU;
    c.ndim = t.ndim;
    for (int i = 0; i < t.ndim; ++i) c.shape[i] = t.shape[i], c.strides[i] = t.strides[i];
    return c;
  };
  flashattn::AttentionOptions o;
  o.block_mask = mask.options();
  fa_options co;
  fa_options_default(&co);
  co.block_mask.block_m = o.block_mask.block_m;
  co.block_mask.block_n = o.block_mask.block_n;
  co.block_mask.kv_num_blocks = c_int(o.block_mask.kv_num_blocks);
  co.block_mask.kv_indices = c_int(o.block_mask.kv_indices);
  co.block_mask.full_kv_num_blocks = c_int(o.block_mask.full_kv_num_blocks);
  co.block_mask.full_kv_indices = c_int(o.block_mask.full_kv_indices);
  co.block_mask.bits = c_int(o.block_mask.bits);
  co.block_mask.bits_block = c_int(o.block_mask.bits_block);

  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  std::vector<float> c_out = nan_floats(p.q.size()), c_lse = nan_floats(p.lse_size());
  const fa_forward_args fa = p.c_forward(c_out, c_lse);
  ASSERT_EQ(fa_forward(&fa, &co, nullptr), FA_OK) << fa_last_error();
  flashattn::forward(p.cpp_forward(out, lse), o);
  expect_bitwise_equal(c_out, out, "out");
  expect_bitwise_equal(c_lse, lse, "lse");
  co.block_mask.index_check = FA_INDEX_CHECK_DEVICE;  // host memory: checked on the host all the same
  ASSERT_EQ(fa_forward(&fa, &co, nullptr), FA_OK) << fa_last_error();
  expect_bitwise_equal(c_out, out, "out");
  co.block_mask.index_check = 2;
  EXPECT_EQ(fa_forward(&fa, &co, nullptr), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("block_mask.index_check: 2 is neither"), std::string::npos)
      << fa_last_error();
  co.block_mask.index_check = FA_INDEX_CHECK_HOST;
  // A malformed mask through C: an error status naming the argument.
  co.block_mask.kv_indices.dtype = FA_DTYPE_FLOAT32;
  EXPECT_EQ(fa_forward(&fa, &co, nullptr), FA_ERROR_INVALID_DTYPE);
  EXPECT_NE(std::string(fa_last_error()).find("block_mask.kv_indices"), std::string::npos) << fa_last_error();
}

TEST(CApi, TensorContiguousMatchesCpp) {
  const int64_t shape[4] = {2, 0, 3, 5};
  fa_tensor t;
  ASSERT_EQ(fa_tensor_contiguous(&t, nullptr, FA_DTYPE_BFLOAT16, 4, shape), FA_OK);
  const TensorView v = TensorView::contiguous(nullptr, DType::kBFloat16, {2, 0, 3, 5});
  EXPECT_EQ(t.ndim, 4);
  EXPECT_EQ(t.dtype, FA_DTYPE_BFLOAT16);
  EXPECT_EQ(t.device_type, FA_DEVICE_CPU);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(t.shape[i], v.shape[i]) << i;
    EXPECT_EQ(t.strides[i], v.strides[i]) << i;
  }
  EXPECT_EQ(fa_tensor_contiguous(&t, nullptr, FA_DTYPE_FLOAT32, 5, shape), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("ndim: 5"), std::string::npos) << fa_last_error();
  EXPECT_EQ(fa_tensor_contiguous(&t, nullptr, FA_DTYPE_FLOAT32, 2, nullptr), FA_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(fa_tensor_contiguous(nullptr, nullptr, FA_DTYPE_FLOAT32, 0, nullptr), FA_ERROR_NULL_ARGUMENT);
}

// Runs a failing forward and checks status and message.
void expect_forward_error(const fa_forward_args& a, const fa_options& o, fa_status status,
                          const std::string& message_part) {
  const fa_status got = fa_forward(&a, &o, nullptr);
  EXPECT_EQ(got, status) << fa_status_string(got) << ": " << fa_last_error();
  EXPECT_NE(std::string(fa_last_error()).find(message_part), std::string::npos)
      << "message '" << fa_last_error() << "' lacks '" << message_part << "'";
}

TEST(CApi, ErrorsNameTheArgument) {
  const DenseCase p;
  using P = DenseCase;
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  const fa_options o = causal_options();

  fa_forward_args a = p.c_forward(out, lse);
  a.k.shape[3] = P::kHeadDim / 2;  // k viewed with the wrong head_dim
  expect_forward_error(a, o, FA_ERROR_INVALID_ARGUMENT, "k: head_dim");

  a = p.c_forward(out, lse);
  a.lse.dtype = FA_DTYPE_FLOAT64;
  expect_forward_error(a, o, FA_ERROR_INVALID_DTYPE, "lse: dtype float64");

  fa_options bad = o;
  bad.window_right = 3;  // conflicts with causal
  expect_forward_error(p.c_forward(out, lse), bad, FA_ERROR_INVALID_ARGUMENT, "window_right");

  // Nothing was written by any failed call.
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

TEST(CApi, OutOfRangeEnumsAreRejected) {
  const DenseCase p;
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  const fa_options o = causal_options();

  fa_forward_args a = p.c_forward(out, lse);
  a.v.dtype = 99;
  expect_forward_error(a, o, FA_ERROR_INVALID_DTYPE, "v: dtype 99");
  a.v.dtype = -1;
  expect_forward_error(a, o, FA_ERROR_INVALID_DTYPE, "v: dtype -1");

  a = p.c_forward(out, lse);
  a.k.device_type = 7;
  expect_forward_error(a, o, FA_ERROR_INVALID_ARGUMENT, "k: device_type 7");

  fa_options bad = o;
  const std::vector<float> slopes(DenseCase::kHeadsQ, 0.5f);
  bad.alibi_slopes = c_tensor(slopes, {DenseCase::kHeadsQ});
  bad.alibi_slopes.dtype = 9;
  expect_forward_error(p.c_forward(out, lse), bad, FA_ERROR_INVALID_DTYPE, "alibi_slopes: dtype 9");

  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

// A status other than the argument errors: CUDA tensors where no GPU can run them. (With a GPU
// present the host pointers below would really be handed to kernels, so the test steps aside.)
TEST(CApi, CudaTensorsWithoutGpuFail) {
  if (fa_cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  const DenseCase p;
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  fa_forward_args a = p.c_forward(out, lse);
  for (fa_tensor* t : {&a.q, &a.k, &a.v, &a.out, &a.lse}) t->device_type = FA_DEVICE_CUDA;
  const fa_options o = causal_options();
  const fa_status s = fa_forward(&a, &o, nullptr);
  // No kernels yet: unsupported; with kernels but no device: the runtime's failure.
  EXPECT_TRUE(s == FA_ERROR_UNSUPPORTED || s == FA_ERROR_BACKEND) << fa_status_string(s);
  EXPECT_NE(std::string(fa_last_error()).find("cuda"), std::string::npos) << fa_last_error();
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

TEST(CApi, NullArguments) {
  const DenseCase p;
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  const fa_forward_args a = p.c_forward(out, lse);
  const fa_backward_args b{};
  const fa_varlen vl{};
  const fa_options o = causal_options();
  size_t bytes = 0;
  auto expect_null = [](fa_status s, const char* name) {
    EXPECT_EQ(s, FA_ERROR_NULL_ARGUMENT) << name;
    EXPECT_EQ(std::string(fa_last_error()), std::string(name) + ": NULL pointer");
  };
  expect_null(fa_forward(nullptr, &o, nullptr), "args");
  expect_null(fa_forward(&a, nullptr, nullptr), "options");
  expect_null(fa_backward(nullptr, &o, nullptr), "args");
  expect_null(fa_backward(&b, nullptr, nullptr), "options");
  expect_null(fa_forward_varlen(&a, nullptr, &o, nullptr), "varlen");
  expect_null(fa_backward_varlen(nullptr, &vl, &o, nullptr), "args");
  expect_null(fa_forward_workspace_size(&a, &o, nullptr), "bytes");
  expect_null(fa_backward_workspace_size(nullptr, &o, &bytes), "args");
  expect_null(fa_forward_varlen_workspace_size(&a, nullptr, &o, &bytes), "varlen");
  expect_null(fa_backward_varlen_workspace_size(&b, &vl, nullptr, &bytes), "options");
  expect_null(fa_reference_forward(nullptr, &o), "args");
  expect_null(fa_reference_backward(&b, nullptr), "options");
  expect_null(fa_reference_forward_varlen(&a, nullptr, &o), "varlen");
  expect_null(fa_reference_backward_varlen(nullptr, &vl, &o), "args");
  for (float x : out) ASSERT_TRUE(std::isnan(x));
}

TEST(CApi, SuccessClearsLastError) {
  const DenseCase p;
  std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
  const fa_options o = causal_options();
  fa_forward_args a = p.c_forward(out, lse);
  a.k.shape[3] = 1;
  ASSERT_NE(fa_forward(&a, &o, nullptr), FA_OK);
  ASSERT_STRNE(fa_last_error(), "");
  a = p.c_forward(out, lse);
  ASSERT_EQ(fa_forward(&a, &o, nullptr), FA_OK) << fa_last_error();
  EXPECT_STREQ(fa_last_error(), "");
}

// Two threads fail differently at the same time; each must still read its own message, and the
// main thread's message survives both.
TEST(CApi, LastErrorIsThreadLocal) {
  const DenseCase p;
  const fa_options o = causal_options();
  ASSERT_EQ(fa_forward(nullptr, &o, nullptr), FA_ERROR_NULL_ARGUMENT);
  const std::string main_message = fa_last_error();

  std::barrier both_failed(2);
  std::string seen_before[2], seen_after[2];
  auto worker = [&](int id) {
    std::vector<float> out = nan_floats(p.q.size()), lse = nan_floats(p.lse_size());
    fa_forward_args a = p.c_forward(out, lse);
    seen_before[id] = fa_last_error();  // a new thread starts clean
    if (id == 0) {
      a.k.shape[3] = 1;
    } else {
      a.v.dtype = 42;
    }
    fa_forward(&a, &o, nullptr);
    both_failed.arrive_and_wait();
    seen_after[id] = fa_last_error();
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(seen_before[0], "");
  EXPECT_EQ(seen_before[1], "");
  EXPECT_NE(seen_after[0].find("k: head_dim"), std::string::npos) << seen_after[0];
  EXPECT_NE(seen_after[1].find("v: dtype 42"), std::string::npos) << seen_after[1];
  EXPECT_EQ(std::string(fa_last_error()), main_message);
}

TEST(CApi, StatusStringsAndVersion) {
  const fa_status all[] = {FA_OK,
                           FA_ERROR_INVALID_ARGUMENT,
                           FA_ERROR_INVALID_DTYPE,
                           FA_ERROR_UNSUPPORTED,
                           FA_ERROR_BACKEND,
                           FA_ERROR_OUT_OF_MEMORY,
                           FA_ERROR_INTERNAL,
                           FA_ERROR_NULL_ARGUMENT,
                           FA_ERROR_UNKNOWN};
  std::vector<std::string> names;
  for (fa_status s : all) {
    ASSERT_NE(fa_status_string(s), nullptr);
    for (const std::string& n : names) EXPECT_NE(n, fa_status_string(s));
    names.emplace_back(fa_status_string(s));
  }
  EXPECT_STREQ(fa_status_string(FA_OK), "ok");
  EXPECT_STREQ(fa_status_string(static_cast<fa_status>(15)), "unrecognised status");
  // Codes shared with the C++ API keep its numbering.
  EXPECT_EQ(FA_ERROR_INVALID_DTYPE, static_cast<int>(flashattn::ErrorCode::kInvalidDtype));
  EXPECT_EQ(FA_ERROR_INTERNAL, static_cast<int>(flashattn::ErrorCode::kInternal));
  EXPECT_STREQ(fa_version(), flashattn::version());
  EXPECT_EQ(fa_cuda_compiled(), flashattn::cuda_compiled());
  EXPECT_EQ(fa_cuda_device_count(), flashattn::cuda_device_count());
}

TEST(CApi, KernelListMatchesCpp) {
  const std::vector<std::string> kernels = flashattn::cuda_kernels();
  ASSERT_EQ(fa_cuda_kernel_count(), kernels.size());
  for (size_t i = 0; i < kernels.size(); ++i) EXPECT_STREQ(fa_cuda_kernel_name(i), kernels[i].c_str());
  EXPECT_EQ(fa_cuda_kernel_name(kernels.size()), nullptr);
  // A CUDA build lists its forward kernels; a CPU-only build has none.
  EXPECT_EQ(kernels.empty(), !flashattn::cuda_compiled());
  for (const std::string& k : kernels) EXPECT_EQ(k.rfind("sm80_fwd_", 0), 0u) << k;
}

}  // namespace

// The FA1-order teaching kernel (src/cuda/teaching, through its C entry point fa1_forward)
// against the fp64 CPU reference with the tolerance rule of docs/CONVENTIONS.md: fp16 / bf16,
// d64 / d128, causal or not, one key tile and several, q_groups 1 (FA1), 2, one query tile per
// CTA, and the control (0: O in registers). Outputs and the workspace are NaN-poisoned before
// every run; the round-trip runs must agree bitwise whatever the grouping (each query tile's
// steps are the same instructions on the same values). The argument errors need no GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "fa1_order.h"
#include "gpu_matrix.hpp"
#include "naive_attention.hpp"
#include "test_util.hpp"

namespace {

using fa_gpu_test::cuda_ok;
using fa_gpu_test::DeviceBuffer;
using flashattn::DType;

struct Tiles {
  int block_m = 0, block_n = 0;
};
Tiles tiles(int head_dim) {
  Tiles t;
  EXPECT_EQ(fa1_tile_sizes(head_dim, &t.block_m, &t.block_n), FA1_OK);
  return t;
}

// One (dtype, head_dim, causal, seqlen) problem, run with every q_groups setting.
void run_problem(DType dtype, int head_dim, bool causal, int seqlen) {
  const int batch = 2, heads = 3;
  fa_test::Case tc;
  tc.dtype = dtype;
  tc.batch = batch;
  tc.seqlen_q = tc.seqlen_k = seqlen;
  tc.heads_q = tc.heads_kv = heads;
  tc.head_dim = head_dim;
  tc.causal = causal;
  tc.backward = false;
  const std::string name = "fa1_order " + tc.name();
  SCOPED_TRACE(name);

  const std::vector<int64_t> shape = {batch, seqlen, heads, head_dim};
  const std::vector<int64_t> lse_shape = {batch, heads, seqlen};
  auto rng = fa_test::rng_for(name);
  fa_test::HostTensor q(dtype, shape), k(dtype, shape), v(dtype, shape), out(dtype, shape), ref(dtype, shape);
  fa_test::HostTensor lse(DType::kFloat32, lse_shape), lse_ref(DType::kFloat32, lse_shape);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  flashattn::AttentionOptions opts;
  opts.mask.causal = causal;
  flashattn::reference_forward({q.view(), k.view(), v.view(), ref.view(), lse_ref.view()}, opts);
  const fa_test::NaiveResult naive = fa_test::naive_attention(tc, fa_test::make_geometry(tc), q.to_vector(),
                                                              k.to_vector(), v.to_vector(), {}, {}, 0, 0);

  const size_t tensor_bytes = static_cast<size_t>(q.numel()) * flashattn::dtype_size(dtype);
  DeviceBuffer dq(tensor_bytes), dk(tensor_bytes), dv(tensor_bytes), dout(tensor_bytes);
  DeviceBuffer dlse(static_cast<size_t>(lse.numel()) * sizeof(float));
  DeviceBuffer workspace(fa1_workspace_bytes(batch, seqlen, heads, head_dim));
  dq.upload(q.data());
  dk.upload(k.data());
  dv.upload(v.data());
  const fa_gpu_test::DeviceStream stream(true);

  const int q_tiles = seqlen / tiles(head_dim).block_m;
  std::vector<std::byte> first_out, first_lse;  // q_groups = 1
  for (int q_groups : {1, 2, q_tiles, 0}) {
    if (q_groups > q_tiles) continue;
    SCOPED_TRACE("q_groups " + std::to_string(q_groups));
    dout.poison();
    dlse.poison();
    workspace.poison();  // no element may be read before the kernel wrote it
    cuda_ok(cudaDeviceSynchronize(), "poison");
    char error[256] = "unset";
    const int status =
        fa1_forward(dq.get(), dk.get(), dv.get(), dout.get(), static_cast<float*>(dlse.get()),
                    q_groups == 0 ? nullptr : workspace.get(), batch, seqlen, heads, head_dim,
                    dtype == DType::kFloat16 ? 0 : 1, causal ? 1 : 0, q_groups, stream.get(), error, sizeof(error));
    ASSERT_EQ(status, FA1_OK) << error;
    EXPECT_STREQ(error, "");
    cuda_ok(cudaStreamSynchronize(stream.get()), "fa1_forward");
    dout.download(out.data());
    dlse.download(lse.data());
    double err = 0, bound = 0;
    fa_test::expect_close("out", out.to_vector(), ref.to_vector(), naive.out, 2.0, dtype, name, &err, &bound);
    fa_test::expect_lse_close(lse.to_vector(), lse_ref.to_vector(), naive.lse, name, &err, &bound);
    std::vector<std::byte> out_bytes(tensor_bytes), lse_bytes(dlse.bytes());
    std::memcpy(out_bytes.data(), out.data(), out_bytes.size());
    std::memcpy(lse_bytes.data(), lse.data(), lse_bytes.size());
    if (q_groups == 1) {
      first_out = out_bytes;
      first_lse = lse_bytes;
    } else if (q_groups > 0) {
      EXPECT_TRUE(out_bytes == first_out) << "out differs bitwise from q_groups 1";
      EXPECT_TRUE(lse_bytes == first_lse) << "lse differs bitwise from q_groups 1";
    }
  }
}

TEST(Fa1Order, MatchesReference) {
  SKIP_WITHOUT_DEVICE();
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int head_dim : {64, 128}) {
      for (bool causal : {false, true}) {
        for (int seqlen : {128, 384}) {
          run_problem(dtype, head_dim, causal, seqlen);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// A longer sequence: 16 key tiles at d64, 32 at d128, so the state makes many round trips.
TEST(Fa1Order, LongSequence) {
  SKIP_WITHOUT_DEVICE();
  run_problem(DType::kBFloat16, 64, true, 2048);
  run_problem(DType::kFloat16, 128, false, 2048);
}

// Argument checks run before any CUDA call: no device needed. Each names the argument.
TEST(Fa1Order, ArgumentErrors) {
  alignas(16) static char buffer[64];
  void* p = buffer;
  struct Bad {
    const char* expect;
    int batch, seqlen, heads, head_dim, dtype, causal, q_groups;
    bool null_q = false, misaligned_out = false, null_workspace = false;
  };
  const Bad cases[] = {
      {"head_dim: 96 is not 64 or 128", 1, 128, 1, 96, 0, 0, 1},
      {"seqlen: 192 is not a multiple of the head_dim 64 tiles (64 query rows, 128 keys)", 1, 192, 1, 64, 0, 0, 1},
      {"seqlen: 100 is not a multiple", 1, 100, 1, 128, 0, 0, 1},
      {"dtype: 2 is not 0 (fp16) or 1 (bf16)", 1, 128, 1, 64, 2, 0, 1},
      {"causal: 3 is not 0 or 1", 1, 128, 1, 64, 0, 3, 1},
      {"q_groups: 3 > 2 query tiles (seqlen 128 / 64 rows)", 1, 128, 1, 64, 0, 0, 3},
      {"q_groups: -1 < 0", 1, 128, 1, 64, 0, 0, -1},
      {"batch: -1 < 0", -1, 128, 1, 64, 0, 0, 1},
      {"heads: 70000 > 65535 (grid limit)", 1, 128, 70000, 64, 0, 0, 1},
      {"q: NULL", 1, 128, 1, 64, 0, 0, 1, true},
      {"out: address not 16-byte aligned", 1, 128, 1, 64, 0, 0, 1, false, true},
      {"workspace: NULL", 1, 128, 1, 64, 0, 0, 1, false, false, true},
  };
  for (const Bad& c : cases) {
    char error[256] = "";
    const int status = fa1_forward(c.null_q ? nullptr : p, p, p, c.misaligned_out ? buffer + 2 : p, nullptr,
                                   c.null_workspace ? nullptr : p, c.batch, c.seqlen, c.heads, c.head_dim, c.dtype,
                                   c.causal, c.q_groups, nullptr, error, sizeof(error));
    EXPECT_EQ(status, FA1_INVALID_ARGUMENT) << c.expect;
    EXPECT_EQ(std::string(error).rfind(c.expect, 0), 0u) << "got: " << error;
  }
  // Nothing to do is not an error (and reads no pointer); a short error buffer is cut, not overrun.
  EXPECT_EQ(
      fa1_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 128, 1, 64, 0, 0, 1, nullptr, nullptr, 0),
      FA1_OK);
  char tiny[8];
  EXPECT_EQ(fa1_forward(p, p, p, p, nullptr, p, 1, 128, 1, 96, 0, 0, 1, nullptr, tiny, sizeof(tiny)),
            FA1_INVALID_ARGUMENT);
  EXPECT_STREQ(tiny, "head_di");
  int block_m = 0, block_n = 0;
  EXPECT_EQ(fa1_tile_sizes(32, &block_m, &block_n), FA1_INVALID_ARGUMENT);
  EXPECT_EQ(fa1_workspace_bytes(2, 128, 3, 64), size_t{2} * 3 * 128 * (64 + 2) * 4);
}

}  // namespace

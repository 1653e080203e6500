// Huge shapes on the GPU (GUIDE.md section 5): byte offsets far past 2^31 and grids of thousands
// of batch entries. The whole forward runs on the device; every output element must be written
// and finite, and sampled (batch, head) slices -- the first, the last, one in between -- must
// match the fp64 reference computed on just those slices (tolerance rule against the naive
// attention of the same slice).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "core/half.hpp"
#include "device_buffer.hpp"
#include "gpu_case.hpp"
#include "naive_attention.hpp"
#include "test_util.hpp"

namespace {

using fa_gpu_test::cuda_ok;
using fa_gpu_test::DeviceBuffer;
using flashattn::DType;
using flashattn::TensorView;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint16_t to_bits(DType dtype, float x) {
  return dtype == DType::kBFloat16 ? flashattn::core::float_to_bf16(x) : flashattn::core::float_to_fp16(x);
}
double from_bits(DType dtype, uint16_t b) {
  return dtype == DType::kBFloat16 ? flashattn::core::bf16_to_float(b) : flashattn::core::fp16_to_float(b);
}

// n values uniform in [-1.5, 1.5) (variance 0.75): a hash of (seed, index), so generation is
// parallel and any slice can be regenerated.
std::vector<uint16_t> random_values(DType dtype, int64_t n, uint64_t seed) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = splitmix64(seed ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull));
    v[static_cast<size_t>(i)] = to_bits(dtype, static_cast<float>((r >> 40) * 0x1p-24 * 3.0 - 1.5));
  }
  return v;
}

// Forward on a contiguous [b, s, h, d] problem; checks as in the header comment. Returns the host
// copy of the output for extra checks.
std::vector<uint16_t> run_huge(DType dtype, int64_t b, int64_t s, int64_t h, int64_t d, bool causal,
                               const std::vector<std::pair<int64_t, int64_t>>& samples,
                               std::vector<uint16_t>* v_host = nullptr) {
  const int64_t n = b * s * h * d;
  const uint64_t seed = fa_test::rng_for("huge " + std::to_string(b) + "x" + std::to_string(s))();
  const std::vector<uint16_t> q = random_values(dtype, n, seed), k = random_values(dtype, n, seed + 1),
                              v = random_values(dtype, n, seed + 2);
  const size_t bytes = static_cast<size_t>(n) * 2;
  DeviceBuffer dq(bytes), dk(bytes), dv(bytes), dout(bytes), dlse(static_cast<size_t>(b * h * s) * 4);
  dq.upload(q.data());
  dk.upload(k.data());
  dv.upload(v.data());
  dout.poison();
  dlse.poison();
  const flashattn::Device dev{flashattn::DeviceType::kCUDA, 0};
  auto view = [&](const DeviceBuffer& buf) { return TensorView::contiguous(buf.get(), dtype, {b, s, h, d}, dev); };
  flashattn::AttentionOptions opts;
  opts.mask.causal = causal;
  flashattn::forward({view(dq), view(dk), view(dv), view(dout),
                      TensorView::contiguous(dlse.get(), DType::kFloat32, {b, h, s}, dev)},
                     opts);
  cuda_ok(cudaDeviceSynchronize(), "forward");
  std::vector<uint16_t> out(static_cast<size_t>(n));
  std::vector<float> lse(static_cast<size_t>(b * h * s));
  dout.download(out.data());
  dlse.download(lse.data());

  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad)
  for (int64_t i = 0; i < n; ++i) bad += !std::isfinite(from_bits(dtype, out[static_cast<size_t>(i)]));
  EXPECT_EQ(bad, 0) << "output elements not written or not finite";
  int64_t bad_lse = 0;
  for (float x : lse) bad_lse += !std::isfinite(x);
  EXPECT_EQ(bad_lse, 0) << "LSE entries not written or not finite";

  for (const auto& [bb, hh] : samples) {
    SCOPED_TRACE("batch " + std::to_string(bb) + " head " + std::to_string(hh));
    fa_test::Case c;
    c.dtype = dtype;
    c.batch = 1;
    c.seqlen_q = c.seqlen_k = s;
    c.heads_q = c.heads_kv = 1;
    c.head_dim = d;
    c.causal = causal;
    c.backward = false;
    auto slice = [&](const std::vector<uint16_t>& t) {  // [s, d] of (bb, hh), as doubles
      std::vector<double> x(static_cast<size_t>(s * d));
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t e = 0; e < d; ++e) {
          x[static_cast<size_t>(i * d + e)] = from_bits(dtype, t[static_cast<size_t>(((bb * s + i) * h + hh) * d + e)]);
        }
      }
      return x;
    };
    const std::vector<double> qs = slice(q), ks = slice(k), vs = slice(v), got = slice(out);
    std::vector<double> got_lse(static_cast<size_t>(s));
    for (int64_t i = 0; i < s; ++i) got_lse[static_cast<size_t>(i)] = lse[static_cast<size_t>((bb * h + hh) * s + i)];

    // fp64 reference on host views of the slice (strided into the big host buffers).
    auto host_view = [&](const std::vector<uint16_t>& t) {
      return TensorView::strided(const_cast<uint16_t*>(t.data()) + (bb * s * h + hh) * d, dtype, {1, s, 1, d},
                                 {s * h * d, h * d, d, 1});
    };
    fa_test::HostTensor out_ref(dtype, {1, s, 1, d}), lse_ref(DType::kFloat32, {1, 1, s});
    flashattn::reference_forward({host_view(q), host_view(k), host_view(v), out_ref.view(), lse_ref.view()},
                                 opts);
    const fa_test::Geometry g = fa_test::make_geometry(c);
    const fa_test::NaiveResult naive = fa_test::naive_attention(c, g, qs, ks, vs, {}, {}, 0, 0);
    double err = 0, bound = 0;
    fa_test::expect_close("out", got, out_ref.to_vector(), naive.out, 2.0, dtype, c.name(), &err, &bound);
    fa_test::expect_close("lse", got_lse, lse_ref.to_vector(), naive.lse, 2.0, DType::kFloat32, c.name(), &err,
                          &bound);
  }
  if (v_host) *v_host = v;
  return out;
}

#define SKIP_WITHOUT_DEVICE() \
  if (!fa_gpu_test::have_device()) GTEST_SKIP() << "no CUDA device visible"

// [1600, 729, 16, 72] bf16: 2.7 GB per tensor, element offsets up to 1.3e9 and byte offsets up
// to 2.7e9, past what 32-bit byte arithmetic can hold.
TEST(GpuHuge, Forward1600x729x16x72) {
  SKIP_WITHOUT_DEVICE();
  run_huge(DType::kBFloat16, 1600, 729, 16, 72, false, {{0, 0}, {917, 9}, {1599, 15}});
}

// 8300 batch entries of one token: a grid of 8300 in z; every row sees one key, so O = V exactly.
TEST(GpuHuge, Forward8300Batches) {
  SKIP_WITHOUT_DEVICE();
  std::vector<uint16_t> v;
  const std::vector<uint16_t> out = run_huge(DType::kFloat16, 8300, 1, 16, 128, true, {{0, 0}, {8299, 15}}, &v);
  EXPECT_TRUE(out == v) << "with one key per row the output must equal V bitwise";
}

}  // namespace

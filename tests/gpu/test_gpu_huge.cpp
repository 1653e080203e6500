// Huge shapes on the GPU (docs/CONVENTIONS.md's test matrix): byte offsets far past 2^31 and grids
// of thousands of batch entries, forward and backward. The whole problem runs on the device; every
// output element must be written and finite, and sampled (batch, head) slices -- the first, the
// last, one in between -- must match the fp64 reference computed on just those slices (tolerance
// rule against the naive attention of the same slice; heads_q == heads_kv, so a slice's dk and dv
// depend on that slice alone).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/half.hpp"
#include "device_buffer.hpp"
#include "gpu_case.hpp"
#include "gpu_matrix.hpp"
#include "naive_attention.hpp"
#include "test_util.hpp"

namespace {

using fa_gpu_test::cuda_ok;
using fa_gpu_test::DeviceBuffer;
using flashattn::DType;
using flashattn::TensorView;

using Samples = std::vector<std::pair<int64_t, int64_t>>;  // (batch, head)

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

int64_t count_not_finite(DType dtype, const std::vector<uint16_t>& t) {
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad)
  for (size_t i = 0; i < t.size(); ++i) bad += !std::isfinite(from_bits(dtype, t[i]));
  return bad;
}

double max_abs(DType dtype, const std::vector<uint16_t>& t) {
  double m = 0;
#pragma omp parallel for reduction(max : m)
  for (size_t i = 0; i < t.size(); ++i) m = std::max(m, std::abs(from_bits(dtype, t[i])));
  return m;
}

// A contiguous [b, s, h, d] problem (h query and kv heads) with host copies of every tensor and
// the device buffers the calls use; outputs are poisoned before the calls.
struct HugeProblem {
  DType dtype;
  int64_t b, s, h, d;
  flashattn::AttentionOptions opts;
  std::vector<uint16_t> q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  DeviceBuffer q_dev, k_dev, v_dev, out_dev, lse_dev;

  HugeProblem(DType dt, int64_t b_, int64_t s_, int64_t h_, int64_t d_, bool causal)
      : dtype(dt), b(b_), s(s_), h(h_), d(d_) {
    opts.mask.causal = causal;
    const uint64_t seed = fa_test::rng_for("huge " + std::to_string(b) + "x" + std::to_string(s))();
    q = random_values(dtype, numel(), seed);
    k = random_values(dtype, numel(), seed + 1);
    v = random_values(dtype, numel(), seed + 2);
    q_dev = upload(q);
    k_dev = upload(k);
    v_dev = upload(v);
  }

  int64_t numel() const { return b * s * h * d; }
  size_t bytes() const { return static_cast<size_t>(numel()) * 2; }
  TensorView device_view(const DeviceBuffer& buf) const {
    return TensorView::contiguous(buf.get(), dtype, {b, s, h, d}, {flashattn::DeviceType::kCUDA, 0});
  }
  TensorView lse_view() const {
    return TensorView::contiguous(lse_dev.get(), DType::kFloat32, {b, h, s}, {flashattn::DeviceType::kCUDA, 0});
  }
  DeviceBuffer upload(const std::vector<uint16_t>& host) const {
    DeviceBuffer buf(bytes());
    buf.upload(host.data());
    return buf;
  }
  std::vector<uint16_t> download(const DeviceBuffer& buf) const {
    std::vector<uint16_t> host(static_cast<size_t>(numel()));
    buf.download(host.data());
    return host;
  }

  // The forward on the device; out and lse downloaded and checked for unwritten or non-finite
  // elements. out and lse stay on the device for the backward.
  void forward() {
    out_dev = DeviceBuffer(bytes());
    lse_dev = DeviceBuffer(static_cast<size_t>(b * h * s) * sizeof(float));
    out_dev.poison();
    lse_dev.poison();
    flashattn::forward({device_view(q_dev), device_view(k_dev), device_view(v_dev), device_view(out_dev), lse_view()},
                       opts);
    cuda_ok(cudaDeviceSynchronize(), "forward");
    out = download(out_dev);
    lse.resize(static_cast<size_t>(b * h * s));
    lse_dev.download(lse.data());
    EXPECT_EQ(count_not_finite(dtype, out), 0) << "output elements not written or not finite";
    int64_t bad_lse = 0;
    for (float x : lse) bad_lse += !std::isfinite(x);
    EXPECT_EQ(bad_lse, 0) << "LSE entries not written or not finite";
  }

  // The backward on the forward's out and lse with a random dout and the workspace the query asks
  // for; dq, dk, dv downloaded and checked for unwritten or non-finite elements.
  void backward() {
    dout = random_values(dtype, numel(), fa_test::rng_for("huge dout")());
    const DeviceBuffer dout_dev = upload(dout);
    DeviceBuffer dq_dev(bytes()), dk_dev(bytes()), dv_dev(bytes());
    for (DeviceBuffer* x : {&dq_dev, &dk_dev, &dv_dev}) x->poison();
    const flashattn::BackwardArgs args{device_view(dout_dev), device_view(q_dev),   device_view(k_dev),
                                       device_view(v_dev),    device_view(out_dev), lse_view(),
                                       device_view(dq_dev),   device_view(dk_dev),  device_view(dv_dev)};
    DeviceBuffer workspace(flashattn::backward_workspace_size(args, opts));
    workspace.poison();
    flashattn::RunContext ctx;
    ctx.workspace = workspace.get();
    ctx.workspace_bytes = workspace.bytes();
    flashattn::backward(args, opts, ctx);
    cuda_ok(cudaDeviceSynchronize(), "backward");
    dq = download(dq_dev);
    dk = download(dk_dev);
    dv = download(dv_dev);
    EXPECT_EQ(count_not_finite(dtype, dq), 0) << "dq elements not written or not finite";
    EXPECT_EQ(count_not_finite(dtype, dk), 0) << "dk elements not written or not finite";
    EXPECT_EQ(count_not_finite(dtype, dv), 0) << "dv elements not written or not finite";
  }

  // [s, d] of (bb, hh) of a host tensor, as doubles.
  std::vector<double> slice(const std::vector<uint16_t>& t, int64_t bb, int64_t hh) const {
    std::vector<double> x(static_cast<size_t>(s * d));
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t e = 0; e < d; ++e) {
        const int64_t at = ((bb * s + i) * h + hh) * d + e;
        x[static_cast<size_t>(i * d + e)] = from_bits(dtype, t[static_cast<size_t>(at)]);
      }
    }
    return x;
  }
  // A [1, s, 1, d] host view of (bb, hh), strided into the big host tensor (for the reference).
  TensorView host_view(const std::vector<uint16_t>& t, int64_t bb, int64_t hh) const {
    return TensorView::strided(const_cast<uint16_t*>(t.data()) + (bb * s * h + hh) * d, dtype, {1, s, 1, d},
                               {s * h * d, h * d, d, 1});
  }

  // The sampled slices against the fp64 reference: out and lse, and the gradients when the
  // backward ran.
  void check_samples(const Samples& samples) const {
    const bool backward = !dq.empty();
    for (const auto& [bb, hh] : samples) {
      SCOPED_TRACE("batch " + std::to_string(bb) + " head " + std::to_string(hh));
      fa_test::Case c;
      c.dtype = dtype;
      c.batch = 1;
      c.seqlen_q = c.seqlen_k = s;
      c.heads_q = c.heads_kv = 1;
      c.head_dim = d;
      c.causal = opts.mask.causal;
      c.backward = backward;
      std::vector<double> got_lse(static_cast<size_t>(s));
      for (int64_t i = 0; i < s; ++i) {
        got_lse[static_cast<size_t>(i)] = lse[static_cast<size_t>((bb * h + hh) * s + i)];
      }

      fa_test::HostTensor out_ref(dtype, {1, s, 1, d}), lse_ref(DType::kFloat32, {1, 1, s});
      fa_test::HostTensor dq_ref(dtype, {1, s, 1, d}), dk_ref(dtype, {1, s, 1, d}), dv_ref(dtype, {1, s, 1, d});
      flashattn::reference_forward(
          {host_view(q, bb, hh), host_view(k, bb, hh), host_view(v, bb, hh), out_ref.view(), lse_ref.view()}, opts);
      if (backward) {
        flashattn::reference_backward(
            {host_view(dout, bb, hh), host_view(q, bb, hh), host_view(k, bb, hh), host_view(v, bb, hh), out_ref.view(),
             lse_ref.view(), dq_ref.view(), dk_ref.view(), dv_ref.view()},
            opts);
      }
      const fa_test::NaiveResult naive =
          fa_test::naive_attention(c, fa_test::make_geometry(c), slice(q, bb, hh), slice(k, bb, hh), slice(v, bb, hh),
                                   backward ? slice(dout, bb, hh) : std::vector<double>{}, {}, 0, 0);
      double err = 0, bound = 0;
      fa_test::expect_close("out", slice(out, bb, hh), out_ref.to_vector(), naive.out, 2.0, dtype, c.name(), &err,
                            &bound);
      fa_test::expect_lse_close(got_lse, lse_ref.to_vector(), naive.lse, c.name(), &err, &bound);
      if (backward) {
        fa_test::expect_grads_close({slice(dq, bb, hh), slice(dk, bb, hh), slice(dv, bb, hh)},
                                    {dq_ref.to_vector(), dk_ref.to_vector(), dv_ref.to_vector()}, naive, dtype,
                                    c.name(), &err, &bound);
      }
    }
  }
};

// Equal as numbers (+0 == -0), element by element.
bool values_equal(DType dtype, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  int64_t differ = 0;
#pragma omp parallel for reduction(+ : differ)
  for (size_t i = 0; i < a.size(); ++i) differ += from_bits(dtype, a[i]) != from_bits(dtype, b[i]);
  return a.size() == b.size() && differ == 0;
}

// [1600, 729, 16, 72] bf16: 2.7 GB per tensor, element offsets up to 1.3e9 and byte offsets up
// to 2.7e9, past what 32-bit byte arithmetic can hold.
TEST(GpuHuge, Forward1600x729x16x72) {
  SKIP_WITHOUT_DEVICE();
  HugeProblem p(DType::kBFloat16, 1600, 729, 16, 72, false);
  p.forward();
  p.check_samples({{0, 0}, {917, 9}, {1599, 15}});
}

// 8300 batch entries of one token: a grid of 8300 in z; every row sees one key, so O = V exactly.
TEST(GpuHuge, Forward8300Batches) {
  SKIP_WITHOUT_DEVICE();
  HugeProblem p(DType::kFloat16, 8300, 1, 16, 128, true);
  p.forward();
  p.check_samples({{0, 0}, {8299, 15}});
  EXPECT_TRUE(p.out == p.v) << "with one key per row the output must equal V bitwise";
}

// The test matrix's [1600, 16, 729, 72] backward (bf16, causal): eight 2.7 GB tensors and the
// workspace, about 30 GB of device memory; fp32 dQ sums of every query element take over 5 GB,
// so their byte offsets pass 2^32.
TEST(GpuHuge, Backward1600x729x16x72) {
  SKIP_WITHOUT_DEVICE();
  HugeProblem p(DType::kBFloat16, 1600, 729, 16, 72, true);
  p.forward();
  p.backward();
  p.check_samples({{0, 0}, {917, 9}, {1599, 15}});
}

// The test matrix's b=8300 s=1 h=16 d=128 backward: with one key per row P = 1, so dV = dO
// exactly and dQ = dK = 0 up to the rounding of dP - D (two fp32 sums of the same products).
// On the backward as dispatched (on Hopper the sm90a kernel: a grid of 8300 in z) and on sm80.
TEST(GpuHuge, Backward8300Batches) {
  SKIP_WITHOUT_DEVICE();
  for (const char* sm90_backward : {"1", "0"}) {
    SCOPED_TRACE(std::string("FLASHATTN_SM90_BACKWARD=") + sm90_backward);
    const fa_gpu_test::ScopedEnv family("FLASHATTN_SM90_BACKWARD", sm90_backward);
    HugeProblem p(DType::kFloat16, 8300, 1, 16, 128, false);
    p.forward();
    p.backward();
    p.check_samples({{0, 0}, {4150, 7}, {8299, 15}});
    EXPECT_TRUE(values_equal(p.dtype, p.dv, p.dout)) << "with one key per row dv must equal dout";
    // Everywhere, not only in the samples: the rounding noise of dP - D is ~1e-6 here.
    const double bound = 0x1p-10 * max_abs(p.dtype, p.dout);
    EXPECT_LE(max_abs(p.dtype, p.dq), bound) << "dq of one-key rows";
    EXPECT_LE(max_abs(p.dtype, p.dk), bound) << "dk of one-key rows";
  }
}

// [1600, 729, 16, 128] bf16, causal, deterministic and not: the d128 backward (on Hopper the
// sm90a kernel, its TMA loads and stores and the dQ sums' bulk reduce-adds) with tensors of
// 4.8 GB and fp32 dQ sums of 10 GB, byte offsets far past 2^32; about 50 GB of device memory.
TEST(GpuHuge, Backward1600x729x16x128) {
  SKIP_WITHOUT_DEVICE();
  for (bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "default");
    HugeProblem p(DType::kBFloat16, 1600, 729, 16, 128, true);
    p.opts.deterministic = deterministic;
    p.forward();
    p.backward();
    p.check_samples({{0, 0}, {917, 9}, {1599, 15}});
  }
}

}  // namespace

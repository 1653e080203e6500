#include "gpu_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <vector>

#include "core/half.hpp"
#include "core/mask.hpp"
#include "core/score.hpp"
#include "device_buffer.hpp"
#include "test_util.hpp"

namespace fa_gpu_test {

using flashattn::DType;
using flashattn::TensorView;

std::string GpuCase::name() const {
  std::ostringstream os;
  os << "cuda " << flashattn::dtype_name(dtype) << " b" << batch << " sq" << seqlen_q << " sk" << seqlen_k
     << " h" << heads_q << "/" << heads_kv << " d" << head_dim;
  if (causal) os << " causal";
  if (window_left >= 0 || window_right >= 0) os << " window(" << window_left << "," << window_right << ")";
  if (softcap > 0) os << " softcap" << softcap;
  if (alibi) os << " alibi";
  if (layout == Layout::kStrided) os << " strided";
  if (layout == Layout::kPacked) os << " packed-qkv";
  if (input_scale != 1.0) os << " x" << input_scale;
  if (own_stream) os << " stream";
  return os.str();
}

bool have_device() { return flashattn::cuda_compiled() && flashattn::cuda_device_count() > 0; }

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Host storage and its device copy, shared by the views into it.
struct Storage {
  DType dtype;
  int64_t elems;
  fa_test::HostTensor host;  // 1-D, zero-initialised
  DeviceBuffer device;

  Storage(DType dt, int64_t n)
      : dtype(dt), elems(n), host(dt, {std::max<int64_t>(n, 1)}),
        device(static_cast<size_t>(n) * flashattn::dtype_size(dt)) {}
  std::byte* bytes() const { return static_cast<std::byte*>(host.data()); }
  size_t size_bytes() const { return device.bytes(); }
};

// A 4-D (or 3-D for lse) strided view into a Storage.
struct View {
  std::shared_ptr<Storage> storage;
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;  // elements

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  int64_t element_offset(int64_t linear) const {
    int64_t off = offset;
    for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
      off += (linear % shape[i]) * strides[i];
      linear /= shape[i];
    }
    return off;
  }
  TensorView make(void* base, flashattn::Device device) const {
    TensorView t;
    t.data = static_cast<std::byte*>(base) + offset * static_cast<int64_t>(flashattn::dtype_size(storage->dtype));
    t.dtype = storage->dtype;
    t.device = device;
    t.ndim = static_cast<int>(shape.size());
    for (int i = 0; i < t.ndim; ++i) {
      t.shape[i] = shape[i];
      t.strides[i] = strides[i];
    }
    return t;
  }
  TensorView on_host() const { return make(storage->host.data(), {}); }
  TensorView on_device() const {
    return make(storage->device.get(), {flashattn::DeviceType::kCUDA, 0});
  }
  // Element `linear` (row-major over shape) through the storage's 1-D host tensor.
  double get(int64_t linear) const { return storage->host.get(element_offset(linear)); }
  void set(int64_t linear, double x) { storage->host.set(element_offset(linear), x); }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[static_cast<size_t>(i)] = get(i);
    return v;
  }
};

std::vector<int64_t> row_major(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * shape[i + 1];
  return st;
}

// [b, s, h, d] with gaps: head stride d + 8, row stride (h + 1) * (d + 8), batch stride
// (s + 2) * row stride (all multiples of 8 elements when d is).
View strided_view(DType dtype, int64_t b, int64_t s, int64_t h, int64_t d) {
  const int64_t hs = d + 8, rs = (h + 1) * hs, bs = (s + 2) * rs;
  View v{std::make_shared<Storage>(dtype, b * bs), {b, s, h, d}, {bs, rs, hs, 1}, 0};
  return v;
}

View contiguous_view(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  return View{std::make_shared<Storage>(dtype, n), shape, row_major(shape), 0};
}

// Naive attention in the tested dtype's precision: fp32 accumulation, P rounded to the dtype
// before P V (as a tensor-core GEMM sees it), output rounded. Inputs row-major [b, s, h, d].
struct Naive {
  std::vector<double> out, lse;
};

Naive naive_forward(const GpuCase& c, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& slopes) {
  const int64_t sq = c.seqlen_q, sk = c.seqlen_k, hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  const int64_t group = hq / hkv;
  Naive n;
  n.out.assign(q.size(), 0.0);
  n.lse.assign(static_cast<size_t>(c.batch * hq * sq), kNegInf);
  const flashattn::core::Mask mask{sq, sk, c.window_left, c.causal ? 0 : c.window_right};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t rows = c.batch * hq * sq;
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t b = t / (hq * sq), h = t / sq % hq, i = t % sq, hk = h / group;
    auto qi = [&](int64_t x) { return q[static_cast<size_t>(((b * sq + i) * hq + h) * d + x)]; };
    auto kj = [&](const std::vector<double>& kv, int64_t j, int64_t x) {
      return kv[static_cast<size_t>(((b * sk + j) * hkv + hk) * d + x)];
    };
    std::vector<float> s(static_cast<size_t>(sk), -std::numeric_limits<float>::infinity());
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < sk; ++j) {
      if (!mask.visible(i, j)) continue;
      float dot = 0;
      for (int64_t x = 0; x < d; ++x) dot += static_cast<float>(qi(x)) * static_cast<float>(kj(k, j, x));
      float sv = scale * dot;
      if (c.softcap > 0) sv = c.softcap * std::tanh(sv / c.softcap);
      if (c.alibi) sv += static_cast<float>(flashattn::core::alibi_bias(slopes[static_cast<size_t>(h)], i, j, sq, sk));
      s[static_cast<size_t>(j)] = sv;
      mx = std::max(mx, sv);
    }
    if (mx == -std::numeric_limits<float>::infinity()) continue;  // empty row: out 0, lse -inf
    float sum = 0;
    for (int64_t j = 0; j < sk; ++j) sum += std::exp(s[static_cast<size_t>(j)] - mx);
    n.lse[static_cast<size_t>((b * hq + h) * sq + i)] = mx + std::log(sum);
    std::vector<float> o(static_cast<size_t>(d), 0.0f);
    for (int64_t j = 0; j < sk; ++j) {
      const float p = static_cast<float>(fa_test::round_to(c.dtype, std::exp(s[static_cast<size_t>(j)] - mx) / sum));
      if (p == 0.0f) continue;
      for (int64_t x = 0; x < d; ++x) o[static_cast<size_t>(x)] += p * static_cast<float>(kj(v, j, x));
    }
    for (int64_t x = 0; x < d; ++x) {
      n.out[static_cast<size_t>(((b * sq + i) * hq + h) * d + x)] = fa_test::round_to(c.dtype, o[static_cast<size_t>(x)]);
    }
  }
  return n;
}

double max_finite_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) {
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  }
  return m;
}

// The tolerance rule, as tests/cpp/attention_case.cpp applies it: max and mean error within
// 2x the naive same-dtype error plus fp32 noise (and one output ulp for 16-bit outputs).
void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                  const std::vector<double>& naive, DType dtype, const std::string& name) {
  const fa_test::ErrorStats ours = fa_test::compare(got, ref), base = fa_test::compare(naive, ref);
  const double scale = max_finite_abs(ref);
  const double out_ulp = dtype == DType::kFloat16 ? 0x1p-10 : dtype == DType::kBFloat16 ? 0x1p-7 : 0.0;
  const double atol = (64 * 0x1p-23 + out_ulp) * std::max(scale, 1e-3);
  EXPECT_FALSE(ours.has_nan) << what << ": NaN mismatch in " << name;
  EXPECT_FALSE(base.has_nan) << what << ": naive NaN mismatch in " << name;
  EXPECT_LE(ours.max_abs, 2 * base.max_abs + atol)
      << what << " max error, naive " << base.max_abs << " atol " << atol << " in " << name;
  EXPECT_LE(ours.mean_abs, 2 * base.mean_abs + atol)
      << what << " mean error, naive " << base.mean_abs << " in " << name;
}

// Bytes of `storage` that no element of the views covers must still hold the 0xFF poison.
void expect_gaps_untouched(const Storage& storage, const std::vector<const View*>& views,
                           const std::string& name) {
  const size_t elem = flashattn::dtype_size(storage.dtype);
  std::vector<char> covered(static_cast<size_t>(storage.elems), 0);
  for (const View* v : views) {
    for (int64_t i = 0; i < v->numel(); ++i) covered[static_cast<size_t>(v->element_offset(i))] = 1;
  }
  int64_t written = 0;
  for (int64_t e = 0; e < storage.elems; ++e) {
    if (covered[static_cast<size_t>(e)]) continue;
    const std::byte* p = storage.bytes() + e * static_cast<int64_t>(elem);
    for (size_t k = 0; k < elem; ++k) written += p[k] != std::byte{0xFF};
  }
  EXPECT_EQ(written, 0) << "bytes outside the output view were written in " << name;
}

}  // namespace

void run_gpu_case(const GpuCase& c) {
  SCOPED_TRACE(c.name());
  const int64_t b = c.batch, sq = c.seqlen_q, sk = c.seqlen_k, hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  auto rng = fa_test::rng_for(c.name());

  View q, k, v, out;
  if (c.layout == Layout::kPacked) {
    ASSERT_EQ(sq, sk) << "packed qkv needs seqlen_q == seqlen_k";
    const int64_t heads = hq + 2 * hkv;
    const View qkv = contiguous_view(c.dtype, {b, sq, heads, d});
    q = View{qkv.storage, {b, sq, hq, d}, qkv.strides, 0};
    k = View{qkv.storage, {b, sk, hkv, d}, qkv.strides, hq * d};
    v = View{qkv.storage, {b, sk, hkv, d}, qkv.strides, (hq + hkv) * d};
    out = strided_view(c.dtype, b, sq, hq, d);
  } else if (c.layout == Layout::kStrided) {
    q = strided_view(c.dtype, b, sq, hq, d);
    k = strided_view(c.dtype, b, sk, hkv, d);
    v = strided_view(c.dtype, b, sk, hkv, d);
    out = strided_view(c.dtype, b, sq, hq, d);
  } else {
    q = contiguous_view(c.dtype, {b, sq, hq, d});
    k = contiguous_view(c.dtype, {b, sk, hkv, d});
    v = contiguous_view(c.dtype, {b, sk, hkv, d});
    out = contiguous_view(c.dtype, {b, sq, hq, d});
  }
  View lse = contiguous_view(DType::kFloat32, {b, hq, sq});
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t i = 0; i < q.numel(); ++i) q.set(i, c.input_scale * normal(rng));
  for (int64_t i = 0; i < k.numel(); ++i) k.set(i, c.input_scale * normal(rng));
  for (int64_t i = 0; i < v.numel(); ++i) v.set(i, normal(rng));
  std::vector<double> slopes;
  View alibi;
  if (c.alibi) {
    alibi = contiguous_view(DType::kFloat32, {hq});
    std::uniform_real_distribution<double> u(0.0, 0.3);
    for (int64_t h = 0; h < hq; ++h) alibi.set(h, u(rng));
    slopes = alibi.values();
    alibi.storage->device.upload(alibi.storage->host.data());
  }
  q.storage->device.upload(q.storage->host.data());  // packed: uploads k and v too
  if (k.storage != q.storage) {
    k.storage->device.upload(k.storage->host.data());
    v.storage->device.upload(v.storage->host.data());
  }

  flashattn::AttentionOptions opts;
  opts.mask.causal = c.causal;
  opts.mask.window_left = c.window_left;
  opts.mask.window_right = c.window_right;
  opts.score.softcap = c.softcap;

  // Reference on the host copies.
  View out_ref = contiguous_view(c.dtype, {b, sq, hq, d});
  View lse_ref = contiguous_view(DType::kFloat32, {b, hq, sq});
  if (c.alibi) opts.score.alibi_slopes = alibi.on_host();
  flashattn::reference_forward({q.on_host(), k.on_host(), v.on_host(), out_ref.on_host(), lse_ref.on_host()}, opts);
  const Naive naive = naive_forward(c, q.values(), k.values(), v.values(), slopes);

  // Two device runs, outputs poisoned before each; the second must match the first bitwise.
  if (c.alibi) opts.score.alibi_slopes = alibi.on_device();
  cudaStream_t stream = nullptr;
  if (c.own_stream) cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<std::byte> first_out, first_lse;
  for (int run = 0; run < 2; ++run) {
    out.storage->device.poison();
    lse.storage->device.poison();
    cuda_ok(cudaDeviceSynchronize(), "poison");
    flashattn::RunContext ctx;
    ctx.stream = stream;
    flashattn::forward({q.on_device(), k.on_device(), v.on_device(), out.on_device(), lse.on_device()}, opts, ctx);
    cuda_ok(cudaStreamSynchronize(stream), "forward kernel");
    cuda_ok(cudaGetLastError(), "forward kernel");
    out.storage->device.download(out.storage->host.data());
    lse.storage->device.download(lse.storage->host.data());
    const std::byte* ob = out.storage->bytes();
    const std::byte* lb = lse.storage->bytes();
    if (run == 0) {
      first_out.assign(ob, ob + out.storage->size_bytes());
      first_lse.assign(lb, lb + lse.storage->size_bytes());
    } else {
      EXPECT_TRUE(std::memcmp(first_out.data(), ob, first_out.size()) == 0) << "out differs between runs";
      EXPECT_TRUE(std::memcmp(first_lse.data(), lb, first_lse.size()) == 0) << "lse differs between runs";
    }
  }
  if (stream) cuda_ok(cudaStreamDestroy(stream), "cudaStreamDestroy");

  const std::string name = c.name();
  expect_close("out", out.values(), out_ref.values(), naive.out, c.dtype, name);
  expect_close("lse", lse.values(), lse_ref.values(), naive.lse, DType::kFloat32, name);
  if (c.layout != Layout::kContiguous) expect_gaps_untouched(*out.storage, {&out}, name);
}

}  // namespace fa_gpu_test

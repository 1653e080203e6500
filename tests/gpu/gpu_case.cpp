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
#include "device_buffer.hpp"
#include "test_util.hpp"

namespace fa_gpu_test {

using flashattn::DType;
using flashattn::TensorView;

std::string GpuCase::name() const {
  std::ostringstream os;
  os << "cuda " << Case::name();
  if (layout == Layout::kStrided) os << " strided";
  if (layout == Layout::kPacked) os << " packed-qkv";
  if (own_stream) os << " stream";
  return os.str();
}

bool have_device() { return flashattn::cuda_compiled() && flashattn::cuda_device_count() > 0; }

namespace {

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
  opts.dropout.p = c.dropout;
  opts.dropout.seed = rng();
  opts.dropout.offset = rng() % 1000;

  // Reference on the host copies.
  View out_ref = contiguous_view(c.dtype, {b, sq, hq, d});
  View lse_ref = contiguous_view(DType::kFloat32, {b, hq, sq});
  if (c.alibi) opts.score.alibi_slopes = alibi.on_host();
  flashattn::reference_forward({q.on_host(), k.on_host(), v.on_host(), out_ref.on_host(), lse_ref.on_host()}, opts);
  const fa_test::NaiveResult naive = fa_test::naive_attention(
      c, fa_test::make_geometry(c), q.values(), k.values(), v.values(), {}, slopes, opts.dropout.seed,
      opts.dropout.offset);

  // Device runs, outputs poisoned before each; every rerun must match the first bitwise.
  if (c.alibi) opts.score.alibi_slopes = alibi.on_device();
  cudaStream_t stream = nullptr;
  if (c.own_stream) cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<std::byte> first_out, first_lse;
  int reruns_differing = 0;
  for (int run = 0; run <= c.reruns; ++run) {
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
    } else if (std::memcmp(first_out.data(), ob, first_out.size()) != 0 ||
               std::memcmp(first_lse.data(), lb, first_lse.size()) != 0) {
      ++reruns_differing;
    }
  }
  EXPECT_EQ(reruns_differing, 0) << "of " << c.reruns << " reruns, out or lse differed from the first run";
  if (stream) cuda_ok(cudaStreamDestroy(stream), "cudaStreamDestroy");

  const std::string name = c.name();
  double err = 0, bound = 0;
  fa_test::expect_close("out", out.values(), out_ref.values(), naive.out, 2.0, c.dtype, name, &err, &bound);
  fa_test::expect_close("lse", lse.values(), lse_ref.values(), naive.lse, 2.0, DType::kFloat32, name, &err, &bound);
  if (c.layout != Layout::kContiguous) expect_gaps_untouched(*out.storage, {&out}, name);
}

void run_gpu_varlen_case(const GpuCase& c) {
  SCOPED_TRACE(c.name());
  ASSERT_TRUE(c.varlen());
  const fa_test::Geometry g = fa_test::make_geometry(c);
  const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  auto rng = fa_test::rng_for(c.name());
  View q = contiguous_view(c.dtype, {g.rows_q, hq, d}), k = contiguous_view(c.dtype, {g.rows_k, hkv, d});
  View v = contiguous_view(c.dtype, {g.rows_k, hkv, d}), out = contiguous_view(c.dtype, {g.rows_q, hq, d});
  View lse = contiguous_view(DType::kFloat32, {hq, g.rows_q});
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t i = 0; i < q.numel(); ++i) q.set(i, c.input_scale * normal(rng));
  for (int64_t i = 0; i < k.numel(); ++i) k.set(i, c.input_scale * normal(rng));
  for (int64_t i = 0; i < v.numel(); ++i) v.set(i, normal(rng));
  View cu_q = contiguous_view(DType::kInt32, {g.batch + 1}), cu_k = contiguous_view(DType::kInt32, {g.batch + 1});
  View used = contiguous_view(DType::kInt32, {std::max<int64_t>(g.batch, 1)});
  flashattn::VarlenArgs vl_host, vl_device;
  for (int64_t b = 0; b <= g.batch; ++b) {
    cu_q.set(b, b < g.batch ? g.q_start[b] : g.q_start.back() + c.lens_q.back());
    cu_k.set(b, b < g.batch ? g.k_start[b] : g.k_start.back() + c.lens_k.back());
  }
  for (int64_t b = 0; b < g.batch; ++b) {
    vl_host.max_seqlen_q = std::max<int64_t>(vl_host.max_seqlen_q, c.lens_q[b]);
    vl_host.max_seqlen_k = std::max<int64_t>(vl_host.max_seqlen_k, c.lens_k[b]);
    if (!c.used_k.empty()) used.set(b, c.used_k[b]);
  }
  vl_device.max_seqlen_q = vl_host.max_seqlen_q;
  vl_device.max_seqlen_k = vl_host.max_seqlen_k;
  for (View* t : {&q, &k, &v, &cu_q, &cu_k, &used}) t->storage->device.upload(t->storage->host.data());
  vl_host.cu_seqlens_q = cu_q.on_host();
  vl_host.cu_seqlens_k = cu_k.on_host();
  vl_device.cu_seqlens_q = cu_q.on_device();
  vl_device.cu_seqlens_k = cu_k.on_device();
  if (!c.used_k.empty()) {
    vl_host.seqused_k = used.on_host();
    vl_device.seqused_k = used.on_device();
  }

  flashattn::AttentionOptions opts;
  opts.mask.causal = c.causal;
  opts.mask.window_left = c.window_left;
  opts.mask.window_right = c.window_right;
  opts.score.softcap = c.softcap;
  opts.dropout.p = c.dropout;
  opts.dropout.seed = rng();
  opts.dropout.offset = rng() % 1000;

  View out_ref = contiguous_view(c.dtype, {g.rows_q, hq, d});
  View lse_ref = contiguous_view(DType::kFloat32, {hq, g.rows_q});
  flashattn::reference_forward_varlen({q.on_host(), k.on_host(), v.on_host(), out_ref.on_host(), lse_ref.on_host()},
                                      vl_host, opts);
  const fa_test::NaiveResult naive = fa_test::naive_attention(c, g, q.values(), k.values(), v.values(), {}, {},
                                                              opts.dropout.seed, opts.dropout.offset);

  std::vector<std::byte> first_out, first_lse;
  int reruns_differing = 0;
  for (int run = 0; run <= c.reruns; ++run) {
    out.storage->device.poison();
    lse.storage->device.poison();
    cuda_ok(cudaDeviceSynchronize(), "poison");
    flashattn::forward_varlen({q.on_device(), k.on_device(), v.on_device(), out.on_device(), lse.on_device()},
                              vl_device, opts);
    cuda_ok(cudaDeviceSynchronize(), "forward_varlen");
    out.storage->device.download(out.storage->host.data());
    lse.storage->device.download(lse.storage->host.data());
    const std::byte* ob = out.storage->bytes();
    const std::byte* lb = lse.storage->bytes();
    if (run == 0) {
      first_out.assign(ob, ob + out.storage->size_bytes());
      first_lse.assign(lb, lb + lse.storage->size_bytes());
    } else if (std::memcmp(first_out.data(), ob, first_out.size()) != 0 ||
               std::memcmp(first_lse.data(), lb, first_lse.size()) != 0) {
      ++reruns_differing;
    }
  }
  EXPECT_EQ(reruns_differing, 0) << "of " << c.reruns << " reruns, out or lse differed from the first run";
  const std::string name = c.name();
  double err = 0, bound = 0;
  // Rows of no sequence: the naive result has 0 / -inf there, like the reference.
  fa_test::expect_close("out", out.values(), out_ref.values(), naive.out, 2.0, c.dtype, name, &err, &bound);
  fa_test::expect_close("lse", lse.values(), lse_ref.values(), naive.lse, 2.0, DType::kFloat32, name, &err, &bound);
}

}  // namespace fa_gpu_test

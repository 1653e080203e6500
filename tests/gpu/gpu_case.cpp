#include "gpu_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <limits>
#include <map>
#include <numeric>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "device_buffer.hpp"
#include "test_util.hpp"

namespace fa_gpu_test {

using flashattn::DType;
using flashattn::TensorView;

std::string GpuCase::name() const {
  std::ostringstream os;
  os << "cuda " << Case::name();
  if (backward) os << " bwd";
  if (deterministic) os << " deterministic";
  if (layout == Layout::kStrided) os << " strided";
  if (layout == Layout::kPacked) os << " packed-qkv";
  if (dout_every_other_row) os << " dout[:,::2]";
  if (own_stream) os << " stream";
  if (nan_outside_sequences) os << " nan-outside";
  if (page_size > 0) os << " paged" << page_size;
  return os.str();
}

GpuCase varlen_forward_case(DType dtype, int64_t heads_q, int64_t heads_kv, int64_t d, const VarlenSpec& spec) {
  GpuCase c;
  c.dtype = dtype;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.head_dim = d;
  c.lens_q = spec.lens_q;
  c.lens_k = spec.lens_k;
  c.used_k = spec.used_k;
  c.causal = spec.causal;
  c.window_left = spec.window_left;
  c.window_right = spec.window_right;
  c.dropout = spec.dropout;
  return c;
}

bool have_device() { return flashattn::cuda_compiled() && flashattn::cuda_device_count() > 0; }

bool have_sm90_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return false;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9 && prop.minor == 0;
}

GpuCase backward_case(flashattn::DType dtype, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q,
                      int64_t heads_kv, int64_t head_dim) {
  GpuCase c;
  c.backward = true;
  c.dtype = dtype;
  c.batch = batch;
  c.seqlen_q = seqlen_q;
  c.seqlen_k = seqlen_k;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.head_dim = head_dim;
  return c;
}

GpuCase varlen_backward_case(flashattn::DType dtype, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                             std::vector<int32_t> lens_q, std::vector<int32_t> lens_k, std::vector<int32_t> used_k) {
  GpuCase c = backward_case(dtype, 1, 1, 1, heads_q, heads_kv, head_dim);
  c.lens_q = std::move(lens_q);
  c.lens_k = std::move(lens_k);
  c.used_k = std::move(used_k);
  return c;
}

namespace {

// Host storage and its device copy, shared by the views into it.
struct Storage {
  DType dtype;
  int64_t elems;
  fa_test::HostTensor host;  // 1-D, zero-initialised
  DeviceBuffer device;

  Storage(DType dt, int64_t n)
      : dtype(dt),
        elems(n),
        host(dt, {std::max<int64_t>(n, 1)}),
        device(static_cast<size_t>(n) * flashattn::dtype_size(dt)) {}
  std::byte* bytes() const { return static_cast<std::byte*>(host.data()); }
  size_t size_bytes() const { return device.bytes(); }
  void poison_host() { std::memset(bytes(), 0xFF, size_bytes()); }  // NaN in every float format
};

// A strided view into a Storage (4-D dense tensors, 3-D varlen tensors and LSE; 1-D vectors).
// The last dimension has unit stride.
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
  TensorView on_device() const { return make(storage->device.get(), {flashattn::DeviceType::kCUDA, 0}); }
  // Element `linear` (row-major over shape) through the storage's 1-D host tensor.
  double get(int64_t linear) const { return storage->host.get(element_offset(linear)); }
  void set(int64_t linear, double x) { storage->host.set(element_offset(linear), x); }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[static_cast<size_t>(i)] = get(i);
    return v;
  }
  // The host bytes of the elements in row-major order, a unit-stride row at a time (250 reruns
  // of a mid-size case compare these).
  std::vector<std::byte> bytes() const {
    const int64_t es = static_cast<int64_t>(flashattn::dtype_size(storage->dtype)), row = shape.back();
    std::vector<std::byte> b(static_cast<size_t>(numel() * es));
    for (int64_t r = 0; row > 0 && r < numel() / row; ++r) {
      std::memcpy(b.data() + r * row * es, storage->bytes() + element_offset(r * row) * es,
                  static_cast<size_t>(row * es));
    }
    return b;
  }
};

std::vector<int64_t> row_major(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * shape[i + 1];
  return st;
}

View contiguous_view(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  return View{std::make_shared<Storage>(dtype, n), shape, row_major(shape), 0};
}

// [b, s, h, d] with gaps: head stride d + 8, row stride (h + 1) * (d + 8), batch stride
// (s + 2) * row stride (all multiples of 8 elements when d is).
View strided_view(DType dtype, int64_t b, int64_t s, int64_t h, int64_t d) {
  const int64_t hs = d + 8, rs = (h + 1) * hs, bs = (s + 2) * rs;
  return View{std::make_shared<Storage>(dtype, b * bs), {b, s, h, d}, {bs, rs, hs, 1}, 0};
}

// dout[:, ::2]: every other row of a buffer with twice the rows, so the row stride (third
// dimension from the end, dense or varlen) is twice out's -- a kernel that reads dout with out's
// strides reads the wrong rows.
View every_other_row(DType dtype, const std::vector<int64_t>& shape) {
  const size_t row_dim = shape.size() - 3;
  std::vector<int64_t> buffer = shape;
  buffer[row_dim] *= 2;
  View v = contiguous_view(dtype, buffer);
  v.shape = shape;
  v.strides[row_dim] *= 2;
  return v;
}

// Every tensor of a case; views of one buffer share its Storage.
struct Tensors {
  View q, k, v, out, lse;
  View dout, dq, dk, dv;  // backward cases
  View alibi;             // c.alibi
  View sink, dsink;       // c.sink: the learnable sink [heads_q] (and its gradient, backward cases)
  View cu_q, cu_k, used;  // varlen cases
  View table;             // GpuCase::page_size: block_table [batch, pages per sequence]
};

struct QkvViews {
  View q, k, v;
};

// q-like [b, sq, hq, d] and k-like [b, sk, hkv, d] views in the case's layout: the inputs, and
// the gradients of a backward case likewise (packed: dq, dk, dv in one dqkv buffer).
QkvViews dense_qkv(const GpuCase& c) {
  const int64_t b = c.batch, sq = c.seqlen_q, sk = c.seqlen_k, hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  if (c.layout == Layout::kPacked) {
    const View qkv = contiguous_view(c.dtype, {b, sq, hq + 2 * hkv, d});
    return {View{qkv.storage, {b, sq, hq, d}, qkv.strides, 0}, View{qkv.storage, {b, sk, hkv, d}, qkv.strides, hq * d},
            View{qkv.storage, {b, sk, hkv, d}, qkv.strides, (hq + hkv) * d}};
  }
  if (c.layout == Layout::kStrided) {
    return {strided_view(c.dtype, b, sq, hq, d), strided_view(c.dtype, b, sk, hkv, d),
            strided_view(c.dtype, b, sk, hkv, d)};
  }
  return {contiguous_view(c.dtype, {b, sq, hq, d}), contiguous_view(c.dtype, {b, sk, hkv, d}),
          contiguous_view(c.dtype, {b, sk, hkv, d})};
}

View dout_view(const GpuCase& c, const std::vector<int64_t>& shape) {
  return c.dout_every_other_row ? every_other_row(c.dtype, shape) : contiguous_view(c.dtype, shape);
}

Tensors dense_tensors(const GpuCase& c) {
  const int64_t b = c.batch, sq = c.seqlen_q, hq = c.heads_q, d = c.head_dim;
  Tensors t;
  const QkvViews in = dense_qkv(c);
  t.q = in.q;
  t.k = in.k;
  t.v = in.v;
  t.out =
      c.layout == Layout::kContiguous ? contiguous_view(c.dtype, {b, sq, hq, d}) : strided_view(c.dtype, b, sq, hq, d);
  t.lse = contiguous_view(DType::kFloat32, {b, hq, sq});
  if (c.backward) {
    t.dout = dout_view(c, {b, sq, hq, d});
    const QkvViews grads = dense_qkv(c);
    t.dq = grads.q;
    t.dk = grads.k;
    t.dv = grads.v;
  }
  return t;
}

// Contiguous [rows, h, d] tensors (rows include those of no sequence) and the int32 cu_seqlens
// and seqused_k vectors.
Tensors varlen_tensors(const GpuCase& c, const fa_test::Geometry& g) {
  const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  Tensors t;
  t.q = contiguous_view(c.dtype, {g.rows_q, hq, d});
  t.k = contiguous_view(c.dtype, {g.rows_k, hkv, d});
  t.v = contiguous_view(c.dtype, {g.rows_k, hkv, d});
  t.out = contiguous_view(c.dtype, {g.rows_q, hq, d});
  t.lse = contiguous_view(DType::kFloat32, {hq, g.rows_q});
  if (c.backward) {
    t.dout = dout_view(c, {g.rows_q, hq, d});
    t.dq = contiguous_view(c.dtype, {g.rows_q, hq, d});
    t.dk = contiguous_view(c.dtype, {g.rows_k, hkv, d});
    t.dv = contiguous_view(c.dtype, {g.rows_k, hkv, d});
  }
  t.cu_q = contiguous_view(DType::kInt32, {g.batch + 1});
  t.cu_k = contiguous_view(DType::kInt32, {g.batch + 1});
  t.used = contiguous_view(DType::kInt32, {std::max<int64_t>(g.batch, 1)});
  for (int64_t b = 0; b <= g.batch; ++b) {
    t.cu_q.set(b, b < g.batch ? g.q_start[b] : g.q_start.back() + c.lens_q.back());
    t.cu_k.set(b, b < g.batch ? g.k_start[b] : g.k_start.back() + c.lens_k.back());
  }
  for (int64_t b = 0; b < static_cast<int64_t>(c.used_k.size()); ++b) t.used.set(b, c.used_k[b]);
  return t;
}

// cu_seqlens / seqused_k on the host (for the reference) or the device (for the calls).
flashattn::VarlenArgs varlen_args(const GpuCase& c, const Tensors& t, bool device) {
  auto at = [device](const View& x) { return device ? x.on_device() : x.on_host(); };
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = at(t.cu_q);
  vl.cu_seqlens_k = at(t.cu_k);
  if (!c.used_k.empty()) vl.seqused_k = at(t.used);
  // Paged once paginate() ran; the expected results come from the packed keys before that.
  if (t.table.storage) vl.block_table = at(t.table);
  vl.index_check = c.index_check;
  for (size_t b = 0; b < c.lens_q.size(); ++b) {
    vl.max_seqlen_q = std::max<int64_t>(vl.max_seqlen_q, c.lens_q[b]);
    vl.max_seqlen_k = std::max<int64_t>(vl.max_seqlen_k, c.lens_k[b]);
  }
  return vl;
}

// q and k ~ N(0, input_scale^2), v and dout ~ N(0, 1), ALiBi slopes ~ U(0, 0.3). What no view
// covers (gaps, dout's skipped rows) holds NaN, so a kernel that reads outside a view fails.
void fill_inputs(const GpuCase& c, Tensors& t, std::mt19937_64& rng) {
  for (View* x : {&t.q, &t.k, &t.v, &t.dout}) {
    if (x->storage) x->storage->poison_host();
  }
  std::normal_distribution<double> normal(0.0, 1.0);
  auto fill = [&](View& x, double stddev) {
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, stddev * normal(rng));
  };
  fill(t.q, c.input_scale);
  fill(t.k, c.input_scale);
  fill(t.v, 1.0);
  if (c.backward) fill(t.dout, 1.0);
  if (c.alibi) {
    t.alibi = contiguous_view(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(0.0, 0.3);
    for (int64_t h = 0; h < c.heads_q; ++h) t.alibi.set(h, u(rng));
  }
  if (c.sink) {  // around a row's logsumexp over a few keys (the CPU suites' range), the last head -inf (none)
    t.sink = contiguous_view(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(-1.0, 3.0);
    for (int64_t h = 0; h < c.heads_q; ++h) {
      t.sink.set(h, h == c.heads_q - 1 ? -std::numeric_limits<double>::infinity() : u(rng));
    }
    if (c.backward) t.dsink = contiguous_view(DType::kFloat32, {c.heads_q});
  }
}

// Each input buffer once (views of one buffer share it).
void upload_inputs(Tensors& t) {
  std::vector<Storage*> done;
  for (View* x : {&t.q, &t.k, &t.v, &t.dout, &t.alibi, &t.sink, &t.cu_q, &t.cu_k, &t.used, &t.table}) {
    Storage* s = x->storage.get();
    if (s == nullptr || std::find(done.begin(), done.end(), s) != done.end()) continue;
    s->device.upload(s->host.data());
    done.push_back(s);
  }
}

flashattn::AttentionOptions options_of(const GpuCase& c, std::mt19937_64& rng) {
  flashattn::AttentionOptions opts;
  opts.mask.causal = c.causal;
  opts.mask.window_left = c.window_left;
  opts.mask.window_right = c.window_right;
  opts.mask.sink_tokens = c.sink_tokens;
  opts.score.softcap = c.softcap;
  opts.dropout.p = c.dropout;
  opts.dropout.seed = rng();
  opts.dropout.offset = rng() % 1000;
  opts.deterministic = c.deterministic;
  return opts;
}

// The fp64 reference's results (contiguous) and the naive attention in the tested dtype. The
// reference backward runs on the reference's own out and lse.
struct Expected {
  View out, lse, dq, dk, dv, dsink;
  fa_test::NaiveResult naive;
};

Expected expected(const GpuCase& c, const fa_test::Geometry& g, const Tensors& t, flashattn::AttentionOptions opts) {
  if (c.alibi) opts.score.alibi_slopes = t.alibi.on_host();
  if (c.sink) opts.score.learnable_sink = t.sink.on_host();
  const flashattn::VarlenArgs vl = g.varlen ? varlen_args(c, t, false) : flashattn::VarlenArgs{};
  Expected e;
  e.out = contiguous_view(c.dtype, t.out.shape);
  e.lse = contiguous_view(DType::kFloat32, t.lse.shape);
  const flashattn::ForwardArgs fa{t.q.on_host(), t.k.on_host(), t.v.on_host(), e.out.on_host(), e.lse.on_host()};
  if (g.varlen) {
    flashattn::reference_forward_varlen(fa, vl, opts);
  } else {
    flashattn::reference_forward(fa, opts);
  }
  if (c.backward) {
    e.dq = contiguous_view(c.dtype, t.q.shape);
    e.dk = contiguous_view(c.dtype, t.k.shape);
    e.dv = contiguous_view(c.dtype, t.v.shape);
    flashattn::BackwardArgs ba{t.dout.on_host(), fa.q,           fa.k,           fa.v,          fa.out,
                               fa.lse,           e.dq.on_host(), e.dk.on_host(), e.dv.on_host()};
    if (c.sink) {
      e.dsink = contiguous_view(DType::kFloat32, {c.heads_q});
      ba.dsink = e.dsink.on_host();
    }
    if (g.varlen) {
      flashattn::reference_backward_varlen(ba, vl, opts);
    } else {
      flashattn::reference_backward(ba, opts);
    }
  }
  e.naive = fa_test::naive_attention(c, g, t.q.values(), t.k.values(), t.v.values(),
                                     c.backward ? t.dout.values() : std::vector<double>{},
                                     c.alibi ? t.alibi.values() : std::vector<double>{}, opts.dropout.seed,
                                     opts.dropout.offset, c.sink ? t.sink.values() : std::vector<double>{});
  return e;
}

// One output of the device runs: whether reruns must reproduce it bitwise, the first run's bytes
// and how many reruns differed.
struct Output {
  const char* name;
  const View* view;
  bool bitwise;
  std::vector<std::byte> first = {};
  int differing = 0;
};

std::vector<Output> outputs_of(const GpuCase& c, const Tensors& t) {
  std::vector<Output> o = {{"out", &t.out, true}, {"lse", &t.lse, true}};
  if (c.backward) {
    // Without `deterministic`, dQ may be accumulated in any order (atomics).
    o.push_back({"dq", &t.dq, c.deterministic});
    o.push_back({"dk", &t.dk, true});
    o.push_back({"dv", &t.dv, true});
    // d sink: a fixed-order reduction of the rows' terms.
    if (c.sink) o.push_back({"dsink", &t.dsink, true});
  }
  return o;
}

// The output buffers, each once (packed dq, dk, dv share one).
std::vector<Storage*> storages_of(const std::vector<Output>& outputs) {
  std::vector<Storage*> s;
  for (const Output& o : outputs) {
    if (std::find(s.begin(), s.end(), o.view->storage.get()) == s.end()) s.push_back(o.view->storage.get());
  }
  return s;
}

// Runs the case 1 + c.reruns times on the device: outputs and workspace poisoned, the forward,
// then (backward cases) the backward on the forward's out and lse. Leaves the last run's
// results in the output views' host copies.
void run_on_device(const GpuCase& c, const Tensors& t, flashattn::AttentionOptions opts, bool varlen) {
  if (c.alibi) opts.score.alibi_slopes = t.alibi.on_device();
  if (c.sink) opts.score.learnable_sink = t.sink.on_device();
  const flashattn::VarlenArgs vl = varlen ? varlen_args(c, t, true) : flashattn::VarlenArgs{};
  const flashattn::ForwardArgs fa{t.q.on_device(), t.k.on_device(), t.v.on_device(), t.out.on_device(),
                                  t.lse.on_device()};
  flashattn::BackwardArgs ba;
  // The forward's optional workspace, as the query asks (masked calls on Hopper use it).
  DeviceBuffer forward_workspace(varlen ? flashattn::forward_varlen_workspace_size(fa, vl, opts)
                                        : flashattn::forward_workspace_size(fa, opts));
  DeviceBuffer workspace;
  if (c.backward) {
    ba = {t.dout.on_device(), fa.q, fa.k, fa.v, fa.out, fa.lse, t.dq.on_device(), t.dk.on_device(), t.dv.on_device()};
    if (c.sink) ba.dsink = t.dsink.on_device();
    // Exactly what the query asks for, as a caller allocates it: a kernel that needs more reads
    // past it (compute-sanitizer's memcheck sees that).
    workspace = DeviceBuffer(varlen ? flashattn::backward_varlen_workspace_size(ba, vl, opts)
                                    : flashattn::backward_workspace_size(ba, opts));
  }
  std::vector<Output> outputs = outputs_of(c, t);
  const std::vector<Storage*> storages = storages_of(outputs);
  const DeviceStream stream(c.own_stream);
  for (int run = 0; run <= c.reruns; ++run) {
    for (Storage* s : storages) s->device.poison();
    workspace.poison();  // the kernels must write scratch memory before they read it
    // 0x7F...: a tile counter left unzeroed would end every CTA's walk at once (-1, 0xFF's
    // value, would only repeat one tile), leaving poisoned rows.
    forward_workspace.fill(0x7F);
    cuda_ok(cudaDeviceSynchronize(), "poison");
    flashattn::RunContext ctx;
    ctx.stream = stream.get();
    ctx.workspace = forward_workspace.get();
    ctx.workspace_bytes = forward_workspace.bytes();
    if (varlen) {
      flashattn::forward_varlen(fa, vl, opts, ctx);
    } else {
      flashattn::forward(fa, opts, ctx);
    }
    if (c.backward) {
      ctx.workspace = workspace.get();
      ctx.workspace_bytes = workspace.bytes();
      if (varlen) {
        flashattn::backward_varlen(ba, vl, opts, ctx);
      } else {
        flashattn::backward(ba, opts, ctx);
      }
    }
    cuda_ok(cudaStreamSynchronize(stream.get()), "kernels");
    cuda_ok(cudaGetLastError(), "kernels");
    for (Storage* s : storages) s->device.download(s->host.data());
    for (Output& o : outputs) {
      std::vector<std::byte> bytes = o.view->bytes();
      if (run == 0) {
        o.first = std::move(bytes);
      } else if (o.bitwise && bytes != o.first) {
        ++o.differing;
      }
    }
  }
  for (const Output& o : outputs) {
    EXPECT_EQ(o.differing, 0) << "of " << c.reruns << " reruns, " << o.differing << " gave another " << o.name
                              << " than the first run";
  }
}

// Bytes of `storage` that no element of the views covers must still hold the 0xFF poison.
void expect_gaps_untouched(const Storage& storage, const std::vector<const View*>& views, const std::string& name) {
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
  EXPECT_EQ(written, 0) << "bytes outside the output views were written in " << name;
}

// The last run's results against the reference; no output buffer written outside its views.
void check_results(const GpuCase& c, const Tensors& t, const Expected& e) {
  const std::string name = c.name();
  double err = 0, bound = 0;
  // Varlen rows of no sequence: the naive result has 0 / -inf there, like the reference.
  fa_test::expect_close("out", t.out.values(), e.out.values(), e.naive.out, 2.0, c.dtype, name, &err, &bound);
  fa_test::expect_lse_close(t.lse.values(), e.lse.values(), e.naive.lse, name, &err, &bound);
  if (c.backward) {
    fa_test::expect_grads_close({t.dq.values(), t.dk.values(), t.dv.values()},
                                {e.dq.values(), e.dk.values(), e.dv.values()}, e.naive, c.dtype, name, &err, &bound);
    if (c.sink) fa_test::expect_dsink_close(t.dsink.values(), e.dsink.values(), e.naive, c.dtype, name, &err, &bound);
  }
  const std::vector<Output> outputs = outputs_of(c, t);
  for (Storage* s : storages_of(outputs)) {
    std::vector<const View*> views;
    for (const Output& o : outputs) {
      if (o.view->storage.get() == s) views.push_back(o.view);
    }
    expect_gaps_untouched(*s, views, name);
  }
}

// Rows of a [rows, ...] tensor outside every [start[b], start[b] + len[b]).
std::vector<int64_t> rows_outside(int64_t rows, const std::vector<int64_t>& start, const std::vector<int64_t>& len) {
  std::vector<char> used(static_cast<size_t>(rows), 0);
  for (size_t b = 0; b < start.size(); ++b) {
    for (int64_t r = start[b]; r < start[b] + len[b]; ++r) used[static_cast<size_t>(r)] = 1;
  }
  std::vector<int64_t> out;
  for (int64_t r = 0; r < rows; ++r) {
    if (!used[static_cast<size_t>(r)]) out.push_back(r);
  }
  return out;
}

// Elements of `rows` of a [rows, h, d] view (or of an LSE [h, rows] view) that are not `value`.
int64_t count_not(const View& x, const std::vector<int64_t>& rows, double value, bool lse_layout) {
  int64_t bad = 0;
  const int64_t per_row = lse_layout ? x.shape[0] : x.shape[1] * x.shape[2];
  for (int64_t r : rows) {
    for (int64_t e = 0; e < per_row; ++e) {
      bad += !(x.get(lse_layout ? e * x.shape[1] + r : r * per_row + e) == value);
    }
  }
  return bad;
}

// GpuCase::nan_outside_sequences: NaN in the input rows that no sequence reads.
void fill_nan_outside_sequences(const fa_test::Geometry& g, Tensors& t) {
  auto fill = [](View& x, const std::vector<int64_t>& rows) {
    const int64_t per_row = x.shape[1] * x.shape[2];
    for (int64_t r : rows) {
      for (int64_t e = 0; e < per_row; ++e) x.set(r * per_row + e, std::numeric_limits<double>::quiet_NaN());
    }
  };
  fill(t.q, rows_outside(g.rows_q, g.q_start, g.len_q));
  const std::vector<int64_t> k_rows = rows_outside(g.rows_k, g.k_start, g.len_k);
  fill(t.k, k_rows);
  fill(t.v, k_rows);
}

// Varlen rows of no sequence, and keys past seqused_k (g.len_k), hold the CPU backend's values
// (src/cpu/unused_rows.cpp): out, dq, dk, dv 0, LSE -inf.
void expect_unused_rows_defined(const GpuCase& c, const fa_test::Geometry& g, const Tensors& t) {
  const std::vector<int64_t> q_rows = rows_outside(g.rows_q, g.q_start, g.len_q);
  const std::vector<int64_t> k_rows = rows_outside(g.rows_k, g.k_start, g.len_k);
  EXPECT_EQ(count_not(t.out, q_rows, 0.0, false), 0) << "out: rows of no sequence not 0";
  EXPECT_EQ(count_not(t.lse, q_rows, -std::numeric_limits<double>::infinity(), true), 0)
      << "lse: rows of no sequence not -inf";
  if (!c.backward) return;
  EXPECT_EQ(count_not(t.dq, q_rows, 0.0, false), 0) << "dq: rows of no sequence not 0";
  EXPECT_EQ(count_not(t.dk, k_rows, 0.0, false), 0) << "dk: rows past seqused_k or of no sequence not 0";
  EXPECT_EQ(count_not(t.dv, k_rows, 0.0, false), 0) << "dv: rows past seqused_k or of no sequence not 0";
}

// GpuCase::page_size: k / v become [blocks, page_size, hkv, d] pages holding each sequence's
// keys (cu_seqlens_k's lengths) in blocks dealt at random, one spare block per sequence, every
// other page row NaN; t.table maps them. The packed tensors gave the expected results: the same
// keys, so the same attention.
void paginate(const GpuCase& c, const fa_test::Geometry& g, Tensors& t, std::mt19937_64& rng) {
  const int64_t page = c.page_size, hkv = c.heads_kv, d = c.head_dim;
  int64_t pages_per_seq = 1;
  for (int64_t len : c.lens_k) pages_per_seq = std::max(pages_per_seq, (len + page - 1) / page);
  const int64_t blocks = g.batch * (pages_per_seq + 1);
  std::vector<int32_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  View k = contiguous_view(c.dtype, {blocks, page, hkv, d}), v = contiguous_view(c.dtype, {blocks, page, hkv, d});
  k.storage->poison_host();
  v.storage->poison_host();
  t.table = contiguous_view(DType::kInt32, {g.batch, pages_per_seq});
  const int64_t per_row = hkv * d;
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t p = 0; p < pages_per_seq; ++p) t.table.set(b * pages_per_seq + p, order[b * pages_per_seq + p]);
    for (int64_t j = 0; j < c.lens_k[b]; ++j) {
      const int64_t block = order[b * pages_per_seq + j / page], to = (block * page + j % page) * per_row,
                    from = (g.k_start[b] + j) * per_row;
      for (int64_t e = 0; e < per_row; ++e) {
        k.set(to + e, t.k.get(from + e));
        v.set(to + e, t.v.get(from + e));
      }
    }
  }
  t.k = k;
  t.v = v;
}

void run_case(const GpuCase& c) {
  const fa_test::Geometry g = fa_test::make_geometry(c);
  auto rng = fa_test::rng_for(c.name());
  Tensors t = g.varlen ? varlen_tensors(c, g) : dense_tensors(c);
  fill_inputs(c, t, rng);
  if (g.varlen && c.nan_outside_sequences) fill_nan_outside_sequences(g, t);
  const flashattn::AttentionOptions opts = options_of(c, rng);
  const Expected e = expected(c, g, t, opts);
  if (c.page_size > 0) paginate(c, g, t, rng);
  upload_inputs(t);
  run_on_device(c, t, opts, g.varlen);
  check_results(c, t, e);
  if (g.varlen) expect_unused_rows_defined(c, g, t);
}

}  // namespace

void run_gpu_case(const GpuCase& c) {
  SCOPED_TRACE(c.name());
  ASSERT_FALSE(c.varlen());
  ASSERT_TRUE(c.layout != Layout::kPacked || c.seqlen_q == c.seqlen_k) << "packed qkv needs seqlen_q == seqlen_k";
  run_case(c);
}

void run_gpu_varlen_case(const GpuCase& c) {
  SCOPED_TRACE(c.name());
  ASSERT_TRUE(c.varlen());
  ASSERT_EQ(c.layout, Layout::kContiguous) << "varlen tensors are contiguous";
  for (const flashattn::IndexCheck check : {flashattn::IndexCheck::kHost, flashattn::IndexCheck::kDevice}) {
    SCOPED_TRACE(check == flashattn::IndexCheck::kHost ? "lengths checked on the host"
                                                       : "lengths checked on the device");
    GpuCase run = c;
    run.index_check = check;
    run_case(run);
  }
}

}  // namespace fa_gpu_test

// Host tensors: dtype conversions, seeded filling and the argument structs of the API.
#include "tensors.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>

#include "core/float8.hpp"

namespace flashattn_cli {
namespace {

using flashattn::DType;

// fp16 / bf16 <-> float, round to nearest even. The library's own converters are private, and
// this tool sees only the public API, so it carries these few lines.
float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // subnormal: mant * 2^-24
  return sign ? -v : v;
}

uint16_t float_to_fp16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x38800000u) {
    // Subnormal result: adding 0.5 (ulp 2^-24) lets the FPU round to a multiple of 2^-24.
    const float r = std::bit_cast<float>(a) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(r) - 0x3f000000u));
  }
  uint32_t v = a - (112u << 23);  // rebias the exponent, then round 23 -> 10 mantissa bits
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

int64_t checked_numel(const std::vector<int64_t>& shape, DType dtype) {
  int64_t n = 1, bytes = 0;
  for (int64_t s : shape) {
    if (__builtin_mul_overflow(n, s, &n)) throw CliError("shape: element count overflows int64");
  }
  if (__builtin_mul_overflow(n, static_cast<int64_t>(flashattn::dtype_size(dtype)), &bytes)) {
    throw CliError("shape: byte size overflows int64");
  }
  return n;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)), numel_(checked_numel(shape_, dtype)) {
  const auto bytes = static_cast<size_t>(numel_) * flashattn::dtype_size(dtype_);
  storage_.assign((bytes + sizeof(double) - 1) / sizeof(double), 0.0);
}

double HostTensor::get(int64_t i) const {
  const void* p = static_cast<const char*>(data()) + i * static_cast<int64_t>(flashattn::dtype_size(dtype_));
  switch (dtype_) {
    case DType::kFloat16:
      return fp16_to_float(*static_cast<const uint16_t*>(p));
    case DType::kBFloat16:
      return bf16_to_float(*static_cast<const uint16_t*>(p));
    case DType::kFloat32:
      return *static_cast<const float*>(p);
    case DType::kFloat64:
      return *static_cast<const double*>(p);
    case DType::kInt32:
      return *static_cast<const int32_t*>(p);
    case DType::kFloat8E4M3:
      return flashattn::core::float8_to_float<flashattn::core::E4M3Format>(*static_cast<const uint8_t*>(p));
    case DType::kFloat8E5M2:
      return flashattn::core::float8_to_float<flashattn::core::E5M2Format>(*static_cast<const uint8_t*>(p));
  }
  return 0.0;
}

void HostTensor::set(int64_t i, double x) {
  void* p = static_cast<char*>(data()) + i * static_cast<int64_t>(flashattn::dtype_size(dtype_));
  switch (dtype_) {
    case DType::kFloat16:
      *static_cast<uint16_t*>(p) = float_to_fp16(static_cast<float>(x));
      break;
    case DType::kBFloat16:
      *static_cast<uint16_t*>(p) = float_to_bf16(static_cast<float>(x));
      break;
    case DType::kFloat32:
      *static_cast<float*>(p) = static_cast<float>(x);
      break;
    case DType::kFloat64:
      *static_cast<double*>(p) = x;
      break;
    case DType::kInt32:
      *static_cast<int32_t*>(p) = static_cast<int32_t>(x);
      break;
    case DType::kFloat8E4M3:  // to nearest even, saturating (the library's quantisation)
      *static_cast<uint8_t*>(p) = flashattn::core::float_to_float8<flashattn::core::E4M3Format>(static_cast<float>(x));
      break;
    case DType::kFloat8E5M2:
      *static_cast<uint8_t*>(p) = flashattn::core::float_to_float8<flashattn::core::E5M2Format>(static_cast<float>(x));
      break;
  }
}

void HostTensor::fill_normal(uint64_t seed) {
  // Fixed-size chunks, each with its own generator: the values do not depend on the threads.
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (numel_ + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    std::mt19937_64 gen(splitmix64(seed ^ splitmix64(static_cast<uint64_t>(c))));
    std::normal_distribution<double> normal(0.0, 1.0);
    const int64_t end = std::min(numel_, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) {
      double x = normal(gen);
      if (x == 0.0) x = 1.0;  // never an exact zero (a zero input hides indexing bugs)
      set(i, x);
    }
  }
}

flashattn::TensorView HostTensor::view() const { return make_view(data(), dtype_, shape_); }

flashattn::TensorView make_view(const void* data, DType dtype, const std::vector<int64_t>& shape,
                                flashattn::Device device) {
  flashattn::TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[static_cast<size_t>(i)];
    t.strides[i] = stride;
    stride *= t.shape[i] > 0 ? t.shape[i] : 1;
  }
  return t;
}

Tensors allocate_tensors(const Dims& d, bool backward) {
  const std::vector<int64_t> q_shape{d.batch, d.seqlen_q, d.heads, d.head_dim};
  const std::vector<int64_t> kv_shape{d.batch, d.seqlen_k, d.heads_kv, d.head_dim};
  Tensors t;
  t.q = HostTensor(d.dtype, q_shape);
  t.k = HostTensor(d.dtype, kv_shape);
  t.v = HostTensor(d.dtype, kv_shape);
  t.out = HostTensor(d.out_dtype(), q_shape);
  t.lse = HostTensor(DType::kFloat32, {d.batch, d.heads, d.seqlen_q});
  if (backward) {
    t.dout = HostTensor(d.dtype, q_shape);
    t.dq = HostTensor(d.dtype, q_shape);
    t.dk = HostTensor(d.dtype, kv_shape);
    t.dv = HostTensor(d.dtype, kv_shape);
  }
  return t;
}

flashattn::ForwardArgs forward_args(const Tensors& t) {
  return {t.q.view(), t.k.view(), t.v.view(), t.out.view(), t.lse.view()};
}

flashattn::BackwardArgs backward_args(const Tensors& t) {
  return {t.dout.view(), t.q.view(),  t.k.view(),  t.v.view(), t.out.view(),
          t.lse.view(),  t.dq.view(), t.dk.view(), t.dv.view()};
}

ProbeArgs probe_args(const Dims& d, const flashattn::AttentionOptions& options, flashattn::Device device) {
  // Consecutive 256-byte-aligned ranges from a non-null base, so no two views overlap.
  uint64_t next = 256;
  auto place = [&](DType dtype, const std::vector<int64_t>& shape) {
    // A negative extent is the library's to reject (with its message); it takes no room here.
    const bool negative = std::any_of(shape.begin(), shape.end(), [](int64_t s) { return s < 0; });
    const uint64_t bytes =
        negative ? 0 : static_cast<uint64_t>(checked_numel(shape, dtype)) * flashattn::dtype_size(dtype);
    const uint64_t at = next;
    if (__builtin_add_overflow(next, (bytes + 255) / 256 * 256, &next) || next > (1ull << 62)) {
      throw CliError("shape: the tensors' total byte size overflows the address space");
    }
    return make_view(reinterpret_cast<const void*>(static_cast<uintptr_t>(at)), dtype, shape, device);
  };
  const std::vector<int64_t> q_shape{d.batch, d.seqlen_q, d.heads, d.head_dim};
  const std::vector<int64_t> kv_shape{d.batch, d.seqlen_k, d.heads_kv, d.head_dim};
  ProbeArgs p;
  auto& f = p.forward;
  f = {place(d.dtype, q_shape), place(d.dtype, kv_shape), place(d.dtype, kv_shape), place(d.out_dtype(), q_shape),
       place(DType::kFloat32, {d.batch, d.heads, d.seqlen_q})};
  p.backward = {place(d.dtype, q_shape), f.q, f.k, f.v, f.out, f.lse, place(d.dtype, q_shape), place(d.dtype, kv_shape),
                place(d.dtype, kv_shape)};
  p.options = options;
  if (options.score.alibi_slopes.present()) {
    p.options.score.alibi_slopes = place(DType::kFloat32, {d.heads});
  }
  return p;
}

std::vector<float> alibi_slopes(int64_t heads) {
  auto power_of_two_slopes = [](int64_t n) {
    std::vector<float> s(static_cast<size_t>(n));
    for (int64_t h = 0; h < n; ++h) {
      s[static_cast<size_t>(h)] =
          static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(n)));
    }
    return s;
  };
  const int64_t lower = std::bit_floor(static_cast<uint64_t>(heads));
  std::vector<float> slopes = power_of_two_slopes(lower);
  const std::vector<float> extra = power_of_two_slopes(2 * lower);
  for (int64_t i = 0; static_cast<int64_t>(slopes.size()) < heads; i += 2) {
    slopes.push_back(extra[static_cast<size_t>(i)]);
  }
  return slopes;
}

}  // namespace flashattn_cli

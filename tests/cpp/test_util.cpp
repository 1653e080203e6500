#include "test_util.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include <gtest/gtest.h>

#include "core/float8.hpp"
#include "core/half.hpp"

namespace fa_test {

bool quick_mode() {
  const char* q = std::getenv("FLASHATTN_TEST_QUICK");
  return q != nullptr && std::string(q) == "1";
}

uint64_t base_seed() {
  static const uint64_t seed = [] {
    uint64_t s;
    if (const char* env = std::getenv("FLASHATTN_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      s = std::random_device{}() ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    std::printf("[flashattn tests] seed %llu (replay with FLASHATTN_TEST_SEED=%llu)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

std::mt19937_64 rng_for(const std::string& what) {
  return std::mt19937_64(base_seed() ^ std::hash<std::string>{}(what));
}

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : HostTensor(dtype, shape, {}) {}

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides)
    : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
  if (strides_.empty()) {
    strides_.assign(shape_.size(), 1);
    for (int i = static_cast<int>(shape_.size()) - 2; i >= 0; --i) {
      strides_[i] = strides_[i + 1] * std::max<int64_t>(shape_[i + 1], 1);
    }
  }
  int64_t extent = 1;
  for (size_t i = 0; i < shape_.size(); ++i) extent += (std::max<int64_t>(shape_[i], 1) - 1) * strides_[i];
  const size_t bytes = static_cast<size_t>(extent) * flashattn::dtype_size(dtype_);
  storage_.resize(bytes + 64);
  pad_ = (64 - reinterpret_cast<uintptr_t>(storage_.data()) % 64) % 64;
}

TensorView HostTensor::view() const {
  TensorView t;
  t.data = data();
  t.dtype = dtype_;
  t.ndim = static_cast<int>(shape_.size());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = shape_[i];
    t.strides[i] = strides_[i];
  }
  return t;
}

int64_t HostTensor::numel() const {
  if (storage_.empty()) return 0;  // default-constructed: no tensor
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

int64_t HostTensor::offset_of(int64_t linear) const {
  int64_t off = 0;
  for (int i = static_cast<int>(shape_.size()) - 1; i >= 0; --i) {
    off += (linear % shape_[i]) * strides_[i];
    linear /= shape_[i];
  }
  return off;
}

double HostTensor::get(int64_t linear) const {
  using namespace flashattn::core;
  const std::byte* p =
      static_cast<const std::byte*>(data()) + offset_of(linear) * static_cast<int64_t>(flashattn::dtype_size(dtype_));
  uint16_t h;
  float f;
  double d;
  int32_t i;
  switch (dtype_) {
    case DType::kFloat16:
      std::memcpy(&h, p, 2);
      return fp16_to_float(h);
    case DType::kBFloat16:
      std::memcpy(&h, p, 2);
      return bf16_to_float(h);
    case DType::kFloat32:
      std::memcpy(&f, p, 4);
      return f;
    case DType::kFloat64:
      std::memcpy(&d, p, 8);
      return d;
    case DType::kInt32:
      std::memcpy(&i, p, 4);
      return i;
    case DType::kFloat8E4M3:
      return float8_to_float<E4M3Format>(static_cast<uint8_t>(*p));
    case DType::kFloat8E5M2:
      return float8_to_float<E5M2Format>(static_cast<uint8_t>(*p));
  }
  return 0;
}

void HostTensor::set(int64_t linear, double value) {
  using namespace flashattn::core;
  std::byte* p =
      static_cast<std::byte*>(data()) + offset_of(linear) * static_cast<int64_t>(flashattn::dtype_size(dtype_));
  uint16_t h;
  float f = static_cast<float>(value);
  int32_t i = static_cast<int32_t>(value);
  switch (dtype_) {
    case DType::kFloat16:
      h = float_to_fp16(f);
      std::memcpy(p, &h, 2);
      break;
    case DType::kBFloat16:
      h = float_to_bf16(f);
      std::memcpy(p, &h, 2);
      break;
    case DType::kFloat32:
      std::memcpy(p, &f, 4);
      break;
    case DType::kFloat64:
      std::memcpy(p, &value, 8);
      break;
    case DType::kInt32:
      std::memcpy(p, &i, 4);
      break;
    case DType::kFloat8E4M3:
      *p = static_cast<std::byte>(float_to_float8<E4M3Format>(f));
      break;
    case DType::kFloat8E5M2:
      *p = static_cast<std::byte>(float_to_float8<E5M2Format>(f));
      break;
  }
}

void HostTensor::fill_normal(std::mt19937_64& rng, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  for (int64_t i = 0; i < numel(); ++i) set(i, dist(rng));
}

void HostTensor::fill(double value) {
  for (int64_t i = 0; i < numel(); ++i) set(i, value);
}

void HostTensor::fill_storage_nan() {
  // 0xFF bytes are NaN in every float format.
  std::memset(storage_.data(), 0xFF, storage_.size());
}

std::vector<double> HostTensor::to_vector() const {
  std::vector<double> v(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
  return v;
}

void expect_finite_difference_gradients(std::initializer_list<std::pair<HostTensor*, const HostTensor*>> inputs,
                                        const std::function<double()>& loss, int64_t stride) {
  const double eps = 1e-6;
  for (auto [t, grad] : inputs) {
    for (int64_t e = 0; e < t->numel(); e += stride) {
      const double orig = t->get(e);
      t->set(e, orig + eps);
      const double up = loss();
      t->set(e, orig - eps);
      const double down = loss();
      t->set(e, orig);
      const double numeric = (up - down) / (2 * eps);
      EXPECT_NEAR(grad->get(e), numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << "element " << e;
    }
  }
}

}  // namespace fa_test

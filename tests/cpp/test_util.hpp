// Test helpers: owned host tensors of any dtype, seeded random data (fresh seed each run,
// printed; FLASHATTN_TEST_SEED replays one), rounding to a dtype and error statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <utility>
#include <random>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "oracle/naive_attention.hpp"
#include "oracle/tolerance.hpp"

namespace fa_test {

using flashattn::DType;
using flashattn::TensorView;

// FLASHATTN_TEST_QUICK=1 (the sanitizer build): tests drop or shrink their largest shapes.
bool quick_mode();

// The run's base seed (printed once); tests derive their own from it and the test name.
uint64_t base_seed();
std::mt19937_64 rng_for(const std::string& what);

// Owns 64-byte aligned storage for a tensor of `shape` (row-major unless strides are given in
// elements, in which case storage covers the strided extent).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);
  HostTensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides);

  TensorView view() const;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  void* data() const { return const_cast<std::byte*>(storage_.data()) + pad_; }

  double get(int64_t linear) const;        // element at row-major linear index (of shape)
  void set(int64_t linear, double value);  // rounded to dtype
  void fill_normal(std::mt19937_64& rng, double stddev = 1.0);
  void fill(double value);
  void fill_storage_nan();  // poison every byte of storage, padding included

  std::vector<double> to_vector() const;

 private:
  int64_t offset_of(int64_t linear) const;
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_, strides_;
  std::vector<std::byte> storage_;
  size_t pad_ = 0;
};

// From the oracle (tools/oracle), which rounds and compares as the tolerance rule does.
using flashattn_oracle::compare;
using flashattn_oracle::ErrorStats;
using flashattn_oracle::round_to;

// Central differences of loss() (a fp64 function of the inputs) over every `stride`-th element
// of each input, against the backward's gradient of it: within 1e-6 * max(1, |numeric|).
void expect_finite_difference_gradients(std::initializer_list<std::pair<HostTensor*, const HostTensor*>> inputs,
                                        const std::function<double()>& loss, int64_t stride);

}  // namespace fa_test

// Host tensors of `flashattn run`: allocation (every page touched), seeded normal inputs,
// element access in any value dtype, and the argument structs of the API built from them.
#pragma once

#include <cstdint>
#include <vector>

#include "cli.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn_cli {

// A contiguous host tensor of any dtype. Storage is zero-initialised on construction, which
// writes every page: the memory of a timed call is then measured without the inputs in it.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(flashattn::DType dtype, std::vector<int64_t> shape);

  int64_t numel() const { return numel_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  flashattn::DType dtype() const { return dtype_; }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  bool empty() const { return shape_.empty(); }

  double get(int64_t i) const;    // element i, widened to double
  void set(int64_t i, double x);  // element i, rounded to the dtype (nearest even)

  // Seeded N(0, 1) values (never zeros), identical for any thread count.
  void fill_normal(uint64_t seed);
  flashattn::TensorView view() const;  // row-major, on the CPU

 private:
  flashattn::DType dtype_ = flashattn::DType::kFloat32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::vector<double> storage_;  // doubles: aligned for every dtype
};

// A row-major view of `shape` at `data`.
flashattn::TensorView make_view(const void* data, flashattn::DType dtype, const std::vector<int64_t>& shape,
                                flashattn::Device device = {});

// Every tensor of a dense call: q [b, sq, h, d], k/v [b, sk, hkv, d], out like q, lse fp32
// [b, h, sq]; the backward ones only when asked for.
struct Tensors {
  HostTensor q, k, v, out, lse;
  HostTensor dout, dq, dk, dv;
};

Tensors allocate_tensors(const Dims& dims, bool backward);
flashattn::ForwardArgs forward_args(const Tensors& t);
flashattn::BackwardArgs backward_args(const Tensors& t);

// Views of the whole problem on `device` at made-up, distinct, aligned addresses. They are only
// for the *_workspace_size queries, which validate and never dereference: this asks the library
// about a shape before allocating it, or about a device this tool cannot allocate on.
struct ProbeArgs {
  flashattn::ForwardArgs forward;
  flashattn::BackwardArgs backward;
  flashattn::AttentionOptions options;  // alibi slopes moved to the probe device too
};
ProbeArgs probe_args(const Dims& dims, const flashattn::AttentionOptions& options, flashattn::Device device);

// Standard ALiBi slopes (Press et al.): 2^(-8(h+1)/H) for H a power of two; otherwise the
// slopes of the nearest lower power of two followed by every other slope of twice that.
std::vector<float> alibi_slopes(int64_t heads);

}  // namespace flashattn_cli

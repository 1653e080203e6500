// The validation tests' harness (test_validation.cpp, test_validation_accepts.cpp): element
// access on views of any strides, and Call, a complete and valid set of arguments for every
// entry point as mutable views over owned tensors, which a test breaks one rule at a time.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/float8.hpp"
#include "core/half.hpp"
#include "flashattn/flashattn.hpp"
#include "test_util.hpp"

namespace fa_validation {

using fa_test::HostTensor;
using flashattn::AttentionOptions;
using flashattn::BackwardArgs;
using flashattn::Device;
using flashattn::DeviceType;
using flashattn::DType;
using flashattn::ErrorCode;
using flashattn::ForwardArgs;
using flashattn::TensorView;
using flashattn::VarlenArgs;

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
inline const Device kCuda0{DeviceType::kCUDA, 0};

// ---------------------------------------------------------------------------------------------
// Element access on views (any strides)
// ---------------------------------------------------------------------------------------------
template <class F>
inline void for_each_element(const TensorView& t, F f) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  const auto size = static_cast<int64_t>(flashattn::dtype_size(t.dtype));
  for (int64_t linear = 0; linear < n; ++linear) {
    int64_t rem = linear, off = 0;
    for (int i = t.ndim - 1; i >= 0; --i) {
      off += (rem % t.shape[i]) * t.strides[i];
      rem /= t.shape[i];
    }
    f(static_cast<std::byte*>(t.data) + off * size);
  }
}

inline bool is_nan_at(const std::byte* p, DType dtype) {
  uint16_t h;
  float f;
  double d;
  switch (dtype) {
    case DType::kFloat16:
      std::memcpy(&h, p, 2);
      return std::isnan(flashattn::core::fp16_to_float(h));
    case DType::kBFloat16:
      std::memcpy(&h, p, 2);
      return std::isnan(flashattn::core::bf16_to_float(h));
    case DType::kFloat32:
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    case DType::kFloat64:
      std::memcpy(&d, p, 8);
      return std::isnan(d);
    case DType::kInt32:
      return false;
    case DType::kFloat8E4M3:
      return std::isnan(flashattn::core::float8_to_float<flashattn::core::E4M3Format>(static_cast<uint8_t>(*p)));
    case DType::kFloat8E5M2:
      return std::isnan(flashattn::core::float8_to_float<flashattn::core::E5M2Format>(static_cast<uint8_t>(*p)));
  }
  return false;
}

// NaN bytes into every element of the view (and nothing else: views may interleave).
inline void poison(const TensorView& t) {
  const size_t size = flashattn::dtype_size(t.dtype);
  for_each_element(t, [&](std::byte* p) { std::memset(p, 0xFF, size); });
}

inline int64_t count_nan(const TensorView& t) {
  int64_t n = 0;
  for_each_element(t, [&](std::byte* p) { n += is_nan_at(p, t.dtype) ? 1 : 0; });
  return n;
}

inline int64_t numel(const TensorView& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// Bytes of the storage HostTensor allocates for a view of its own shape and strides.
inline size_t storage_bytes(const TensorView& t) {
  int64_t extent = 1;
  for (int i = 0; i < t.ndim; ++i) extent += (std::max<int64_t>(t.shape[i], 1) - 1) * t.strides[i];
  return static_cast<size_t>(extent) * flashattn::dtype_size(t.dtype);
}

inline TensorView with_device(TensorView t, Device d) {
  t.device = d;
  return t;
}

inline TensorView offset_bytes(TensorView t, int64_t bytes) {
  t.data = static_cast<std::byte*>(t.data) + bytes;
  return t;
}

// ---------------------------------------------------------------------------------------------
// A complete, valid set of arguments for every entry point, as mutable views over owned tensors.
// ---------------------------------------------------------------------------------------------
struct Dims {
  bool varlen = false;
  DType dtype = DType::kFloat32;
  int64_t batch = 2, seqlen_q = 3, seqlen_k = 5, heads_q = 4, heads_kv = 2, head_dim = 8;
  int64_t head_dim_v = 0;  // v's (out's, dout's, dv's); 0: head_dim
  // Varlen: sequence lengths (batch = their count) and unused rows after the last sequence.
  std::vector<int32_t> lens_q{2, 3}, lens_k{4, 5};
  int64_t pad_q = 1, pad_k = 0;
};

using Entry = std::pair<std::string, std::function<void()>>;

class Call {
 public:
  explicit Call(Dims d = {}) : d_(std::move(d)) {
    const DType dt = d_.dtype;
    const int64_t hq = d_.heads_q, hkv = d_.heads_kv, hd = d_.head_dim;
    const int64_t hdv = d_.head_dim_v > 0 ? d_.head_dim_v : hd;
    std::vector<int64_t> qs, ks, ls;
    if (!d_.varlen) {
      qs = {d_.batch, d_.seqlen_q, hq, hd};
      ks = {d_.batch, d_.seqlen_k, hkv, hd};
      ls = {d_.batch, hq, d_.seqlen_q};
    } else {
      total_q = std::accumulate(d_.lens_q.begin(), d_.lens_q.end(), int64_t{0}) + d_.pad_q;
      total_k = std::accumulate(d_.lens_k.begin(), d_.lens_k.end(), int64_t{0}) + d_.pad_k;
      qs = {total_q, hq, hd};
      ks = {total_k, hkv, hd};
      ls = {hq, total_q};
      vl.cu_seqlens_q = ints(prefix_sums(d_.lens_q));
      vl.cu_seqlens_k = ints(prefix_sums(d_.lens_k));
      vl.max_seqlen_q = d_.lens_q.empty() ? 0 : *std::max_element(d_.lens_q.begin(), d_.lens_q.end());
      vl.max_seqlen_k = d_.lens_k.empty() ? 0 : *std::max_element(d_.lens_k.begin(), d_.lens_k.end());
    }
    // out, dout and dv take v's head_dim.
    std::vector<int64_t> os = qs, vs = ks;
    os.back() = vs.back() = hdv;
    q = tensor(dt, qs);
    k = tensor(dt, ks);
    v = tensor(dt, vs);
    dout = tensor(dt, os);
    out = tensor(dt, os, {}, true);
    lse = tensor(DType::kFloat32, ls, {}, true);
    dq = tensor(dt, qs, {}, true);
    dk = tensor(dt, ks, {}, true);
    dv = tensor(dt, vs, {}, true);
  }

  bool varlen() const { return d_.varlen; }
  const Dims& dims() const { return d_; }
  int nd() const { return d_.varlen ? 3 : 4; }

  TensorView q, k, v, out, lse, dout, dq, dk, dv;
  TensorView dsink;  // absent unless a test sets it
  VarlenArgs vl;
  AttentionOptions opt;
  int64_t total_q = 0, total_k = 0;

  TensorView& operator[](const std::string& name) {
    if (name == "q") return q;
    if (name == "k") return k;
    if (name == "v") return v;
    if (name == "out") return out;
    if (name == "lse") return lse;
    if (name == "dout") return dout;
    if (name == "dq") return dq;
    if (name == "dk") return dk;
    return dv;
  }

  // A new owned tensor: random values, or NaN bytes when it is an output.
  TensorView tensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {}, bool output = false) {
    owned_.emplace_back(dtype, std::move(shape), std::move(strides));
    HostTensor& t = owned_.back();
    if (output) {
      t.fill_storage_nan();
    } else {
      auto rng = fa_test::rng_for("validation" + std::to_string(owned_.size()));
      t.fill_normal(rng, 1.0);
    }
    return t.view();
  }
  TensorView output(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
    return tensor(dtype, std::move(shape), std::move(strides), true);
  }
  TensorView ints(const std::vector<int32_t>& values) {
    owned_.emplace_back(DType::kInt32, std::vector<int64_t>{static_cast<int64_t>(values.size())});
    HostTensor& t = owned_.back();
    t.fill_storage_nan();
    for (size_t i = 0; i < values.size(); ++i) t.set(static_cast<int64_t>(i), values[i]);
    return t.view();
  }
  static std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lens) {
    std::vector<int32_t> cu{0};
    for (int32_t l : lens) cu.push_back(cu.back() + l);
    return cu;
  }

  // Shapes of the current q / k views, as vectors (for building replacements).
  std::vector<int64_t> shape_of(const TensorView& t) const { return std::vector<int64_t>(t.shape, t.shape + t.ndim); }

  ForwardArgs fwd_args() const {
    ForwardArgs a;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = out;
    a.lse = lse;
    return a;
  }
  BackwardArgs bwd_args() const {
    BackwardArgs a;
    a.dout = dout;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = out;
    a.lse = lse;
    a.dq = dq;
    a.dk = dk;
    a.dv = dv;
    a.dsink = dsink;
    return a;
  }

  // Entry points by role: fwd, fwd_ws, fwd_ref, bwd, bwd_ws, bwd_ref (dense or varlen form).
  Entry entry(const std::string& role) {
    namespace fa = flashattn;
    if (!d_.varlen) {
      if (role == "fwd") return {"forward", [this] { fa::forward(fwd_args(), opt); }};
      if (role == "fwd_ws")
        return {"forward_workspace_size", [this] { ws_ = fa::forward_workspace_size(fwd_args(), opt); }};
      if (role == "fwd_ref") return {"reference_forward", [this] { fa::reference_forward(fwd_args(), opt); }};
      if (role == "bwd") return {"backward", [this] { fa::backward(bwd_args(), opt); }};
      if (role == "bwd_ws")
        return {"backward_workspace_size", [this] { ws_ = fa::backward_workspace_size(bwd_args(), opt); }};
      return {"reference_backward", [this] { fa::reference_backward(bwd_args(), opt); }};
    }
    if (role == "fwd") return {"forward_varlen", [this] { fa::forward_varlen(fwd_args(), vl, opt); }};
    if (role == "fwd_ws")
      return {"forward_varlen_workspace_size",
              [this] { ws_ = fa::forward_varlen_workspace_size(fwd_args(), vl, opt); }};
    if (role == "fwd_ref")
      return {"reference_forward_varlen", [this] { fa::reference_forward_varlen(fwd_args(), vl, opt); }};
    if (role == "bwd") return {"backward_varlen", [this] { fa::backward_varlen(bwd_args(), vl, opt); }};
    if (role == "bwd_ws")
      return {"backward_varlen_workspace_size",
              [this] { ws_ = fa::backward_varlen_workspace_size(bwd_args(), vl, opt); }};
    return {"reference_backward_varlen", [this] { fa::reference_backward_varlen(bwd_args(), vl, opt); }};
  }

  // Every listed entry point throws `code` with all `parts` in what(), writing nothing.
  testing::AssertionResult fails(const std::vector<std::string>& roles, ErrorCode code,
                                 const std::vector<std::string>& parts) {
    for (const std::string& role : roles) {
      auto [name, call] = entry(role);
      const auto before = snapshot();
      std::string what;
      ErrorCode got{};
      bool threw = false;
      try {
        call();
      } catch (const flashattn::Error& e) {
        threw = true;
        got = e.code();
        what = e.what();
      } catch (const std::exception& e) {
        return testing::AssertionFailure() << name << ": threw a non-flashattn exception: " << e.what();
      }
      if (!threw) {
        return testing::AssertionFailure()
               << name << ": did not throw (expected code " << static_cast<int>(code) << ")";
      }
      if (got != code) {
        return testing::AssertionFailure() << name << ": code " << static_cast<int>(got) << " != expected "
                                           << static_cast<int>(code) << " (what: \"" << what << "\")";
      }
      for (const std::string& part : parts) {
        if (what.find(part) == std::string::npos) {
          return testing::AssertionFailure() << name << ": what() \"" << what << "\" lacks \"" << part << "\"";
        }
      }
      const auto after = snapshot();
      for (size_t i = 0; i < before.size(); ++i) {
        if (before[i] != after[i]) {
          return testing::AssertionFailure()
                 << name << ": failed call modified owned tensor #" << i << " (" << what << ")";
        }
      }
    }
    return testing::AssertionSuccess();
  }
  testing::AssertionResult fwd_fails(ErrorCode code, const std::vector<std::string>& parts) {
    return fails({"fwd", "fwd_ws", "fwd_ref"}, code, parts);
  }
  testing::AssertionResult bwd_fails(ErrorCode code, const std::vector<std::string>& parts) {
    return fails({"bwd", "bwd_ws", "bwd_ref"}, code, parts);
  }
  testing::AssertionResult all_fail(ErrorCode code, const std::vector<std::string>& parts) {
    return fails({"fwd", "fwd_ws", "fwd_ref", "bwd", "bwd_ws", "bwd_ref"}, code, parts);
  }
  // A bad value inside cu_seqlens / seqused_k: every call fails, while the workspace queries,
  // whose answer depends on shapes alone, leave the arrays unread and answer.
  testing::AssertionResult values_fail(ErrorCode code, const std::vector<std::string>& parts) {
    testing::AssertionResult failed = fails({"fwd", "fwd_ref", "bwd", "bwd_ref"}, code, parts);
    if (!failed) return failed;
    for (const char* role : {"fwd_ws", "bwd_ws"}) {
      testing::AssertionResult answered = runs(role, {});
      if (!answered) return answered;
    }
    return testing::AssertionSuccess();
  }

  // Runs the entry point; it must not throw, must write every element of `outputs` (poisoned
  // first), and the workspace queries must answer 0 (the CPU backend needs none).
  testing::AssertionResult runs(const std::string& role, std::vector<TensorView> outputs) {
    for (const TensorView& t : outputs) poison(t);
    auto [name, call] = entry(role);
    ws_ = 12345;
    try {
      call();
    } catch (const std::exception& e) {
      return testing::AssertionFailure() << name << ": threw \"" << e.what() << "\"";
    }
    if (role.find("_ws") != std::string::npos && ws_ != 0) {
      return testing::AssertionFailure() << name << ": answered " << ws_ << " bytes, CPU needs 0";
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (const int64_t n = count_nan(outputs[i])) {
        return testing::AssertionFailure() << name << ": output #" << i << " has " << n << " NaN elements of "
                                           << numel(outputs[i]) << " (left unwritten?)";
      }
    }
    return testing::AssertionSuccess();
  }

  // Forward (flash then reference), then backward on the reference's out / lse.
  void expect_all_run(bool backward = true) {
    std::vector<TensorView> fo{out};
    if (lse.present()) fo.push_back(lse);
    EXPECT_TRUE(runs("fwd_ws", {}));
    EXPECT_TRUE(runs("fwd", fo));
    EXPECT_TRUE(runs("fwd_ref", fo));
    if (!backward) return;
    EXPECT_TRUE(runs("bwd_ws", {}));
    std::vector<TensorView> bo{dq, dk, dv};
    if (dsink.present()) bo.push_back(dsink);
    EXPECT_TRUE(runs("bwd", bo));
    EXPECT_TRUE(runs("bwd_ref", bo));
  }

 private:
  std::vector<std::vector<std::byte>> snapshot() const {
    std::vector<std::vector<std::byte>> s;
    for (const HostTensor& t : owned_) {
      const TensorView view = t.view();
      const auto* p = static_cast<const std::byte*>(view.data);
      s.emplace_back(p, p + storage_bytes(view));
    }
    return s;
  }

  Dims d_;
  std::deque<HostTensor> owned_;
  size_t ws_ = 0;
};

// Runs f on a dense and on a varlen setup built from d.
template <class F>
inline void each_mode(F f, Dims d = {}) {
  for (bool varlen : {false, true}) {
    SCOPED_TRACE(varlen ? "varlen" : "dense");
    d.varlen = varlen;
    Call s(d);
    f(s);
  }
}

inline Dims varlen_dims() {
  Dims d;
  d.varlen = true;
  return d;
}

inline constexpr ErrorCode kArg = ErrorCode::kInvalidArgument;
inline constexpr ErrorCode kDtype = ErrorCode::kInvalidDtype;

}  // namespace fa_validation

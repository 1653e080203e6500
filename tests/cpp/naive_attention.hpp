// The test oracle shared by the CPU and GPU suites: the test case description, a naive
// attention computed in the tested dtype's precision (the baseline of the tolerance rule of
// docs/CONVENTIONS.md), and the rule itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace fa_test {

struct Case {
  flashattn::DType dtype = flashattn::DType::kFloat32;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads_q = 6, heads_kv = 6, head_dim = 64;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  float dropout = 0.0f;
  bool precise = false;
  // Varlen: per-sequence lengths (then batch/seqlen_* are ignored); seqused_k optional.
  std::vector<int32_t> lens_q, lens_k, used_k;
  bool strided = false;  // q/k/v as slices of a packed qkv layout, dout[:, ::2]
  bool backward = true;
  double input_scale = 1.0;  // stddev of q and k (x5 tests large logits)

  bool varlen() const { return !lens_q.empty(); }
  std::string name() const;
};

// Per-sequence starts and lengths in the q / k tensors; dense tensors are row-major
// [b, s, h, d], varlen ones [total, h, d] with a few trailing rows that belong to no sequence.
struct Geometry {
  int64_t batch, hq, hkv, d;
  std::vector<int64_t> q_start, k_start, len_q, len_k;
  int64_t rows_q, rows_k;  // tensor rows: total tokens (varlen) or seqlen (dense, per batch)
  bool varlen;

  // Linear index of element (b, i, h, c) in a q-like (heads hq) or k-like tensor.
  int64_t q_index(int64_t b, int64_t i, int64_t h, int64_t c) const {
    const int64_t row = varlen ? q_start[b] + i : b * rows_q + i;
    return (row * hq + h) * d + c;
  }
  int64_t k_index(int64_t b, int64_t j, int64_t h, int64_t c) const {
    const int64_t row = varlen ? k_start[b] + j : b * rows_k + j;
    return (row * hkv + h) * d + c;
  }
  int64_t lse_index(int64_t b, int64_t i, int64_t h) const {
    return varlen ? h * rows_q + q_start[b] + i : (b * hq + h) * rows_q + i;
  }
};

Geometry make_geometry(const Case& c);

struct NaiveResult {
  std::vector<double> out, lse, dq, dk, dv;  // dq / dk / dv only when c.backward
};

// Naive attention on row-major copies of the inputs (in Geometry's layout): fp32 arithmetic
// (fp64 for fp64 cases), P and dS rounded to the dtype before the GEMMs that consume them, as
// a tensor-core or SIMD kernel sees them. alibi: slopes [heads_q]; dout unused without backward.
NaiveResult naive_attention(const Case& c, const Geometry& g, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v,
                            const std::vector<double>& dout, const std::vector<double>& alibi,
                            uint64_t dropout_seed, uint64_t dropout_offset);

double max_finite_abs(const std::vector<double>& x);

// The tolerance rule: max error <= factor * naive's max error + atol, the same for the mean
// (factor 2 for outputs, 3 for gradients). Updates *err_out / *bound_out with the maxima.
void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                  const std::vector<double>& naive, double factor, flashattn::DType dtype,
                  const std::string& name, double* err_out, double* bound_out, double scale_floor = 0);

// LSE (fp32) by the rule with factor 2, at a rounding scale of at least 1: an LSE near 0 (one
// visible key whose logit cancels to ~0) carries the rounding of the q.k terms it sums, which a
// tensor core's fp32 accumulation (truncating, aligned to the largest term) makes larger than the
// naive sequential FMAs do. Seen on an H200: 5.6e-8 off an LSE of 0.003 (fp16, d128, one key),
// where the scale |LSE| gave a bound of 4e-8.
inline constexpr double kLseScaleFloor = 1.0;
void expect_lse_close(const std::vector<double>& got, const std::vector<double>& ref,
                      const std::vector<double>& naive, const std::string& name, double* err_out,
                      double* bound_out, const char* what = "lse");

// dq, dk, dv by the rule with factor 3. The three share one rounding scale: a gradient that is
// exactly 0 (one visible key) is computed as a difference of terms of the size of the others.
struct Grads {
  std::vector<double> dq, dk, dv;
};
void expect_grads_close(const Grads& got, const Grads& ref, const NaiveResult& naive,
                        flashattn::DType dtype, const std::string& name, double* err_out,
                        double* bound_out);

}  // namespace fa_test

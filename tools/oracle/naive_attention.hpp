// A naive attention computed in the checked dtype's precision: the baseline of the tolerance
// rule of docs/CONVENTIONS.md (tolerance.hpp). The C++ tests and `flashattn run` share it, with
// the description of the problem it runs on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn_oracle {

// One attention problem: dtype, shape (or varlen lengths), mask, score mods, dropout. The test
// suites' cases are these; `strided` and `input_scale` only say how a test lays out and fills
// its inputs, the naive attention does not read them.
struct Case {
  flashattn::DType dtype = flashattn::DType::kFloat32;  // q's, k's and v's
  // FP8 inputs (dtype float8): out's dtype, bfloat16 or float16; otherwise out has dtype.
  flashattn::DType out_dtype = flashattn::DType::kBFloat16;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads_q = 6, heads_kv = 6, head_dim = 64;
  int64_t head_dim_v = 0;  // v's, out's and dout's head_dim; 0: head_dim (q's and k's)
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  int64_t sink_tokens = 0;  // keys exempt from window_left
  float softcap = 0.0f;
  bool alibi = false;
  bool sink = false;  // a learnable sink per query head
  float dropout = 0.0f;
  bool precise = false;
  // Varlen: per-sequence lengths (then batch/seqlen_* are ignored); seqused_k optional.
  std::vector<int32_t> lens_q, lens_k, used_k;
  bool strided = false;  // q/k/v as slices of a packed qkv layout, dout[:, ::2]
  bool backward = true;
  double input_scale = 1.0;  // stddev of q and k (x5 tests large logits)

  bool varlen() const { return !lens_q.empty(); }
  bool float8() const { return dtype == flashattn::DType::kFloat8E4M3 || dtype == flashattn::DType::kFloat8E5M2; }
  flashattn::DType result_dtype() const { return float8() ? out_dtype : dtype; }  // out's
  int64_t value_head_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  std::string name() const;
};

// Per-sequence starts and lengths in the q / k tensors; dense tensors are row-major
// [b, s, h, d], varlen ones [total, h, d] with a few trailing rows that belong to no sequence.
// q and k rows are d wide, v, out and dout rows dv.
struct Geometry {
  int64_t batch, hq, hkv, d, dv;
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
  // The same in an out-like (q's rows, dv wide) or v-like tensor.
  int64_t out_index(int64_t b, int64_t i, int64_t h, int64_t c) const {
    const int64_t row = varlen ? q_start[b] + i : b * rows_q + i;
    return (row * hq + h) * dv + c;
  }
  int64_t v_index(int64_t b, int64_t j, int64_t h, int64_t c) const {
    const int64_t row = varlen ? k_start[b] + j : b * rows_k + j;
    return (row * hkv + h) * dv + c;
  }
  int64_t lse_index(int64_t b, int64_t i, int64_t h) const {
    return varlen ? h * rows_q + q_start[b] + i : (b * hq + h) * rows_q + i;
  }
};

Geometry make_geometry(const Case& c);

struct NaiveResult {
  std::vector<double> out, lse, dq, dk, dv;  // dq / dk / dv only when c.backward
  std::vector<double> dsink;                 // [heads_q], with a sink and c.backward
  // The largest over heads of sum_i |P_sink,i * D_i|: the magnitude of d sink's terms, its
  // rounding scale (tolerance.hpp's judge_dsink).
  double dsink_scale = 0;
};

// Naive attention on row-major copies of the inputs (in Geometry's layout; out, dout and dv
// out-like / v-like, dv wide): fp32 arithmetic
// (fp64 for fp64 cases), P and dS rounded to the dtype before the GEMMs that consume them, as
// a tensor-core or SIMD kernel sees them. FP8 inputs: the copies hold the dequantised values
// (exact in fp32), P is rounded to the FP8 dtype (an FP8 GEMM's operand) and out to out_dtype. alibi: slopes [heads_q]; dout unused without backward.
// The dropout keep-mask is that of (batch, head) bh at stream bh + dropout_offset. sink: the
// learnable sink's logits [heads_q], or empty for none.
NaiveResult naive_attention(const Case& c, const Geometry& g, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>& dout,
                            const std::vector<double>& alibi, uint64_t dropout_seed, uint64_t dropout_offset,
                            const std::vector<double>& sink = {});

// x rounded to dtype (round to nearest even), as a tensor of that dtype stores it.
double round_to(flashattn::DType dtype, double x);

}  // namespace flashattn_oracle

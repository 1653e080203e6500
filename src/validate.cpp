// Argument validation: every constraint of the API is checked here, before any tensor is read
// or written, and turned into a Problem that the backends trust.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/mask.hpp"
#include "core/philox.hpp"
#include "core/variant.hpp"
#include "problem.hpp"
#include "tensor_checks.hpp"
#include "validate_common.hpp"

namespace flashattn::detail {
namespace {

// Dense calls: no cu_seqlens / seqused_k to keep outputs away from.
const VarlenArgs kNoVarlen{};

}  // namespace

// A number for an error message, shortest form ("%g"), through snprintf rather than iostreams:
// no locale state is involved in formatting an error.
std::string float_str(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

void check_same_device(const char* name, const TensorView& t, const TensorView& q) {
  if (!(t.device == q.device)) {
    fail(ErrorCode::kInvalidArgument,
         std::string(name) + ": on " + device_str(t.device) + " but q is on " + device_str(q.device));
  }
}

// q, k, v, out (and dout, dq, dk, dv) share one floating dtype, but for FP8 inputs.
void check_value_tensor(const char* name, const TensorView& t, const TensorView& q, int ndim) {
  check_value_tensor_as(name, t, q, ndim, q.dtype, "q dtype");
}

void check_value_tensor_as(const char* name, const TensorView& t, const TensorView& q, int ndim, DType dtype,
                           const char* dtype_what) {
  check_tensor(name, t, ndim);
  if (!is_value_dtype(t.dtype) && !is_float8_dtype(t.dtype)) {
    fail(ErrorCode::kInvalidDtype, std::string(name) + ": dtype " + std::string(dtype_name(t.dtype)) +
                                       " is not one of float16, bfloat16, float32, float64, float8_e4m3fn, "
                                       "float8_e5m2");
  }
  if (t.dtype != dtype) {
    fail(ErrorCode::kInvalidDtype, std::string(name) + ": dtype " + std::string(dtype_name(t.dtype)) +
                                       " != " + dtype_what + " " + std::string(dtype_name(dtype)));
  }
  check_same_device(name, t, q);
  // An empty tensor's strides are meaningless (numpy's DLPack export gives them as 0).
  const bool empty = std::any_of(t.shape, t.shape + ndim, [](int64_t n) { return n == 0; });
  if (!empty && t.strides[ndim - 1] != 1 && t.shape[ndim - 1] > 1) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": head_dim stride " + std::to_string(t.strides[ndim - 1]) +
                                          " must be 1 (the last dimension must be contiguous)");
  }
}

DType output_dtype(const char* name, const TensorView& out, const char* input_name, DType input_dtype) {
  if (!is_float8_dtype(input_dtype)) return input_dtype;
  if (out.dtype != DType::kBFloat16 && out.dtype != DType::kFloat16) {
    fail(ErrorCode::kInvalidDtype, std::string(name) + ": dtype " + dtype_name(out.dtype) + " with " + input_name +
                                       " " + dtype_name(input_dtype) +
                                       ": float8 inputs give a bfloat16 or float16 output (FP8 output is not "
                                       "supported)");
  }
  return out.dtype;
}

core::Descale check_descale(const char* name, const TensorView& t, const TensorView& q, const char* operand_name,
                            DType operand_dtype, const Problem& p, int64_t heads_per_kv_head) {
  core::Descale descale;
  if (!t.present()) return descale;
  if (!is_float8_dtype(operand_dtype)) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": given for " + operand_name + " of dtype " +
                                          dtype_name(operand_dtype) + " (descale factors apply to float8 inputs only)");
  }
  check_tensor(name, t, 2);
  if (t.dtype != DType::kFloat32) {
    fail(ErrorCode::kInvalidDtype,
         std::string(name) + ": dtype " + std::string(dtype_name(t.dtype)) + " must be float32");
  }
  check_same_device(name, t, q);
  check_dim(name, t, 0, "batch", p.batch, "batch");
  check_dim(name, t, 1, "heads", p.heads_kv, "heads_kv");
  descale.data = static_cast<const float*>(t.data);
  descale.batch_stride = t.strides[0];
  descale.head_stride = t.strides[1];
  descale.heads_per_kv_head = heads_per_kv_head;
  return descale;
}

void check_same_shape(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  for (int i = 0; i < ref.ndim; ++i) {
    if (t.shape[i] != ref.shape[i]) {
      fail(ErrorCode::kInvalidArgument,
           std::string(name) + ": shape " + shape_str(t) + " != " + ref_name + " shape " + shape_str(ref));
    }
  }
}

// q's shape with v's head_dim: out and dout (v's head_dim may differ from q's and k's), and the
// KV-cache call's out.
void check_like_q_with_v_head_dim(const char* name, const TensorView& t, const TensorView& q, const Problem& p) {
  if (p.head_dim_v == p.head_dim) {  // one head_dim: the message names q's shape
    check_same_shape(name, t, "q", q);
    return;
  }
  TensorView expected = q;
  expected.shape[q.ndim - 1] = p.head_dim_v;
  for (int i = 0; i < q.ndim; ++i) {
    if (t.shape[i] != expected.shape[i]) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": shape " + shape_str(t) + " != " + shape_str(expected) +
                                            ", q's shape with v's head_dim (v's head_dim " +
                                            std::to_string(p.head_dim_v) + " differs from q's " +
                                            std::to_string(p.head_dim) + ")");
    }
  }
}

void check_dim(const char* name, const TensorView& t, int dim, const char* what, int64_t expected,
               const char* ref_what) {
  if (t.shape[dim] != expected) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": " + what + " " + std::to_string(t.shape[dim]) +
                                          " != " + ref_what + " " + std::to_string(expected));
  }
}

Operand operand(const TensorView& t, bool varlen) {
  Operand o;
  o.data = t.data;
  if (varlen) {  // [total, h, d]
    o.layout = {0, t.strides[0], t.strides[1]};
  } else {  // [b, s, h, d]
    o.layout = {t.strides[0], t.strides[1], t.strides[2]};
  }
  return o;
}

// LSE: dense [b, h, sq] -> offset(b, i, h); varlen [h, total_q] -> batch stride 0.
Operand lse_operand(const TensorView& t, bool varlen) {
  Operand o;
  o.data = t.data;
  if (varlen) {
    o.layout = {0, t.strides[1], t.strides[0]};
  } else {
    o.layout = {t.strides[0], t.strides[2], t.strides[1]};
  }
  return o;
}

void check_lse(const TensorView& lse, const TensorView& q, const Problem& p, bool varlen) {
  check_tensor("lse", lse, varlen ? 2 : 3);
  if (lse.dtype != DType::kFloat32) {
    fail(ErrorCode::kInvalidDtype, "lse: dtype " + std::string(dtype_name(lse.dtype)) + " must be float32");
  }
  check_same_device("lse", lse, q);
  if (varlen) {
    check_dim("lse", lse, 0, "heads", p.heads_q, "q heads");
    check_dim("lse", lse, 1, "total_q", q.shape[0], "q total_q");
  } else {
    check_dim("lse", lse, 0, "batch", p.batch, "q batch");
    check_dim("lse", lse, 1, "heads", p.heads_q, "q heads");
    check_dim("lse", lse, 2, "seqlen", p.seqlen_q, "q seqlen");
  }
}

void check_head_vector(const char* name, const TensorView& t, const TensorView& q, int64_t heads) {
  check_tensor(name, t, 1);
  if (t.dtype != DType::kFloat32) {
    fail(ErrorCode::kInvalidDtype,
         std::string(name) + ": dtype " + std::string(dtype_name(t.dtype)) + " must be float32");
  }
  check_same_device(name, t, q);
  check_dim(name, t, 0, "heads", heads, "q heads");
}

void check_options(const AttentionOptions& o, Problem& p, const TensorView& q) {
  const MaskOptions& m = o.mask;
  if (m.window_left < -1) {
    fail(ErrorCode::kInvalidArgument,
         "window_left: " + std::to_string(m.window_left) + " must be >= -1 (-1 = unbounded)");
  }
  if (m.window_right < -1) {
    fail(ErrorCode::kInvalidArgument,
         "window_right: " + std::to_string(m.window_right) + " must be >= -1 (-1 = unbounded)");
  }
  if (m.causal && m.window_right > 0) {
    fail(ErrorCode::kInvalidArgument,
         "window_right: " + std::to_string(m.window_right) + " conflicts with causal (causal means window_right 0)");
  }
  // A window side wider than any sequence restricts nothing: it is unbounded. Every sequence is
  // shorter than kUnboundedWindow tokens (its tensors' byte sizes fit 64 bits), so folding wider
  // sides into -1 changes no result and keeps the mask arithmetic (diag(i) -+ window) in int64.
  auto side = [](int64_t w) { return w >= core::kUnboundedWindow ? int64_t{-1} : w; };
  p.mask.window_left = side(m.window_left);
  p.mask.window_right = m.causal ? 0 : side(m.window_right);
  if (m.sink_tokens < 0) {
    fail(ErrorCode::kInvalidArgument, "sink_tokens: " + std::to_string(m.sink_tokens) + " must be >= 0");
  }
  // Past every key they change nothing; kept below kUnboundedWindow, the mask's sums stay in int64.
  p.mask.sink_tokens = std::min(m.sink_tokens, core::kUnboundedWindow);

  const ScoreOptions& s = o.score;
  if (!std::isfinite(s.softmax_scale)) {
    fail(ErrorCode::kInvalidArgument, "softmax_scale: must be finite");
  }
  p.score.scale = s.softmax_scale != 0.0 ? s.softmax_scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  // The kernels take the scale as fp32 with log2(e) folded in, and softcap as fp32 with its
  // inverse: each must be a normal fp32 number there, or every score becomes inf, 0 or NaN.
  auto normal_fp32 = [](double x) { return std::isnormal(static_cast<float>(x)); };
  if (!normal_fp32(p.score.scale * core::kLog2e)) {
    fail(ErrorCode::kInvalidArgument,
         "softmax_scale: " + float_str(p.score.scale) + " times log2(e) is not a normal fp32 number (0 = the default)");
  }
  if (!std::isfinite(s.softcap) || s.softcap < 0.0f) {
    fail(ErrorCode::kInvalidArgument, "softcap: " + float_str(s.softcap) + " must be finite and >= 0 (0 = off)");
  }
  if (s.softcap > 0.0f && !(normal_fp32(s.softcap * core::kLog2e) && normal_fp32(1.0 / s.softcap))) {
    fail(ErrorCode::kInvalidArgument,
         "softcap: " + float_str(s.softcap) + " is out of fp32's normal range (with its inverse and log2(e))");
  }
  p.score.softcap = s.softcap;

  if (s.alibi_slopes.present()) {
    const TensorView& a = s.alibi_slopes;
    if (a.ndim != 1 && a.ndim != 2) {
      fail(ErrorCode::kInvalidArgument,
           "alibi_slopes: ndim " + std::to_string(a.ndim) + " must be 1 [heads] or 2 [batch, heads]");
    }
    check_tensor("alibi_slopes", a, a.ndim);
    if (a.dtype != DType::kFloat32) {
      fail(ErrorCode::kInvalidDtype, "alibi_slopes: dtype " + std::string(dtype_name(a.dtype)) + " must be float32");
    }
    check_same_device("alibi_slopes", a, q);
    check_dim("alibi_slopes", a, a.ndim - 1, "heads", p.heads_q, "q heads");
    if (a.ndim == 2) check_dim("alibi_slopes", a, 0, "batch", p.batch, "batch");
    p.score.alibi = static_cast<const float*>(a.data);
    p.score.alibi_head_stride = a.strides[a.ndim - 1];
    p.score.alibi_batch_stride = a.ndim == 2 ? a.strides[0] : 0;
  }
  if (s.learnable_sink.present()) {
    check_head_vector("learnable_sink", s.learnable_sink, q, p.heads_q);
    p.score.sink = static_cast<const float*>(s.learnable_sink.data);
    p.score.sink_stride = s.learnable_sink.strides[0];
  }

  const DropoutOptions& d = o.dropout;
  if (!(d.p >= 0.0f && d.p < 1.0f)) {  // also rejects NaN
    fail(ErrorCode::kInvalidArgument, "dropout_p: " + float_str(d.p) + " must be in [0, 1)");
  }
  p.dropout.p = d.p;
  p.dropout.seed = d.seed;
  p.dropout.offset = d.offset;
  p.dropout.threshold = core::dropout_threshold(d.p);  // 0 iff p == 0

  p.deterministic = o.deterministic;
  p.precise = o.precise;
}

void check_int_vector(const char* name, const TensorView& t, const TensorView& q) {
  check_tensor(name, t, 1);
  if (t.dtype != DType::kInt32) {
    fail(ErrorCode::kInvalidDtype,
         std::string(name) + ": dtype " + std::string(dtype_name(t.dtype)) + " must be int32");
  }
  check_same_device(name, t, q);
  if (t.strides[0] != 1 && t.shape[0] > 1) {
    fail(ErrorCode::kInvalidArgument,
         std::string(name) + ": must be contiguous (stride " + std::to_string(t.strides[0]) + ")");
  }
}

void check_device_runs_lengths(const char* name, const char* what, const TensorView& q) {
  if (q.device.type == DeviceType::kCPU) return;
  const std::string head = std::string(name) + ": " + what + " on " + device_str(q.device);
  if (!cuda_compiled()) {
    fail(ErrorCode::kUnsupported, head + " needs the CUDA backend, which this build does not provide");
  }
  if (q.device.index >= cuda_device_count()) {  // never hand a host pointer to the driver
    fail(ErrorCode::kUnsupported,
         head + " needs a CUDA device; this process sees " + std::to_string(cuda_device_count()));
  }
}

const int32_t* HostIndices::add(const int32_t* src, int64_t n, std::vector<int32_t>& copy) {
  if (device_.type == DeviceType::kCPU || src == nullptr) return src;
  copy.resize(static_cast<size_t>(n));
  if (n > 0) copies_.push_back({copy.data(), src, copy.size() * sizeof(int32_t)});
  return copy.data();
}

const int32_t* HostIndices::add_block_table(const TensorView& t, std::vector<int32_t>& copy) {
  const auto* table = static_cast<const int32_t*>(t.data);
  if (t.shape[0] == 0 || t.shape[1] == 0) return table;
  return add(table, (t.shape[0] - 1) * t.strides[0] + t.shape[1], copy);
}

void HostIndices::fetch() {
  if (!copies_.empty()) copy_to_host(copies_, device_, stream_);
  copies_.clear();
}

void check_block_table(const TensorView& t, const TensorView& q, int64_t batch) {
  check_tensor("block_table", t, 2);
  if (t.dtype != DType::kInt32) {
    fail(ErrorCode::kInvalidDtype, std::string("block_table: dtype ") + dtype_name(t.dtype) + " must be int32");
  }
  check_same_device("block_table", t, q);
  check_dim("block_table", t, 0, "batch", batch, "batch");
  if (t.strides[1] != 1 && t.shape[1] > 1) {
    fail(ErrorCode::kInvalidArgument,
         "block_table: last dimension stride " + std::to_string(t.strides[1]) + " must be 1");
  }
}

void check_pages(const int32_t* table, const CacheRows& rows, int64_t b, int64_t first, int64_t end, int64_t blocks) {
  for (int64_t page = first / rows.page_size; page * rows.page_size < end; ++page) {
    const int32_t block = table[b * rows.block_table_stride + page];
    if (block < 0 || block >= blocks) {
      fail(ErrorCode::kInvalidArgument, "block_table: entry [" + std::to_string(b) + ", " + std::to_string(page) +
                                            "] is " + std::to_string(block) + ", outside [0, " +
                                            std::to_string(blocks) + ") (k blocks)");
    }
  }
}

namespace {

// Checks cu_seqlens / seqused_k: their shapes, then (LengthValues::kCheck) their values, in place
// on the host or copied from the device (a stream synchronisation per call: the price of a clear
// error before any kernel reads a bad offset), or, device tensors under IndexCheck::kDevice, on
// the device by the backend (the same rules: cuda/varlen_checks.cuh).
// With a block_table, k / v are pages [num_blocks, page_size, hkv, d] and cu_seqlens_k gives
// each sequence's length (its keys are positions 0.. of its pages; p.k.cache locates them).
void check_varlen(const VarlenArgs& vl, const TensorView& q, const TensorView& k, Problem& p, void* stream,
                  LengthValues lengths) {
  const bool paged = vl.block_table.present();
  if (!vl.cu_seqlens_q.present()) fail(ErrorCode::kInvalidArgument, "cu_seqlens_q: missing");
  if (!vl.cu_seqlens_k.present()) fail(ErrorCode::kInvalidArgument, "cu_seqlens_k: missing");
  check_int_vector("cu_seqlens_q", vl.cu_seqlens_q, q);
  check_int_vector("cu_seqlens_k", vl.cu_seqlens_k, q);
  if (vl.cu_seqlens_q.shape[0] < 1) {
    fail(ErrorCode::kInvalidArgument, "cu_seqlens_q: needs batch + 1 >= 1 entries, has 0");
  }
  p.batch = vl.cu_seqlens_q.shape[0] - 1;
  check_dim("cu_seqlens_k", vl.cu_seqlens_k, 0, "length", p.batch + 1, "cu_seqlens_q length");
  if (paged) {
    check_block_table(vl.block_table, q, p.batch);
    if (k.shape[1] < 1) fail(ErrorCode::kInvalidArgument, "k: page size (dim 1) must be >= 1 with block_table");
    p.k.cache.block_table = static_cast<const int32_t*>(vl.block_table.data);
    p.k.cache.block_table_stride = vl.block_table.strides[0];
    p.k.cache.page_size = k.shape[1];
    p.table_columns = vl.block_table.shape[1];
  }
  if (vl.max_seqlen_q < 0) fail(ErrorCode::kInvalidArgument, "max_seqlen_q: must be >= 0");
  if (vl.max_seqlen_k < 0) fail(ErrorCode::kInvalidArgument, "max_seqlen_k: must be >= 0");
  if (vl.seqused_k.present()) {
    check_int_vector("seqused_k", vl.seqused_k, q);
    check_dim("seqused_k", vl.seqused_k, 0, "length", p.batch, "batch");
  }
  p.total_q = q.shape[0];
  p.total_k = k.shape[0];
  p.max_seqlen_q = vl.max_seqlen_q;
  p.max_seqlen_k = vl.max_seqlen_k;
  const auto* cu_q = static_cast<const int32_t*>(vl.cu_seqlens_q.data);
  const auto* cu_k = static_cast<const int32_t*>(vl.cu_seqlens_k.data);
  const auto* used = static_cast<const int32_t*>(vl.seqused_k.data);
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.seqused_k = used;
  check_device_runs_lengths("cu_seqlens_q", "varlen", q);
  if (vl.index_check != IndexCheck::kHost && vl.index_check != IndexCheck::kDevice) {
    fail(ErrorCode::kInvalidArgument,
         "index_check: " + std::to_string(static_cast<int64_t>(vl.index_check)) + " is neither kHost nor kDevice");
  }
  p.device_checks_lengths = vl.index_check == IndexCheck::kDevice && q.device.type != DeviceType::kCPU;
  if (lengths == LengthValues::kUnread || p.device_checks_lengths) return;
  HostIndices indices(q.device, stream);
  cu_q = indices.add(cu_q, p.batch + 1, p.host_cu_seqlens_q);
  cu_k = indices.add(cu_k, p.batch + 1, p.host_cu_seqlens_k);
  used = indices.add(used, p.batch, p.host_seqused_k);
  std::vector<int32_t> table_copy;
  const int32_t* table = paged ? indices.add_block_table(vl.block_table, table_copy) : nullptr;
  indices.fetch();
  auto check_prefix = [&](const char* name, const int32_t* cu, int64_t total, int64_t max_len, const char* max_name) {
    if (cu[0] < 0) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": entry 0 is " + std::to_string(cu[0]) + " < 0");
    }
    for (int64_t b = 0; b < p.batch; ++b) {
      if (cu[b + 1] < cu[b]) {
        fail(ErrorCode::kInvalidArgument, std::string(name) + ": not monotone at entry " + std::to_string(b + 1) +
                                              " (" + std::to_string(cu[b + 1]) + " < " + std::to_string(cu[b]) + ")");
      }
      if (cu[b + 1] - cu[b] > max_len) {
        fail(ErrorCode::kInvalidArgument, std::string(max_name) + ": " + std::to_string(max_len) + " < length " +
                                              std::to_string(cu[b + 1] - cu[b]) + " of sequence " + std::to_string(b));
      }
    }
    if (cu[p.batch] > total) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": last entry " + std::to_string(cu[p.batch]) +
                                            " is past the end of the tensor (" + std::to_string(total) + " tokens)");
    }
  };
  check_prefix("cu_seqlens_q", cu_q, q.shape[0], vl.max_seqlen_q, "max_seqlen_q");
  // Paged keys are read through the table, not from packed rows: no end of tensor to check.
  check_prefix("cu_seqlens_k", cu_k, paged ? std::numeric_limits<int64_t>::max() : k.shape[0], vl.max_seqlen_k,
               "max_seqlen_k");
  if (used) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t len = cu_k[b + 1] - cu_k[b];
      if (used[b] < 0 || used[b] > len) {
        fail(ErrorCode::kInvalidArgument, "seqused_k: entry " + std::to_string(b) + " is " + std::to_string(used[b]) +
                                              ", outside [0, " + std::to_string(len) + "]");
      }
    }
  }
  if (paged) {
    const CacheRows& rows = p.k.cache;
    const int64_t capacity = vl.block_table.shape[1] * rows.page_size;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t len = used ? used[b] : cu_k[b + 1] - cu_k[b];
      if (len > capacity) {
        fail(ErrorCode::kInvalidArgument,
             "cu_seqlens_k: sequence " + std::to_string(b) + " has " + std::to_string(len) + " keys, more than its " +
                 std::to_string(vl.block_table.shape[1]) + " pages of " + std::to_string(rows.page_size) + " hold");
      }
      check_pages(table, rows, b, 0, len, k.shape[0]);
    }
  }
}

// Shapes and dtypes of q, k, v (and the problem dimensions derived from them).
Problem check_qkv(const TensorView& q, const TensorView& k, const TensorView& v, const VarlenArgs* varlen, void* stream,
                  LengthValues lengths) {
  const bool vl = varlen != nullptr;
  const bool paged = vl && varlen->block_table.present();
  const int nd = vl ? 3 : 4, k_nd = paged ? 4 : nd;  // paged k / v: [blocks, page_size, hkv, d]
  const int hdim = nd - 2, ddim = nd - 1;
  if (!q.present()) fail(ErrorCode::kInvalidArgument, "q: missing");
  check_value_tensor("q", q, q, nd);
  check_value_tensor("k", k, q, k_nd);
  check_value_tensor("v", v, q, k_nd);
  Problem p;
  p.dtype = p.q_dtype = p.kv_dtype = q.dtype;  // a forward's out may differ: FP8 inputs
  p.device = q.device;
  p.heads_q = q.shape[hdim];
  p.heads_kv = k.shape[k_nd - 2];
  p.head_dim = q.shape[ddim];
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    fail(ErrorCode::kInvalidArgument,
         "q: head_dim " + std::to_string(p.head_dim) + " outside [1, " + std::to_string(kMaxHeadDim) + "]");
  }
  check_dim("k", k, k_nd - 1, "head_dim", p.head_dim, "q head_dim");
  // v may have a head_dim of its own (multi-head latent attention), which out then has; its
  // other dims are k's.
  p.head_dim_v = v.shape[k_nd - 1];
  if (p.head_dim_v < 1 || p.head_dim_v > kMaxHeadDim) {
    fail(ErrorCode::kInvalidArgument,
         "v: head_dim " + std::to_string(p.head_dim_v) + " outside [1, " + std::to_string(kMaxHeadDim) + "]");
  }
  for (int i = 0; i < k_nd - 1; ++i) {
    if (v.shape[i] != k.shape[i]) {
      fail(ErrorCode::kInvalidArgument,
           "v: shape " + shape_str(v) + " != k shape " + shape_str(k) + " (v may differ from k in head_dim alone)");
    }
  }
  if (p.heads_q < 1) fail(ErrorCode::kInvalidArgument, "q: heads must be >= 1");
  if (p.heads_kv < 1) fail(ErrorCode::kInvalidArgument, "k: heads must be >= 1");
  if (p.heads_q % p.heads_kv != 0) {
    fail(ErrorCode::kInvalidArgument,
         "k: heads " + std::to_string(p.heads_kv) + " must divide q heads " + std::to_string(p.heads_q));
  }
  if (!vl) {
    p.batch = q.shape[0];
    p.seqlen_q = p.max_seqlen_q = q.shape[1];
    p.seqlen_k = p.max_seqlen_k = k.shape[1];
    check_dim("k", k, 0, "batch", p.batch, "q batch");
  } else {
    check_varlen(*varlen, q, k, p, stream, lengths);
  }
  return p;
}

}  // namespace

Problem validate_forward(const ForwardArgs& a, const VarlenArgs* varlen, const AttentionOptions& options, void* stream,
                         LengthValues lengths) {
  const bool vl = varlen != nullptr;
  Problem p = check_qkv(a.q, a.k, a.v, varlen, stream, lengths);
  p.dtype = output_dtype("out", a.out, "q", p.q_dtype);
  check_value_tensor_as("out", a.out, a.q, vl ? 3 : 4, p.dtype, "q dtype");
  check_like_q_with_v_head_dim("out", a.out, a.q, p);
  if (a.lse.present()) check_lse(a.lse, a.q, p, vl);
  const core::Descale q_descale = check_descale("q_descale", a.q_descale, a.q, "q", p.q_dtype, p, p.group_size());
  const core::Descale k_descale = check_descale("k_descale", a.k_descale, a.q, "k", p.kv_dtype, p, 1);
  const core::Descale v_descale = check_descale("v_descale", a.v_descale, a.q, "v", p.kv_dtype, p, 1);
  check_options(options, p, a.q);
  check_block_mask(options.block_mask, p, vl, a.q);
  const VarlenArgs& va = vl ? *varlen : kNoVarlen;
  check_no_overlap({{"out", &a.out}, {"lse", &a.lse}}, {{"q", &a.q},
                                                        {"k", &a.k},
                                                        {"v", &a.v},
                                                        {"alibi_slopes", &options.score.alibi_slopes},
                                                        {"learnable_sink", &options.score.learnable_sink},
                                                        {"q_descale", &a.q_descale},
                                                        {"k_descale", &a.k_descale},
                                                        {"v_descale", &a.v_descale},
                                                        {"cu_seqlens_q", &va.cu_seqlens_q},
                                                        {"cu_seqlens_k", &va.cu_seqlens_k},
                                                        {"seqused_k", &va.seqused_k},
                                                        {"block_table", &va.block_table}});
  check_block_mask_values(p, options.block_mask, {{"out", &a.out}, {"lse", &a.lse}}, stream);
  const CacheRows pages = p.k.cache;  // paged k / v: 4-D blocks, found through the table
  p.q = operand(a.q, vl);
  p.k = operand(a.k, vl && !pages.paged());
  p.v = operand(a.v, vl && !pages.paged());
  p.k.cache = p.v.cache = pages;
  p.q.descale = q_descale;
  p.k.descale = k_descale;
  p.v.descale = v_descale;
  p.out = operand(a.out, vl);
  if (a.lse.present()) p.lse = lse_operand(a.lse, vl);
  return p;
}

Problem validate_backward(const BackwardArgs& a, const VarlenArgs* varlen, const AttentionOptions& options,
                          void* stream, LengthValues lengths) {
  const bool vl = varlen != nullptr;
  const int nd = vl ? 3 : 4;
  if (vl && varlen->block_table.present()) {
    fail(ErrorCode::kUnsupported, "block_table: paged K/V is supported in the forward pass only");
  }
  for (const auto& [name, t] : {NamedView{"q", &a.q}, NamedView{"k", &a.k}, NamedView{"v", &a.v}}) {
    if (is_float8_dtype(t->dtype)) {
      fail(ErrorCode::kUnsupported, std::string(name) + ": dtype " + dtype_name(t->dtype) +
                                        ": the backward pass does not take float8 inputs yet (FP8 runs the "
                                        "forward pass only; its backward is a later step)");
    }
  }
  Problem p = check_qkv(a.q, a.k, a.v, varlen, stream, lengths);
  check_value_tensor("out", a.out, a.q, nd);
  check_like_q_with_v_head_dim("out", a.out, a.q, p);
  check_value_tensor("dout", a.dout, a.q, nd);
  check_like_q_with_v_head_dim("dout", a.dout, a.q, p);
  if (!a.lse.present()) fail(ErrorCode::kInvalidArgument, "lse: required by the backward pass");
  check_lse(a.lse, a.q, p, vl);
  check_value_tensor("dq", a.dq, a.q, nd);
  check_same_shape("dq", a.dq, "q", a.q);
  check_value_tensor("dk", a.dk, a.q, nd);
  check_same_shape("dk", a.dk, "k", a.k);
  check_value_tensor("dv", a.dv, a.q, nd);
  check_same_shape("dv", a.dv, "v", a.v);
  check_options(options, p, a.q);
  check_block_mask(options.block_mask, p, vl, a.q);
  // The backward's transpose of the lists (CUDA) reads them before any kernel could check them:
  // the host checks them, whatever index_check says.
  p.block_mask_checked_on_device = false;
  if (a.dsink.present()) {
    if (!p.score.sink) fail(ErrorCode::kInvalidArgument, "dsink: given without a learnable_sink");
    check_head_vector("dsink", a.dsink, a.q, p.heads_q);
  }
  const VarlenArgs& va = vl ? *varlen : kNoVarlen;
  check_no_overlap({{"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}, {"dsink", &a.dsink}},
                   {{"q", &a.q},
                    {"k", &a.k},
                    {"v", &a.v},
                    {"out", &a.out},
                    {"dout", &a.dout},
                    {"lse", &a.lse},
                    {"alibi_slopes", &options.score.alibi_slopes},
                    {"learnable_sink", &options.score.learnable_sink},
                    {"cu_seqlens_q", &va.cu_seqlens_q},
                    {"cu_seqlens_k", &va.cu_seqlens_k},
                    {"seqused_k", &va.seqused_k}});
  check_block_mask_values(p, options.block_mask, {{"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}, {"dsink", &a.dsink}},
                          stream);
  p.q = operand(a.q, vl);
  p.k = operand(a.k, vl);
  p.v = operand(a.v, vl);
  p.out = operand(a.out, vl);
  p.dout = operand(a.dout, vl);
  p.lse = lse_operand(a.lse, vl);
  p.dq = operand(a.dq, vl);
  p.dk = operand(a.dk, vl);
  p.dv = operand(a.dv, vl);
  if (a.dsink.present()) {
    p.dsink = static_cast<float*>(a.dsink.data);
    p.dsink_stride = a.dsink.strides[0];
  }
  return p;
}

}  // namespace flashattn::detail

// flashattn._ext: the C++ API for Python through nanobind. Arrays of any framework arrive as
// DLPack views (no copy) and are described to the library as TensorViews; outputs are arrays the
// Python layer allocated with the caller's framework (python/flashattn/_arrays.py), written in
// place. The library validates everything before it reads or writes; its errors become
// ValueError (invalid argument), TypeError (dtype), NotImplementedError (unsupported here),
// MemoryError or RuntimeError, with the library's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "flashattn/flashattn.hpp"

#if FLASHATTN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;

namespace {

using flashattn::DType;
using flashattn::ErrorCode;
using flashattn::TensorView;

using InArray = nb::ndarray<nb::ro>;  // inputs: read-only arrays (e.g. JAX's) are accepted
using OutArray = nb::ndarray<>;       // outputs: must be writable

[[noreturn]] void fail(ErrorCode code, const std::string& message) { throw flashattn::Error(code, message); }

// A DLPack dtype's name as array libraries spell it ("int64", "uint8", "float8_e4m3fn", ...; "float32x4"
// with lanes), so that an error says what was passed rather than a raw type code.
std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  // DLPack's DLDataTypeCode values (dlpack.h); their names are those of numpy / ml_dtypes / PyTorch.
  static const char* const kCodeNames[] = {"int",
                                           "uint",
                                           "float",
                                           "opaque_handle",
                                           "bfloat",
                                           "complex",
                                           "bool",
                                           "float8_e3m4",
                                           "float8_e4m3",
                                           "float8_e4m3b11fnuz",
                                           "float8_e4m3fn",
                                           "float8_e4m3fnuz",
                                           "float8_e5m2",
                                           "float8_e5m2fnuz",
                                           "float8_e8m0fnu",
                                           "float6_e2m3fn",
                                           "float6_e3m2fn",
                                           "float4_e2m1fn"};
  constexpr size_t kCodes = sizeof(kCodeNames) / sizeof(kCodeNames[0]);
  std::string name;
  if (t.code >= kCodes) {
    name = "unknown DLPack type code " + std::to_string(t.code) + " of " + std::to_string(t.bits) + " bits";
  } else if (t.code <= 5 && t.code != 3) {  // the families whose width is part of the name
    name = kCodeNames[t.code] + std::to_string(t.bits);
  } else {
    name = kCodeNames[t.code];
  }
  return t.lanes == 1 ? name : name + "x" + std::to_string(t.lanes);
}

DType dtype_of(nb::dlpack::dtype t, const char* name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 16) return DType::kFloat16;
    if (code == Code::Float && t.bits == 32) return DType::kFloat32;
    if (code == Code::Float && t.bits == 64) return DType::kFloat64;
    if (code == Code::Bfloat && t.bits == 16) return DType::kBFloat16;
    if (code == Code::Int && t.bits == 32) return DType::kInt32;
    // DLPack's kDLFloat8_e4m3fn (10) and kDLFloat8_e5m2 (12): FP8 inputs.
    if (t.code == 10 && t.bits == 8) return DType::kFloat8E4M3;
    if (t.code == 12 && t.bits == 8) return DType::kFloat8E5M2;
  }
  fail(ErrorCode::kInvalidDtype, std::string(name) + ": unsupported dtype " + dlpack_dtype_name(t) +
                                     "; expected float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2 "
                                     "(values) or int32 (indices)");
}

void check_ndim(size_t ndim, const char* name) {
  if (ndim > static_cast<size_t>(flashattn::kMaxDims)) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": " + std::to_string(ndim) + " dimensions, at most " +
                                          std::to_string(flashattn::kMaxDims) + " supported");
  }
}

template <class Array>
TensorView dlpack_view(const Array& a, const char* name) {
  check_ndim(a.ndim(), name);
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = dtype_of(a.dtype(), name);
  if (a.device_type() == nb::device::cpu::value) {
    v.device = {flashattn::DeviceType::kCPU, 0};
  } else if (a.device_type() == nb::device::cuda::value) {
    v.device = {flashattn::DeviceType::kCUDA, static_cast<int>(a.device_id())};
  } else {
    fail(ErrorCode::kUnsupported, std::string(name) + ": arrays on DLPack device type " +
                                      std::to_string(a.device_type()) + " are not supported (cpu or cuda)");
  }
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.strides[i] = static_cast<int64_t>(a.stride(i));
  }
  return v;
}

// The Python layer's array arguments as TensorViews. Each is None (absent), a descriptor tuple
// (data_ptr, DType, DeviceType, device_index, shape, strides in elements[, owner]), or any
// DLPack array.
// Descriptors carry what DLPack cannot or only slowly: numpy's ml_dtypes bfloat16 (no DLPack
// type), and PyTorch tensors (whose DLPack export records and waits on a CUDA event per tensor,
// which dominated the per-call overhead). DLPack imports stay alive until the call ends.
class Views {
 public:
  TensorView in(nb::handle h, const char* name) { return view(h, name, false); }
  TensorView out(nb::handle h, const char* name) { return view(h, name, true); }

  // The call's stream and scratch memory. The workspace is None (the call needs none), a pair
  // (data_ptr, bytes) from frameworks that hand out pointers cheaply (PyTorch, whose DLPack
  // export would record and wait on an event), or a contiguous 1-D array of any dtype with DLPack
  // support (CuPy's, JAX's _ext.empty buffers). Its allocator keeps it alive for the call.
  flashattn::RunContext run_context(nb::handle h, uintptr_t stream) {
    flashattn::RunContext ctx{reinterpret_cast<void*>(stream), nullptr, 0};
    if (h.is_none()) return ctx;
    if (PyTuple_Check(h.ptr())) {
      const nb::tuple t = nb::borrow<nb::tuple>(h);
      if (t.size() != 2) fail(ErrorCode::kInvalidArgument, "workspace: expected (data_ptr, bytes)");
      ctx.workspace = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0]));
      ctx.workspace_bytes = nb::cast<size_t>(t[1]);
      return ctx;
    }
    OutArray a;
    if (!nb::try_cast(h, a)) not_an_array(h, "workspace", " (writable)");
    if (a.ndim() != 1 || (a.shape(0) > 1 && a.stride(0) != 1)) {
      fail(ErrorCode::kInvalidArgument, "workspace: expected a contiguous 1-D array");
    }
    outputs_.push_back(a);
    ctx.workspace = a.data();
    ctx.workspace_bytes = a.nbytes();
    return ctx;
  }

 private:
  TensorView view(nb::handle h, const char* name, bool writable) {
    if (h.is_none()) return TensorView{};
    if (PyTuple_Check(h.ptr())) return descriptor(nb::borrow<nb::tuple>(h), name);
    if (writable) {
      OutArray a;
      if (!nb::try_cast(h, a)) {
        InArray read_only;
        if (nb::try_cast(h, read_only)) {  // an array, but one the library may not write
          fail(ErrorCode::kInvalidArgument, std::string(name) + ": read-only array (outputs must be writable)");
        }
        not_an_array(h, name, " (writable)");
      }
      outputs_.push_back(a);
      return dlpack_view(a, name);
    }
    InArray a;
    if (!nb::try_cast(h, a)) not_an_array(h, name, "");
    inputs_.push_back(a);
    return dlpack_view(a, name);
  }

  static TensorView descriptor(const nb::tuple& t, const char* name) {
    // A 7th entry, when present, only keeps the memory's owner alive for the call.
    if (t.size() != 6 && t.size() != 7) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": malformed tensor descriptor");
    }
    TensorView v;
    v.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0]));
    v.dtype = static_cast<DType>(nb::cast<int>(t[1]));
    v.device = {static_cast<flashattn::DeviceType>(nb::cast<int>(t[2])), nb::cast<int>(t[3])};
    const nb::tuple shape = nb::borrow<nb::tuple>(t[4]), strides = nb::borrow<nb::tuple>(t[5]);
    check_ndim(shape.size(), name);
    v.ndim = static_cast<int>(shape.size());
    for (int i = 0; i < v.ndim; ++i) {
      v.shape[i] = nb::cast<int64_t>(shape[i]);
      v.strides[i] = nb::cast<int64_t>(strides[i]);
    }
    return v;
  }

  [[noreturn]] static void not_an_array(nb::handle h, const char* name, const char* what) {
    fail(ErrorCode::kInvalidDtype, std::string(name) + ": expected an array with DLPack support" + what + ", got " +
                                       nb::cast<std::string>(nb::str(h.type())));
  }

  std::vector<InArray> inputs_;
  std::vector<OutArray> outputs_;
};

// The keyword options shared by forward and backward, as the Python layer passes them.
flashattn::AttentionOptions make_options(double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                                         int64_t sink_tokens, float softcap, const TensorView& alibi_slopes,
                                         const TensorView& learnable_sink, float dropout_p, uint64_t seed,
                                         uint64_t offset, bool deterministic) {
  flashattn::AttentionOptions o;
  o.mask = {causal, window_left, window_right, sink_tokens};
  o.score.softmax_scale = softmax_scale;
  o.score.softcap = softcap;
  o.score.alibi_slopes = alibi_slopes;
  o.score.learnable_sink = learnable_sink;
  o.dropout = {dropout_p, seed, offset};
  o.deterministic = deterministic;
  return o;
}

// A block-sparse mask as the Python layer passes it: None, or (block_m, block_n, kv_num_blocks,
// kv_indices, full_kv_num_blocks, full_kv_indices, bits, bits_block), each array or None; its lists
// checked where the call's index_check says.
flashattn::BlockMaskOptions block_mask_options(Views& views, nb::handle h, bool device_index_check) {
  flashattn::BlockMaskOptions o;
  o.index_check = device_index_check ? flashattn::IndexCheck::kDevice : flashattn::IndexCheck::kHost;
  if (h.is_none()) return o;
  if (!PyTuple_Check(h.ptr()) || nb::len(h) != 8) {
    fail(ErrorCode::kInvalidArgument,
         "block_mask: expected (block_m, block_n, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, "
         "bits, bits_block)");
  }
  const nb::tuple t = nb::borrow<nb::tuple>(h);
  o.block_m = nb::cast<int64_t>(t[0]);
  o.block_n = nb::cast<int64_t>(t[1]);
  o.kv_num_blocks = views.in(t[2], "block_mask.kv_num_blocks");
  o.kv_indices = views.in(t[3], "block_mask.kv_indices");
  o.full_kv_num_blocks = views.in(t[4], "block_mask.full_kv_num_blocks");
  o.full_kv_indices = views.in(t[5], "block_mask.full_kv_indices");
  o.bits = views.in(t[6], "block_mask.bits");
  o.bits_block = views.in(t[7], "block_mask.bits_block");
  return o;
}

// With cu_seqlens_q / cu_seqlens_k (int32 [batch + 1]): a variable-length batch; else none.
std::optional<flashattn::VarlenArgs> varlen_args(Views& views, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                                                 nb::handle seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                 bool device_index_check, nb::handle block_table = nb::none()) {
  if (cu_seqlens_q.is_none() != cu_seqlens_k.is_none()) {
    fail(ErrorCode::kInvalidArgument, std::string(cu_seqlens_q.is_none() ? "cu_seqlens_q" : "cu_seqlens_k") +
                                          ": varlen needs both cu_seqlens_q and cu_seqlens_k");
  }
  if (cu_seqlens_q.is_none()) {
    if (!block_table.is_none())
      fail(ErrorCode::kInvalidArgument, "block_table: paged K/V needs cu_seqlens_q / cu_seqlens_k");
    return std::nullopt;
  }
  flashattn::VarlenArgs v;
  v.block_table = views.in(block_table, "block_table");
  v.cu_seqlens_q = views.in(cu_seqlens_q, "cu_seqlens_q");
  v.cu_seqlens_k = views.in(cu_seqlens_k, "cu_seqlens_k");
  v.seqused_k = views.in(seqused_k, "seqused_k");
  v.max_seqlen_q = max_seqlen_q;
  v.max_seqlen_k = max_seqlen_k;
  v.index_check = device_index_check ? flashattn::IndexCheck::kDevice : flashattn::IndexCheck::kHost;
  return v;
}

// The descale factors of FP8 inputs as the Python layer passes them: a tuple of `n` entries.
nb::tuple descale_tuple(nb::handle h, size_t n, const char* what) {
  if (!PyTuple_Check(h.ptr()) || nb::len(h) != n)
    fail(ErrorCode::kInvalidArgument, std::string("descale: expected ") + what);
  return nb::borrow<nb::tuple>(h);
}

// forward's arguments as the library takes them, shared by the call and its workspace query (the
// Python layer passes both the same arguments). Its Views keep DLPack imports alive.
class ForwardCall {
 public:
  ForwardCall(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle cu_seqlens_q,
              nb::handle cu_seqlens_k, nb::handle seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
              double softmax_scale, bool causal, int64_t window_left, int64_t window_right, int64_t sink_tokens,
              float softcap, nb::handle alibi_slopes, nb::handle learnable_sink, float dropout_p, uint64_t seed,
              uint64_t offset, nb::handle block_table, bool device_index_check, nb::handle block_mask,
              nb::handle descale)
      : args_{views_.in(q, "q"), views_.in(k, "k"), views_.in(v, "v"), views_.out(out, "out"), views_.out(lse, "lse")},
        options_(make_options(softmax_scale, causal, window_left, window_right, sink_tokens, softcap,
                              views_.in(alibi_slopes, "alibi_slopes"), views_.in(learnable_sink, "learnable_sink"),
                              dropout_p, seed, offset, false)),
        varlen_(varlen_args(views_, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                            device_index_check, block_table)) {
    options_.block_mask = block_mask_options(views_, block_mask, device_index_check);
    if (!descale.is_none()) {  // FP8 inputs: (q_descale, k_descale, v_descale), each array or None
      const nb::tuple t = descale_tuple(descale, 3, "(q_descale, k_descale, v_descale)");
      args_.q_descale = views_.in(t[0], "q_descale");
      args_.k_descale = views_.in(t[1], "k_descale");
      args_.v_descale = views_.in(t[2], "v_descale");
    }
  }

  size_t workspace_size() {
    nb::gil_scoped_release no_gil;
    return varlen_ ? flashattn::forward_varlen_workspace_size(args_, *varlen_, options_)
                   : flashattn::forward_workspace_size(args_, options_);
  }

  void run(nb::handle workspace, uintptr_t stream) {
    const flashattn::RunContext ctx = views_.run_context(workspace, stream);
    nb::gil_scoped_release no_gil;  // the CPU backend computes here, the CUDA one enqueues
    if (varlen_) {
      flashattn::forward_varlen(args_, *varlen_, options_, ctx);
    } else {
      flashattn::forward(args_, options_, ctx);
    }
  }

 private:
  Views views_;  // first: the members below are built from it
  flashattn::ForwardArgs args_;
  flashattn::AttentionOptions options_;
  std::optional<flashattn::VarlenArgs> varlen_;
};

size_t forward_workspace_size(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                              nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k,
                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                              int64_t window_left, int64_t window_right, int64_t sink_tokens, float softcap,
                              nb::handle alibi_slopes, nb::handle learnable_sink, float dropout_p, uint64_t seed,
                              uint64_t offset, nb::handle block_table, bool device_index_check, nb::handle block_mask,
                              nb::handle descale) {
  return ForwardCall(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, sink_tokens, softcap, alibi_slopes,
                     learnable_sink, dropout_p, seed, offset, block_table, device_index_check, block_mask, descale)
      .workspace_size();
}

void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle cu_seqlens_q,
             nb::handle cu_seqlens_k, nb::handle seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
             double softmax_scale, bool causal, int64_t window_left, int64_t window_right, int64_t sink_tokens,
             float softcap, nb::handle alibi_slopes, nb::handle learnable_sink, float dropout_p, uint64_t seed,
             uint64_t offset, nb::handle block_table, bool device_index_check, nb::handle block_mask,
             nb::handle descale, nb::handle workspace, uintptr_t stream) {
  ForwardCall(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, sink_tokens, softcap, alibi_slopes, learnable_sink, dropout_p, seed,
              offset, block_table, device_index_check, block_mask, descale)
      .run(workspace, stream);
}

// forward_kvcache's arguments as the library takes them, shared by the call and its workspace
// query. k_new / v_new (when given) are written into the caches, which must then be writable.
class KvCacheCall {
 public:
  KvCacheCall(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle k_new, nb::handle v_new,
              nb::handle cache_seqlens, nb::handle cache_batch_idx, nb::handle cache_leftpad, nb::handle block_table,
              nb::handle rotary_cos, nb::handle rotary_sin, bool rotary_interleaved, int64_t num_splits, nb::handle out,
              nb::handle lse, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
              int64_t sink_tokens, float softcap, nb::handle alibi_slopes, nb::handle learnable_sink,
              bool device_index_check, nb::handle descale) {
    const bool append = !k_new.is_none() || !v_new.is_none();
    args_.q = views_.in(q, "q");
    args_.k_cache = append ? views_.out(k_cache, "k_cache") : views_.in(k_cache, "k_cache");
    args_.v_cache = append ? views_.out(v_cache, "v_cache") : views_.in(v_cache, "v_cache");
    args_.k_new = views_.in(k_new, "k_new");
    args_.v_new = views_.in(v_new, "v_new");
    args_.cache_seqlens = views_.in(cache_seqlens, "cache_seqlens");
    args_.cache_batch_idx = views_.in(cache_batch_idx, "cache_batch_idx");
    args_.cache_leftpad = views_.in(cache_leftpad, "cache_leftpad");
    args_.block_table = views_.in(block_table, "block_table");
    args_.rotary_cos = views_.in(rotary_cos, "rotary_cos");
    args_.rotary_sin = views_.in(rotary_sin, "rotary_sin");
    args_.rotary_interleaved = rotary_interleaved;
    args_.num_splits = num_splits;
    args_.out = views_.out(out, "out");
    args_.lse = views_.out(lse, "lse");
    args_.index_check = device_index_check ? flashattn::IndexCheck::kDevice : flashattn::IndexCheck::kHost;
    options_ = make_options(softmax_scale, causal, window_left, window_right, sink_tokens, softcap,
                            views_.in(alibi_slopes, "alibi_slopes"), views_.in(learnable_sink, "learnable_sink"), 0.0f,
                            0, 0, false);
    if (!descale.is_none()) {  // an FP8 cache: (k_descale, v_descale), each array or None
      const nb::tuple t = descale_tuple(descale, 2, "(k_descale, v_descale)");
      args_.k_descale = views_.in(t[0], "k_descale");
      args_.v_descale = views_.in(t[1], "v_descale");
    }
  }

  size_t workspace_size() {
    nb::gil_scoped_release no_gil;
    return flashattn::forward_kvcache_workspace_size(args_, options_);
  }

  void run(nb::handle workspace, uintptr_t stream) {
    const flashattn::RunContext ctx = views_.run_context(workspace, stream);
    nb::gil_scoped_release no_gil;  // the CPU backend computes here, the CUDA one enqueues
    flashattn::forward_kvcache(args_, options_, ctx);
  }

 private:
  Views views_;
  flashattn::KvCacheArgs args_;
  flashattn::AttentionOptions options_;
};

size_t forward_kvcache_workspace_size(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle k_new,
                                      nb::handle v_new, nb::handle cache_seqlens, nb::handle cache_batch_idx,
                                      nb::handle cache_leftpad, nb::handle block_table, nb::handle rotary_cos,
                                      nb::handle rotary_sin, bool rotary_interleaved, int64_t num_splits,
                                      nb::handle out, nb::handle lse, double softmax_scale, bool causal,
                                      int64_t window_left, int64_t window_right, int64_t sink_tokens, float softcap,
                                      nb::handle alibi_slopes, nb::handle learnable_sink, bool device_index_check,
                                      nb::handle descale) {
  return KvCacheCall(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                     rotary_cos, rotary_sin, rotary_interleaved, num_splits, out, lse, softmax_scale, causal,
                     window_left, window_right, sink_tokens, softcap, alibi_slopes, learnable_sink, device_index_check,
                     descale)
      .workspace_size();
}

void forward_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle k_new, nb::handle v_new,
                     nb::handle cache_seqlens, nb::handle cache_batch_idx, nb::handle cache_leftpad,
                     nb::handle block_table, nb::handle rotary_cos, nb::handle rotary_sin, bool rotary_interleaved,
                     int64_t num_splits, nb::handle out, nb::handle lse, double softmax_scale, bool causal,
                     int64_t window_left, int64_t window_right, int64_t sink_tokens, float softcap,
                     nb::handle alibi_slopes, nb::handle learnable_sink, bool device_index_check, nb::handle descale,
                     nb::handle workspace, uintptr_t stream) {
  KvCacheCall(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
              rotary_sin, rotary_interleaved, num_splits, out, lse, softmax_scale, causal, window_left, window_right,
              sink_tokens, softcap, alibi_slopes, learnable_sink, device_index_check, descale)
      .run(workspace, stream);
}

// backward's arguments as the library takes them, shared by the call and its workspace query
// (the Python layer passes both the same arguments). Its Views keep DLPack imports alive.
class BackwardCall {
 public:
  BackwardCall(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle dq,
               nb::handle dk, nb::handle dv, nb::handle dsink, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
               nb::handle seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
               int64_t window_left, int64_t window_right, int64_t sink_tokens, float softcap, nb::handle alibi_slopes,
               nb::handle learnable_sink, float dropout_p, uint64_t seed, uint64_t offset, bool deterministic,
               bool device_index_check, nb::handle block_mask)
      : args_{views_.in(dout, "dout"), views_.in(q, "q"),         views_.in(k, "k"),    views_.in(v, "v"),
              views_.in(out, "out"),   views_.in(lse, "lse"),     views_.out(dq, "dq"), views_.out(dk, "dk"),
              views_.out(dv, "dv"),    views_.out(dsink, "dsink")},
        options_(make_options(softmax_scale, causal, window_left, window_right, sink_tokens, softcap,
                              views_.in(alibi_slopes, "alibi_slopes"), views_.in(learnable_sink, "learnable_sink"),
                              dropout_p, seed, offset, deterministic)),
        varlen_(varlen_args(views_, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                            device_index_check)) {
    options_.block_mask = block_mask_options(views_, block_mask, device_index_check);
  }

  size_t workspace_size() {
    nb::gil_scoped_release no_gil;  // varlen on CUDA: validation copies cu_seqlens to the host
    return varlen_ ? flashattn::backward_varlen_workspace_size(args_, *varlen_, options_)
                   : flashattn::backward_workspace_size(args_, options_);
  }

  void run(nb::handle workspace, uintptr_t stream) {
    const flashattn::RunContext ctx = views_.run_context(workspace, stream);
    nb::gil_scoped_release no_gil;  // the CPU backend computes here, the CUDA one enqueues
    if (varlen_) {
      flashattn::backward_varlen(args_, *varlen_, options_, ctx);
    } else {
      flashattn::backward(args_, options_, ctx);
    }
  }

 private:
  Views views_;  // first: the members below are built from it
  flashattn::BackwardArgs args_;
  flashattn::AttentionOptions options_;
  std::optional<flashattn::VarlenArgs> varlen_;
};

size_t backward_workspace_size(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                               nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle dsink,
                               nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, int64_t sink_tokens, float softcap,
                               nb::handle alibi_slopes, nb::handle learnable_sink, float dropout_p, uint64_t seed,
                               uint64_t offset, bool deterministic, bool device_index_check, nb::handle block_mask) {
  return BackwardCall(dout, q, k, v, out, lse, dq, dk, dv, dsink, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                      max_seqlen_k, softmax_scale, causal, window_left, window_right, sink_tokens, softcap,
                      alibi_slopes, learnable_sink, dropout_p, seed, offset, deterministic, device_index_check,
                      block_mask)
      .workspace_size();
}

void backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle dq,
              nb::handle dk, nb::handle dv, nb::handle dsink, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
              nb::handle seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
              int64_t window_left, int64_t window_right, int64_t sink_tokens, float softcap, nb::handle alibi_slopes,
              nb::handle learnable_sink, float dropout_p, uint64_t seed, uint64_t offset, bool deterministic,
              bool device_index_check, nb::handle block_mask, nb::handle workspace, uintptr_t stream) {
  BackwardCall(dout, q, k, v, out, lse, dq, dk, dv, dsink, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
               max_seqlen_k, softmax_scale, causal, window_left, window_right, sink_tokens, softcap, alibi_slopes,
               learnable_sink, dropout_p, seed, offset, deterministic, device_index_check, block_mask)
      .run(workspace, stream);
}

#if FLASHATTN_WITH_CUDA
void check_cuda(cudaError_t status, const std::string& what) {
  if (status == cudaErrorMemoryAllocation) fail(ErrorCode::kOutOfMemory, what + ": " + cudaGetErrorString(status));
  if (status != cudaSuccess) fail(ErrorCode::kBackendError, what + ": " + cudaGetErrorString(status));
}
#endif

// An uninitialised array owned by the returned object (host memory, or device memory on CUDA
// device `device_id`), for frameworks whose own arrays cannot be written in place (JAX): an
// object with __dlpack__ (each call exports a new capsule, so the library can write it and the
// framework take it over), freed with the last array that uses it.
nb::ndarray<nb::array_api> empty(const std::vector<size_t>& shape, const std::string& dtype, int device_type,
                                 int device_id) {
  nb::dlpack::dtype t;
  if (dtype == "float16") {
    t = nb::dtype<uint16_t>();
    t.code = static_cast<uint8_t>(nb::dlpack::dtype_code::Float);
  } else if (dtype == "bfloat16") {
    t = nb::dtype<uint16_t>();
    t.code = static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat);
  } else if (dtype == "float32") {
    t = nb::dtype<float>();
  } else if (dtype == "float64") {
    t = nb::dtype<double>();
  } else if (dtype == "uint8") {  // workspaces
    t = nb::dtype<uint8_t>();
  } else {
    fail(ErrorCode::kInvalidDtype,
         "dtype: " + dtype + " cannot be allocated (float16, bfloat16, float32, float64, uint8)");
  }
  size_t bytes = t.bits / 8;
  for (size_t n : shape) bytes *= n;
  bytes = bytes > 0 ? bytes : 1;
  void* data = nullptr;
  nb::capsule owner;
  if (device_type == nb::device::cpu::value) {
    data = new char[bytes];
    owner = nb::capsule(data, [](void* p) noexcept { delete[] static_cast<char*>(p); });
  } else if (device_type == nb::device::cuda::value) {
#if FLASHATTN_WITH_CUDA
    int previous = 0;
    check_cuda(cudaGetDevice(&previous), "empty");
    check_cuda(cudaSetDevice(device_id), "empty: cuda:" + std::to_string(device_id));
    const cudaError_t status = cudaMalloc(&data, bytes);
    cudaSetDevice(previous);
    check_cuda(status, "empty: " + std::to_string(bytes) + " bytes on cuda:" + std::to_string(device_id));
    owner = nb::capsule(data, [](void* p) noexcept { cudaFree(p); });
#else
    fail(ErrorCode::kUnsupported, "empty: this build has no CUDA backend");
#endif
  } else {
    fail(ErrorCode::kUnsupported, "empty: device type " + std::to_string(device_type) + " (cpu or cuda)");
  }
  return nb::ndarray<nb::array_api>(data, shape.size(), shape.data(), owner, nullptr, t, device_type, device_id);
}

// Waits for all work on CUDA device `device_id` (for callers that have no stream to order on).
void cuda_synchronize(int device_id) {
#if FLASHATTN_WITH_CUDA
  int previous = 0;
  check_cuda(cudaGetDevice(&previous), "cuda_synchronize");
  check_cuda(cudaSetDevice(device_id), "cuda_synchronize: cuda:" + std::to_string(device_id));
  const cudaError_t status = cudaDeviceSynchronize();
  cudaSetDevice(previous);
  check_cuda(status, "cuda_synchronize");
#else
  (void)device_id;
  fail(ErrorCode::kUnsupported, "cuda_synchronize: this build has no CUDA backend");
#endif
}

// flashattn::Error -> the Python exception its code stands for, with the library's message.
void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const flashattn::Error& e) {
    PyObject* type = PyExc_RuntimeError;
    switch (e.code()) {
      case ErrorCode::kInvalidArgument:
        type = PyExc_ValueError;
        break;
      case ErrorCode::kInvalidDtype:
        type = PyExc_TypeError;
        break;
      case ErrorCode::kUnsupported:
        type = PyExc_NotImplementedError;
        break;
      case ErrorCode::kOutOfMemory:
        type = PyExc_MemoryError;
        break;
      default:
        break;
    }
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flashattn's C++ library (use the flashattn package, not this module)";
  nb::register_exception_translator(translate_error);

  // forward and its workspace query take the same leading arguments.
  const auto forward_args = std::make_tuple(
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(), nb::arg("cu_seqlens_q").none(),
      nb::arg("cu_seqlens_k").none(), nb::arg("seqused_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
      nb::arg("sink_tokens"), nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("learnable_sink").none(),
      nb::arg("dropout_p"), nb::arg("seed"), nb::arg("offset"), nb::arg("block_table").none(),
      nb::arg("device_index_check"), nb::arg("block_mask").none(), nb::arg("descale").none());
  std::apply(
      [&](auto... names) {
        m.def("forward_workspace_size", &forward_workspace_size, names...,
              "Bytes of scratch memory forward uses on the tensors' device (0: none); validates like forward.");
        m.def("forward", &forward, names..., nb::arg("workspace").none(), nb::arg("stream"),
              "Writes out (and lse) for q, k, v (paged k / v with block_table); every argument is validated "
              "first. workspace: None, or forward_workspace_size bytes on q's device (optional, "
              "FORWARD_WORKSPACE_BYTES, unless varlen lengths are checked on the device).");
      },
      forward_args);
  m.attr("FORWARD_WORKSPACE_BYTES") = flashattn::kForwardWorkspaceBytes;
  // forward_kvcache and its workspace query take the same leading arguments.
  const auto kvcache_args = std::make_tuple(
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("k_new").none(), nb::arg("v_new").none(),
      nb::arg("cache_seqlens").none(), nb::arg("cache_batch_idx").none(), nb::arg("cache_leftpad").none(),
      nb::arg("block_table").none(), nb::arg("rotary_cos").none(), nb::arg("rotary_sin").none(),
      nb::arg("rotary_interleaved"), nb::arg("num_splits"), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
      nb::arg("sink_tokens"), nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("learnable_sink").none(),
      nb::arg("device_index_check"), nb::arg("descale").none());
  std::apply(
      [&](auto... names) {
        m.def("forward_kvcache_workspace_size", &forward_kvcache_workspace_size, names...,
              "Bytes of scratch memory forward_kvcache needs on the tensors' device (0: none).");
        m.def("forward_kvcache", &forward_kvcache, names..., nb::arg("workspace").none(), nb::arg("stream"),
              "Appends k_new / v_new to the caches (when given), then writes out (and lse) for q against them.");
      },
      kvcache_args);
  // backward and its workspace query take the same leading arguments.
  const auto backward_args = std::make_tuple(
      nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("dsink").none(), nb::arg("cu_seqlens_q").none(),
      nb::arg("cu_seqlens_k").none(), nb::arg("seqused_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
      nb::arg("sink_tokens"), nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("learnable_sink").none(),
      nb::arg("dropout_p"), nb::arg("seed"), nb::arg("offset"), nb::arg("deterministic"), nb::arg("device_index_check"),
      nb::arg("block_mask").none());
  std::apply(
      [&](auto... names) {
        m.def("backward_workspace_size", &backward_workspace_size, names...,
              "Bytes of scratch memory backward needs on the tensors' device (0: none); validates like "
              "backward.");
        m.def("backward", &backward, names..., nb::arg("workspace").none(), nb::arg("stream"),
              "Writes dq, dk, dv from dout and the forward's out and lse; workspace: None, (data_ptr, bytes) or "
              "a 1-D array of at least backward_workspace_size bytes.");
      },
      backward_args);
  m.def("empty", &empty, nb::arg("shape"), nb::arg("dtype"), nb::arg("device_type"), nb::arg("device_id"));
  m.def("cuda_synchronize", &cuda_synchronize, nb::arg("device_id"));
  m.def("version", &flashattn::version);
  m.def("cuda_compiled", &flashattn::cuda_compiled);
  m.def("cuda_device_count", &flashattn::cuda_device_count);
  m.def("cuda_kernels", &flashattn::cuda_kernels);
  m.def("check_device_errors", &flashattn::check_device_errors, nb::arg("cuda_device"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Waits for the CUDA device (-1: every device), then raises the bad index a kernel of an earlier "
        "index_check='device' call recorded there.");
}

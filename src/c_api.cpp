// C ABI: converts the plain structs of flashattn.h to the C++ types and calls the C++ API.
// Every entry point runs inside `guarded`, so no exception ever crosses into C; values that C
// can put in an int32_t but that are not enumerators are rejected before the C++ side sees them.
#include "flashattn/flashattn.h"

#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace {

using flashattn::AttentionOptions;
using flashattn::BackwardArgs;
using flashattn::DeviceType;
using flashattn::DType;
using flashattn::Error;
using flashattn::ErrorCode;
using flashattn::ForwardArgs;
using flashattn::RunContext;
using flashattn::TensorView;
using flashattn::VarlenArgs;

static_assert(FA_ERROR_INVALID_ARGUMENT == static_cast<int>(ErrorCode::kInvalidArgument));
static_assert(FA_ERROR_INVALID_DTYPE == static_cast<int>(ErrorCode::kInvalidDtype));
static_assert(FA_ERROR_UNSUPPORTED == static_cast<int>(ErrorCode::kUnsupported));
static_assert(FA_ERROR_BACKEND == static_cast<int>(ErrorCode::kBackendError));
static_assert(FA_ERROR_OUT_OF_MEMORY == static_cast<int>(ErrorCode::kOutOfMemory));
static_assert(FA_ERROR_INTERNAL == static_cast<int>(ErrorCode::kInternal));
static_assert(FA_DTYPE_FLOAT16 == static_cast<int>(DType::kFloat16));
static_assert(FA_DTYPE_BFLOAT16 == static_cast<int>(DType::kBFloat16));
static_assert(FA_DTYPE_FLOAT32 == static_cast<int>(DType::kFloat32));
static_assert(FA_DTYPE_FLOAT64 == static_cast<int>(DType::kFloat64));
static_assert(FA_DTYPE_FLOAT8_E4M3 == static_cast<int>(DType::kFloat8E4M3));
static_assert(FA_DTYPE_FLOAT8_E5M2 == static_cast<int>(DType::kFloat8E5M2));
static_assert(FA_DTYPE_INT32 == static_cast<int>(DType::kInt32));
static_assert(FA_DEVICE_CPU == static_cast<int>(DeviceType::kCPU));
static_assert(FA_DEVICE_CUDA == static_cast<int>(DeviceType::kCUDA));
static_assert(FA_MAX_DIMS == flashattn::kMaxDims);

// A fixed buffer, not a std::string: recording an error must not allocate (it may be reporting
// an out-of-memory failure) and must not throw. Long messages are truncated.
constexpr size_t kMaxMessage = 1024;
thread_local char t_last_error[kMaxMessage] = "";

void set_error(const char* message) noexcept {
  std::strncpy(t_last_error, message, kMaxMessage - 1);
  t_last_error[kMaxMessage - 1] = '\0';
}

// Thrown for a NULL struct pointer; caught by `guarded` only, so it never escapes.
struct NullArgument {
  const char* name;
};

template <class T>
T& deref(T* p, const char* name) {
  if (p == nullptr) throw NullArgument{name};
  return *p;
}

fa_status to_status(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kInvalidDtype:
    case ErrorCode::kUnsupported:
    case ErrorCode::kBackendError:
    case ErrorCode::kOutOfMemory:
    case ErrorCode::kInternal:
      return static_cast<fa_status>(code);  // same values, asserted above
  }
  return FA_ERROR_UNKNOWN;
}

template <class F>
fa_status guarded(F&& body) noexcept {
  try {
    body();
    t_last_error[0] = '\0';
    return FA_OK;
  } catch (const NullArgument& e) {
    char message[128] = "";
    std::strncat(message, e.name, 64);
    std::strncat(message, ": NULL pointer", 32);
    set_error(message);
    return FA_ERROR_NULL_ARGUMENT;
  } catch (const Error& e) {
    set_error(e.what());
    return to_status(e.code());
  } catch (const std::bad_alloc&) {
    set_error("out of memory");
    return FA_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error(e.what());
    return FA_ERROR_UNKNOWN;
  } catch (...) {
    set_error("unknown exception");
    return FA_ERROR_UNKNOWN;
  }
}

TensorView to_view(const fa_tensor& t, const char* name) {
  TensorView v;
  if (t.data == nullptr && t.ndim == 0) return v;  // absent: other fields are not looked at
  if (t.dtype < FA_DTYPE_FLOAT16 || t.dtype > FA_DTYPE_FLOAT8_E5M2) {
    throw Error(ErrorCode::kInvalidDtype,
                std::string(name) + ": dtype " + std::to_string(t.dtype) + " is not an FA_DTYPE_* value");
  }
  if (t.device_type != FA_DEVICE_CPU && t.device_type != FA_DEVICE_CUDA) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(name) + ": device_type " + std::to_string(t.device_type) + " is not an FA_DEVICE_* value");
  }
  v.data = t.data;
  v.dtype = static_cast<DType>(t.dtype);
  v.device.type = static_cast<DeviceType>(t.device_type);
  v.device.index = t.device_index;
  v.ndim = t.ndim;  // out-of-range ndim is reported by the C++ validation with the expected one
  for (int i = 0; i < FA_MAX_DIMS; ++i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides[i];
  }
  return v;
}

flashattn::IndexCheck to_index_check(int32_t value, const char* name = "index_check") {
  if (value != FA_INDEX_CHECK_HOST && value != FA_INDEX_CHECK_DEVICE) {
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": " + std::to_string(value) +
                                                 " is neither FA_INDEX_CHECK_HOST (0) nor FA_INDEX_CHECK_DEVICE (1)");
  }
  return value == FA_INDEX_CHECK_DEVICE ? flashattn::IndexCheck::kDevice : flashattn::IndexCheck::kHost;
}

AttentionOptions to_options(const fa_options* p) {
  const fa_options& o = deref(p, "options");
  AttentionOptions a;
  a.mask.causal = o.causal;
  a.mask.window_left = o.window_left;
  a.mask.window_right = o.window_right;
  a.mask.sink_tokens = o.sink_tokens;
  a.score.softmax_scale = o.softmax_scale;
  a.score.softcap = o.softcap;
  a.score.alibi_slopes = to_view(o.alibi_slopes, "alibi_slopes");
  a.dropout.p = o.dropout_p;
  a.dropout.seed = o.dropout_seed;
  a.dropout.offset = o.dropout_offset;
  a.deterministic = o.deterministic;
  a.precise = o.precise;
  a.score.learnable_sink = to_view(o.learnable_sink, "learnable_sink");
  const fa_block_mask& bm = o.block_mask;
  a.block_mask.block_m = bm.block_m;
  a.block_mask.block_n = bm.block_n;
  a.block_mask.kv_num_blocks = to_view(bm.kv_num_blocks, "block_mask.kv_num_blocks");
  a.block_mask.kv_indices = to_view(bm.kv_indices, "block_mask.kv_indices");
  a.block_mask.full_kv_num_blocks = to_view(bm.full_kv_num_blocks, "block_mask.full_kv_num_blocks");
  a.block_mask.full_kv_indices = to_view(bm.full_kv_indices, "block_mask.full_kv_indices");
  a.block_mask.bits = to_view(bm.bits, "block_mask.bits");
  a.block_mask.bits_block = to_view(bm.bits_block, "block_mask.bits_block");
  a.block_mask.index_check = to_index_check(bm.index_check, "block_mask.index_check");
  return a;
}

ForwardArgs to_forward(const fa_forward_args* p) {
  const fa_forward_args& a = deref(p, "args");
  ForwardArgs f;
  f.q = to_view(a.q, "q");
  f.k = to_view(a.k, "k");
  f.v = to_view(a.v, "v");
  f.out = to_view(a.out, "out");
  f.lse = to_view(a.lse, "lse");
  f.q_descale = to_view(a.q_descale, "q_descale");
  f.k_descale = to_view(a.k_descale, "k_descale");
  f.v_descale = to_view(a.v_descale, "v_descale");
  return f;
}

BackwardArgs to_backward(const fa_backward_args* p) {
  const fa_backward_args& a = deref(p, "args");
  BackwardArgs b;
  b.dout = to_view(a.dout, "dout");
  b.q = to_view(a.q, "q");
  b.k = to_view(a.k, "k");
  b.v = to_view(a.v, "v");
  b.out = to_view(a.out, "out");
  b.lse = to_view(a.lse, "lse");
  b.dq = to_view(a.dq, "dq");
  b.dk = to_view(a.dk, "dk");
  b.dv = to_view(a.dv, "dv");
  b.dsink = to_view(a.dsink, "dsink");
  return b;
}

VarlenArgs to_varlen(const fa_varlen* p) {
  const fa_varlen& v = deref(p, "varlen");
  VarlenArgs r;
  r.cu_seqlens_q = to_view(v.cu_seqlens_q, "cu_seqlens_q");
  r.cu_seqlens_k = to_view(v.cu_seqlens_k, "cu_seqlens_k");
  r.seqused_k = to_view(v.seqused_k, "seqused_k");
  r.max_seqlen_q = v.max_seqlen_q;
  r.max_seqlen_k = v.max_seqlen_k;
  r.block_table = to_view(v.block_table, "block_table");
  r.index_check = to_index_check(v.index_check);
  return r;
}

flashattn::KvCacheArgs to_kvcache(const fa_kvcache_args* p) {
  const fa_kvcache_args& a = deref(p, "args");
  flashattn::KvCacheArgs k;
  k.q = to_view(a.q, "q");
  k.k_cache = to_view(a.k_cache, "k_cache");
  k.v_cache = to_view(a.v_cache, "v_cache");
  k.k_new = to_view(a.k_new, "k_new");
  k.v_new = to_view(a.v_new, "v_new");
  k.cache_seqlens = to_view(a.cache_seqlens, "cache_seqlens");
  k.cache_batch_idx = to_view(a.cache_batch_idx, "cache_batch_idx");
  k.cache_leftpad = to_view(a.cache_leftpad, "cache_leftpad");
  k.block_table = to_view(a.block_table, "block_table");
  k.rotary_cos = to_view(a.rotary_cos, "rotary_cos");
  k.rotary_sin = to_view(a.rotary_sin, "rotary_sin");
  k.rotary_interleaved = a.rotary_interleaved;
  k.num_splits = a.num_splits;
  k.out = to_view(a.out, "out");
  k.lse = to_view(a.lse, "lse");
  k.index_check = to_index_check(a.index_check);
  k.k_descale = to_view(a.k_descale, "k_descale");
  k.v_descale = to_view(a.v_descale, "v_descale");
  return k;
}

RunContext to_context(const fa_run_context* c) {
  if (c == nullptr) return {};
  return RunContext{c->stream, c->workspace, c->workspace_bytes};
}

}  // namespace

extern "C" {

void fa_options_default(fa_options* options) {
  if (options == nullptr) return;
  const AttentionOptions d;                   // the C++ defaults are the single source of truth
  std::memset(options, 0, sizeof(*options));  // absent alibi_slopes, zero padding
  options->causal = d.mask.causal;
  options->window_left = d.mask.window_left;
  options->window_right = d.mask.window_right;
  options->softmax_scale = d.score.softmax_scale;
  options->softcap = d.score.softcap;
  options->dropout_p = d.dropout.p;
  options->dropout_seed = d.dropout.seed;
  options->dropout_offset = d.dropout.offset;
  options->deterministic = d.deterministic;
  options->precise = d.precise;
  options->block_mask.block_m = d.block_mask.block_m;
  options->block_mask.block_n = d.block_mask.block_n;
}

fa_status fa_tensor_contiguous(fa_tensor* tensor, const void* data, int32_t dtype, int32_t ndim, const int64_t* shape) {
  return guarded([&] {
    fa_tensor& t = deref(tensor, "tensor");
    if (ndim < 0 || ndim > FA_MAX_DIMS) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ndim: " + std::to_string(ndim) + " outside [0, " + std::to_string(FA_MAX_DIMS) + "]");
    }
    if (ndim > 0) deref(shape, "shape");
    std::memset(&t, 0, sizeof(t));
    t.data = const_cast<void*>(data);
    t.dtype = dtype;  // checked where the tensor is used, like every other field
    t.device_type = FA_DEVICE_CPU;
    t.ndim = ndim;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.strides[i] = stride;
      // as TensorView::contiguous; a product past 64 bits is an error, not a wrapped stride
      if (i > 0 && __builtin_mul_overflow(stride, shape[i] > 0 ? shape[i] : int64_t{1}, &stride)) {
        std::memset(&t, 0, sizeof(t));
        throw Error(ErrorCode::kInvalidArgument, "shape: the product of the sizes overflows 64 bits");
      }
    }
  });
}

fa_status fa_forward(const fa_forward_args* args, const fa_options* options, const fa_run_context* ctx) {
  return guarded([&] { flashattn::forward(to_forward(args), to_options(options), to_context(ctx)); });
}

fa_status fa_backward(const fa_backward_args* args, const fa_options* options, const fa_run_context* ctx) {
  return guarded([&] { flashattn::backward(to_backward(args), to_options(options), to_context(ctx)); });
}

fa_status fa_forward_varlen(const fa_forward_args* args, const fa_varlen* varlen, const fa_options* options,
                            const fa_run_context* ctx) {
  return guarded(
      [&] { flashattn::forward_varlen(to_forward(args), to_varlen(varlen), to_options(options), to_context(ctx)); });
}

fa_status fa_backward_varlen(const fa_backward_args* args, const fa_varlen* varlen, const fa_options* options,
                             const fa_run_context* ctx) {
  return guarded(
      [&] { flashattn::backward_varlen(to_backward(args), to_varlen(varlen), to_options(options), to_context(ctx)); });
}

fa_status fa_forward_kvcache(const fa_kvcache_args* args, const fa_options* options, const fa_run_context* ctx) {
  return guarded([&] { flashattn::forward_kvcache(to_kvcache(args), to_options(options), to_context(ctx)); });
}

fa_status fa_forward_workspace_size(const fa_forward_args* args, const fa_options* options, size_t* bytes) {
  return guarded([&] {
    size_t& out = deref(bytes, "bytes");
    out = flashattn::forward_workspace_size(to_forward(args), to_options(options));
  });
}

fa_status fa_backward_workspace_size(const fa_backward_args* args, const fa_options* options, size_t* bytes) {
  return guarded([&] {
    size_t& out = deref(bytes, "bytes");
    out = flashattn::backward_workspace_size(to_backward(args), to_options(options));
  });
}

fa_status fa_forward_varlen_workspace_size(const fa_forward_args* args, const fa_varlen* varlen,
                                           const fa_options* options, size_t* bytes) {
  return guarded([&] {
    size_t& out = deref(bytes, "bytes");
    out = flashattn::forward_varlen_workspace_size(to_forward(args), to_varlen(varlen), to_options(options));
  });
}

fa_status fa_backward_varlen_workspace_size(const fa_backward_args* args, const fa_varlen* varlen,
                                            const fa_options* options, size_t* bytes) {
  return guarded([&] {
    size_t& out = deref(bytes, "bytes");
    out = flashattn::backward_varlen_workspace_size(to_backward(args), to_varlen(varlen), to_options(options));
  });
}

fa_status fa_forward_kvcache_workspace_size(const fa_kvcache_args* args, const fa_options* options, size_t* bytes) {
  return guarded([&] {
    size_t& out = deref(bytes, "bytes");
    out = flashattn::forward_kvcache_workspace_size(to_kvcache(args), to_options(options));
  });
}

fa_status fa_check_device_errors(int cuda_device) {
  return guarded([&] { flashattn::check_device_errors(cuda_device); });
}

fa_status fa_reference_forward(const fa_forward_args* args, const fa_options* options) {
  return guarded([&] { flashattn::reference_forward(to_forward(args), to_options(options)); });
}

fa_status fa_reference_backward(const fa_backward_args* args, const fa_options* options) {
  return guarded([&] { flashattn::reference_backward(to_backward(args), to_options(options)); });
}

fa_status fa_reference_forward_varlen(const fa_forward_args* args, const fa_varlen* varlen, const fa_options* options) {
  return guarded(
      [&] { flashattn::reference_forward_varlen(to_forward(args), to_varlen(varlen), to_options(options)); });
}

fa_status fa_reference_backward_varlen(const fa_backward_args* args, const fa_varlen* varlen,
                                       const fa_options* options) {
  return guarded(
      [&] { flashattn::reference_backward_varlen(to_backward(args), to_varlen(varlen), to_options(options)); });
}

fa_status fa_reference_forward_kvcache(const fa_kvcache_args* args, const fa_options* options) {
  return guarded([&] { flashattn::reference_forward_kvcache(to_kvcache(args), to_options(options)); });
}

const char* fa_version(void) { return flashattn::version(); }

bool fa_cuda_compiled(void) { return flashattn::cuda_compiled(); }

int fa_cuda_device_count(void) {
  try {
    return flashattn::cuda_device_count();
  } catch (...) {  // it reports failures as "no device"; keep that true at the C boundary too
    return 0;
  }
}

// The list never changes after load, so it is built once and its strings stay valid.
static const std::vector<std::string>& kernel_names() {
  static const std::vector<std::string> names = [] {
    try {
      return flashattn::cuda_kernels();
    } catch (...) {
      return std::vector<std::string>{};
    }
  }();
  return names;
}

size_t fa_cuda_kernel_count(void) { return kernel_names().size(); }

const char* fa_cuda_kernel_name(size_t index) {
  return index < kernel_names().size() ? kernel_names()[index].c_str() : NULL;
}

const char* fa_last_error(void) { return t_last_error; }

const char* fa_status_string(fa_status status) {
  switch (static_cast<int>(status)) {  // as int: C may pass any value
    case FA_OK:
      return "ok";
    case FA_ERROR_INVALID_ARGUMENT:
      return "invalid argument";
    case FA_ERROR_INVALID_DTYPE:
      return "invalid dtype";
    case FA_ERROR_UNSUPPORTED:
      return "unsupported";
    case FA_ERROR_BACKEND:
      return "backend error";
    case FA_ERROR_OUT_OF_MEMORY:
      return "out of memory";
    case FA_ERROR_INTERNAL:
      return "internal error";
    case FA_ERROR_NULL_ARGUMENT:
      return "null argument";
    case FA_ERROR_UNKNOWN:
      return "unknown error";
  }
  return "unrecognised status";
}

}  // extern "C"

// flashattn._ext: the C++ API for Python through nanobind. Arrays of any framework arrive as
// DLPack views (no copy) and are described to the library as TensorViews; outputs are arrays the
// Python layer allocated with the caller's framework (python/flashattn/_arrays.py), written in
// place. The library validates everything before it reads or writes; its errors become
// ValueError (invalid argument), TypeError (dtype), NotImplementedError (unsupported here),
// MemoryError or RuntimeError, with the library's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>

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

DType dtype_of(nb::dlpack::dtype t, const char* name, bool uint16_is_bf16) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 16) return DType::kFloat16;
    if (code == Code::Float && t.bits == 32) return DType::kFloat32;
    if (code == Code::Float && t.bits == 64) return DType::kFloat64;
    if (code == Code::Bfloat && t.bits == 16) return DType::kBFloat16;
    if (code == Code::Int && t.bits == 32) return DType::kInt32;
    // numpy cannot export ml_dtypes' bfloat16 through DLPack: the Python layer passes such
    // arrays as uint16 views and says so.
    if (code == Code::UInt && t.bits == 16 && uint16_is_bf16) return DType::kBFloat16;
  }
  fail(ErrorCode::kInvalidDtype, std::string(name) + ": unsupported dtype (code " + std::to_string(t.code) +
                                     ", " + std::to_string(t.bits) + " bits); expected float16, bfloat16, "
                                     "float32, float64 or int32");
}

template <class Array>
TensorView view_of(const Array& a, const char* name, bool uint16_is_bf16) {
  if (a.ndim() > static_cast<size_t>(flashattn::kMaxDims)) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": " + std::to_string(a.ndim()) + " dimensions, at most " +
                                          std::to_string(flashattn::kMaxDims) + " supported");
  }
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = dtype_of(a.dtype(), name, uint16_is_bf16);
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

template <class Array>
TensorView optional_view(const std::optional<Array>& a, const char* name, bool uint16_is_bf16) {
  return a ? view_of(*a, name, uint16_is_bf16) : TensorView{};
}

// The keyword options shared by forward and backward, as the Python layer passes them.
flashattn::AttentionOptions make_options(double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                                         float softcap, const std::optional<InArray>& alibi_slopes, float dropout_p,
                                         uint64_t seed, uint64_t offset, bool deterministic) {
  flashattn::AttentionOptions o;
  o.mask = {causal, window_left, window_right};
  o.score.softmax_scale = softmax_scale;
  o.score.softcap = softcap;
  o.score.alibi_slopes = optional_view(alibi_slopes, "alibi_slopes", false);
  o.dropout = {dropout_p, seed, offset};
  o.deterministic = deterministic;
  return o;
}

// cu_seqlens_q / cu_seqlens_k (int32 [batch + 1]) given: a variable-length batch.
struct Varlen {
  const std::optional<InArray>& cu_seqlens_q;
  const std::optional<InArray>& cu_seqlens_k;
  const std::optional<InArray>& seqused_k;
  int64_t max_seqlen_q, max_seqlen_k;

  bool present() const { return cu_seqlens_q || cu_seqlens_k; }
  flashattn::VarlenArgs args() const {
    if (!cu_seqlens_q || !cu_seqlens_k) {
      fail(ErrorCode::kInvalidArgument, std::string(cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q") +
                                            ": varlen needs both cu_seqlens_q and cu_seqlens_k");
    }
    flashattn::VarlenArgs v;
    v.cu_seqlens_q = view_of(*cu_seqlens_q, "cu_seqlens_q", false);
    v.cu_seqlens_k = view_of(*cu_seqlens_k, "cu_seqlens_k", false);
    v.seqused_k = optional_view(seqused_k, "seqused_k", false);
    v.max_seqlen_q = max_seqlen_q;
    v.max_seqlen_k = max_seqlen_k;
    return v;
  }
};

void forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& out, const std::optional<OutArray>& lse,
             const std::optional<InArray>& cu_seqlens_q, const std::optional<InArray>& cu_seqlens_k,
             const std::optional<InArray>& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
             float softcap, const std::optional<InArray>& alibi_slopes, float dropout_p, uint64_t seed,
             uint64_t offset, uintptr_t stream, bool uint16_is_bf16) {
  flashattn::ForwardArgs a{view_of(q, "q", uint16_is_bf16), view_of(k, "k", uint16_is_bf16),
                           view_of(v, "v", uint16_is_bf16), view_of(out, "out", uint16_is_bf16),
                           optional_view(lse, "lse", false)};
  const auto o = make_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                              offset, false);
  const flashattn::RunContext ctx{reinterpret_cast<void*>(stream), nullptr, 0};
  const Varlen varlen{cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k};
  const bool is_varlen = varlen.present();
  const flashattn::VarlenArgs va = is_varlen ? varlen.args() : flashattn::VarlenArgs{};
  nb::gil_scoped_release no_gil;  // the CPU backend computes here, the CUDA one enqueues
  if (is_varlen) {
    flashattn::forward_varlen(a, va, o, ctx);
  } else {
    flashattn::forward(a, o, ctx);
  }
}

void backward(const InArray& dout, const InArray& q, const InArray& k, const InArray& v, const InArray& out,
              const InArray& lse, const OutArray& dq, const OutArray& dk, const OutArray& dv,
              const std::optional<InArray>& cu_seqlens_q, const std::optional<InArray>& cu_seqlens_k,
              const std::optional<InArray>& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left, int64_t window_right, float softcap,
              const std::optional<InArray>& alibi_slopes, float dropout_p, uint64_t seed, uint64_t offset,
              bool deterministic, uintptr_t stream, bool uint16_is_bf16) {
  flashattn::BackwardArgs a{view_of(dout, "dout", uint16_is_bf16), view_of(q, "q", uint16_is_bf16),
                            view_of(k, "k", uint16_is_bf16),       view_of(v, "v", uint16_is_bf16),
                            view_of(out, "out", uint16_is_bf16),   view_of(lse, "lse", false),
                            view_of(dq, "dq", uint16_is_bf16),     view_of(dk, "dk", uint16_is_bf16),
                            view_of(dv, "dv", uint16_is_bf16)};
  const auto o = make_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                              offset, deterministic);
  const flashattn::RunContext ctx{reinterpret_cast<void*>(stream), nullptr, 0};
  const Varlen varlen{cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k};
  const bool is_varlen = varlen.present();
  const flashattn::VarlenArgs va = is_varlen ? varlen.args() : flashattn::VarlenArgs{};
  nb::gil_scoped_release no_gil;
  if (is_varlen) {
    flashattn::backward_varlen(a, va, o, ctx);
  } else {
    flashattn::backward(a, o, ctx);
  }
}

#if FLASHATTN_WITH_CUDA
void check_cuda(cudaError_t status, const std::string& what) {
  if (status == cudaErrorMemoryAllocation) fail(ErrorCode::kOutOfMemory, what + ": " + cudaGetErrorString(status));
  if (status != cudaSuccess) fail(ErrorCode::kBackendError, what + ": " + cudaGetErrorString(status));
}
#endif

// An uninitialised array owned by the returned object (host memory, or device memory on CUDA
// device `device_id`), for frameworks whose own arrays cannot be written in place (JAX): it
// crosses to them through DLPack and is freed with the last array that uses it.
nb::ndarray<> empty(const std::vector<size_t>& shape, const std::string& dtype, int device_type, int device_id) {
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
  } else {
    fail(ErrorCode::kInvalidDtype, "dtype: " + dtype + " cannot be allocated (float16, bfloat16, float32, float64)");
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
  return nb::ndarray<>(data, shape.size(), shape.data(), owner, nullptr, t, device_type, device_id);
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
      case ErrorCode::kInvalidArgument: type = PyExc_ValueError; break;
      case ErrorCode::kInvalidDtype: type = PyExc_TypeError; break;
      case ErrorCode::kUnsupported: type = PyExc_NotImplementedError; break;
      case ErrorCode::kOutOfMemory: type = PyExc_MemoryError; break;
      default: break;
    }
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flashattn's C++ library (use the flashattn package, not this module)";
  nb::register_exception_translator(translate_error);

  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("seqused_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("dropout_p"),
        nb::arg("seed"), nb::arg("offset"), nb::arg("stream"), nb::arg("uint16_is_bf16"),
        "Writes out (and lse) for q, k, v; every argument is validated first.");
  m.def("backward", &backward, nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("seqused_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("dropout_p"), nb::arg("seed"), nb::arg("offset"),
        nb::arg("deterministic"), nb::arg("stream"), nb::arg("uint16_is_bf16"),
        "Writes dq, dk, dv from dout and the forward's out and lse.");
  m.def("empty", &empty, nb::arg("shape"), nb::arg("dtype"), nb::arg("device_type"), nb::arg("device_id"));
  m.def("cuda_synchronize", &cuda_synchronize, nb::arg("device_id"));
  m.def("version", &flashattn::version);
  m.def("cuda_compiled", &flashattn::cuda_compiled);
  m.def("cuda_device_count", &flashattn::cuda_device_count);
  m.def("cuda_kernels", &flashattn::cuda_kernels);
}

// TensorView helpers, dtype names and the tensor-level checks of tensor_checks.hpp.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tensor_checks.hpp"

namespace flashattn {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kInt32:
      return "int32";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

namespace {
TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    throw Error(ErrorCode::kInvalidArgument, "shape: " + std::to_string(shape.size()) + " dims, at most 4 supported");
  }
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  return t;
}
}  // namespace

TensorView TensorView::contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView t = make_view(data, dtype, shape, device);
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[i] = stride;
    if (i > 0 && __builtin_mul_overflow(stride, t.shape[i] > 0 ? t.shape[i] : 1, &stride)) {
      throw Error(ErrorCode::kInvalidArgument, "shape: " + detail::shape_str(t) + " overflows 64-bit strides");
    }
  }
  return t;
}

TensorView TensorView::strided(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  if (strides.size() != shape.size()) {
    throw Error(ErrorCode::kInvalidArgument, "strides: " + std::to_string(strides.size()) + " entries for " +
                                                 std::to_string(shape.size()) + " dims");
  }
  TensorView t = make_view(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : strides) t.strides[i++] = s;
  return t;
}

namespace detail {

void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

std::string device_str(const Device& d) {
  return (d.type == DeviceType::kCPU ? std::string("cpu") : std::string("cuda:")) +
         (d.type == DeviceType::kCPU ? std::string() : std::to_string(d.index));
}

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

bool is_value_dtype(DType d) {
  return d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat32 || d == DType::kFloat64;
}

bool is_float8_dtype(DType d) { return d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2; }

void check_tensor(const char* name, const TensorView& t, int ndim) {
  const std::string n(name);
  if (t.ndim != ndim) {
    fail(ErrorCode::kInvalidArgument, n + ": ndim " + std::to_string(t.ndim) + " != expected " + std::to_string(ndim));
  }
  if (dtype_size(t.dtype) == 0) fail(ErrorCode::kInvalidDtype, n + ": unknown dtype");
  if (t.device.type != DeviceType::kCPU && t.device.type != DeviceType::kCUDA) {
    fail(ErrorCode::kInvalidArgument, n + ": unknown device type");
  }
  int64_t numel = 1, extent = 0;  // extent: largest element offset + 1
  bool empty = false;
  for (int i = 0; i < ndim; ++i) {
    if (t.shape[i] < 0) {
      fail(ErrorCode::kInvalidArgument, n + ": negative size in shape " + shape_str(t));
    }
    if (t.strides[i] < 0) {
      fail(ErrorCode::kInvalidArgument, n + ": stride[" + std::to_string(i) + "] " + std::to_string(t.strides[i]) +
                                            " < 0 (negative strides are not supported)");
    }
    if (t.shape[i] == 0) empty = true;
    int64_t span;
    if (__builtin_mul_overflow(t.shape[i], numel, &numel) ||
        __builtin_mul_overflow(t.shape[i] > 0 ? t.shape[i] - 1 : 0, t.strides[i], &span) ||
        __builtin_add_overflow(extent, span, &extent)) {
      fail(ErrorCode::kInvalidArgument, n + ": size of shape " + shape_str(t) + " overflows 64-bit offsets");
    }
  }
  int64_t bytes;
  if (__builtin_add_overflow(extent, int64_t{1}, &bytes) ||
      __builtin_mul_overflow(bytes, static_cast<int64_t>(dtype_size(t.dtype)), &bytes)) {
    fail(ErrorCode::kInvalidArgument, n + ": byte size of shape " + shape_str(t) + " overflows 64 bits");
  }
  if (empty) return;
  if (t.data == nullptr) fail(ErrorCode::kInvalidArgument, n + ": data is null");
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
    fail(ErrorCode::kInvalidArgument,
         n + ": data pointer is not aligned to its " + std::to_string(dtype_size(t.dtype)) + "-byte dtype");
  }
}

std::pair<uintptr_t, uintptr_t> byte_range(const TensorView& t) {
  if (t.data == nullptr) return {0, 0};
  int64_t extent = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return {0, 0};
    extent += (t.shape[i] - 1) * t.strides[i];
  }
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + static_cast<uintptr_t>(extent + 1) * dtype_size(t.dtype)};
}

namespace {
// No two elements of a nonempty output share memory (threads would race on them). Sufficient
// condition, exact for every layout a tensor library makes: with the dimensions of size > 1 in
// order of stride, each stride is larger than the furthest offset the faster ones reach.
void check_no_self_overlap(const char* name, const TensorView& t) {
  const auto [t0, t1] = byte_range(t);
  if (t0 == t1) return;
  int dims[kMaxDims];
  int n = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1) dims[n++] = d;
  }
  for (int a = 1; a < n; ++a) {  // by stride (insertion sort of at most kMaxDims)
    for (int b = a; b > 0 && t.strides[dims[b]] < t.strides[dims[b - 1]]; --b) std::swap(dims[b], dims[b - 1]);
  }
  int64_t reach = 0;  // the furthest offset of the faster dimensions
  for (int k = 0; k < n; ++k) {
    const int d = dims[k];
    if (t.strides[d] <= reach) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": stride[" + std::to_string(d) + "] " +
                                            std::to_string(t.strides[d]) + " of shape " + shape_str(t) +
                                            " makes elements share memory (outputs must not overlap themselves)");
    }
    reach += (t.shape[d] - 1) * t.strides[d];  // check_tensor bounded the extent
  }
}

bool fills_range(const TensorView& t) {
  auto [begin, end] = byte_range(t);
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
  return end - begin == static_cast<uintptr_t>(numel) * dtype_size(t.dtype);
}
}  // namespace

void check_no_overlap(std::initializer_list<NamedView> outputs, std::initializer_list<NamedView> inputs) {
  // Exact overlap of two strided views is costly to decide; views that fill their byte range
  // (contiguous tensors, the common aliasing mistake) are checked, interleaved views such as
  // the q/k/v slices of a packed qkv buffer are not flagged unless they share their first element.
  auto overlaps = [](const TensorView& a, const TensorView& b) {
    if (!(a.device == b.device)) return false;
    auto [a0, a1] = byte_range(a);
    auto [b0, b1] = byte_range(b);
    if (a0 == a1 || b0 == b1) return false;  // empty
    if (a0 == b0) return true;               // both hold the element at offset 0
    return fills_range(a) && fills_range(b) && a0 < b1 && b0 < a1;
  };
  std::vector<NamedView> outs(outputs);
  for (size_t i = 0; i < outs.size(); ++i) {
    check_no_self_overlap(outs[i].first, *outs[i].second);
    for (const NamedView& in : inputs) {
      if (overlaps(*outs[i].second, *in.second)) {
        fail(ErrorCode::kInvalidArgument,
             std::string(outs[i].first) + ": memory overlaps input " + in.first + " (outputs must not alias inputs)");
      }
    }
    for (size_t j = i + 1; j < outs.size(); ++j) {
      if (overlaps(*outs[i].second, *outs[j].second)) {
        fail(ErrorCode::kInvalidArgument,
             std::string(outs[j].first) + ": memory overlaps " + outs[i].first + " (outputs must not alias)");
      }
    }
  }
}

}  // namespace detail
}  // namespace flashattn

// Checks shared by every entry point: tensor well-formedness (ndim, shapes, strides, 64-bit
// extent overflow, pointer alignment) and output/input overlap.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

[[noreturn]] void fail(ErrorCode code, const std::string& message);

std::string device_str(const Device& d);
std::string shape_str(const TensorView& t);
bool is_value_dtype(DType d);   // float16, bfloat16, float32, float64
bool is_float8_dtype(DType d);  // float8_e4m3fn, float8_e5m2 (FP8 inputs)

// ndim matches; shapes and strides >= 0; numel, extent and byte size fit in int64; data non-null
// when the tensor is not empty; data aligned to the element size.
void check_tensor(const char* name, const TensorView& t, int ndim);

// Bytes [begin, end) the view can touch; {0, 0} for an empty or absent view.
std::pair<uintptr_t, uintptr_t> byte_range(const TensorView& t);

using NamedView = std::pair<const char*, const TensorView*>;
// No output may overlap another output or an input (results would be corrupted silently).
void check_no_overlap(std::initializer_list<NamedView> outputs, std::initializer_list<NamedView> inputs);

}  // namespace flashattn::detail

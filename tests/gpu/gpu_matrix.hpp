// The GPU suites' reduced form of the test matrix (docs/CONVENTIONS.md), shared by the forward and
// backward suites: shapes, head dims, head layouts and mask / score-mod variants, combined one
// case per (shape, variant) with the other axes rotating.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gpu_case.hpp"

#define SKIP_WITHOUT_DEVICE() \
  if (!fa_gpu_test::have_device()) GTEST_SKIP() << "no CUDA device visible"

namespace fa_gpu_test {

struct Shape {
  int64_t sq, sk;
};
extern const std::vector<Shape> kShapes;
extern const std::vector<int64_t> kHeadDims;                   // every CUDA head-dim bucket, and 40 (padded)
extern const std::vector<std::pair<int64_t, int64_t>> kHeads;  // (heads_q, heads_kv): MHA, GQA, MQA

enum class Variant { kPlain, kCausal, kLocal, kSoftcap, kAlibi, kDropout, kSink };

// Sets the variant's options on c; n seeds the random window sizes of kLocal and picks causal or
// not for kAlibi.
void apply_variant(GpuCase& c, Variant v, int64_t n);

// One case per (shape, variant) in `dtype`; head dim, head layout, batch and memory layout rotate
// so every value of each axis meets every dtype. The largest shapes run with fewer heads: the
// fp64 reference and the naive oracle on the host are most of the suites' time. With
// `backward` the cases run the backward too, and each variant of the largest shape runs in one
// of the two dtypes only (alternating).
std::vector<GpuCase> shape_matrix(flashattn::DType dtype, const std::vector<Variant>& variants, bool backward);

// The learnable sink with every mask and score modifier (and dropout), GQA / MQA, strided
// layouts and rows that see no key, and with sink tokens past a window (the sink-token pass), at
// head dims 64 and 128 (the sm80 and Hopper families both).
std::vector<GpuCase> sink_matrix(flashattn::DType dtype, bool backward);

std::string dtype_param_name(const ::testing::TestParamInfo<flashattn::DType>& p);

}  // namespace fa_gpu_test

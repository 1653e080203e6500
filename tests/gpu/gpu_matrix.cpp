#include "gpu_matrix.hpp"

#include <algorithm>
#include <random>

#include "test_util.hpp"

namespace fa_gpu_test {

using flashattn::DType;

const std::vector<Shape> kShapes = {{1, 1},     {1, 147},   {239, 1},     {3, 799},    {113, 203},
                                    {128, 217}, {512, 256}, {1023, 1024}, {2048, 2048}};
const std::vector<int64_t> kHeadDims = {32, 40, 64, 96, 128, 160, 192, 224, 256};
const std::vector<std::pair<int64_t, int64_t>> kHeads = {{6, 6}, {6, 2}, {6, 1}};

void apply_variant(GpuCase& c, Variant v, int64_t n) {
  switch (v) {
    case Variant::kPlain:
      break;
    case Variant::kCausal:
      c.causal = true;
      break;
    case Variant::kLocal: {
      auto rng = fa_test::rng_for("gpu window " + std::to_string(n));
      std::uniform_int_distribution<int64_t> w(0, std::max<int64_t>(c.seqlen_k, 1));
      c.window_left = w(rng);
      c.window_right = w(rng);
      break;
    }
    case Variant::kSoftcap:
      c.softcap = 50.0f;
      break;
    case Variant::kAlibi:
      c.alibi = true;
      c.causal = n % 2 == 0;
      break;
    case Variant::kDropout:
      c.dropout = 0.17f;
      c.causal = n % 2 == 1;
      break;
    case Variant::kSink:  // a learnable sink, with a causal mask (rows that see no key) or a softcap
      c.sink = true;
      c.causal = n % 2 == 0;
      c.softcap = n % 3 == 1 ? 30.0f : 0.0f;
      break;
  }
}

std::vector<GpuCase> shape_matrix(DType dtype, const std::vector<Variant>& variants, bool backward) {
  constexpr int64_t kMidWork = 300000, kBigWork = 1000000;  // score elements per (batch, head)
  std::vector<GpuCase> cases;
  int64_t n = 0;
  for (const Shape& s : kShapes) {
    for (Variant v : variants) {
      const int64_t work = s.sq * s.sk, i = n++;
      GpuCase c;
      c.dtype = dtype;
      c.backward = backward;
      c.seqlen_q = s.sq;
      c.seqlen_k = s.sk;
      c.head_dim = kHeadDims[static_cast<size_t>(i) % kHeadDims.size()];
      c.heads_q = kHeads[static_cast<size_t>(i) % kHeads.size()].first;
      c.heads_kv = kHeads[static_cast<size_t>(i) % kHeads.size()].second;
      c.batch = work <= kMidWork && i % 2 == 1 ? 4 : 1;
      c.layout = i % 4 == 3 ? Layout::kStrided : Layout::kContiguous;
      if (!backward && work > kBigWork) {  // one head group bounds the reference's time
        c.heads_q = 2;
        c.heads_kv = 1;
      }
      if (backward && work > kMidWork) {
        // The backward's oracle costs about three forwards; the host runs it in parallel over
        // kv heads, so two of them cost as much as one.
        c.heads_q = c.heads_kv = 2;
        if (work > kBigWork && i % 2 != (dtype == DType::kBFloat16 ? 1 : 0)) continue;
        if (work > kBigWork) c.head_dim = std::min<int64_t>(c.head_dim, 128);
      }
      apply_variant(c, v, i);
      cases.push_back(c);
    }
  }
  return cases;
}

std::vector<GpuCase> sink_matrix(DType dtype, bool backward) {
  const std::vector<Shape> shapes = {{1, 1}, {113, 203}, {239, 1}, {300, 129}, {1023, 1024}};
  std::vector<GpuCase> cases;
  int64_t n = 0;
  for (const Shape& s : shapes) {
    for (int feature = 0; feature < 8; ++feature, ++n) {
      GpuCase c;
      c.dtype = dtype;
      c.backward = backward;
      c.sink = true;
      c.seqlen_q = s.sq;
      c.seqlen_k = s.sk;
      c.head_dim = n % 2 == 0 ? 64 : 128;
      c.heads_q = kHeads[static_cast<size_t>(n) % kHeads.size()].first;
      c.heads_kv = kHeads[static_cast<size_t>(n) % kHeads.size()].second;
      c.batch = s.sq * s.sk <= 300000 && n % 2 == 1 ? 3 : 1;
      c.layout = n % 4 == 3 ? Layout::kStrided : Layout::kContiguous;
      c.causal = feature == 1 || feature == 4;
      if (feature == 2) c.window_left = 17, c.window_right = 3;
      c.softcap = feature == 3 ? 30.0f : 0.0f;
      c.alibi = feature == 4;
      c.dropout = feature == 5 || feature == 7 ? 0.17f : 0.0f;
      if (feature == 6) c.causal = true, c.window_left = 40, c.sink_tokens = 4;  // the sink-token pass
      if (feature == 7) c.window_left = 17, c.window_right = 3, c.sink_tokens = 70;
      c.reruns = 2;
      cases.push_back(c);
    }
  }
  return cases;
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& p) { return flashattn::dtype_name(p.param); }

}  // namespace fa_gpu_test

// One causal attention forward on the CPU through the flashattn C++ API.
#include <flashattn/flashattn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  constexpr int64_t batch = 1, seqlen = 64, heads = 4, head_dim = 32;
  const size_t n = batch * seqlen * heads * head_dim;
  std::vector<float> q(n), k(n), v(n), out(n);
  for (size_t i = 0; i < n; ++i) {  // any values will do; these are reproducible
    q[i] = std::sin(0.37f * i);
    k[i] = std::cos(0.11f * i);
    v[i] = std::sin(0.07f * i + 1.0f);
  }

  using flashattn::DType;
  using flashattn::TensorView;
  flashattn::ForwardArgs args;  // all [batch, seqlen, heads, head_dim], row-major
  args.q = TensorView::contiguous(q.data(), DType::kFloat32, {batch, seqlen, heads, head_dim});
  args.k = TensorView::contiguous(k.data(), DType::kFloat32, {batch, seqlen, heads, head_dim});
  args.v = TensorView::contiguous(v.data(), DType::kFloat32, {batch, seqlen, heads, head_dim});
  args.out = TensorView::contiguous(out.data(), DType::kFloat32, {batch, seqlen, heads, head_dim});
  flashattn::AttentionOptions options;
  options.mask.causal = true;
  try {
    flashattn::forward(args, options);
  } catch (const flashattn::Error& e) {
    std::fprintf(stderr, "flashattn::forward failed: %s\n", e.what());
    return 1;
  }

  // Softmax weights are >= 0 and sum to 1, so each output is a convex combination of the V rows
  // its query sees (keys 0..i under the causal mask): finite and within their range.
  for (int64_t i = 0; i < seqlen; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < head_dim; ++c) {
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          lo = std::min(lo, v[(j * heads + h) * head_dim + c]);
          hi = std::max(hi, v[(j * heads + h) * head_dim + c]);
        }
        const float o = out[(i * heads + h) * head_dim + c];
        if (!std::isfinite(o) || o < lo - 1e-5f || o > hi + 1e-5f) {
          std::fprintf(stderr, "out[0, %lld, %lld, %lld] = %g is outside [%g, %g]\n", static_cast<long long>(i),
                       static_cast<long long>(h), static_cast<long long>(c), o, lo, hi);
          return 1;
        }
      }
    }
  }
  std::printf("flashattn %s (C++ API): causal forward [%lld, %lld, %lld, %lld] ok\n", flashattn::version(),
              static_cast<long long>(batch), static_cast<long long>(seqlen), static_cast<long long>(heads),
              static_cast<long long>(head_dim));
  return 0;
}

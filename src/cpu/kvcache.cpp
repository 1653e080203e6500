// KV-cache attention on the CPU (forward_kvcache): the new tokens go into the cache first
// (keys rotated; quantised into an FP8 cache), q is rotated into a scratch copy, then the flash
// or the reference forward runs over the cache, whose rows the operands' CacheRows locate
// (paging, leftpad, batch_idx).
#include <type_traits>
#include <vector>

#include "../kvcache_problem.hpp"
#include "backend.hpp"
#include "elem.hpp"

namespace flashattn::cpu {
namespace {

using detail::KvCacheProblem;
using detail::RotaryParams;

// Rotary math in fp32 for the 16-bit and fp32 dtypes (what a GPU kernel does), fp64 for fp64.
template <typename T>
using RotaryAcc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename Acc>
Acc table_value(const RotaryParams& r, const void* table, int64_t row_stride, int64_t pos, int64_t pair) {
  const int64_t at = pos * row_stride + pair;
  return static_cast<Acc>(dispatch_dtype(r.dtype, [&](auto tag) -> double {
    using Table = decltype(tag);
    return to_float(static_cast<const Table*>(table)[at]);
  }));
}

// dst = src with its first r.dim features rotated to position `pos` (dst may be src), rounded
// to T; the other features copied.
template <typename T>
void rotate_row(const T* src, T* dst, int64_t d, const RotaryParams& r, int64_t pos) {
  using Acc = RotaryAcc<T>;
  const int64_t half = r.dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = r.interleaved ? 2 * i : i;
    const int64_t b = r.interleaved ? 2 * i + 1 : i + half;
    const Acc c = table_value<Acc>(r, r.cos, r.cos_row_stride, pos, i);
    const Acc s = table_value<Acc>(r, r.sin, r.sin_row_stride, pos, i);
    const Acc x1 = static_cast<Acc>(to_float(src[a])), x2 = static_cast<Acc>(to_float(src[b]));
    dst[a] = from_acc<T>(x1 * c - x2 * s);
    dst[b] = from_acc<T>(x1 * s + x2 * c);
  }
  if (dst != src) {
    for (int64_t c = r.dim; c < d; ++c) dst[c] = src[c];
  }
}

template <typename T>
void copy_row(const T* src, T* dst, int64_t d) {
  for (int64_t c = 0; c < d; ++c) dst[c] = src[c];
}

// One new row of head h of sequence b into the cache at position pos: keys rotated there (with
// rotary), rounded to the new rows' dtype T as always; an FP8 cache (TCache) then stores each
// value quantised by its descale factor, from_acc<TCache>(float(x) / float(descale)): round to
// nearest even, saturating. `row` is scratch for the rotated row.
template <typename T, typename TCache>
void append_row(const detail::Operand& cache, const T* src, int64_t b, int64_t pos, int64_t h, int64_t d,
                const RotaryParams* rotary, std::vector<T>& row) {
  TCache* dst = static_cast<TCache*>(cache.data) + cache.cache.position_offset(cache.layout, b, pos, h);
  if constexpr (std::is_same_v<T, TCache>) {
    if (rotary) {
      rotate_row(src, dst, d, *rotary, pos);
    } else {
      copy_row(src, dst, d);
    }
  } else {
    if (rotary) {
      row.resize(static_cast<size_t>(d));
      rotate_row(src, row.data(), d, *rotary, pos);
      src = row.data();
    }
    const auto descale = static_cast<float>(dequantise_factor(cache, b, h));
    for (int64_t c = 0; c < d; ++c) dst[c] = from_acc<TCache>(to_float(src[c]) / descale);
  }
}

// k_new / v_new into the cache at positions cache_seqlens[b] + t (keys rotated there).
template <typename T, typename TCache>
void append(const KvCacheProblem& kp) {
  const detail::Problem& p = kp.attn;
  const RotaryParams* rotary = kp.rotary.enabled() ? &kp.rotary : nullptr;
  std::vector<T> row;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t t = 0; t < kp.seqlen_new; ++t) {
      const int64_t pos = kp.host_cache_seqlens[b] + t;
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        append_row<T, TCache>(p.k, row_ptr<T>(kp.k_new, b, t, h), b, pos, h, p.head_dim, rotary, row);
        append_row<T, TCache>(p.v, row_ptr<T>(kp.v_new, b, t, h), b, pos, h, p.head_dim_v, nullptr, row);
      }
    }
  }
}

// q rotated into `rotated` ([b, sq, hq, d], contiguous); returns the problem reading it.
template <typename T>
detail::Problem with_rotated_q(const KvCacheProblem& kp, std::vector<T>& rotated) {
  detail::Problem p = kp.attn;
  const int64_t d = p.head_dim;
  rotated.resize(static_cast<size_t>(p.batch * p.seqlen_q * p.heads_q * d));
  detail::Operand q;
  q.data = rotated.data();
  q.layout = {p.seqlen_q * p.heads_q * d, p.heads_q * d, d};
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t i = 0; i < p.seqlen_q; ++i) {
      const int64_t pos = kp.host_cache_seqlens[b] + (kp.rotary.per_row_q ? i : 0);
      for (int64_t h = 0; h < p.heads_q; ++h) {
        rotate_row(row_ptr<T>(kp.attn.q, b, i, h), row_ptr<T>(q, b, i, h), d, kp.rotary, pos);
      }
    }
  }
  p.q = q;
  return p;
}

}  // namespace

void forward_kvcache(const KvCacheProblem& kp, bool reference) {
  dispatch_element_types(kp.attn, [&](auto types) {
    using T = typename decltype(types)::q;  // q's, k_new's and v_new's (validated)
    if (kp.append) append<T, typename decltype(types)::kv>(kp);
    std::vector<T> rotated_q;
    const detail::Problem p = kp.rotary.enabled() ? with_rotated_q(kp, rotated_q) : kp.attn;
    if (reference) {
      reference_forward(p);
    } else {
      flash_forward(p);
    }
  });
}

}  // namespace flashattn::cpu

// KV-cache attention on the CPU (forward_kvcache): the new tokens go into the cache first
// (keys rotated), q is rotated into a scratch copy, then the flash or the reference forward
// runs over the cache, whose rows the operands' CacheRows locate (paging, leftpad, batch_idx).
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

// k_new / v_new into the cache at positions cache_seqlens[b] + t (keys rotated there).
template <typename T>
void append(const KvCacheProblem& kp) {
  const detail::Problem& p = kp.attn;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t t = 0; t < kp.seqlen_new; ++t) {
      const int64_t pos = kp.host_cache_seqlens[b] + t;
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        T* k_dst = static_cast<T*>(p.k.data) + p.k.cache.position_offset(p.k.layout, b, pos, h);
        T* v_dst = static_cast<T*>(p.v.data) + p.v.cache.position_offset(p.v.layout, b, pos, h);
        const T* k_src = row_ptr<T>(kp.k_new, b, t, h);
        if (kp.rotary.enabled()) {
          rotate_row(k_src, k_dst, p.head_dim, kp.rotary, pos);
        } else {
          copy_row(k_src, k_dst, p.head_dim);
        }
        copy_row(row_ptr<T>(kp.v_new, b, t, h), v_dst, p.head_dim_v);
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
  dispatch_dtype(kp.attn.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (kp.append) append<T>(kp);
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

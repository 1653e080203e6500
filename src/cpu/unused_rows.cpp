// Defined values for varlen rows outside every sequence (see backend.hpp).
#include <limits>
#include <vector>

#include "backend.hpp"
#include "elem.hpp"

namespace flashattn::cpu {
namespace {

// Marks rows [begin_b, end_b) of each batch entry; returns the unmarked rows.
std::vector<int64_t> unused_rows(int64_t total, int64_t batch, const int32_t* begin, const int32_t* end_or_null,
                                 const int32_t* used_len) {
  std::vector<char> used(static_cast<size_t>(total), 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t e = used_len ? begin[b] + used_len[b] : end_or_null[b];
    for (int64_t r = begin[b]; r < e; ++r) used[r] = 1;
  }
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < total; ++r) {
    if (!used[r]) rows.push_back(r);
  }
  return rows;
}

template <typename T>
void zero_rows(const detail::Operand& op, const std::vector<int64_t>& rows, int64_t heads, int64_t d) {
  for (int64_t r : rows) {
    for (int64_t h = 0; h < heads; ++h) {
      T* dst = row_ptr<T>(op, 0, r, h);
      for (int64_t c = 0; c < d; ++c) dst[c] = from_acc<T>(0.0);
    }
  }
}

}  // namespace

void fill_unused_rows(const detail::Problem& p, detail::Direction direction) {
  if (!p.varlen()) return;
  const auto q_rows = unused_rows(p.total_q, p.batch, p.cu_seqlens_q, p.cu_seqlens_q + 1, nullptr);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (direction == detail::Direction::kForward) {
      zero_rows<T>(p.out, q_rows, p.heads_q, p.head_dim_v);
      if (p.lse.data) {
        for (int64_t r : q_rows) {
          for (int64_t h = 0; h < p.heads_q; ++h) {
            *row_ptr<float>(p.lse, 0, r, h) = -std::numeric_limits<float>::infinity();
          }
        }
      }
      return;
    }
    zero_rows<T>(p.dq, q_rows, p.heads_q, p.head_dim);
    const auto k_rows = unused_rows(p.total_k, p.batch, p.cu_seqlens_k, p.cu_seqlens_k + 1, p.seqused_k);
    zero_rows<T>(p.dk, k_rows, p.heads_kv, p.head_dim);
    zero_rows<T>(p.dv, k_rows, p.heads_kv, p.head_dim_v);
  });
}

}  // namespace flashattn::cpu

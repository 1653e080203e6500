#include "decode_setup.hpp"

#include <algorithm>

#include "../problem_params.hpp"

namespace flashattn::cuda::decode {

DecodeLayout decode_layout(const detail::KvCacheProblem& kp, int sm_count) {
  const detail::Problem& p = kp.attn;
  DecodeLayout l;
  const int64_t rows = p.seqlen_q * p.group_size();  // a KV group's query rows
  // (One row per CTA when the packed tiles do not fill the SMs was measured slower from 16k
  // keys on: the group's CTAs drift apart and read K / V from HBM once each.)
  l.rows_per_cta = rows >= 2 ? kMmaRows : 1;
  l.row_blocks = static_cast<int>(std::max<int64_t>(1, (rows + l.rows_per_cta - 1) / l.rows_per_cta));
  // Splits: enough CTAs for every SM to hold its CTAs at once (one wave: a decode CTA is a short
  // stream of loads), none with fewer than the kernel's least split keys, and none for short
  // contexts whose unsplit grid fills a quarter of the SMs (decode_params.hpp). From shapes and
  // the cache's kind alone, so the workspace query and the call agree.
  const int64_t keys = kp.capacity + kp.seqlen_new;
  const int64_t ctas = p.batch * p.heads_kv * l.row_blocks;
  const bool one_row = l.rows_per_cta == 1;
  const int ctas_per_sm = one_row ? kOneRowCtasPerSm : mma_ctas_per_sm(static_cast<int>(p.head_dim));
  const int64_t target = int64_t{ctas_per_sm} * sm_count;
  const int64_t most = std::clamp<int64_t>(keys / (one_row ? kMinOneRowSplitKeys : kMinSplitKeys), 1, kMaxSplits);
  int64_t splits = kp.num_splits;
  // (Rounded down: one CTA past the target starts a second, mostly idle wave.)
  if (splits == 0) {
    const bool short_and_filled = keys <= kShortKeys && 4 * ctas >= sm_count && (one_row || !p.k.cache.paged());
    splits = ctas >= target || short_and_filled ? 1 : target / std::max<int64_t>(ctas, 1);
  }
  l.num_splits = static_cast<int>(std::clamp<int64_t>(splits, 1, kp.num_splits == 0 ? most : kMaxSplits));
  if (l.num_splits > 1) {
    const int64_t partial_rows = l.num_splits * p.batch * p.heads_q * p.seqlen_q;
    l.partial_out_bytes = static_cast<size_t>(partial_rows * p.head_dim) * sizeof(float);
    l.partial_out_bytes = (l.partial_out_bytes + 255) / 256 * 256;
    l.partial_lse_bytes = static_cast<size_t>(partial_rows) * sizeof(float);
  }
  return l;
}

DecodeParams decode_params(const detail::KvCacheProblem& kp, const DecodeLayout& layout, void* workspace) {
  const detail::Problem& p = kp.attn;
  const ForwardParams fp = forward_params(p);
  auto rows_in = [](const detail::Operand& op) {
    return RowsIn{op.data, op.layout.batch_stride, op.layout.row_stride, op.layout.head_stride};
  };
  auto rows_out = [](const detail::Operand& op) {
    return RowsOut{op.data, op.layout.batch_stride, op.layout.row_stride, op.layout.head_stride};
  };
  DecodeParams d;
  d.q = fp.q;
  d.k = rows_in(p.k);
  d.v = rows_in(p.v);
  d.k_cache_out = rows_out(p.k);
  d.v_cache_out = rows_out(p.v);
  if (kp.append) {
    d.k_new = rows_in(kp.k_new);
    d.v_new = rows_in(kp.v_new);
  }
  d.out = fp.out;
  d.lse = fp.lse;
  d.shape = fp.shape;
  d.window = fp.window;
  d.score = fp.score;
  static_cast<core::CacheRows&>(d.cache) = p.k.cache;
  d.cache.cache_seqlens = kp.cache_seqlens;
  d.cache.capacity = kp.capacity;
  d.cache.seqlen_new = kp.seqlen_new;
  d.cache.entries = kp.cache_entries;
  if (d.cache.paged()) d.cache.page = core::FastDivmod(static_cast<uint32_t>(d.cache.page_size));
  const detail::RotaryParams& r = kp.rotary;
  d.rotary = {r.cos,         r.sin,      r.dtype == DType::kFloat32, r.dim, r.rows, r.cos_row_stride, r.sin_row_stride,
              r.interleaved, r.per_row_q};
  d.num_splits = layout.num_splits;
  d.split_divisor = core::FastDivmod(static_cast<uint32_t>(layout.num_splits));
  d.row_blocks = core::FastDivmod(static_cast<uint32_t>(layout.row_blocks));
  d.group = core::FastDivmod(static_cast<uint32_t>(p.group_size()));
  d.rows_per_cta = layout.rows_per_cta;
  d.cluster_merge = layout.cluster_merge;
  if (layout.num_splits > 1) {
    d.partial_out = static_cast<float*>(workspace);
    d.partial_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + layout.partial_out_bytes);
  }
  return d;
}

}  // namespace flashattn::cuda::decode

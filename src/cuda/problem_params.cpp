#include "problem_params.hpp"

#include "../core/variant.hpp"

namespace flashattn::cuda {

using detail::Problem;

ForwardParams forward_params(const Problem& p) {
  auto rows_in = [](const detail::Operand& op) {
    return RowsIn{op.data, op.layout.batch_stride, op.layout.row_stride, op.layout.head_stride};
  };
  ForwardParams fp;
  fp.q = rows_in(p.q);
  fp.k = rows_in(p.k);
  fp.v = rows_in(p.v);
  fp.out = {p.out.data, p.out.layout.batch_stride, p.out.layout.row_stride, p.out.layout.head_stride};
  fp.lse = {static_cast<float*>(p.lse.data), p.lse.layout.batch_stride, p.lse.layout.row_stride,
            p.lse.layout.head_stride};
  // Varlen: the kernels read each sequence's lengths; the maxima size the grid.
  fp.shape = {p.batch, p.heads_q, p.heads_kv, p.head_dim, p.max_seqlen_q, p.max_seqlen_k};
  fp.cu_seqlens_q = p.cu_seqlens_q;
  fp.cu_seqlens_k = p.cu_seqlens_k;
  fp.seqused_k = p.seqused_k;
  fp.total_q = p.total_q;
  fp.total_k = p.total_k;
  if (p.k.cache.paged()) {
    fp.block_table = p.k.cache.block_table;
    fp.block_table_stride = p.k.cache.block_table_stride;
    fp.page = core::FastDivmod(static_cast<uint32_t>(p.k.cache.page_size));  // < 2^31: supports_forward
  }
  fp.window = {p.mask.window_left, p.mask.window_right, p.mask.sink_tokens};
  fp.block_mask = p.block_mask;
  // The one place log2(e) is folded into the scale (the kernels work in the exp2 domain;
  // docs/CONVENTIONS.md).
  fp.score.scale_log2 = static_cast<float>(p.score.scale * core::kLog2e);
  if (p.score.softcap > 0.0) {
    fp.score.tanh_scale = static_cast<float>(p.score.scale / p.score.softcap);
    fp.score.softcap_log2 = static_cast<float>(p.score.softcap * core::kLog2e);
  }
  fp.score.raw_scores = p.score.softcap == 0.0 && p.score.alibi == nullptr && p.score.scale > 0.0;
  fp.dropout = {p.dropout.seed, p.dropout.offset, p.dropout.threshold, static_cast<float>(1.0 / (1.0 - p.dropout.p))};
  fp.score.alibi = p.score.alibi;
  fp.score.alibi_batch_stride = p.score.alibi_batch_stride;
  fp.score.alibi_head_stride = p.score.alibi_head_stride;
  fp.score.sink = p.score.sink;
  fp.score.sink_stride = p.score.sink_stride;
  return fp;
}

}  // namespace flashattn::cuda

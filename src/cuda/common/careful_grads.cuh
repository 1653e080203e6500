// dK and dV recomputed one key row at a time, term by term, for the rare backward tile whose fast
// result holds a NaN: careful_rows.cuh's repair, for the backward.
//
// The backward multiplies whole tiles on tensor cores, where a masked element's 0 times a NaN (or
// inf) is NaN: dV += P^T dO and dK += dS^T Q carry a bad dO or q row (or a row whose D or LSE is
// NaN: its dS is NaN) to the keys of its tiles that the row does not see. The rule
// (docs/CONVENTIONS.md, "NaN") is that a row's NaN reaches the dK / dV of the keys it sees only.
// A NaN in a dK or dV row at the end marks every such spread (0 * inf is NaN too), and that key
// row is recomputed here by one warp from q, k, v, dO and the rows' LSE2 and D (the prepare
// kernel's scratch, which the main kernel reads too), over the (row, key) pairs the mask lets
// through only, as the CPU backend's careful tiles compute it (src/cpu/flash_backward.cpp):
// dS = P (dP' - D) (dP' through dropout's keep-mask and 1 / (1 - p), times 1 - tanh^2 with a
// softcap), dV = sum of P' dO over the terms whose P' (dropped: 0) is not 0, dK = scale * sum of
// dS finite(q), finite() turning inf into 0 (a bad q reaches dK through dS, NaN, where its row
// sees the key). Sums are fp32. A key row that the rule makes NaN is NaN here too: recomputing it
// costs time, not correctness.
//
// dQ has no such repair (it is summed across CTAs): a key or value row's NaN would reach, through
// dQ += dS K and the masked dS of 0, the dQ of rows of its tile that do not see it. The masked
// kernels therefore zero the non-finite elements of their K and V tiles once, after loading them
// (zero_nonfinite), as the CPU backend does (a non-finite k entering dQ as 0): a row that sees
// such a key still gets NaN everywhere it should, through its LSE (a NaN key row) or D (a NaN
// value row, through the row's output), which make its P and dS NaN.
//
// Kernel code only, inlined where it is called, with no operation that compiles to a subroutine
// (careful_rows.cuh). The CPU tests run it with the CUDA built-ins emulated.
#pragma once

#include <cmath>
#include <cstdint>

#include <type_traits>

#include <cutlass/numeric_types.h>

#include "../../core/mask.hpp"
#include "../../core/philox.hpp"
#include "../params.hpp"
#include "backward_tiles.cuh"
#include "careful_rows.cuh"
#include "fast_math.cuh"
#include "mask.cuh"
#include "sequence.cuh"

namespace flashattn::cuda {

// One (batch entry, query head) of a backward call: CarefulRows' q, k, v, mask, score and
// dropout, and dO with the rows' LSE2 and D, from row 0 of the sequence.
struct CarefulGrads {
  CarefulRows rows;
  const void* dout = nullptr;
  int64_t dout_row_stride = 0;
  const float* lse2 = nullptr;
  const float* delta = nullptr;
};

template <class Element>
__device__ __forceinline__ CarefulGrads careful_grads_of(const BackwardParams& p, int64_t batch, int64_t head,
                                                         int64_t head_kv, const Sequence& seq, const core::Mask& mask) {
  CarefulGrads g;
  g.rows = careful_rows_of<Element>(p.fwd, batch, head, head_kv, seq.q_start, seq.k_start, mask);
  g.dout = static_cast<const Element*>(p.dout.data) + batch * p.dout.batch_stride + head * p.dout.head_stride +
           seq.q_start * p.dout.row_stride;
  g.dout_row_stride = p.dout.row_stride;
  const int64_t row0 = head * p.scratch.rows + backward_row_base(p.fwd.cu_seqlens_q, p.fwd.shape.seqlen_q, batch);
  g.lse2 = p.scratch.lse2 + row0;
  g.delta = p.scratch.delta + row0;
  return g;
}

__device__ __forceinline__ float careful_finite(float x) { return std::isfinite(x) ? x : 0.0f; }

// The pair (i, j)'s P as dV takes it (dropped: 0, kept: over 1 - p) and dS, from the warp's
// products q.k and dO.v, as the main kernel's element pass (backward_score.cuh) computes them.
struct CarefulTerm {
  float p, ds;
};
__device__ __forceinline__ CarefulTerm careful_term(const CarefulGrads& g, float qk, float dov, int64_t i, int64_t j) {
  const CarefulRows& r = g.rows;
  float t = 0.0f;
  const float p = fast_exp2(careful_score(r, qk, i, j, &t) - g.lse2[i]);
  const float grad_factor = softcap_grad_factor(r.score, t);
  const bool kept = r.dropout.threshold == 0 ||
                    core::dropout_keep(r.dropout.seed, r.dropout.offset, r.dropout_stream, i, j, r.dropout.threshold);
  const float dp = kept ? dov * r.dropout.keep_scale : 0.0f;  // (keep_scale 1 without dropout)
  return {kept ? p * r.dropout.keep_scale : 0.0f, p * (dp - g.delta[i]) * grad_factor};
}

// dK and dV of key j (within the sequence) of KV head head_kv, by the 32 lanes of one warp, each
// holding the columns lane + 32 t: put_dk(col, value) and put_dv(col, value) receive them (dK
// times the softmax scale). The sum runs over the query heads of the GQA group and the rows that
// see j (kSparse: by the block mask too); a key past seqlen_k (seqused_k) is seen by none: 0.
template <class Element, int kMaxCols, bool kSparse, class PutDk, class PutDv>
__device__ __forceinline__ void careful_key_grads(const BackwardParams& p, int64_t batch, int64_t head_kv,
                                                  const Sequence& seq, const core::Mask& mask, int64_t j, int lane,
                                                  PutDk&& put_dk, PutDv&& put_dv) {
  const int head_dim = static_cast<int>(p.fwd.shape.head_dim);
  const int64_t group = static_cast<int>(p.fwd.shape.heads_q) / static_cast<int>(p.fwd.shape.heads_kv);  // (32-bit)
  float dk[kMaxCols] = {}, dv[kMaxCols] = {};
  if (j < mask.seqlen_k) {
    float k[kMaxCols], v[kMaxCols];
    bool loaded = false;
    for (int64_t h = head_kv * group; h < (head_kv + 1) * group; ++h) {
      const CarefulGrads g = careful_grads_of<Element>(p, batch, h, head_kv, seq, mask);
      const CarefulRows& r = g.rows;
      if (!loaded) {
        careful_load<Element>(static_cast<const Element*>(r.k) + j * r.k_row_stride, head_dim, lane, k);
        careful_load<Element>(static_cast<const Element*>(r.v) + j * r.v_row_stride, head_dim, lane, v);
        loaded = true;
      }
      const int64_t end = mask.row_end(j + 1);
      for (int64_t i = mask.row_begin(j); i < end; ++i) {
        if (!mask.visible(i, j)) continue;
        if constexpr (kSparse) {
          if (!p.fwd.block_mask.visible(batch, h, i, j)) continue;
        }
        float q[kMaxCols], dout[kMaxCols];
        careful_load<Element>(static_cast<const Element*>(r.q) + i * r.q_row_stride, head_dim, lane, q);
        careful_load<Element>(static_cast<const Element*>(g.dout) + i * g.dout_row_stride, head_dim, lane, dout);
        float qk = 0.0f, dov = 0.0f;
#pragma unroll
        for (int t = 0; t < kMaxCols; ++t) {
          qk += q[t] * k[t];
          dov += dout[t] * v[t];
        }
        const CarefulTerm term = careful_term(g, careful_warp_sum(qk), careful_warp_sum(dov), i, j);
#pragma unroll
        for (int t = 0; t < kMaxCols; ++t) {
          if (term.p != 0.0f) dv[t] += term.p * dout[t];  // no 0 * NaN from a term that does not count
          dk[t] += term.ds * careful_finite(q[t]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxCols; ++t) {
    const int c = lane + 32 * t;
    if (c < head_dim) {
      put_dk(c, dk[t] * p.softmax_scale);
      put_dv(c, dv[t]);
    }
  }
}

// Every non-finite element (exponent bits all ones: inf or NaN) of a 16-bit tile of `count`
// elements in shared memory set to 0, by `threads` threads of which this is `tid`; a multiple of
// 8 elements, 16-byte aligned. Element-wise, so the tile's layout (swizzle) does not matter.
// Integer compares on 16-byte words: once a CTA, off the main loop.
template <class Element>
__device__ __forceinline__ void zero_nonfinite(Element* tile, int count, int tid, int threads) {
  static_assert(sizeof(Element) == 2, "16-bit elements");
  constexpr uint32_t kExponent = std::is_same_v<Element, cutlass::bfloat16_t> ? 0x7F80u : 0x7C00u;
  auto* words = reinterpret_cast<uint32_t*>(tile);
  for (int i = tid; i < count / 8; i += threads) {
    uint32_t w[4];
    bool bad = false;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      w[e] = words[4 * i + e];
      const bool lo = (w[e] & kExponent) == kExponent, hi = ((w[e] >> 16) & kExponent) == kExponent;
      w[e] &= (lo ? 0xFFFF0000u : 0xFFFFFFFFu) & (hi ? 0x0000FFFFu : 0xFFFFFFFFu);
      bad |= lo || hi;
    }
    if (bad) {
#pragma unroll
      for (int e = 0; e < 4; ++e) words[4 * i + e] = w[e];
    }
  }
}

// The epilogue's cold path: every key row of [row_begin, row_end) of the CTA's tile (keys n0 ..,
// n0 = n_block * kBlockN within the sequence), taken by the warps row_step apart, whose dK or dV,
// staged in sK / sV, holds a NaN is recomputed by one warp (careful_key_grads) into sK / sV, which
// the epilogue then stores. Rows past the sequence's keys are left alone (nothing stores them).
template <class Element, int kHeadDim, int kBlockN, MaskKind kMask, bool kSparse = false, class SmemK, class SmemV>
__device__ __forceinline__ void repair_key_rows(const BackwardParams& params, int batch, int head_kv, int n_block,
                                                int row_begin, int row_end, int row_step, int lane, SmemK& sK,
                                                SmemV& sV) {
  const ForwardParams& fp = params.fwd;
  const Sequence seq = sequence(fp, batch);
  const int64_t n0 = int64_t{n_block} * kBlockN;
  const int rows = static_cast<int>(cute::min(int64_t{row_end}, key_rows(fp, batch) - n0));
  const core::Mask mask = make_mask<kMask>(fp, seq.seqlen_q, seq.seqlen_k);
  const int head_dim = static_cast<int>(fp.shape.head_dim);
  for (int r = row_begin; r < rows; r += row_step) {
    bool nan = false;
    for (int c = lane; c < head_dim; c += 32) {
      nan |= std::isnan(static_cast<float>(sK(r, c))) || std::isnan(static_cast<float>(sV(r, c)));
    }
    if (!__any_sync(0xffffffffu, nan)) continue;
    careful_key_grads<Element, kHeadDim / 32, kSparse>(
        params, batch, head_kv, seq, mask, n0 + r, lane,
        [&](int c, float value) { sK(r, c) = static_cast<Element>(value); },
        [&](int c, float value) { sV(r, c) = static_cast<Element>(value); });
  }
}

}  // namespace flashattn::cuda

// The attention variant as the CUDA kernels see it: core/variant.hpp's score modifiers in the
// exp2 domain the kernels work in, and the interface every kernel family (the sm80 and Hopper
// forwards and backwards, the decode kernels, the careful-row and sink-token passes) calls to
// score an element, take its gradient factor and join a row's sink. Plain data and host-device
// functions: the CPU emulation of the kernels runs this code too.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "../core/host_device.hpp"
#include "../core/variant.hpp"

namespace flashattn::cuda {

// A call's score modifiers with log2(e) folded in once, on the host (problem_params.cpp, from
// core::VariantParams), so the kernels work in the exp2 domain throughout. raw = q.k:
//   softcap off:  score = raw * scale_log2
//   softcap on:   score = softcap_log2 * tanh(raw * tanh_scale)
//   ALiBi:        score += alibi_bias(slope * log2(e), i, j, seqlen_q, seqlen_k)
//   raw_scores:   neither softcap nor ALiBi and scale > 0, so the scale commutes with the row
//                 max: the kernel keeps raw q.k and folds scale_log2 into the exponent's FMA
//                 (exp2(raw * scale_log2 - max)), one instruction per score instead of three.
//   sink:         a learnable sink (core/variant.hpp): each row's sum gains exp2(sink[h] * log2(e)
//                 - max), joined to the row's state after its key loop (sink_log2, join_sink in
//                 common/join_sink.cuh; decode: split 0 alone, merge_warps).
struct ScoreParams {
  float scale_log2 = 0.0f;  // softmax_scale * log2(e)
  bool raw_scores = false;
  float tanh_scale = 0.0f;       // softmax_scale / softcap
  float softcap_log2 = 0.0f;     // softcap * log2(e); 0 = softcap off
  const float* alibi = nullptr;  // fp32 slopes (natural-log units); nullptr = off
  int64_t alibi_batch_stride = 0, alibi_head_stride = 0;
  const float* sink = nullptr;  // fp32 sink logits [heads_q] (natural-log units); nullptr = none
  int64_t sink_stride = 0;
};

// Query head `head`'s learnable sink in the exp2 domain; -inf without one (core::sink_start's
// "no sink": a row then starts and ends exactly as it would without the feature).
FA_HOST_DEVICE float sink_log2(const ScoreParams& score, int64_t head) {
  return score.sink == nullptr ? -std::numeric_limits<float>::infinity()
                               : score.sink[head * score.sink_stride] * static_cast<float>(core::kLog2e);
}

// The softcap (core::softcap_apply) of a raw product q.k in the exp2 domain, from its tanh t:
// softcap * log2(e) * tanh(q.k * scale / softcap); its gradient is core::softcap_grad's 1 - t^2.
FA_HOST_DEVICE float softcap_tanh(const ScoreParams& score, float qk) { return tanhf(qk * score.tanh_scale); }
FA_HOST_DEVICE float capped_score_log2(const ScoreParams& score, float tanh_of_qk) {
  return score.softcap_log2 * tanh_of_qk;
}

// A raw product q.k's score in the exp2 domain: capped (above) or scaled; *tanh_out gets the
// cap's tanh when there is one.
FA_HOST_DEVICE float score_log2(const ScoreParams& score, float qk, float* tanh_out = nullptr) {
  if (score.softcap_log2 > 0.0f) {
    const float t = softcap_tanh(score, qk);
    if (tanh_out != nullptr) *tanh_out = t;
    return capped_score_log2(score, t);
  }
  return qk * score.scale_log2;
}

// d(score) / d(q.k) / scale from the cap's tanh t: 1 - t^2 with a softcap, 1 without.
FA_HOST_DEVICE float softcap_grad_factor(const ScoreParams& score, float t) {
  return score.softcap_log2 > 0.0f ? 1.0f - t * t : 1.0f;
}

// The ALiBi slope of (batch, query head) in the exp2 domain; 0 without ALiBi.
FA_HOST_DEVICE float alibi_slope_log2_of(const ScoreParams& score, int64_t batch, int64_t head) {
  return score.alibi == nullptr ? 0.0f
                                : score.alibi[batch * score.alibi_batch_stride + head * score.alibi_head_stride] *
                                      static_cast<float>(core::kLog2e);
}

// One (batch entry, query head)'s variant: the fixed interface a kernel scores through. Its
// parts, in core/variant.hpp's order (the mask, and so which tiles a kernel may skip, is
// core::Mask's; the sink, a per-row term, is sink_log2 above, joined after the key loop):
//   raw()            the score is q.k * scale alone: a kernel may keep raw products and fold
//                    the scale into its exponent (RowSoftmax's scale argument);
//   score(qk, &t)    the element-wise part (scale, or softcap with its tanh in t);
//   has_bias()       whether a position term follows, and with_bias(s, d) a score s with that
//                    term at the distance d = diag(i) - j of row i from key j (ALiBi; mask.hpp's
//                    diag), without_bias(s, d) the score before it: the tile loops evaluate it
//                    in a loop of their own behind this uniform flag;
//   grad_factor(t)   d(score) / d(q.k) / scale from score()'s t, and capped_grad_factor(s)
//                    the same from the capped score s (bias removed), for passes that recover s
//                    from P rather than keep t.
// Runtime values stay runtime: kernels specialise on raw() alone, where a kernel of its own pays
// (the Hopper backward, the decode kernels' plain path). A view: `params` stays where the kernel
// has it (its __grid_constant__ parameters), read where used, as a copy in registers would not
// be (with a copy, the sm80 forward's code changed from its prologue on).
struct ScoreVariant {
  const ScoreParams& params;
  float alibi_slope_log2 = 0.0f;  // this (batch, head)'s slope; 0 without ALiBi

  FA_HOST_DEVICE bool raw() const { return params.raw_scores; }
  FA_HOST_DEVICE float score(float qk, float* tanh_out = nullptr) const { return score_log2(params, qk, tanh_out); }
  FA_HOST_DEVICE bool has_bias() const { return params.alibi != nullptr; }
  // ALiBi's term is subtracted, not added as a negative bias: through a negation the compiler
  // lost the fused multiply-add (the sm80 backward grew by 80-144 instructions).
  FA_HOST_DEVICE float with_bias(float score, float distance) const {
    return score - alibi_slope_log2 * fabsf(distance);
  }
  FA_HOST_DEVICE float without_bias(float score, float distance) const {
    return score + alibi_slope_log2 * fabsf(distance);
  }
  FA_HOST_DEVICE float grad_factor(float tanh_of_qk) const { return softcap_grad_factor(params, tanh_of_qk); }
  FA_HOST_DEVICE float capped_grad_factor(float capped) const {
    return core::softcap_grad(capped, params.softcap_log2);
  }
};

FA_HOST_DEVICE ScoreVariant score_variant(const ScoreParams& score, int64_t batch, int64_t head) {
  return {score, alibi_slope_log2_of(score, batch, head)};
}

}  // namespace flashattn::cuda

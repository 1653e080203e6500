// One (batch, head) slice of the problem is copied into fp64 tensors of batch 1 and one head
// and given to flashattn::reference_forward/backward; the run's outputs for that slice are then
// judged against it by the tolerance rule, whose baseline is the naive attention in the run's
// dtype on the same slice. fp64 copies of the rounded inputs are exact, so the reference and the
// naive attention answer for exactly the values the run saw.
#include "reference_check.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "oracle/naive_attention.hpp"

namespace flashattn_cli {
namespace {

using flashattn::DType;
namespace oracle = flashattn_oracle;

// Rows [row0, row0 + rows) of head h of batch b of a [B, S, H, D] tensor, row-major [rows, D].
std::vector<double> slice_values(const HostTensor& src, int64_t b, int64_t h, int64_t row0, int64_t rows) {
  const int64_t s = src.shape()[1], heads = src.shape()[2], d = src.shape()[3];
  std::vector<double> out(static_cast<size_t>(rows * d));
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t base = ((b * s + row0 + i) * heads + h) * d;
    for (int64_t c = 0; c < d; ++c) out[static_cast<size_t>(i * d + c)] = src.get(base + c);
  }
  return out;
}

// The same rows as an fp64 tensor [1, rows, 1, D], an input of the reference.
HostTensor slice(const HostTensor& src, int64_t b, int64_t h, int64_t row0, int64_t rows) {
  const std::vector<double> values = slice_values(src, b, h, row0, rows);
  HostTensor out(DType::kFloat64, {1, rows, 1, src.shape()[3]});
  for (size_t i = 0; i < values.size(); ++i) out.set(static_cast<int64_t>(i), values[i]);
  return out;
}

std::vector<double> values(const HostTensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.get(i);
  return v;
}

uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

}  // namespace

bool CheckResult::passed() const {
  return done && std::all_of(verdicts.begin(), verdicts.end(), [](const oracle::Verdict& v) { return v.passed; });
}

CheckResult check_against_reference(const Dims& dims, const Tensors& t, const flashattn::AttentionOptions& options,
                                    const std::vector<float>& slopes, int64_t check_rows, bool backward,
                                    uint64_t seed) {
  CheckResult r;
  if (check_rows == 0) {
    r.what = "skipped (--check-rows 0)";
    return r;
  }
  const int64_t sq = dims.seqlen_q, sk = dims.seqlen_k, d = dims.head_dim;
  const uint64_t pick = mix(seed + 0x9e3779b97f4a7c15ull);
  r.batch = static_cast<int64_t>(pick % static_cast<uint64_t>(dims.batch));
  r.head = static_cast<int64_t>((pick >> 32) % static_cast<uint64_t>(dims.heads));
  const int64_t b = r.batch, h = r.head, hk = h / (dims.heads / dims.heads_kv);
  const bool whole = sq <= kMaxFullCheckPairs / sk;
  r.rows = whole ? sq : std::min(check_rows, sq);
  r.row0 = sq - r.rows;
  const std::string where = "batch " + std::to_string(b) + " head " + std::to_string(h) + ", ";
  if (r.row0 > 0 && options.dropout.p > 0.0f) {
    // The keep-mask is keyed by the absolute row index, which a row slice cannot reproduce.
    r.what = "skipped (with dropout only a whole head can be checked, and one head has " + std::to_string(sq) + "x" +
             std::to_string(sk) + " scores, above the limit of " + std::to_string(kMaxFullCheckPairs) + ")";
    return r;
  }
  r.what = where + (whole ? "all " + std::to_string(sq) + " rows"
                          : "last " + std::to_string(r.rows) + " of " + std::to_string(sq) +
                                " rows (one head exceeds " + std::to_string(kMaxFullCheckPairs) + " scores)");

  // The slice is batch 0 head 0 of its own problem: its ALiBi slope is that of head h, and the
  // dropout stream (keyed by batch * heads + head + offset) is shifted to that of (b, h).
  flashattn::AttentionOptions o = options;
  const float slope = options.score.alibi_slopes.present() ? slopes[static_cast<size_t>(h)] : 0.0f;
  if (options.score.alibi_slopes.present()) o.score.alibi_slopes = make_view(&slope, DType::kFloat32, {1});
  o.dropout.offset += static_cast<uint64_t>(b * dims.heads + h);

  const HostTensor q = slice(t.q, b, h, r.row0, r.rows);
  const HostTensor k = slice(t.k, b, hk, 0, sk);
  const HostTensor v = slice(t.v, b, hk, 0, sk);
  HostTensor out(DType::kFloat64, {1, r.rows, 1, d});
  HostTensor lse(DType::kFloat32, {1, 1, r.rows});
  flashattn::reference_forward({q.view(), k.view(), v.view(), out.view(), lse.view()}, o);

  // The same problem for the naive attention (the CLI's AttentionOptions set no softmax scale:
  // 1/sqrt(d), the naive attention's).
  oracle::Case c;
  c.dtype = dims.dtype;
  c.out_dtype = dims.out_dtype();  // FP8: P rounded to FP8 in the naive attention, out to bfloat16
  c.seqlen_q = r.rows;
  c.seqlen_k = sk;
  c.heads_q = c.heads_kv = 1;
  c.head_dim = d;
  c.causal = o.mask.causal;
  c.window_left = o.mask.window_left;
  c.window_right = o.mask.window_right;
  c.softcap = o.score.softcap;
  c.alibi = o.score.alibi_slopes.present();
  c.dropout = o.dropout.p;
  c.precise = o.precise;
  c.backward = backward;
  const HostTensor dout = backward ? slice(t.dout, b, h, r.row0, r.rows) : HostTensor();
  const oracle::NaiveResult naive = oracle::naive_attention(
      c, oracle::make_geometry(c), values(q), values(k), values(v), backward ? values(dout) : std::vector<double>{},
      {static_cast<double>(slope)}, o.dropout.seed, o.dropout.offset);

  r.verdicts.push_back(oracle::judge("out", slice_values(t.out, b, h, r.row0, r.rows), values(out), naive.out,
                                     oracle::kOutputFactor, dims.out_dtype()));
  std::vector<double> lse_got(static_cast<size_t>(r.rows));
  for (int64_t i = 0; i < r.rows; ++i) {
    lse_got[static_cast<size_t>(i)] = t.lse.get((b * dims.heads + h) * sq + r.row0 + i);
  }
  r.verdicts.push_back(oracle::judge_lse(lse_got, values(lse), naive.lse));
  r.done = true;
  if (!backward) return r;

  HostTensor dq(DType::kFloat64, {1, r.rows, 1, d});
  HostTensor dk(DType::kFloat64, {1, sk, 1, d});
  HostTensor dv(DType::kFloat64, {1, sk, 1, d});
  flashattn::reference_backward(
      {dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view()}, o);
  const oracle::Grads ref{values(dq), values(dk), values(dv)};
  // dK/dV of a kv head sum over every query row of every query head that reads it; the slice
  // has them all only for a whole head without GQA.
  if (dims.heads != dims.heads_kv) {
    r.dkdv_note = "dk/dv not checked: kv head " + std::to_string(hk) + " is shared by " +
                  std::to_string(dims.heads / dims.heads_kv) + " query heads";
  } else if (r.row0 > 0) {
    r.dkdv_note = "dk/dv not checked: they depend on all rows, only the last were checked";
  }
  if (!r.dkdv_note.empty()) {
    // dq alone, at the rounding scale the rule gives the three gradients: the slice's dk / dv
    // are made of the terms dq is.
    r.verdicts.push_back(oracle::judge("dq", slice_values(t.dq, b, h, r.row0, r.rows), ref.dq, naive.dq,
                                       oracle::kGradFactor, dims.dtype, oracle::grads_scale(ref)));
    return r;
  }
  const oracle::Grads got{slice_values(t.dq, b, h, 0, sq), slice_values(t.dk, b, hk, 0, sk),
                          slice_values(t.dv, b, hk, 0, sk)};
  for (oracle::Verdict& verdict : oracle::judge_grads(got, ref, naive, dims.dtype)) {
    r.verdicts.push_back(std::move(verdict));
  }
  return r;
}

}  // namespace flashattn_cli

// One (batch, head) slice of the problem is copied into fp64 tensors of batch 1 and one head
// and given to flashattn::reference_forward/backward; the run's outputs for that slice are then
// compared element by element. fp64 copies of the rounded inputs are exact, so the reference
// answers for exactly the values the run saw.
#include "reference_check.hpp"

#include <algorithm>
#include <cmath>
#include <string>

namespace flashattn_cli {
namespace {

using flashattn::DType;

// NaN-propagating running maximum of |a - b|; equal infinities (empty rows' -inf LSE) count 0.
void track(double& err, double a, double b) {
  if (std::isnan(err)) return;
  const double diff = a == b ? 0.0 : std::abs(a - b);
  if (std::isnan(diff) || diff > err) err = diff;
}

// Rows [row0, row0 + rows) of head h of batch b of a [B, S, H, D] tensor, as fp64 [1, rows, 1, D].
HostTensor slice(const HostTensor& src, int64_t b, int64_t h, int64_t row0, int64_t rows) {
  const int64_t s = src.shape()[1], heads = src.shape()[2], d = src.shape()[3];
  HostTensor out(DType::kFloat64, {1, rows, 1, d});
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t base = ((b * s + row0 + i) * heads + h) * d;
    for (int64_t c = 0; c < d; ++c) out.set(i * d + c, src.get(base + c));
  }
  return out;
}

// Max |full[b, row0 + i, h, :] - ref[0, i, 0, :]|.
double max_error(const HostTensor& full, const HostTensor& ref, int64_t b, int64_t h,
                 int64_t row0) {
  const int64_t s = full.shape()[1], heads = full.shape()[2], d = full.shape()[3];
  const int64_t rows = ref.shape()[1];
  double err = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t base = ((b * s + row0 + i) * heads + h) * d;
    for (int64_t c = 0; c < d; ++c) track(err, full.get(base + c), ref.get(i * d + c));
  }
  return err;
}

uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

}  // namespace

CheckResult check_against_reference(const Dims& dims, const Tensors& t,
                                    const flashattn::AttentionOptions& options,
                                    const std::vector<float>& slopes, int64_t check_rows,
                                    bool backward, uint64_t seed) {
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
    r.what = "skipped (with dropout only a whole head can be checked, and one head has " +
             std::to_string(sq) + "x" + std::to_string(sk) + " scores, above the limit of " +
             std::to_string(kMaxFullCheckPairs) + ")";
    return r;
  }
  r.what = where + (whole ? "all " + std::to_string(sq) + " rows"
                          : "last " + std::to_string(r.rows) + " of " + std::to_string(sq) +
                                " rows (one head exceeds " + std::to_string(kMaxFullCheckPairs) +
                                " scores)");

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
  r.out = max_error(t.out, out, b, h, r.row0);
  double lse_err = 0.0;
  for (int64_t i = 0; i < r.rows; ++i) {
    track(lse_err, t.lse.get((b * dims.heads + h) * sq + r.row0 + i), lse.get(i));
  }
  r.lse = lse_err;
  r.done = true;
  if (!backward) return r;

  const HostTensor dout = slice(t.dout, b, h, r.row0, r.rows);
  HostTensor dq(DType::kFloat64, {1, r.rows, 1, d});
  HostTensor dk(DType::kFloat64, {1, sk, 1, d});
  HostTensor dv(DType::kFloat64, {1, sk, 1, d});
  flashattn::reference_backward({dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                                 dq.view(), dk.view(), dv.view()},
                                o);
  r.dq = max_error(t.dq, dq, b, h, r.row0);
  // dK/dV of a kv head sum over every query row of every query head that reads it; the slice
  // has them all only for a whole head without GQA.
  if (dims.heads != dims.heads_kv) {
    r.dkdv_note = "dk/dv not checked: kv head " + std::to_string(hk) + " is shared by " +
                  std::to_string(dims.heads / dims.heads_kv) + " query heads";
  } else if (r.row0 > 0) {
    r.dkdv_note = "dk/dv not checked: they depend on all rows, only the last were checked";
  } else {
    r.dk = max_error(t.dk, dk, b, hk, 0);
    r.dv = max_error(t.dv, dv, b, hk, 0);
  }
  return r;
}

}  // namespace flashattn_cli

// FP8 (e4m3, e5m2) inputs on the CPU backend: the conversions against a value table built from
// the formats' fields, the forward (every mask and score mod, GQA, varlen, LSE) by the tolerance
// rule against the fp64 reference of the dequantised inputs, the reference against itself on
// those inputs in fp32, decode over an FP8 KV cache (quantise-on-append against the test's own
// rounding, every other cache byte unchanged, attention against the dense forward on the
// dequantised cache), the errors for bad arguments (nothing written) and the C ABI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "core/float8.hpp"
#include "flashattn/flashattn.h"
#include "test_util.hpp"

namespace {

using fa_test::Case;
using fa_test::HostTensor;
using flashattn::DType;
using flashattn::ErrorCode;
namespace core = flashattn::core;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The value of an FP8 code from its fields: sign, exponent (bias 7 or 15), mantissa (3 or 2
// bits); e4m3fn's S.1111.111 is NaN (no infinities), e5m2's exponent 31 is inf / NaN.
double code_value(DType dtype, int code) {
  const bool e4m3 = dtype == DType::kFloat8E4M3;
  const int mant_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, exp_max = e4m3 ? 15 : 31;
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int exp = (code & 0x7f) >> mant_bits, mant = code & ((1 << mant_bits) - 1);
  if (e4m3 && (code & 0x7f) == 0x7f) return kNaN;
  if (!e4m3 && exp == exp_max) return mant == 0 ? sign * std::numeric_limits<double>::infinity() : kNaN;
  if (exp == 0) return sign * std::ldexp(mant, 1 - bias - mant_bits);
  return sign * std::ldexp(1.0 + std::ldexp(mant, -mant_bits), exp - bias);
}

uint8_t encode(DType dtype, float x) {
  return dtype == DType::kFloat8E4M3 ? core::float_to_float8<core::E4M3Format>(x)
                                     : core::float_to_float8<core::E5M2Format>(x);
}
float decode(DType dtype, uint8_t code) {
  return dtype == DType::kFloat8E4M3 ? core::float8_to_float<core::E4M3Format>(code)
                                     : core::float8_to_float<core::E5M2Format>(code);
}

// The test's own rounding (the rule of docs/CONVENTIONS.md): the nearest finite code by a search
// of the table, ties to the even code, magnitudes past the largest finite value (infinities too)
// saturating to it, NaN to NaN. Returns the code's value.
double reference_round(DType dtype, double x) {
  if (std::isnan(x)) return kNaN;
  const double max = code_value(dtype, dtype == DType::kFloat8E4M3 ? 0x7e : 0x7b);
  if (std::abs(x) >= max) return std::signbit(x) ? -max : max;
  double best = 0, best_err = std::numeric_limits<double>::infinity();
  int best_code = 0;
  for (int code = 0; code < 0x80; ++code) {
    const double v = code_value(dtype, code);
    if (!std::isfinite(v)) continue;
    const double err = std::abs(std::abs(x) - v);
    if (err < best_err || (err == best_err && (code & 1) == 0)) best = v, best_err = err, best_code = code;
  }
  (void)best_code;
  return std::signbit(x) ? -best : best;
}

template <class F>
void expect_error(F call, ErrorCode code, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing \"" << needle << "\"";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

constexpr DType kFloat8Types[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};

// ---------------------------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------------------------
TEST(Float8, DecodesEveryCode) {
  for (DType dtype : kFloat8Types) {
    for (int code = 0; code < 256; ++code) {
      const double want = code_value(dtype, code);
      const double got = decode(dtype, static_cast<uint8_t>(code));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << flashattn::dtype_name(dtype) << " code " << code;
      } else {
        EXPECT_EQ(got, want) << flashattn::dtype_name(dtype) << " code " << code;
      }
    }
  }
  EXPECT_EQ(decode(DType::kFloat8E4M3, 0x7e), 448.0f);
  EXPECT_EQ(decode(DType::kFloat8E5M2, 0x7b), 57344.0f);
}

TEST(Float8, EncodesToNearestEvenSaturating) {
  auto rng = fa_test::rng_for("Float8.Encode");
  for (DType dtype : kFloat8Types) {
    const char* name = flashattn::dtype_name(dtype);
    std::vector<double> inputs;
    std::vector<double> finite;
    for (int code = 0; code < 0x80; ++code) {
      if (std::isfinite(code_value(dtype, code))) finite.push_back(code_value(dtype, code));
    }
    std::sort(finite.begin(), finite.end());
    for (size_t i = 0; i < finite.size(); ++i) {
      inputs.push_back(finite[i]);
      if (i + 1 < finite.size()) {
        const double mid = 0.5 * (finite[i] + finite[i + 1]);  // a tie: to the even code
        inputs.push_back(mid);
        inputs.push_back(std::nextafter(static_cast<float>(mid), 0.0f));
        inputs.push_back(std::nextafter(static_cast<float>(mid), 1e9f));
      }
    }
    const double max = finite.back();
    for (double x : {max * 1.03, max * 1.0625, max * 1.2, max * 4, 1e30, 1e-30, 1e-45}) inputs.push_back(x);
    std::uniform_real_distribution<double> log_mag(-22.0, std::log2(max) + 1.0);
    for (int i = 0; i < 20000; ++i) inputs.push_back(std::exp2(log_mag(rng)));
    for (double x : inputs) {
      for (double s : {1.0, -1.0}) {
        const auto xf = static_cast<float>(s * x);
        EXPECT_EQ(decode(dtype, encode(dtype, xf)), reference_round(dtype, xf)) << name << " " << xf;
      }
    }
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(decode(dtype, encode(dtype, inf)), static_cast<float>(max)) << name;
    EXPECT_EQ(decode(dtype, encode(dtype, -inf)), static_cast<float>(-max)) << name;
    EXPECT_TRUE(std::isnan(decode(dtype, encode(dtype, std::numeric_limits<float>::quiet_NaN())))) << name;
  }
  EXPECT_EQ(decode(DType::kFloat8E4M3, encode(DType::kFloat8E4M3, 464.0f)), 448.0f);  // the tie past 448
  EXPECT_EQ(decode(DType::kFloat8E4M3, encode(DType::kFloat8E4M3, 470.0f)), 448.0f);  // would round to 480
}

// ---------------------------------------------------------------------------------------------
// Forward: the tolerance rule against the fp64 reference of the dequantised inputs
// ---------------------------------------------------------------------------------------------
std::vector<Case> float8_cases() {
  std::vector<Case> cases;
  auto add = [&](Case c) {
    c.backward = false;
    cases.push_back(c);
  };
  for (DType dtype : kFloat8Types) {
    for (DType out : {DType::kBFloat16, DType::kFloat16}) {
      Case c;
      c.dtype = dtype;
      c.out_dtype = out;
      c.batch = 2, c.seqlen_q = 113, c.seqlen_k = 203, c.heads_q = 6, c.heads_kv = 2, c.head_dim = 64;
      add(c);
      Case causal = c;
      causal.causal = true;
      causal.seqlen_q = 128, causal.seqlen_k = 217, causal.heads_kv = 1, causal.head_dim = 40;
      add(causal);
      Case window = c;
      window.window_left = 37, window.window_right = 5, window.softcap = 20.0f, window.alibi = true;
      add(window);
      Case sink = c;
      sink.sink = true, sink.sink_tokens = 4, sink.window_left = 16, sink.causal = true;
      add(sink);
      Case decode = c;
      decode.seqlen_q = 1, decode.seqlen_k = 239, decode.head_dim = 128;
      add(decode);
      Case empty_rows = c;  // rows above the causal diagonal see no key
      empty_rows.seqlen_q = 239, empty_rows.seqlen_k = 1, empty_rows.causal = true;
      add(empty_rows);
      Case varlen = c;
      varlen.lens_q = {17, 0, 64, 3};
      varlen.lens_k = {40, 5, 0, 130};
      varlen.causal = true;
      add(varlen);
      Case mla = c;  // v's own head_dim
      mla.head_dim = 96, mla.head_dim_v = 64, mla.heads_kv = 6;
      add(mla);
    }
  }
  Case large = cases.front();  // logits of a few tens: the FP8 rounding of q and k matters more
  large.input_scale = 3.0;
  add(large);
  Case strided = cases.front();
  strided.strided = true;
  add(strided);
  Case precise = cases.front();  // fp64 accumulators
  precise.precise = true;
  add(precise);
  return cases;
}

TEST(Float8Forward, ToleranceRuleAgainstDequantisedReference) {
  double worst_ratio = 0;
  std::string worst;
  for (const Case& c : float8_cases()) {
    SCOPED_TRACE(c.name());
    const fa_test::CaseResult r = fa_test::run_case(c);
    // The rule bounds the error by 2x the naive FP8 attention's; the ratio is reported (the
    // flash path in fp32 sees none of FP8's rounding of P, so it is far below 2).
    if (c.seqlen_k == 1) continue;  // one key: P = 1 is exact, the rule is atol alone
    EXPECT_GT(r.out_naive_err, 0.0) << "the naive FP8 attention should carry FP8 rounding of P";
    const double ratio = r.out_only_err / std::max(r.out_naive_err, 1e-300);
    if (ratio > worst_ratio) worst_ratio = ratio, worst = c.name();
  }
  std::printf("FP8 forward: worst max|out - ref| / max|naive - ref| = %.4g (%s)\n", worst_ratio, worst.c_str());
  EXPECT_LE(worst_ratio, 2.0);
}

// The reference reads FP8 through the same dequantisation as the flash path: on inputs whose
// dequantised values are exact in fp32 (factors with short mantissas) it equals the reference
// run on fp32 copies of those values, bit for bit once both outputs are rounded to bf16.
TEST(Float8Forward, ReferenceEqualsReferenceOfDequantisedInputs) {
  auto rng = fa_test::rng_for("Float8.ReferenceDequantised");
  const int64_t b = 2, s = 37, hq = 4, hkv = 2, d = 24;
  HostTensor q(DType::kFloat8E4M3, {b, s, hq, d}), k(DType::kFloat8E4M3, {b, s, hkv, d}),
      v(DType::kFloat8E4M3, {b, s, hkv, d});
  for (HostTensor* t : {&q, &k, &v}) t->fill_normal(rng, 2.0);
  const double factors[] = {0.5, 0.75, 1.25, 1.5, 2.0, 3.0};
  std::uniform_int_distribution<int> pick(0, 5);
  HostTensor qs(DType::kFloat32, {b, hkv}), ks(DType::kFloat32, {b, hkv}), vs(DType::kFloat32, {b, hkv});
  for (HostTensor* t : {&qs, &ks, &vs}) {
    for (int64_t e = 0; e < t->numel(); ++e) t->set(e, factors[pick(rng)]);
  }
  auto dequantise = [&](const HostTensor& x, const HostTensor& scales, int64_t heads) {
    HostTensor f(DType::kFloat32, x.shape());
    for (int64_t e = 0; e < x.numel(); ++e) {
      const int64_t h = (e / d) % heads, batch = e / (d * heads * s);
      f.set(e, x.get(e) * scales.get(batch * hkv + h / (heads / hkv)));
    }
    return f;
  };
  const HostTensor qf = dequantise(q, qs, hq), kf = dequantise(k, ks, hkv), vf = dequantise(v, vs, hkv);
  HostTensor out(DType::kBFloat16, {b, s, hq, d}), out_f(DType::kFloat32, {b, s, hq, d});
  HostTensor lse(DType::kFloat32, {b, hq, s}), lse_f(DType::kFloat32, {b, hq, s});
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  o.score.softcap = 15.0f;
  flashattn::ForwardArgs a{q.view(), k.view(), v.view(), out.view(), lse.view()};
  a.q_descale = qs.view(), a.k_descale = ks.view(), a.v_descale = vs.view();
  flashattn::reference_forward(a, o);
  flashattn::reference_forward({qf.view(), kf.view(), vf.view(), out_f.view(), lse_f.view()}, o);
  for (int64_t e = 0; e < out.numel(); ++e) ASSERT_EQ(out.get(e), fa_test::round_to(DType::kBFloat16, out_f.get(e)));
  for (int64_t e = 0; e < lse.numel(); ++e) ASSERT_EQ(lse.get(e), lse_f.get(e));
  // A factor applies to its own (batch entry, KV head) alone: changing q's factor of (1, 0)
  // changes exactly the rows of q heads 0 and 1 of batch entry 1.
  HostTensor out2(DType::kBFloat16, {b, s, hq, d});
  qs.set(1 * hkv + 0, 7.0);
  flashattn::ForwardArgs a2 = a;
  a2.out = out2.view();
  a2.lse = {};
  flashattn::reference_forward(a2, o);
  for (int64_t e = 0; e < out.numel(); ++e) {
    const int64_t h = (e / d) % hq, batch = e / (d * hq * s), row = (e / (d * hq)) % s;
    if (batch != 1 || h / 2 != 0) {
      EXPECT_EQ(out2.get(e), out.get(e)) << e << " row " << row;
    }
  }
  int64_t changed = 0;
  for (int64_t e = 0; e < out.numel(); ++e) changed += out2.get(e) != out.get(e);
  EXPECT_GT(changed, 0);
}

// ---------------------------------------------------------------------------------------------
// Decode over an FP8 KV cache
// ---------------------------------------------------------------------------------------------
struct CacheCase {
  DType cache = DType::kFloat8E4M3, dtype = DType::kBFloat16;
  int64_t page_size = 0;  // 0: contiguous
  int64_t seqlen_q = 1, seqlen_new = 2;
  int64_t heads_q = 6, heads_kv = 2;
  bool causal = false;
  std::string name() const {
    return std::string(flashattn::dtype_name(cache)) + "/" + flashattn::dtype_name(dtype) + " page" +
           std::to_string(page_size) + " sq" + std::to_string(seqlen_q) + " new" + std::to_string(seqlen_new) + " h" +
           std::to_string(heads_q) + "/" + std::to_string(heads_kv) + (causal ? " causal" : "");
  }
};

// Factors whose products with FP8 values are exact in fp32, so the dense fp32 reference below
// sees the dequantised cache exactly.
constexpr double kShortFactors[] = {0.5, 0.75, 1.25, 1.5, 2.0, 3.0};

void run_cache_case(const CacheCase& c) {
  SCOPED_TRACE(c.name());
  auto rng = fa_test::rng_for(c.name());
  const int64_t batch = 3, d = 64, capacity = 48, hq = c.heads_q, hkv = c.heads_kv;
  const bool paged = c.page_size > 0;
  const int64_t pages = paged ? capacity / c.page_size : 0, blocks = paged ? batch * pages + 1 : batch;
  const int64_t rows = paged ? c.page_size : capacity;  // dim 1 of the caches
  HostTensor k_cache(c.cache, {blocks, rows, hkv, d}), v_cache(c.cache, {blocks, rows, hkv, d});
  k_cache.fill_normal(rng, 2.0);
  v_cache.fill_normal(rng, 2.0);
  // Sequence b's position pos: entry b (contiguous) or a shuffled page of its table.
  std::vector<int32_t> order(static_cast<size_t>(blocks));
  for (int64_t i = 0; i < blocks; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), rng);
  HostTensor table(DType::kInt32, {batch, std::max<int64_t>(pages, 1)});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < pages; ++p) table.set(b * pages + p, order[b * pages + p]);
  }
  auto cache_row = [&](int64_t b, int64_t pos) {  // row index in [blocks * rows]
    if (!paged) return b * rows + pos;
    return static_cast<int64_t>(table.get(b * pages + pos / c.page_size)) * rows + pos % c.page_size;
  };
  HostTensor seqlens(DType::kInt32, {batch});
  std::uniform_int_distribution<int64_t> len(0, capacity - c.seqlen_new);
  for (int64_t b = 0; b < batch; ++b) seqlens.set(b, b == 0 ? 0 : len(rng));  // one empty cache
  HostTensor q(c.dtype, {batch, c.seqlen_q, hq, d}), k_new(c.dtype, {batch, c.seqlen_new, hkv, d}),
      v_new(c.dtype, {batch, c.seqlen_new, hkv, d});
  q.fill_normal(rng);
  k_new.fill_normal(rng, 4.0);
  v_new.fill_normal(rng, 4.0);
  if (c.cache == DType::kFloat8E4M3 && v_new.numel() > 1) {  // saturate: past 448 * factor (e4m3)
    k_new.set(0, 5000.0);
    v_new.set(1, -1e5);  // -inf in float16: saturates too
  }
  HostTensor k_descale(DType::kFloat32, {batch, hkv}), v_descale(DType::kFloat32, {batch, hkv});
  std::uniform_int_distribution<int> pick(0, 5);
  for (HostTensor* t : {&k_descale, &v_descale}) {
    for (int64_t e = 0; e < t->numel(); ++e) t->set(e, kShortFactors[pick(rng)]);
  }
  const HostTensor k_before = k_cache, v_before = v_cache;
  HostTensor k_ref = k_cache, v_ref = v_cache;  // the reference call's own caches
  HostTensor out(c.dtype, {batch, c.seqlen_q, hq, d}), out_ref(c.dtype, {batch, c.seqlen_q, hq, d});
  HostTensor lse(DType::kFloat32, {batch, hq, c.seqlen_q}), lse_ref(DType::kFloat32, {batch, hq, c.seqlen_q});
  out.fill_storage_nan();
  lse.fill_storage_nan();
  auto args = [&](HostTensor& kc, HostTensor& vc, HostTensor& o, HostTensor& l) {
    flashattn::KvCacheArgs a;
    a.q = q.view();
    a.k_cache = kc.view();
    a.v_cache = vc.view();
    a.k_new = k_new.view();
    a.v_new = v_new.view();
    a.cache_seqlens = seqlens.view();
    if (paged) a.block_table = table.view();
    a.out = o.view();
    a.lse = l.view();
    a.k_descale = k_descale.view();
    a.v_descale = v_descale.view();
    return a;
  };
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  flashattn::forward_kvcache(args(k_cache, v_cache, out, lse), o);
  flashattn::reference_forward_kvcache(args(k_ref, v_ref, out_ref, lse_ref), o);

  // The caches: appended rows hold the test's rounding of new / factor, every other byte is
  // unchanged; the reference call appended the same bytes.
  const auto* k_bytes = static_cast<const uint8_t*>(k_cache.data());
  const auto* v_bytes = static_cast<const uint8_t*>(v_cache.data());
  ASSERT_EQ(std::memcmp(k_bytes, k_ref.data(), static_cast<size_t>(k_cache.numel())), 0);
  ASSERT_EQ(std::memcmp(v_bytes, v_ref.data(), static_cast<size_t>(v_cache.numel())), 0);
  std::vector<bool> appended(static_cast<size_t>(blocks * rows), false);
  int64_t saturated = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < c.seqlen_new; ++t) {
      const int64_t row = cache_row(b, static_cast<int64_t>(seqlens.get(b)) + t);
      appended[row] = true;
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t x = 0; x < d; ++x) {
          const int64_t src = ((b * c.seqlen_new + t) * hkv + h) * d + x, dst = (row * hkv + h) * d + x;
          const auto kq = static_cast<float>(k_new.get(src)) / static_cast<float>(k_descale.get(b * hkv + h));
          const auto vq = static_cast<float>(v_new.get(src)) / static_cast<float>(v_descale.get(b * hkv + h));
          ASSERT_EQ(decode(c.cache, k_bytes[dst]), reference_round(c.cache, kq)) << "k row " << row << " x " << x;
          ASSERT_EQ(decode(c.cache, v_bytes[dst]), reference_round(c.cache, vq)) << "v row " << row << " x " << x;
          saturated += std::abs(kq) > 448 && c.cache == DType::kFloat8E4M3;
        }
      }
    }
  }
  if (c.seqlen_new > 0 && c.cache == DType::kFloat8E4M3) {
    EXPECT_GT(saturated, 0);
  }
  const auto* k_old = static_cast<const uint8_t*>(k_before.data());
  const auto* v_old = static_cast<const uint8_t*>(v_before.data());
  for (int64_t row = 0; row < blocks * rows; ++row) {
    if (appended[row]) continue;
    ASSERT_EQ(std::memcmp(k_bytes + row * hkv * d, k_old + row * hkv * d, static_cast<size_t>(hkv * d)), 0) << row;
    ASSERT_EQ(std::memcmp(v_bytes + row * hkv * d, v_old + row * hkv * d, static_cast<size_t>(hkv * d)), 0) << row;
  }

  // Attention: the dense fp32 reference on each sequence's dequantised cache (exact in fp32).
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = static_cast<int64_t>(seqlens.get(b)) + c.seqlen_new;
    HostTensor qb(DType::kFloat32, {1, c.seqlen_q, hq, d}), kb(DType::kFloat32, {1, keys, hkv, d}),
        vb(DType::kFloat32, {1, keys, hkv, d}), ob(DType::kFloat32, {1, c.seqlen_q, hq, d}),
        lb(DType::kFloat32, {1, hq, c.seqlen_q});
    for (int64_t e = 0; e < qb.numel(); ++e) qb.set(e, q.get(b * qb.numel() + e));
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t row = cache_row(b, j);
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t x = 0; x < d; ++x) {
          kb.set((j * hkv + h) * d + x, decode(c.cache, k_bytes[(row * hkv + h) * d + x]) * k_descale.get(b * hkv + h));
          vb.set((j * hkv + h) * d + x, decode(c.cache, v_bytes[(row * hkv + h) * d + x]) * v_descale.get(b * hkv + h));
        }
      }
    }
    flashattn::reference_forward({qb.view(), kb.view(), vb.view(), ob.view(), lb.view()}, o);
    double scale = 0;
    for (int64_t e = 0; e < ob.numel(); ++e) scale = std::max(scale, std::abs(ob.get(e)));
    const double atol = flashattn_oracle::tolerance_atol(c.dtype, scale);
    for (int64_t e = 0; e < ob.numel(); ++e) {
      const double want = fa_test::round_to(c.dtype, ob.get(e));
      ASSERT_EQ(out_ref.get(b * ob.numel() + e), want) << "reference, batch " << b << " element " << e;
      ASSERT_LE(std::abs(out.get(b * ob.numel() + e) - want), atol) << "batch " << b << " element " << e;
    }
    for (int64_t e = 0; e < lb.numel(); ++e) {
      const double want = lb.get(e), got = lse.get(b * lb.numel() + e);
      ASSERT_EQ(lse_ref.get(b * lb.numel() + e), want);
      if (std::isinf(want)) {
        ASSERT_EQ(got, want);
      } else {
        ASSERT_LE(std::abs(got - want), 1e-5 * std::max(1.0, std::abs(want))) << "lse, batch " << b;
      }
    }
  }
}

TEST(Float8Cache, DecodeAgainstDenseForwardOnDequantisedCache) {
  for (DType cache : kFloat8Types) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      for (int64_t page : {0, 16, 5}) {
        CacheCase c;
        c.cache = cache, c.dtype = dtype, c.page_size = page == 5 ? 6 : page;
        run_cache_case(c);
        c.seqlen_q = 3, c.seqlen_new = 3, c.causal = true;  // several new tokens, bottom-right causal
        run_cache_case(c);
      }
    }
  }
  CacheCase mqa;
  mqa.heads_kv = 1;
  run_cache_case(mqa);
  CacheCase mha;  // no append: attention over the cache as it is
  mha.heads_kv = 6, mha.seqlen_new = 0;
  run_cache_case(mha);
}

// With rotary embedding the FP8 cache stores the rotated row as a 16-bit cache would hold it,
// quantised: the same call on a bfloat16 cache gives the values the test rounds.
TEST(Float8Cache, RotaryAppendQuantisesTheRotatedRow) {
  auto rng = fa_test::rng_for("Float8.Rotary");
  const int64_t batch = 2, cap = 16, hq = 4, hkv = 2, d = 32, new_rows = 2, rotary_dim = 16;
  HostTensor q(DType::kBFloat16, {batch, 1, hq, d}), k_new(DType::kBFloat16, {batch, new_rows, hkv, d}),
      v_new(DType::kBFloat16, {batch, new_rows, hkv, d});
  for (HostTensor* t : {&q, &k_new, &v_new}) t->fill_normal(rng, 3.0);
  HostTensor cos(DType::kFloat32, {cap, rotary_dim / 2}), sin(DType::kFloat32, {cap, rotary_dim / 2});
  for (int64_t e = 0; e < cos.numel(); ++e) {
    const double angle = static_cast<double>(e / (rotary_dim / 2)) * std::pow(10.0, -0.5 * (e % (rotary_dim / 2)));
    cos.set(e, std::cos(angle));
    sin.set(e, std::sin(angle));
  }
  HostTensor seqlens(DType::kInt32, {batch}), ks(DType::kFloat32, {batch, hkv}), vs(DType::kFloat32, {batch, hkv});
  seqlens.set(0, 3.0);
  seqlens.set(1, 9.0);
  for (int64_t e = 0; e < ks.numel(); ++e) ks.set(e, kShortFactors[e % 6]), vs.set(e, kShortFactors[(e + 3) % 6]);
  HostTensor k16(DType::kBFloat16, {batch, cap, hkv, d}), v16(DType::kBFloat16, {batch, cap, hkv, d});
  HostTensor k8(DType::kFloat8E4M3, {batch, cap, hkv, d}), v8(DType::kFloat8E4M3, {batch, cap, hkv, d});
  for (HostTensor* t : {&k16, &v16, &k8, &v8}) t->fill(0.0);
  HostTensor out(DType::kBFloat16, {batch, 1, hq, d});
  auto call = [&](HostTensor& kc, HostTensor& vc, bool fp8) {
    flashattn::KvCacheArgs a;
    a.q = q.view(), a.k_cache = kc.view(), a.v_cache = vc.view(), a.k_new = k_new.view(), a.v_new = v_new.view();
    a.cache_seqlens = seqlens.view(), a.rotary_cos = cos.view(), a.rotary_sin = sin.view(), a.out = out.view();
    if (fp8) a.k_descale = ks.view(), a.v_descale = vs.view();
    flashattn::forward_kvcache(a, {});
  };
  call(k16, v16, false);
  call(k8, v8, true);
  int64_t rotated = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < new_rows; ++t) {
      const int64_t pos = static_cast<int64_t>(seqlens.get(b)) + t;
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t x = 0; x < d; ++x) {
          const int64_t e = ((b * cap + pos) * hkv + h) * d + x, src = ((b * new_rows + t) * hkv + h) * d + x;
          const auto kq = static_cast<float>(k16.get(e)) / static_cast<float>(ks.get(b * hkv + h));
          const auto vq = static_cast<float>(v16.get(e)) / static_cast<float>(vs.get(b * hkv + h));
          ASSERT_EQ(k8.get(e), reference_round(DType::kFloat8E4M3, kq)) << b << " " << pos << " " << h << " " << x;
          ASSERT_EQ(v8.get(e), reference_round(DType::kFloat8E4M3, vq)) << b << " " << pos << " " << h << " " << x;
          rotated += x < rotary_dim && k16.get(e) != k_new.get(src);
        }
      }
    }
  }
  EXPECT_GT(rotated, 0);  // the keys were rotated, not copied
}

// ---------------------------------------------------------------------------------------------
// Bad input: an error naming the argument, nothing written
// ---------------------------------------------------------------------------------------------
struct DenseFloat8 {
  static constexpr int64_t b = 2, s = 9, hq = 4, hkv = 2, d = 16;
  HostTensor q{DType::kFloat8E4M3, {b, s, hq, d}}, k{DType::kFloat8E4M3, {b, s, hkv, d}},
      v{DType::kFloat8E4M3, {b, s, hkv, d}}, out{DType::kBFloat16, {b, s, hq, d}}, lse{DType::kFloat32, {b, hq, s}};
  HostTensor qs{DType::kFloat32, {b, hkv}}, ks{DType::kFloat32, {b, hkv}}, vs{DType::kFloat32, {b, hkv}};
  DenseFloat8() {
    auto rng = fa_test::rng_for("Float8.Dense");
    for (HostTensor* t : {&q, &k, &v}) t->fill_normal(rng);
    for (HostTensor* t : {&qs, &ks, &vs}) t->fill(0.5);
    out.fill_storage_nan();
    lse.fill_storage_nan();
  }
  flashattn::ForwardArgs args() const {
    flashattn::ForwardArgs a{q.view(), k.view(), v.view(), out.view(), lse.view()};
    a.q_descale = qs.view(), a.k_descale = ks.view(), a.v_descale = vs.view();
    return a;
  }
  bool untouched() const {
    for (int64_t e = 0; e < out.numel(); ++e) {
      if (!std::isnan(out.get(e))) return false;
    }
    for (int64_t e = 0; e < lse.numel(); ++e) {
      if (!std::isnan(lse.get(e))) return false;
    }
    return true;
  }
};

TEST(Float8Errors, ForwardArguments) {
  DenseFloat8 t;
  const flashattn::AttentionOptions o;
  auto fails = [&](flashattn::ForwardArgs a, ErrorCode code, const std::string& needle) {
    expect_error([&] { flashattn::forward(a, o); }, code, needle);
    expect_error([&] { flashattn::reference_forward(a, o); }, code, needle);
    EXPECT_TRUE(t.untouched()) << needle;
  };
  HostTensor f64(DType::kFloat64, {t.b, t.hkv}), wide(DType::kFloat32, {t.b, t.hq}), flat(DType::kFloat32, {t.hkv});
  HostTensor short_batch(DType::kFloat32, {1, t.hkv});
  flashattn::ForwardArgs a = t.args();
  a.q_descale = f64.view();
  fails(a, ErrorCode::kInvalidDtype, "q_descale: dtype float64 must be float32");
  a = t.args();
  a.k_descale = wide.view();
  fails(a, ErrorCode::kInvalidArgument, "k_descale: heads 4 != heads_kv 2");
  a = t.args();
  a.v_descale = short_batch.view();
  fails(a, ErrorCode::kInvalidArgument, "v_descale: batch 1 != batch 2");
  a = t.args();
  a.v_descale = flat.view();
  fails(a, ErrorCode::kInvalidArgument, "v_descale: ndim 1 != expected 2");
  a = t.args();
  a.k_descale.device = {flashattn::DeviceType::kCUDA, 0};
  fails(a, ErrorCode::kInvalidArgument, "k_descale: on cuda:0 but q is on cpu");
  // FP8 output, mixed dtypes.
  HostTensor out8(DType::kFloat8E4M3, {t.b, t.s, t.hq, t.d}), k16(DType::kBFloat16, {t.b, t.s, t.hkv, t.d});
  HostTensor v5(DType::kFloat8E5M2, {t.b, t.s, t.hkv, t.d});
  a = t.args();
  a.out = out8.view();
  fails(a, ErrorCode::kInvalidDtype, "out: dtype float8_e4m3fn with q float8_e4m3fn: float8 inputs give a bfloat16");
  a = t.args();
  a.k = k16.view();
  fails(a, ErrorCode::kInvalidDtype, "k: dtype bfloat16 != q dtype float8_e4m3fn");
  a = t.args();
  a.v = v5.view();
  fails(a, ErrorCode::kInvalidDtype, "v: dtype float8_e5m2 != q dtype float8_e4m3fn");
  // Descale factors for 16-bit inputs.
  HostTensor q16(DType::kBFloat16, {t.b, t.s, t.hq, t.d}), v16(DType::kBFloat16, {t.b, t.s, t.hkv, t.d});
  a = {q16.view(), k16.view(), v16.view(), t.out.view(), t.lse.view()};
  a.q_descale = t.qs.view();
  fails(a, ErrorCode::kInvalidArgument, "q_descale: given for q of dtype bfloat16");
  // A descale that overlaps an output.
  a = t.args();
  a.v_descale = flashattn::TensorView::contiguous(t.lse.data(), DType::kFloat32, {t.b, t.hkv});
  fails(a, ErrorCode::kInvalidArgument, "v_descale");
}

TEST(Float8Errors, BackwardRefusedByName) {
  DenseFloat8 t;
  HostTensor dout(DType::kBFloat16, {t.b, t.s, t.hq, t.d}), dq(DType::kFloat8E4M3, {t.b, t.s, t.hq, t.d}),
      dk(DType::kFloat8E4M3, {t.b, t.s, t.hkv, t.d}), dv(DType::kFloat8E4M3, {t.b, t.s, t.hkv, t.d});
  dq.fill_storage_nan();
  const flashattn::BackwardArgs a{dout.view(),  t.q.view(), t.k.view(), t.v.view(), t.out.view(),
                                  t.lse.view(), dq.view(),  dk.view(),  dv.view()};
  expect_error([&] { flashattn::backward(a, {}); }, ErrorCode::kUnsupported,
               "q: dtype float8_e4m3fn: the backward pass does not take float8 inputs yet");
  for (int64_t e = 0; e < dq.numel(); ++e) ASSERT_TRUE(std::isnan(dq.get(e)));
}

TEST(Float8Errors, KvCacheArguments) {
  const int64_t b = 2, cap = 8, hq = 4, hkv = 2, d = 16;
  auto rng = fa_test::rng_for("Float8.CacheErrors");
  HostTensor q(DType::kBFloat16, {b, 1, hq, d}), kc(DType::kFloat8E4M3, {b, cap, hkv, d}),
      vc(DType::kFloat8E4M3, {b, cap, hkv, d}), k_new(DType::kBFloat16, {b, 1, hkv, d}),
      v_new(DType::kBFloat16, {b, 1, hkv, d}), seqlens(DType::kInt32, {b}), out(DType::kBFloat16, {b, 1, hq, d});
  HostTensor ks(DType::kFloat32, {b, hkv}), vs(DType::kFloat32, {b, hkv});
  for (HostTensor* t : {&q, &kc, &vc, &k_new, &v_new}) t->fill_normal(rng);
  ks.fill(2.0);
  vs.fill(2.0);
  seqlens.fill(3.0);
  out.fill_storage_nan();
  const HostTensor kc_before = kc, vc_before = vc;
  auto base = [&] {
    flashattn::KvCacheArgs a;
    a.q = q.view(), a.k_cache = kc.view(), a.v_cache = vc.view(), a.k_new = k_new.view(), a.v_new = v_new.view();
    a.cache_seqlens = seqlens.view(), a.out = out.view(), a.k_descale = ks.view(), a.v_descale = vs.view();
    return a;
  };
  auto fails = [&](const flashattn::KvCacheArgs& a, ErrorCode code, const std::string& needle) {
    expect_error([&] { flashattn::forward_kvcache(a, {}); }, code, needle);
    for (int64_t e = 0; e < out.numel(); ++e) ASSERT_TRUE(std::isnan(out.get(e))) << needle;
    ASSERT_EQ(std::memcmp(kc.data(), kc_before.data(), static_cast<size_t>(kc.numel())), 0) << needle;
    ASSERT_EQ(std::memcmp(vc.data(), vc_before.data(), static_cast<size_t>(vc.numel())), 0) << needle;
  };
  HostTensor q8(DType::kFloat8E4M3, {b, 1, hq, d}), q32(DType::kFloat32, {b, 1, hq, d});
  HostTensor vc16(DType::kBFloat16, {b, cap, hkv, d}), kc16(DType::kBFloat16, {b, cap, hkv, d});
  HostTensor knew8(DType::kFloat8E4M3, {b, 1, hkv, d}), wide(DType::kFloat32, {b, hq}), f16(DType::kFloat16, {b, hkv});
  flashattn::KvCacheArgs a = base();
  a.q = q8.view();
  fails(a, ErrorCode::kUnsupported, "q: dtype float8_e4m3fn: forward_kvcache takes bfloat16 or float16 queries");
  a = base();
  a.q = q32.view();
  fails(a, ErrorCode::kInvalidDtype, "q: dtype float32 with k_cache float8_e4m3fn");
  a = base();
  a.v_cache = vc16.view();
  fails(a, ErrorCode::kInvalidDtype, "v_cache: dtype bfloat16 != k_cache dtype float8_e4m3fn");
  a = base();
  a.k_new = knew8.view();
  fails(a, ErrorCode::kInvalidDtype, "k_new: dtype float8_e4m3fn != q dtype bfloat16");
  a = base();
  a.k_descale = wide.view();
  fails(a, ErrorCode::kInvalidArgument, "k_descale: heads 4 != heads_kv 2");
  a = base();
  a.v_descale = f16.view();
  fails(a, ErrorCode::kInvalidDtype, "v_descale: dtype float16 must be float32");
  a = base();
  a.k_descale.device = {flashattn::DeviceType::kCUDA, 0};
  fails(a, ErrorCode::kInvalidArgument, "k_descale: on cuda:0 but q is on cpu");
  a = base();
  a.k_cache = kc16.view(), a.v_cache = vc16.view();
  fails(a, ErrorCode::kInvalidArgument, "k_descale: given for k_cache of dtype bfloat16");
  a = base();  // a descale inside the cache that the call writes
  a.v_descale = flashattn::TensorView::contiguous(kc.data(), DType::kFloat32, {b, hkv});
  fails(a, ErrorCode::kInvalidArgument, "v_descale");
}

// The CUDA backend refuses FP8 tensors by name before anything else (its kernels come later).
// The views hold host memory labelled cuda:0, which the refusal never reads.
TEST(Float8Errors, CudaBackendRefusesByName) {
  if (!flashattn::cuda_compiled()) GTEST_SKIP() << "no CUDA backend in this build";
  DenseFloat8 t;
  flashattn::ForwardArgs a = t.args();
  for (flashattn::TensorView* v : {&a.q, &a.k, &a.v, &a.out, &a.lse, &a.q_descale, &a.k_descale, &a.v_descale}) {
    v->device = {flashattn::DeviceType::kCUDA, 0};
  }
  expect_error([&] { flashattn::forward(a, {}); }, ErrorCode::kUnsupported,
               "q: dtype float8_e4m3fn: the CUDA kernels do not take float8 inputs yet (the CPU backend runs them)");
  EXPECT_TRUE(t.untouched());
}

// ---------------------------------------------------------------------------------------------
// The C ABI: the same bits as the C++ API
// ---------------------------------------------------------------------------------------------
fa_tensor c_tensor(const HostTensor& t) {
  fa_tensor c{};
  std::vector<int64_t> shape = t.shape();
  EXPECT_EQ(fa_tensor_contiguous(&c, t.data(), static_cast<int32_t>(t.dtype()), static_cast<int32_t>(shape.size()),
                                 shape.data()),
            FA_OK);
  return c;
}

TEST(Float8CApi, ForwardBitwiseEqualToCpp) {
  for (DType dtype : kFloat8Types) {
    DenseFloat8 t;
    auto rng = fa_test::rng_for("Float8.CApi");
    HostTensor q(dtype, t.q.shape()), k(dtype, t.k.shape()), v(dtype, t.v.shape());
    for (HostTensor* x : {&q, &k, &v}) x->fill_normal(rng);
    std::uniform_real_distribution<double> u(0.25, 4.0);
    for (HostTensor* x : {&t.qs, &t.ks, &t.vs}) {
      for (int64_t e = 0; e < x->numel(); ++e) x->set(e, u(rng));
    }
    HostTensor out_c(DType::kFloat16, t.out.shape()), out_cpp(DType::kFloat16, t.out.shape());
    HostTensor lse_c(DType::kFloat32, t.lse.shape()), lse_cpp(DType::kFloat32, t.lse.shape());
    fa_forward_args ca{};
    ca.q = c_tensor(q), ca.k = c_tensor(k), ca.v = c_tensor(v), ca.out = c_tensor(out_c), ca.lse = c_tensor(lse_c);
    ca.q_descale = c_tensor(t.qs), ca.k_descale = c_tensor(t.ks), ca.v_descale = c_tensor(t.vs);
    fa_options co;
    fa_options_default(&co);
    co.causal = true;
    ASSERT_EQ(fa_forward(&ca, &co, nullptr), FA_OK) << fa_last_error();
    flashattn::ForwardArgs a{q.view(), k.view(), v.view(), out_cpp.view(), lse_cpp.view()};
    a.q_descale = t.qs.view(), a.k_descale = t.ks.view(), a.v_descale = t.vs.view();
    flashattn::AttentionOptions o;
    o.mask.causal = true;
    flashattn::forward(a, o);
    EXPECT_EQ(std::memcmp(out_c.data(), out_cpp.data(), static_cast<size_t>(out_c.numel()) * 2), 0);
    EXPECT_EQ(std::memcmp(lse_c.data(), lse_cpp.data(), static_cast<size_t>(lse_c.numel()) * 4), 0);
    // A bad descale through the C ABI: the status and the message.
    HostTensor f64(DType::kFloat64, {t.b, t.hkv});
    ca.k_descale = c_tensor(f64);
    EXPECT_EQ(fa_forward(&ca, &co, nullptr), FA_ERROR_INVALID_DTYPE);
    EXPECT_NE(std::string(fa_last_error()).find("k_descale: dtype float64 must be float32"), std::string::npos)
        << fa_last_error();
  }
}

}  // namespace

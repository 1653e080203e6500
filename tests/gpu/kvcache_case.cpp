#include "kvcache_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

namespace fa_test {

using flashattn::DType;

std::string KvCase::name() const {
  return std::string(flashattn::dtype_name(dtype)) + " b" + std::to_string(batch) + " sq" + std::to_string(seqlen_q) +
         " new" + std::to_string(seqlen_new) + " h" + std::to_string(heads_q) + "/" + std::to_string(heads_kv) + " d" +
         std::to_string(head_dim) + " cap" + std::to_string(capacity) + " page" + std::to_string(page_size) +
         (leftpad ? " leftpad" : "") + " rotary" + std::to_string(rotary_dim) + (interleaved ? "i" : "n") + " splits" +
         std::to_string(num_splits) + (causal ? " causal" : "") +
         (window_left >= 0 ? " window_left" + std::to_string(window_left) : "") +
         (sink_tokens > 0 ? " sink_tokens" + std::to_string(sink_tokens) : "") + (softcap != 0.0f ? " softcap" : "") +
         (alibi ? " alibi" : "") + (sink ? " sink" : "") +
         (has_nan_key ? std::string(" nan ") + (nan_in_k ? "k" : "v") + " key " + std::to_string(nan_key) : "");
}

namespace {

// Row of the [entries * rows, hkv, d] cache storage that holds position pos of sequence b.
int64_t cache_row(const KvCase& c, const HostTensor& table, int64_t b, int64_t pos) {
  if (c.page_size == 0) return b * c.capacity + pos;
  return static_cast<int64_t>(table.get(b * table.shape()[1] + pos / c.page_size)) * c.page_size + pos % c.page_size;
}

// expect_matches_cpu's bound on |out - CPU out| / max(1, |CPU out|): two output ulps.
double out_tolerance(const KvCase& c) { return 2 * (c.dtype == DType::kBFloat16 ? 0x1p-7 : 0x1p-10); }

}  // namespace

KvTensors make_kv_tensors(const KvCase& c, std::mt19937_64& rng) {
  KvTensors t;
  const int64_t hkv = c.heads_kv, d = c.head_dim;
  std::vector<int64_t> used(c.batch), first(c.batch, 0);
  std::uniform_int_distribution<int64_t> len(1, c.capacity - c.seqlen_new);
  for (int64_t b = 0; b < c.batch; ++b) used[b] = len(rng);
  if (c.empty_sequence) used[0] = 0;
  if (c.full_sequence) used[c.batch - 1] = c.capacity - c.seqlen_new;
  if (c.leftpad) {
    for (int64_t b = 0; b < c.batch; ++b) first[b] = std::uniform_int_distribution<int64_t>(0, used[b])(rng);
  }
  int64_t entries = c.batch;
  if (c.page_size > 0) {
    const int64_t pages = (c.capacity + c.page_size - 1) / c.page_size;
    entries = c.batch * pages + 1;  // one block nobody uses
    std::vector<int32_t> order(entries);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    t.table = HostTensor(DType::kInt32, {c.batch, pages});
    for (int64_t i = 0; i < c.batch * pages; ++i) t.table.set(i, order[i]);
  }
  const int64_t rows = c.page_size > 0 ? c.page_size : c.capacity;
  t.k_cache = HostTensor(c.dtype, {entries, rows, hkv, d});
  t.v_cache = HostTensor(c.dtype, {entries, rows, hkv, d});
  t.k_cache.fill_normal(rng);
  t.v_cache.fill_normal(rng);
  // Positions outside [leftpad, seqlens + seqlen_new) of every sequence: NaN, so a read shows.
  auto row_of = [&](int64_t b, int64_t pos) { return cache_row(c, t.table, b, pos); };
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t positions = c.page_size > 0 ? t.table.shape()[1] * c.page_size : c.capacity;
    for (int64_t pos = 0; pos < positions; ++pos) {
      if (pos >= first[b] && pos < used[b] + c.seqlen_new) continue;
      for (int64_t e = 0; e < hkv * d; ++e) {
        t.k_cache.set(row_of(b, pos) * hkv * d + e, std::nan(""));
        t.v_cache.set(row_of(b, pos) * hkv * d + e, std::nan(""));
      }
    }
  }
  t.q = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, d});
  t.q.fill_normal(rng);
  if (c.seqlen_new > 0) {
    t.k_new = HostTensor(c.dtype, {c.batch, c.seqlen_new, hkv, d});
    t.v_new = HostTensor(c.dtype, {c.batch, c.seqlen_new, hkv, d});
    t.k_new.fill_normal(rng);
    t.v_new.fill_normal(rng);
  }
  for (int64_t b = 0; c.has_nan_key && b < c.batch; ++b) {
    const int64_t keys = used[b] + c.seqlen_new - first[b];
    const int64_t key = c.nan_key < 0 ? keys + c.nan_key : c.nan_key;
    if (key < 0 || key >= keys) continue;
    const int64_t pos = first[b] + key;
    for (int64_t h = 0; h < hkv; ++h) {
      if (pos < used[b]) {
        (c.nan_in_k ? t.k_cache : t.v_cache).set((row_of(b, pos) * hkv + h) * d + 3, std::nan(""));
      } else {
        (c.nan_in_k ? t.k_new : t.v_new).set(((b * c.seqlen_new + pos - used[b]) * hkv + h) * d + 3, std::nan(""));
      }
    }
  }
  t.seqlens = HostTensor(DType::kInt32, {c.batch});
  t.leftpad = HostTensor(DType::kInt32, {c.batch});
  for (int64_t b = 0; b < c.batch; ++b) {
    t.seqlens.set(b, static_cast<double>(used[b]));
    t.leftpad.set(b, static_cast<double>(first[b]));
  }
  if (c.rotary_dim > 0) {
    const int64_t ro = c.capacity + c.seqlen_q, half = c.rotary_dim / 2;
    t.cos = HostTensor(DType::kFloat32, {ro, half});
    t.sin = HostTensor(DType::kFloat32, {ro, half});
    for (int64_t pos = 0; pos < ro; ++pos) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos) *
                             std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(c.rotary_dim));
        t.cos.set(pos * half + i, std::cos(angle));
        t.sin.set(pos * half + i, std::sin(angle));
      }
    }
  }
  if (c.alibi) {
    t.alibi = HostTensor(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(0.0, 0.3);
    for (int64_t h = 0; h < c.heads_q; ++h) t.alibi.set(h, u(rng));
  }
  if (c.sink) {  // logits around the scores' scale and above: the sink takes a fair share of a row
    t.sink = HostTensor(DType::kFloat32, {c.heads_q});
    std::normal_distribution<double> n(1.0, 2.0);
    for (int64_t h = 0; h < c.heads_q; ++h) {
      t.sink.set(h, h == c.heads_q - 1 ? -std::numeric_limits<double>::infinity() : n(rng));
    }
  }
  t.out = HostTensor(c.dtype, t.q.shape());
  t.lse = HostTensor(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q});
  t.out.fill_storage_nan();
  t.lse.fill_storage_nan();
  return t;
}

flashattn::KvCacheArgs kv_args(const KvCase& c, const KvTensors& t) {
  flashattn::KvCacheArgs a;
  a.q = t.q.view();
  a.k_cache = t.k_cache.view();
  a.v_cache = t.v_cache.view();
  a.k_new = t.k_new.view();
  a.v_new = t.v_new.view();
  a.cache_seqlens = t.seqlens.view();
  if (c.leftpad) a.cache_leftpad = t.leftpad.view();
  a.block_table = t.table.view();
  a.rotary_cos = t.cos.view();
  a.rotary_sin = t.sin.view();
  a.rotary_interleaved = c.interleaved;
  a.num_splits = c.num_splits;
  a.out = t.out.view();
  a.lse = t.lse.view();
  return a;
}

flashattn::AttentionOptions kv_options(const KvCase& c, const KvTensors& t) {
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.window_left;
  o.mask.sink_tokens = c.sink_tokens;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = t.alibi.view();
  if (c.sink) o.score.learnable_sink = t.sink.view();
  return o;
}

void expect_near(const char* what, const HostTensor& got, const HostTensor& ref, double tol, const std::string& name) {
  const std::vector<double> g = got.to_vector(), r = ref.to_vector();
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if ((std::isnan(g[i]) && std::isnan(r[i])) || g[i] == r[i]) continue;
    if (!std::isnan(g[i]) && std::abs(g[i] - r[i]) <= tol * std::max(1.0, std::abs(r[i]))) continue;
    if (++bad <= 3) ADD_FAILURE() << name << ": " << what << "[" << i << "] " << g[i] << " vs CPU " << r[i];
  }
  EXPECT_EQ(bad, 0) << name << ": " << what;
}

void expect_matches_cpu(const KvCase& c, const KvTensors& got, const KvTensors& cpu) {
  // Rotated keys too are bitwise: the rotation's arithmetic is part of the API (flashattn.hpp).
  expect_near("k_cache", got.k_cache, cpu.k_cache, 0.0, c.name());
  expect_near("v_cache", got.v_cache, cpu.v_cache, 0.0, c.name());
  // Both accumulate in fp32, in different orders: a couple of output ulps apart at most.
  expect_near("out", got.out, cpu.out, out_tolerance(c), c.name());
  // The device's tanhf is a few ulp from the host's tanh; under a softcap s its error is scaled
  // by s * log2(e) (30: about 43) in every score, and reaches the lse at 1e-5 and more.
  expect_near("lse", got.lse, cpu.lse, c.softcap != 0.0f ? 1e-4 : 1e-5, c.name());
}

void expect_only_sequence_zero_bad(const KvCase& c, const KvTensors& got, const KvTensors& cpu, const KvTensors& before,
                                   bool append_skipped) {
  const int64_t out_per_seq = c.seqlen_q * c.heads_q * c.head_dim, lse_per_seq = c.heads_q * c.seqlen_q;
  int64_t not_nan = 0, differ = 0;
  for (int64_t i = 0; i < out_per_seq; ++i) not_nan += !std::isnan(got.out.get(i));
  for (int64_t i = 0; i < lse_per_seq; ++i) not_nan += !std::isnan(got.lse.get(i));
  // (expect_matches_cpu's tolerances: out_tolerance, 1e-5 in the lse.)
  const double out_tol = out_tolerance(c);
  auto far = [](double value, double ref, double tol) {
    return !(std::abs(value - ref) <= tol * std::max(1.0, std::abs(ref)));
  };
  for (int64_t i = out_per_seq; i < 2 * out_per_seq; ++i) differ += far(got.out.get(i), cpu.out.get(i), out_tol);
  for (int64_t i = lse_per_seq; i < 2 * lse_per_seq; ++i) differ += far(got.lse.get(i), cpu.lse.get(i), 1e-5);
  EXPECT_EQ(not_nan, 0) << "sequence 0's out / lse elements that are not NaN";
  EXPECT_EQ(differ, 0) << "sequence 1's out / lse elements unlike the CPU's";
  // The caches: as before the call but for sequence 1's new row (as the CPU wrote it) and, where
  // the append is unspecified, sequence 0's.
  const int64_t row_elems = c.heads_kv * c.head_dim;
  auto row_of = [&](int64_t b) { return cache_row(c, before.table, b, static_cast<int64_t>(before.seqlens.get(b))); };
  const int64_t row0 = row_of(0), row1 = row_of(1);
  int64_t wrong = 0;
  for (const auto& [cache, cpu_cache, old] :
       {std::tie(got.k_cache, cpu.k_cache, before.k_cache), std::tie(got.v_cache, cpu.v_cache, before.v_cache)}) {
    for (int64_t i = 0; i < cache.numel(); ++i) {
      const int64_t row = i / row_elems;
      if (row == row0 && !append_skipped) continue;
      const double expected = row == row1 ? cpu_cache.get(i) : old.get(i), value = cache.get(i);
      wrong += !(value == expected || (std::isnan(value) && std::isnan(expected)));
    }
  }
  EXPECT_EQ(wrong, 0) << "cache elements other than the call may write";
}

}  // namespace fa_test

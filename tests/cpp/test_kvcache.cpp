// forward_kvcache on the CPU against an oracle that shares none of its cache machinery: the test
// keeps its own map of where each sequence's positions live (contiguous entries, pages,
// leftpad), applies the rotary embedding itself (its own code, in the arithmetic the API states), gathers every sequence into a plain
// dense K / V, and runs the dense fp64 reference on it. Cache positions that no call may read
// hold NaN, so an over-read shows up in the output; after the call every cache element is
// compared with what the append should have left (appended rows only changed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "test_util.hpp"

namespace {

using fa_test::HostTensor;
using flashattn::DType;

struct KvCase {
  DType dtype = DType::kBFloat16;
  int64_t batch = 3, seqlen_q = 1, seqlen_new = 1, heads_q = 6, heads_kv = 2, head_dim = 64;
  int64_t head_dim_v = 0;     // v's (and out's) head_dim; 0: head_dim
  int64_t capacity = 300;     // positions per sequence (paged: rounded up to whole pages)
  int64_t page_size = 0;      // 0: contiguous cache
  bool append = true;         // k_new / v_new given
  bool seqlens_given = true;  // else every cache is full (needs append = false)
  bool leftpad = false, batch_idx = false;
  int64_t rotary_dim = 0;
  bool interleaved = true, rotary_fp32 = false;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  bool check_cache = true;  // compare every cache element afterwards (off for huge caches)

  std::string name() const {
    return std::string(flashattn::dtype_name(dtype)) + " b" + std::to_string(batch) + " sq" + std::to_string(seqlen_q) +
           " new" + std::to_string(seqlen_new) + " h" + std::to_string(heads_q) + "/" + std::to_string(heads_kv) +
           " d" +
           (head_dim_v ? std::to_string(head_dim) + "/" + std::to_string(head_dim_v) : std::to_string(head_dim)) +
           " cap" + std::to_string(capacity) + " page" + std::to_string(page_size) + (leftpad ? " leftpad" : "") +
           (batch_idx ? " batch_idx" : "") + " rotary" + std::to_string(rotary_dim) + (interleaved ? "i" : "n") +
           (causal ? " causal" : "") + " window" + std::to_string(window_left) + "," + std::to_string(window_right) +
           (softcap > 0 ? " softcap" : "") + (alibi ? " alibi" : "");
  }
  int64_t dv() const { return head_dim_v ? head_dim_v : head_dim; }
};

// The test's own model of the cache layout and contents.
struct Cache {
  int64_t capacity = 0, entries = 0, page_size = 0;
  std::vector<int64_t> seqlens, leftpad, entry;  // entry: contiguous cache entry of batch b
  std::vector<std::vector<int32_t>> table;       // paged: [b][page] -> block (-1: unused)
  HostTensor k, v;

  int64_t row(int64_t b, int64_t pos) const {  // row of the [entries * rows, hkv, d] storage
    if (page_size > 0) return int64_t{table[b][pos / page_size]} * page_size + pos % page_size;
    return entry[b] * capacity + pos;
  }
};

struct Inputs {
  Cache cache;
  HostTensor q, k_new, v_new, seqlens, batch_idx, leftpad, block_table, cos, sin, alibi;
};

bool per_row_q(const KvCase& c, int64_t capacity) {
  auto bounded = [&](int64_t w) { return w >= 0 && w < capacity; };
  return bounded(c.window_left) || bounded(c.causal ? 0 : c.window_right);
}

Inputs make_inputs(const KvCase& c, std::mt19937_64& rng) {
  Inputs in;
  Cache& cache = in.cache;
  const int64_t hkv = c.heads_kv, d = c.head_dim, dv = c.dv();
  const bool paged = c.page_size > 0;
  cache.page_size = c.page_size;
  const int64_t max_pages = paged ? (c.capacity + c.page_size - 1) / c.page_size : 0;
  cache.capacity = paged ? max_pages * c.page_size : c.capacity;

  // Lengths: one sequence empty and one full after the append, the rest random.
  std::uniform_int_distribution<int64_t> len(0, cache.capacity - c.seqlen_new);
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t s = c.seqlens_given ? len(rng) : cache.capacity;
    if (c.seqlens_given && b == 0) s = 0;
    if (c.seqlens_given && b == 1) s = cache.capacity - c.seqlen_new;
    cache.seqlens.push_back(s);
    cache.leftpad.push_back(c.leftpad ? std::uniform_int_distribution<int64_t>(0, s)(rng) : 0);
  }

  if (paged) {
    int64_t used = 0;
    cache.table.assign(c.batch, std::vector<int32_t>(max_pages, -1));
    std::vector<std::pair<int64_t, int64_t>> slots;  // (b, page) in use
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t end = cache.seqlens[b] + c.seqlen_new;
      for (int64_t p = cache.leftpad[b] / c.page_size; p * c.page_size < end; ++p) slots.push_back({b, p});
    }
    cache.entries = static_cast<int64_t>(slots.size()) + 3;  // three blocks nobody uses
    std::vector<int32_t> blocks(cache.entries);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    for (const auto& [b, p] : slots) cache.table[b][p] = blocks[used++];
    // Entries the call must not read: -1 and out-of-range values.
    for (auto& row : cache.table) {
      for (auto& e : row) {
        if (e < 0 && rng() % 2) e = static_cast<int32_t>(cache.entries + 1000);
      }
    }
    in.block_table = HostTensor(DType::kInt32, {c.batch, max_pages});
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t p = 0; p < max_pages; ++p) in.block_table.set(b * max_pages + p, cache.table[b][p]);
    }
  } else {
    cache.entries = c.batch + (c.batch_idx ? 2 : 0);
    std::vector<int64_t> order(cache.entries);
    std::iota(order.begin(), order.end(), 0);
    if (c.batch_idx) std::shuffle(order.begin(), order.end(), rng);
    cache.entry.assign(order.begin(), order.begin() + c.batch);
    if (c.batch_idx) {
      in.batch_idx = HostTensor(DType::kInt32, {c.batch});
      for (int64_t b = 0; b < c.batch; ++b) in.batch_idx.set(b, cache.entry[b]);
    }
  }
  const int64_t rows = paged ? c.page_size : cache.capacity;
  cache.k = HostTensor(c.dtype, {cache.entries, rows, hkv, d});
  cache.v = HostTensor(c.dtype, {cache.entries, rows, hkv, dv});
  cache.k.fill_storage_nan();  // positions outside [leftpad, seqlens) must never be read
  cache.v.fill_storage_nan();
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t pos = cache.leftpad[b]; pos < cache.seqlens[b]; ++pos) {
      for (int64_t e = 0; e < hkv * d; ++e) cache.k.set(cache.row(b, pos) * hkv * d + e, normal(rng));
      for (int64_t e = 0; e < hkv * dv; ++e) cache.v.set(cache.row(b, pos) * hkv * dv + e, normal(rng));
    }
  }

  in.q = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, d});
  in.q.fill_normal(rng);
  if (c.append) {
    in.k_new = HostTensor(c.dtype, {c.batch, c.seqlen_new, hkv, d});
    in.v_new = HostTensor(c.dtype, {c.batch, c.seqlen_new, hkv, dv});
    in.k_new.fill_normal(rng);
    in.v_new.fill_normal(rng);
  }
  if (c.seqlens_given) {
    in.seqlens = HostTensor(DType::kInt32, {c.batch});
    for (int64_t b = 0; b < c.batch; ++b) in.seqlens.set(b, cache.seqlens[b]);
  }
  if (c.leftpad) {
    in.leftpad = HostTensor(DType::kInt32, {c.batch});
    for (int64_t b = 0; b < c.batch; ++b) in.leftpad.set(b, cache.leftpad[b]);
  }
  if (c.rotary_dim > 0) {
    const int64_t half = c.rotary_dim / 2, ro_rows = cache.capacity + c.seqlen_q;
    const DType table_dtype = c.rotary_fp32 ? DType::kFloat32 : c.dtype;
    in.cos = HostTensor(table_dtype, {ro_rows, half});
    in.sin = HostTensor(table_dtype, {ro_rows, half});
    for (int64_t pos = 0; pos < ro_rows; ++pos) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos) *
                             std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(c.rotary_dim));
        in.cos.set(pos * half + i, std::cos(angle));
        in.sin.set(pos * half + i, std::sin(angle));
      }
    }
  }
  if (c.alibi) {
    in.alibi = HostTensor(DType::kFloat32, {c.heads_q});
    std::uniform_real_distribution<double> u(0.0, 0.3);
    for (int64_t h = 0; h < c.heads_q; ++h) in.alibi.set(h, u(rng));
  }
  return in;
}

flashattn::AttentionOptions options_of(const KvCase& c, const Inputs& in) {
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.window_left;
  o.mask.window_right = c.window_right;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = in.alibi.view();
  return o;
}

flashattn::KvCacheArgs args_of(const KvCase& c, const Inputs& in, const HostTensor& out, const HostTensor& lse) {
  flashattn::KvCacheArgs a;
  a.rotary_interleaved = c.interleaved;
  a.q = in.q.view();
  a.k_cache = in.cache.k.view();
  a.v_cache = in.cache.v.view();
  a.k_new = in.k_new.view();
  a.v_new = in.v_new.view();
  a.cache_seqlens = in.seqlens.view();
  a.cache_batch_idx = in.batch_idx.view();
  a.cache_leftpad = in.leftpad.view();
  a.block_table = in.block_table.view();
  a.rotary_cos = in.cos.view();
  a.rotary_sin = in.sin.view();
  a.out = out.view();
  a.lse = lse.view();
  return a;
}

// x (d features) with its first rotary_dim features rotated to `pos`, in the arithmetic the API
// states (flashattn.hpp: fp32, fp64 for fp64 tensors; each product rounded, no fused
// multiply-add), then rounded to the dtype: every backend must store exactly these bits. (An
// fp64 rotation would differ from it by one unit in the last place wherever the fp32 result
// lands near a rounding boundary of the dtype, and one such q element moves an lse by ~1e-4.)
template <typename Acc>
std::vector<double> rotated_as(const KvCase& c, const Inputs& in, const double* x, int64_t pos) {
  std::vector<double> y(x, x + c.head_dim);
  const int64_t half = c.rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = c.interleaved ? 2 * i : i, b = c.interleaved ? 2 * i + 1 : i + half;
    // Exact: x holds dtype values, the tables fp32 or dtype values.
    const Acc x1 = static_cast<Acc>(x[a]), x2 = static_cast<Acc>(x[b]);
    const Acc cs = static_cast<Acc>(in.cos.get(pos * half + i)), sn = static_cast<Acc>(in.sin.get(pos * half + i));
    const Acc x1c = x1 * cs, x2s = x2 * sn, x1s = x1 * sn, x2c = x2 * cs;
    y[a] = fa_test::round_to(c.dtype, static_cast<double>(x1c - x2s));
    y[b] = fa_test::round_to(c.dtype, static_cast<double>(x1s + x2c));
  }
  return y;
}

std::vector<double> rotated(const KvCase& c, const Inputs& in, const double* x, int64_t pos) {
  return c.dtype == DType::kFloat64 ? rotated_as<double>(c, in, x, pos) : rotated_as<float>(c, in, x, pos);
}

// The cache contents the append must leave: (k, v) as flat vectors of the storage's shape.
std::pair<std::vector<double>, std::vector<double>> expected_cache(const KvCase& c, const Inputs& in,
                                                                   std::vector<double> k, std::vector<double> v) {
  if (!c.append) return {k, v};
  const int64_t hkv = c.heads_kv, d = c.head_dim, dv = c.dv();
  const std::vector<double> kn = in.k_new.to_vector(), vn = in.v_new.to_vector();
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t t = 0; t < c.seqlen_new; ++t) {
      const int64_t pos = in.cache.seqlens[b] + t;
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t src = ((b * c.seqlen_new + t) * hkv + h) * d, dst = (in.cache.row(b, pos) * hkv + h) * d;
        const std::vector<double> kr = rotated(c, in, &kn[src], pos);
        std::copy(kr.begin(), kr.end(), k.begin() + dst);
        const int64_t v_src = ((b * c.seqlen_new + t) * hkv + h) * dv, v_dst = (in.cache.row(b, pos) * hkv + h) * dv;
        std::copy(vn.begin() + v_src, vn.begin() + v_src + dv, v.begin() + v_dst);
      }
    }
  }
  return {k, v};
}

bool same_bits(const HostTensor& t, int64_t i, double expected) {
  const double got = t.get(i);
  return (std::isnan(got) && std::isnan(expected)) || got == expected;
}

// Every cache element equals the expectation bitwise (NaN stays NaN): rotated keys too, the
// rotation's arithmetic being part of the API.
void expect_cache(const KvCase& c, const HostTensor& got, const std::vector<double>& expected, const char* what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (same_bits(got, i, expected[i])) continue;
    if (++bad <= 3)
      ADD_FAILURE() << c.name() << ": " << what << " element " << i << " is " << got.get(i) << ", expected "
                    << expected[i];
  }
  EXPECT_EQ(bad, 0) << c.name() << ": " << what << " elements differ";
}

struct Oracle {
  std::vector<double> out, lse, naive_out, naive_lse;  // [b, sq, hq, d] and [b, hq, sq]
};

// Per sequence: rotate q, gather K / V from the expected cache, dense fp64 reference and the
// same-dtype naive attention (the tolerance rule's baseline).
Oracle oracle(const KvCase& c, const Inputs& in, const std::vector<double>& k_cache, const std::vector<double>& v_cache,
              const flashattn::AttentionOptions& opts) {
  const int64_t sq = c.seqlen_q, hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim, dv = c.dv();
  const std::vector<double> q_all = in.q.to_vector();
  Oracle o;
  o.out.resize(c.batch * sq * hq * dv);
  o.lse.resize(c.batch * hq * sq);
  o.naive_out = o.out;
  o.naive_lse = o.lse;
  const bool row_q = per_row_q(c, in.cache.capacity);
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t first = in.cache.leftpad[b], end = in.cache.seqlens[b] + (c.append ? c.seqlen_new : 0);
    const int64_t sk = end - first;
    HostTensor q(c.dtype, {1, sq, hq, d}), k(c.dtype, {1, sk, hkv, d}), v(c.dtype, {1, sk, hkv, dv});
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t h = 0; h < hq; ++h) {
        const double* x = &q_all[((b * sq + i) * hq + h) * d];
        const std::vector<double> y =
            c.rotary_dim > 0 ? rotated(c, in, x, in.cache.seqlens[b] + (row_q ? i : 0)) : std::vector<double>(x, x + d);
        for (int64_t e = 0; e < d; ++e) q.set((i * hq + h) * d + e, y[e]);
      }
    }
    for (int64_t j = 0; j < sk; ++j) {
      for (int64_t e = 0; e < hkv * d; ++e) k.set(j * hkv * d + e, k_cache[in.cache.row(b, first + j) * hkv * d + e]);
      for (int64_t e = 0; e < hkv * dv; ++e) {
        v.set(j * hkv * dv + e, v_cache[in.cache.row(b, first + j) * hkv * dv + e]);
      }
    }
    HostTensor out(c.dtype, {1, sq, hq, dv}), lse(DType::kFloat32, {1, hq, sq});
    flashattn::reference_forward({q.view(), k.view(), v.view(), out.view(), lse.view()}, opts);
    fa_test::Case dense;
    dense.dtype = c.dtype;
    dense.seqlen_q = sq;
    dense.seqlen_k = sk;
    dense.heads_q = hq;
    dense.heads_kv = hkv;
    dense.head_dim = d;
    dense.head_dim_v = c.head_dim_v;
    dense.causal = c.causal;
    dense.window_left = c.window_left;
    dense.window_right = c.window_right;
    dense.softcap = c.softcap;
    dense.alibi = c.alibi;
    dense.backward = false;
    const fa_test::NaiveResult naive =
        fa_test::naive_attention(dense, fa_test::make_geometry(dense), q.to_vector(), k.to_vector(), v.to_vector(), {},
                                 in.alibi.to_vector(), 0, 0);
    const std::vector<double> ov = out.to_vector(), lv = lse.to_vector();
    std::copy(ov.begin(), ov.end(), o.out.begin() + b * sq * hq * dv);
    std::copy(lv.begin(), lv.end(), o.lse.begin() + b * hq * sq);
    std::copy(naive.out.begin(), naive.out.end(), o.naive_out.begin() + b * sq * hq * dv);
    std::copy(naive.lse.begin(), naive.lse.end(), o.naive_lse.begin() + b * hq * sq);
  }
  return o;
}

// Runs forward_kvcache and reference_forward_kvcache on one case and checks both, and the cache.
void run_kv_case(const KvCase& c) {
  SCOPED_TRACE(c.name());
  auto rng = fa_test::rng_for("kvcache " + c.name());
  Inputs in = make_inputs(c, rng);
  const flashattn::AttentionOptions opts = options_of(c, in);
  std::vector<double> k_before, v_before;
  if (c.check_cache) {
    k_before = in.cache.k.to_vector();
    v_before = in.cache.v.to_vector();
  }
  const std::vector<int64_t> out_shape = {c.batch, c.seqlen_q, c.heads_q, c.dv()};
  HostTensor out(c.dtype, out_shape), lse(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q});
  out.fill_storage_nan();
  lse.fill_storage_nan();
  flashattn::forward_kvcache(args_of(c, in, out, lse), opts);

  std::vector<double> k_after = in.cache.k.to_vector(), v_after = in.cache.v.to_vector();
  if (c.check_cache) {
    const auto [k_exp, v_exp] = expected_cache(c, in, k_before, v_before);
    expect_cache(c, in.cache.k, k_exp, "k_cache");
    expect_cache(c, in.cache.v, v_exp, "v_cache");
  }
  // The oracle reads the cache as the append left it (checked above), so it needs no copy.
  const Oracle ref = oracle(c, in, k_after, v_after, opts);
  double err = 0, bound = 0;
  fa_test::expect_close("out", out.to_vector(), ref.out, ref.naive_out, 2.0, c.dtype, c.name(), &err, &bound);
  fa_test::expect_lse_close(lse.to_vector(), ref.lse, ref.naive_lse, c.name(), &err, &bound);

  // The reference entry point appends the same rows again (same values) and attends in fp64.
  HostTensor out_ref(c.dtype, out_shape), lse_ref(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q});
  out_ref.fill_storage_nan();
  lse_ref.fill_storage_nan();
  flashattn::reference_forward_kvcache(args_of(c, in, out_ref, lse_ref), opts);
  EXPECT_EQ(fa_test::compare(in.cache.k.to_vector(), k_after).max_abs, 0.0) << "the append is not idempotent";
  fa_test::expect_close("reference out", out_ref.to_vector(), ref.out, ref.naive_out, 2.0, c.dtype, c.name(), &err,
                        &bound);
  fa_test::expect_lse_close(lse_ref.to_vector(), ref.lse, ref.naive_lse, c.name(), &err, &bound, "reference lse");
}

TEST(KvCache, ContiguousDecodeCausalGqa) {
  KvCase c;
  c.causal = true;
  run_kv_case(c);
}

TEST(KvCache, FullCachesWithoutSeqlensOrAppend) {
  KvCase c;
  c.dtype = DType::kFloat16;
  c.append = false;
  c.seqlens_given = false;
  c.seqlen_new = 0;
  c.seqlen_q = 2;
  c.capacity = 147;
  run_kv_case(c);
}

TEST(KvCache, ContiguousBatchIdxLeftpadRotaryHalves) {
  KvCase c;
  c.dtype = DType::kFloat32;
  c.batch = 4;
  c.batch_idx = true;
  c.leftpad = true;
  c.seqlen_q = c.seqlen_new = 3;
  c.rotary_dim = 32;
  c.interleaved = false;
  c.causal = true;
  run_kv_case(c);
}

TEST(KvCache, PagedDecodeEveryPageSize) {
  for (int64_t page : {1, 16, 64, 256}) {
    KvCase c;
    c.page_size = page;
    c.capacity = 700;
    c.rotary_dim = 64;
    c.leftpad = page != 256;
    c.causal = true;
    run_kv_case(c);
  }
}

TEST(KvCache, PagedChunkedPrefillRotaryFp32Tables) {
  KvCase c;
  c.dtype = DType::kFloat16;
  c.page_size = 16;
  c.seqlen_q = c.seqlen_new = 37;
  c.heads_q = 8;
  c.heads_kv = 1;
  c.head_dim = 128;
  c.rotary_dim = 64;
  c.rotary_fp32 = true;
  c.causal = true;
  run_kv_case(c);
}

TEST(KvCache, NonCausalQueriesRotateAtOnePosition) {
  KvCase c;
  c.seqlen_q = 4;
  c.seqlen_new = 2;
  c.rotary_dim = 16;
  c.head_dim = 40;
  run_kv_case(c);
}

TEST(KvCache, ScoreModsAndWindowsPagedFp64) {
  KvCase c;
  c.dtype = DType::kFloat64;
  c.page_size = 16;
  c.seqlen_q = c.seqlen_new = 5;
  c.window_left = 40;
  c.window_right = 0;
  c.softcap = 50.0f;
  c.alibi = true;
  c.rotary_dim = 32;
  run_kv_case(c);
}

// Absorbed multi-head latent attention's decode: one latent K / V head of 576 / 512 columns, paged,
// two query tokens a sequence (speculative decoding), fp32.
KvCase latent_decode_case() {
  KvCase c;
  c.dtype = DType::kFloat32;
  c.batch = 2;
  c.heads_q = 8;
  c.heads_kv = 1;
  c.head_dim = 576;
  c.head_dim_v = 512;
  c.capacity = 130;
  c.page_size = 64;
  c.seqlen_q = 2;
  c.append = false;
  c.causal = true;
  return c;
}

// v with a head_dim of its own: multi-head latent attention's 192 / 128 heads appending to their
// caches, and its absorbed decode (one latent K / V head of 576 / 512 columns, several query
// tokens a sequence, as in speculative decoding).
TEST(KvCache, ValueHeadDimOfItsOwn) {
  KvCase c;
  c.head_dim = 192;
  c.head_dim_v = 128;
  c.page_size = 16;
  c.seqlen_q = c.seqlen_new = 3;
  c.causal = true;
  c.rotary_dim = 64;
  run_kv_case(c);
  run_kv_case(latent_decode_case());
}

// Absorbed multi-head latent attention reads one latent cache as K (all 576 columns) and as V (its
// first 512): v_cache a view of k_cache. The result equals that of a separate V cache holding
// the same columns, bit for bit.
TEST(KvCache, LatentCacheReadAsKeysAndValues) {
  const KvCase c = latent_decode_case();
  auto rng = fa_test::rng_for("kvcache latent " + c.name());
  Inputs in = make_inputs(c, rng);
  const int64_t rows = in.cache.k.numel() / c.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < c.head_dim_v; ++e) in.cache.v.set(r * c.head_dim_v + e, in.cache.k.get(r * c.head_dim + e));
  }
  const std::vector<int64_t> out_shape = {c.batch, c.seqlen_q, c.heads_q, c.head_dim_v};
  HostTensor out_separate(c.dtype, out_shape), out_latent(c.dtype, out_shape);
  HostTensor lse_separate(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q}), lse_latent = lse_separate;
  const flashattn::AttentionOptions opts = options_of(c, in);
  flashattn::forward_kvcache(args_of(c, in, out_separate, lse_separate), opts);
  flashattn::KvCacheArgs latent = args_of(c, in, out_latent, lse_latent);
  latent.v_cache = in.cache.k.view();
  latent.v_cache.shape[3] = c.head_dim_v;  // k_cache's strides: its first 512 columns
  flashattn::forward_kvcache(latent, opts);
  for (double x : out_latent.to_vector()) ASSERT_TRUE(std::isfinite(x));
  EXPECT_EQ(fa_test::compare(out_latent.to_vector(), out_separate.to_vector()).max_abs, 0.0);
  EXPECT_EQ(fa_test::compare(lse_latent.to_vector(), lse_separate.to_vector()).max_abs, 0.0);
}

TEST(KvCache, AppendWithoutQueriesAndQueriesLongerThanAppend) {
  KvCase c;
  c.seqlen_q = 0;
  c.seqlen_new = 4;
  run_kv_case(c);
  c.seqlen_q = 6;
  c.seqlen_new = 2;
  c.causal = true;
  c.rotary_dim = 64;
  run_kv_case(c);
}

// The CPU ignores num_splits: every split count gives the same bits (the GPU's split-KV
// results are compared within tolerance by the GPU tests).
TEST(KvCache, SplitCountsGiveTheSameResult) {
  KvCase c;
  c.page_size = 64;
  c.capacity = 2000;
  c.append = false;
  c.seqlen_new = 0;
  auto rng = fa_test::rng_for("kvcache splits");
  Inputs in = make_inputs(c, rng);
  std::vector<double> first;
  for (int64_t splits : {0, 1, 3, 17}) {
    HostTensor out(c.dtype, in.q.shape()), lse(DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q});
    flashattn::KvCacheArgs a = args_of(c, in, out, lse);
    a.num_splits = splits;
    flashattn::forward_kvcache(a, options_of(c, in));
    if (first.empty()) {
      first = out.to_vector();
    } else {
      EXPECT_EQ(fa_test::compare(out.to_vector(), first).max_abs, 0.0) << "num_splits " << splits;
    }
  }
}

// A context of 2^22 tokens (a paged cache of 256-token pages), one new token appended.
TEST(KvCache, FourMillionTokenContext) {
  if (fa_test::quick_mode()) GTEST_SKIP() << "FLASHATTN_TEST_QUICK=1: 2^22-token caches left out";
  KvCase c;
  c.batch = 2;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.head_dim = 8;  // small: the point is 64-bit positions and the page walk, not the arithmetic
  c.page_size = 256;
  c.capacity = int64_t{1} << 22;
  c.causal = true;
  c.check_cache = false;
  run_kv_case(c);
}

}  // namespace

// `call` throws a flashattn::Error whose message contains `message`.
template <typename Call>
void expect_call_error(Call&& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

// Each bad argument is an Error naming it, raised before the cache is written.
class KvCacheErrors : public ::testing::Test {
 protected:
  KvCase c_;
  Inputs in_;
  HostTensor out_, lse_;

  void SetUp() override {
    c_.page_size = 16;
    c_.capacity = 64;
    c_.rotary_dim = 16;
    auto rng = fa_test::rng_for("kvcache errors");
    in_ = make_inputs(c_, rng);
    out_ = HostTensor(c_.dtype, in_.q.shape());
    lse_ = HostTensor(DType::kFloat32, {c_.batch, c_.heads_q, c_.seqlen_q});
  }
  flashattn::KvCacheArgs args() const { return args_of(c_, in_, out_, lse_); }

  void expect_error(const flashattn::KvCacheArgs& a, const std::string& message,
                    flashattn::AttentionOptions opts = {}) {
    const std::vector<double> k_before = in_.cache.k.to_vector();
    expect_call_error([&] { flashattn::forward_kvcache(a, opts); }, message);
    const std::vector<double> k_after = in_.cache.k.to_vector();
    for (size_t i = 0; i < k_after.size(); ++i) {
      if (!(same_bits(in_.cache.k, static_cast<int64_t>(i), k_before[i]))) {
        ADD_FAILURE() << "k_cache element " << i << " written by a call that failed";
        break;
      }
    }
  }
};

TEST_F(KvCacheErrors, IndexValuesOutOfRange) {
  HostTensor table = in_.block_table;                             // a copy to corrupt
  const int64_t used_page = in_.cache.seqlens[1] / c_.page_size;  // sequence 1 is full
  table.set(1 * table.shape()[1] + used_page, static_cast<double>(in_.cache.entries));
  flashattn::KvCacheArgs a = args();
  a.block_table = table.view();
  expect_error(a, "block_table: entry [1, " + std::to_string(used_page) + "] is");

  // Host tensors' values are checked on the host whatever index_check asks.
  a.index_check = flashattn::IndexCheck::kDevice;
  expect_error(a, "block_table: entry [1, " + std::to_string(used_page) + "] is");

  HostTensor seqlens = in_.seqlens;
  seqlens.set(2, static_cast<double>(in_.cache.capacity));  // no room for the new token
  a = args();
  a.cache_seqlens = seqlens.view();
  expect_error(a, "cache_seqlens: entry 2 is 64; with 1 new tokens the cache of capacity 64 overflows");
  seqlens.set(2, -1);
  expect_error(a, "cache_seqlens: entry 2 is -1, outside [0, cache capacity 64]");

  HostTensor leftpad(DType::kInt32, {c_.batch});
  leftpad.fill(0);
  leftpad.set(1, static_cast<double>(in_.cache.seqlens[1] + 1));
  a = args();
  a.cache_leftpad = leftpad.view();
  expect_error(a, "cache_leftpad: entry 1 is");

  HostTensor cos_short(c_.dtype, {in_.cache.seqlens[1], c_.rotary_dim / 2});
  cos_short.fill(1.0);
  a = args();
  a.rotary_cos = a.rotary_sin = cos_short.view();
  expect_error(
      a, "rotary_cos: " + std::to_string(in_.cache.seqlens[1]) + " rows, but batch entry 1 needs positions up to");
}

TEST_F(KvCacheErrors, ArgumentCombinations) {
  flashattn::KvCacheArgs a = args();
  HostTensor batch_idx(DType::kInt32, {c_.batch});
  batch_idx.fill(0);
  a.cache_batch_idx = batch_idx.view();
  expect_error(a, "cache_batch_idx: not used with block_table");

  a = args();
  a.index_check = static_cast<flashattn::IndexCheck>(7);
  expect_error(a, "index_check: 7 is neither kHost nor kDevice");

  a = args();
  a.cache_seqlens = {};
  expect_error(a, "cache_seqlens: required with k_new");

  a = args();
  a.v_new = {};
  expect_error(a, "v_new: missing (k_new and v_new come together)");

  a = args();
  a.k_new = a.v_new = {};
  expect_error(a, "rotary_cos: rotary embedding needs k_new / v_new");

  a = args();
  a.rotary_sin = {};
  expect_error(a, "rotary_sin: missing");

  a = args();
  a.num_splits = -1;
  expect_error(a, "num_splits: -1 must be >= 0");

  flashattn::AttentionOptions dropout;
  dropout.dropout.p = 0.1f;
  expect_error(args(), "dropout_p: must be 0 with a KV cache", dropout);

  HostTensor k_new_heads(c_.dtype, {c_.batch, c_.seqlen_new, c_.heads_kv + 1, c_.head_dim});
  a = args();
  a.k_new = a.v_new = k_new_heads.view();
  expect_error(a, "k_new: heads 3 != k_cache heads 2");

  HostTensor wide_cos(c_.dtype, {100, c_.head_dim});
  a = args();
  a.rotary_cos = a.rotary_sin = wide_cos.view();
  expect_error(a, "rotary_cos: rotary_dim 2 * 64 = 128 must be in [2, head_dim 64]");

  HostTensor float_table(DType::kInt32, {c_.batch, 4});
  a = args();
  a.block_table = float_table.view();
  a.block_table.dtype = DType::kFloat32;
  expect_error(a, "block_table: dtype float32 must be int32");

  a = args();
  a.out = in_.k_new.view();  // shape mismatch and overlap: the shape is checked first
  expect_error(a, "out: shape");

  // v_cache and v_new may have a head_dim of their own (one between them), and out then has it.
  std::vector<int64_t> narrow = in_.cache.v.shape();
  narrow.back() /= 2;
  HostTensor narrow_cache(c_.dtype, narrow), narrow_new(c_.dtype, {c_.batch, c_.seqlen_new, c_.heads_kv, 32});
  a = args();
  a.v_cache = narrow_cache.view();
  expect_error(a, "v_new: head_dim 64 != v_cache head_dim 32");
  a = args();
  a.v_new = narrow_new.view();
  expect_error(a, "v_new: head_dim 32 != v_cache head_dim 64");
  a = args();
  a.v_cache = narrow_cache.view();
  a.v_new = narrow_new.view();
  expect_error(a, "out: shape [");
}

TEST_F(KvCacheErrors, ContiguousCacheSmallerThanBatch) {
  KvCase c;
  c.batch = 3;
  auto rng = fa_test::rng_for("kvcache small cache");
  Inputs in = make_inputs(c, rng);
  HostTensor small(c.dtype, {2, c.capacity, c.heads_kv, c.head_dim});
  flashattn::KvCacheArgs a = args_of(c, in, out_, lse_);
  a.k_cache = a.v_cache = small.view();
  expect_call_error([&] { flashattn::forward_kvcache(a, {}); }, "k_cache: batch 2 < q batch 3");
}

// Paged K/V in the varlen forward (chunked prefill against a paged cache) gives the same bits as
// the same keys packed: the flash path visits the same values in the same order.
TEST(PagedVarlen, EqualsPackedKeysBitwise) {
  auto rng = fa_test::rng_for("paged varlen");
  const int64_t hq = 4, hkv = 2, d = 48, page = 16;
  const std::vector<int32_t> lens_q{5, 0, 17, 1}, lens_k{40, 3, 33, 0}, used_k{37, 3, 20, 0};
  const int64_t batch = static_cast<int64_t>(lens_q.size());
  HostTensor cu_q(DType::kInt32, {batch + 1}), cu_k(DType::kInt32, {batch + 1}), used(DType::kInt32, {batch});
  int64_t tq = 0, tk = 0, pages_needed = 0, max_pages = 0;
  for (int64_t b = 0; b < batch; ++b) {
    cu_q.set(b, tq);
    cu_k.set(b, tk);
    used.set(b, used_k[b]);
    tq += lens_q[b];
    tk += lens_k[b];
    const int64_t pages = (lens_k[b] + page - 1) / page;
    pages_needed += pages;
    max_pages = std::max(max_pages, pages);
  }
  cu_q.set(batch, tq);
  cu_k.set(batch, tk);
  HostTensor q(DType::kBFloat16, {tq, hq, d}), k(DType::kBFloat16, {tk, hkv, d}), v(DType::kBFloat16, {tk, hkv, d});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  // Pages in shuffled order; key j of sequence b is row j % page of its page j / page.
  const int64_t blocks = pages_needed + 2;
  std::vector<int32_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  HostTensor table(DType::kInt32, {batch, max_pages + 1}), k_pages(DType::kBFloat16, {blocks, page, hkv, d}),
      v_pages(DType::kBFloat16, {blocks, page, hkv, d});
  table.fill(-1);
  k_pages.fill_storage_nan();
  v_pages.fill_storage_nan();
  int64_t next = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p * page < lens_k[b]; ++p) table.set(b * (max_pages + 1) + p, order[next++]);
    for (int64_t j = 0; j < lens_k[b]; ++j) {
      const int64_t block = static_cast<int64_t>(table.get(b * (max_pages + 1) + j / page));
      for (int64_t e = 0; e < hkv * d; ++e) {
        const int64_t src = (cu_k.get(b) + j) * hkv * d + e, dst = (block * page + j % page) * hkv * d + e;
        k_pages.set(dst, k.get(src));
        v_pages.set(dst, v.get(src));
      }
    }
  }
  flashattn::AttentionOptions opts;
  opts.mask.causal = true;
  opts.score.softcap = 20.0f;
  for (bool with_used : {false, true}) {
    flashattn::VarlenArgs vl;
    vl.cu_seqlens_q = cu_q.view();
    vl.cu_seqlens_k = cu_k.view();
    if (with_used) vl.seqused_k = used.view();
    vl.max_seqlen_q = 17;
    vl.max_seqlen_k = 40;
    HostTensor out(DType::kBFloat16, {tq, hq, d}), lse(DType::kFloat32, {hq, tq});
    HostTensor out_paged(DType::kBFloat16, {tq, hq, d}), lse_paged(DType::kFloat32, {hq, tq});
    out_paged.fill_storage_nan();
    lse_paged.fill_storage_nan();
    flashattn::forward_varlen({q.view(), k.view(), v.view(), out.view(), lse.view()}, vl, opts);
    vl.block_table = table.view();
    flashattn::forward_varlen({q.view(), k_pages.view(), v_pages.view(), out_paged.view(), lse_paged.view()}, vl, opts);
    EXPECT_EQ(fa_test::compare(out_paged.to_vector(), out.to_vector()).max_abs, 0.0) << "seqused_k " << with_used;
    EXPECT_FALSE(fa_test::compare(out_paged.to_vector(), out.to_vector()).has_nan);
    EXPECT_EQ(fa_test::compare(lse_paged.to_vector(), lse.to_vector()).max_abs, 0.0) << "seqused_k " << with_used;

    // The reference reads the pages too.
    HostTensor out_ref(DType::kBFloat16, {tq, hq, d}), lse_ref(DType::kFloat32, {hq, tq});
    flashattn::reference_forward_varlen({q.view(), k_pages.view(), v_pages.view(), out_ref.view(), lse_ref.view()}, vl,
                                        opts);
    EXPECT_LE(fa_test::compare(out_ref.to_vector(), out.to_vector()).max_abs, 2.0 * 0x1p-7 * 4);
  }

  // Errors: a table entry in use out of range, too few pages, and the backward pass.
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = cu_q.view();
  vl.cu_seqlens_k = cu_k.view();
  vl.max_seqlen_q = 17;
  vl.max_seqlen_k = 40;
  HostTensor out(DType::kBFloat16, {tq, hq, d}), bad = table;
  bad.set(2 * (max_pages + 1) + 1, static_cast<double>(blocks));
  vl.block_table = bad.view();
  const flashattn::ForwardArgs fa{q.view(), k_pages.view(), v_pages.view(), out.view(), {}};
  expect_call_error([&] { flashattn::forward_varlen(fa, vl, opts); },
                    "block_table: entry [2, 1] is " + std::to_string(blocks));
  HostTensor narrow(DType::kInt32, {batch, 2});
  narrow.fill(0);
  vl.block_table = narrow.view();
  expect_call_error([&] { flashattn::forward_varlen(fa, vl, opts); },
                    "cu_seqlens_k: sequence 0 has 40 keys, more than its 2 pages of 16 hold");
  HostTensor dq(DType::kBFloat16, {tq, hq, d});
  const flashattn::BackwardArgs ba{q.view(), q.view(),  k_pages.view(), v_pages.view(), out.view(),
                                   {},       dq.view(), k_pages.view(), v_pages.view()};
  expect_call_error([&] { flashattn::backward_varlen(ba, vl, opts); },
                    "block_table: paged K/V is supported in the forward pass only");
}

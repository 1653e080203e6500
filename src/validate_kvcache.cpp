// Validation of forward_kvcache (semantics in flashattn.hpp, KvCacheArgs): shapes, dtypes and
// devices first, then every index the call will read -- cache_seqlens, cache_leftpad,
// cache_batch_idx and the block_table entries of the positions in use -- so no bad index ever
// reaches a tensor access and nothing is written before the whole call is known to be valid.
// (IndexCheck::kDevice leaves the values of device tensors to the kernels.)
#include <algorithm>
#include <string>

#include "kvcache_problem.hpp"
#include "tensor_checks.hpp"
#include "validate_common.hpp"

namespace flashattn::detail {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

[[noreturn]] void bad(const std::string& message) { fail(ErrorCode::kInvalidArgument, message); }

// v_cache / v_new: shaped like k_cache / k_new but for the head_dim, which may be v's own
// (multi-head latent attention's 512 beside q / k's 576).
void check_like_but_head_dim(const char* name, const TensorView& v, const char* k_name, const TensorView& k) {
  for (int dim = 0; dim < 3; ++dim) {
    if (v.shape[dim] != k.shape[dim]) {
      bad(std::string(name) + ": dim " + str(dim) + " is " + str(v.shape[dim]) + ", " + k_name + "'s " +
          str(k.shape[dim]) + " (v may differ from k in head_dim alone)");
    }
  }
}

void check_optional_vector(const char* name, const TensorView& t, const TensorView& q, int64_t batch) {
  if (!t.present()) return;
  check_int_vector(name, t, q);
  check_dim(name, t, 0, "length", batch, "q batch");
}

// The rotary tables: shapes, dtype, device; fills everything but per_row_q.
RotaryParams check_rotary(const KvCacheArgs& a, int64_t head_dim) {
  RotaryParams r;
  const bool has_cos = a.rotary_cos.present(), has_sin = a.rotary_sin.present();
  if (!has_cos && !has_sin) return r;
  if (!has_cos || !has_sin) {
    bad(std::string(has_cos ? "rotary_sin" : "rotary_cos") + ": missing (rotary_cos and rotary_sin come together)");
  }
  if (!a.k_new.present()) {
    bad("rotary_cos: rotary embedding needs k_new / v_new (it rotates the new keys and q)");
  }
  for (const auto& [name, t] : {std::pair{"rotary_cos", &a.rotary_cos}, std::pair{"rotary_sin", &a.rotary_sin}}) {
    check_tensor(name, *t, 2);
    if (t->dtype != DType::kFloat32 && t->dtype != a.q.dtype) {
      fail(ErrorCode::kInvalidDtype, std::string(name) + ": dtype " + dtype_name(t->dtype) +
                                         " must be float32 or q's dtype " + dtype_name(a.q.dtype));
    }
    check_same_device(name, *t, a.q);
    if (t->strides[1] != 1 && t->shape[1] > 1) {
      bad(std::string(name) + ": last dimension stride " + str(t->strides[1]) + " must be 1");
    }
  }
  check_same_shape("rotary_sin", a.rotary_sin, "rotary_cos", a.rotary_cos);
  if (a.rotary_sin.dtype != a.rotary_cos.dtype) {
    fail(ErrorCode::kInvalidDtype, std::string("rotary_sin: dtype ") + dtype_name(a.rotary_sin.dtype) +
                                       " != rotary_cos dtype " + dtype_name(a.rotary_cos.dtype));
  }
  r.dim = 2 * a.rotary_cos.shape[1];
  if (r.dim < 2 || r.dim > head_dim) {
    bad("rotary_cos: rotary_dim 2 * " + str(a.rotary_cos.shape[1]) + " = " + str(r.dim) + " must be in [2, head_dim " +
        str(head_dim) + "]");
  }
  r.cos = a.rotary_cos.data;
  r.sin = a.rotary_sin.data;
  r.dtype = a.rotary_cos.dtype;
  r.rows = a.rotary_cos.shape[0];
  r.cos_row_stride = a.rotary_cos.strides[0];
  r.sin_row_stride = a.rotary_sin.strides[0];
  r.interleaved = a.rotary_interleaved;
  return r;
}

// Every index the call reads, per sequence; fills the per-sequence key counts.
void check_index_values(const KvCacheArgs& a, KvCacheProblem& kp, int64_t capacity, int64_t cache_entries,
                        void* stream) {
  Problem& p = kp.attn;
  const CacheRows& rows = p.k.cache;
  std::vector<int32_t> seqlens_copy, leftpad_copy, batch_idx_copy, table_copy;
  HostIndices indices(p.device, stream);
  const int32_t* seqlens = indices.add(kp.cache_seqlens, p.batch, seqlens_copy);
  const int32_t* leftpad = indices.add(rows.leftpad, p.batch, leftpad_copy);
  const int32_t* batch_idx = indices.add(rows.batch_idx, p.batch, batch_idx_copy);
  const int32_t* table = rows.paged() ? indices.add_block_table(a.block_table, table_copy) : nullptr;
  indices.fetch();
  if (seqlens != nullptr) {
    kp.host_cache_seqlens.assign(seqlens, seqlens + p.batch);
  } else {
    kp.host_cache_seqlens.assign(static_cast<size_t>(p.batch), capacity);
  }

  p.host_seqlens_k.resize(static_cast<size_t>(p.batch));
  int64_t rotary_rows_needed = 0, rotary_row_batch = 0, max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t used = kp.host_cache_seqlens[b];
    if (used < 0 || used > capacity) {
      bad("cache_seqlens: entry " + str(b) + " is " + str(used) + ", outside [0, cache capacity " + str(capacity) +
          "]");
    }
    if (used + kp.seqlen_new > capacity) {
      bad("cache_seqlens: entry " + str(b) + " is " + str(used) + "; with " + str(kp.seqlen_new) +
          " new tokens the cache of capacity " + str(capacity) + " overflows");
    }
    const int64_t first = leftpad ? leftpad[b] : 0;
    if (first < 0 || first > used) {
      bad("cache_leftpad: entry " + str(b) + " is " + str(first) + ", outside [0, cache_seqlens " + str(used) + "]");
    }
    if (batch_idx && (batch_idx[b] < 0 || batch_idx[b] >= cache_entries)) {
      bad("cache_batch_idx: entry " + str(b) + " is " + str(batch_idx[b]) + ", outside [0, " + str(cache_entries) +
          ") (k_cache batch)");
    }
    const int64_t end = used + kp.seqlen_new;  // one past the last position attended to
    if (table) check_pages(table, rows, b, first, end, cache_entries);
    p.host_seqlens_k[b] = end - first;
    max_keys = std::max(max_keys, end - first);
    if (kp.rotary.enabled()) {
      const int64_t q_last = kp.rotary.per_row_q ? used + p.seqlen_q : used + 1;
      const int64_t needed = std::max(end, p.seqlen_q > 0 ? q_last : int64_t{0});
      if (needed > rotary_rows_needed) rotary_rows_needed = needed, rotary_row_batch = b;
    }
  }
  if (rotary_rows_needed > kp.rotary.rows) {
    bad("rotary_cos: " + str(kp.rotary.rows) + " rows, but batch entry " + str(rotary_row_batch) +
        " needs positions up to " + str(rotary_rows_needed - 1));
  }
  p.seqlen_k = p.max_seqlen_k = max_keys;
}

}  // namespace

KvCacheProblem validate_kvcache(const KvCacheArgs& a, const AttentionOptions& options, void* stream,
                                LengthValues lengths) {
  if (!a.q.present()) bad("q: missing");
  check_value_tensor("q", a.q, a.q, 4);
  if (is_float8_dtype(a.q.dtype)) {
    fail(ErrorCode::kUnsupported, std::string("q: dtype ") + dtype_name(a.q.dtype) +
                                      ": forward_kvcache takes bfloat16 or float16 queries (an FP8 cache is "
                                      "k_cache / v_cache)");
  }
  // An FP8 cache beside 16-bit queries; otherwise the caches have q's dtype.
  const bool fp8_cache = a.k_cache.present() && is_float8_dtype(a.k_cache.dtype);
  if (fp8_cache && a.q.dtype != DType::kBFloat16 && a.q.dtype != DType::kFloat16) {
    fail(ErrorCode::kInvalidDtype, std::string("q: dtype ") + dtype_name(a.q.dtype) + " with k_cache " +
                                       dtype_name(a.k_cache.dtype) +
                                       ": an FP8 cache takes bfloat16 or float16 queries");
  }
  const DType cache_dtype = fp8_cache ? a.k_cache.dtype : a.q.dtype;
  check_value_tensor_as("k_cache", a.k_cache, a.q, 4, cache_dtype, "q dtype");
  check_value_tensor_as("v_cache", a.v_cache, a.q, 4, cache_dtype, fp8_cache ? "k_cache dtype" : "q dtype");
  KvCacheProblem kp;
  Problem& p = kp.attn;
  p.kv_cache = true;
  p.dtype = p.q_dtype = a.q.dtype;
  p.kv_dtype = cache_dtype;
  p.device = a.q.device;
  p.batch = a.q.shape[0];
  p.seqlen_q = p.max_seqlen_q = a.q.shape[1];
  p.heads_q = a.q.shape[2];
  p.head_dim = a.q.shape[3];
  p.head_dim_v = a.v_cache.shape[3];
  p.heads_kv = a.k_cache.shape[2];
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    bad("q: head_dim " + str(p.head_dim) + " outside [1, " + str(kMaxHeadDim) + "]");
  }
  if (p.head_dim_v < 1 || p.head_dim_v > kMaxHeadDim) {
    bad("v_cache: head_dim " + str(p.head_dim_v) + " outside [1, " + str(kMaxHeadDim) + "]");
  }
  check_dim("k_cache", a.k_cache, 3, "head_dim", p.head_dim, "q head_dim");
  check_like_but_head_dim("v_cache", a.v_cache, "k_cache", a.k_cache);
  if (p.heads_q < 1) bad("q: heads must be >= 1");
  if (p.heads_kv < 1) bad("k_cache: heads must be >= 1");
  if (p.heads_q % p.heads_kv != 0) {
    bad("k_cache: heads " + str(p.heads_kv) + " must divide q heads " + str(p.heads_q));
  }

  // Where each sequence's positions live.
  CacheRows rows;
  const int64_t cache_entries = a.k_cache.shape[0];  // cache batch, or blocks when paged
  int64_t capacity = a.k_cache.shape[1];
  if (a.block_table.present()) {
    const TensorView& t = a.block_table;
    check_block_table(t, a.q, p.batch);
    if (a.cache_batch_idx.present()) {
      bad("cache_batch_idx: not used with block_table (the table names each sequence's blocks)");
    }
    if (a.k_cache.shape[1] < 1) bad("k_cache: page size (dim 1) must be >= 1 with block_table");
    rows.block_table = static_cast<const int32_t*>(t.data);
    rows.block_table_stride = t.strides[0];
    rows.page_size = a.k_cache.shape[1];
    capacity = t.shape[1] * rows.page_size;
  } else if (!a.cache_batch_idx.present() && cache_entries < p.batch) {
    bad("k_cache: batch " + str(cache_entries) + " < q batch " + str(p.batch) +
        " (cache_batch_idx maps batch entries to cache entries)");
  }
  check_optional_vector("cache_seqlens", a.cache_seqlens, a.q, p.batch);
  check_optional_vector("cache_batch_idx", a.cache_batch_idx, a.q, p.batch);
  check_optional_vector("cache_leftpad", a.cache_leftpad, a.q, p.batch);
  rows.batch_idx = static_cast<const int32_t*>(a.cache_batch_idx.data);
  rows.leftpad = static_cast<const int32_t*>(a.cache_leftpad.data);
  kp.cache_seqlens = static_cast<const int32_t*>(a.cache_seqlens.data);

  // New tokens.
  if (a.k_new.present() != a.v_new.present()) {
    bad(std::string(a.k_new.present() ? "v_new" : "k_new") + ": missing (k_new and v_new come together)");
  }
  if (a.k_new.present()) {
    check_value_tensor("k_new", a.k_new, a.q, 4);
    check_value_tensor("v_new", a.v_new, a.q, 4);
    check_dim("k_new", a.k_new, 0, "batch", p.batch, "q batch");
    check_dim("k_new", a.k_new, 2, "heads", p.heads_kv, "k_cache heads");
    check_dim("k_new", a.k_new, 3, "head_dim", p.head_dim, "q head_dim");
    check_like_but_head_dim("v_new", a.v_new, "k_new", a.k_new);
    check_dim("v_new", a.v_new, 3, "head_dim", p.head_dim_v, "v_cache head_dim");
    if (!a.cache_seqlens.present()) {
      bad("cache_seqlens: required with k_new (where the new tokens go)");
    }
    kp.append = true;
    kp.seqlen_new = a.k_new.shape[1];
    kp.k_new = operand(a.k_new, false);
    kp.v_new = operand(a.v_new, false);
  }
  kp.rotary = check_rotary(a, p.head_dim);

  check_value_tensor("out", a.out, a.q, 4);
  check_like_q_with_v_head_dim("out", a.out, a.q, p);
  if (a.lse.present()) check_lse(a.lse, a.q, p, false);
  const core::Descale k_descale = check_descale("k_descale", a.k_descale, a.q, "k_cache", p.kv_dtype, p, 1);
  const core::Descale v_descale = check_descale("v_descale", a.v_descale, a.q, "v_cache", p.kv_dtype, p, 1);
  check_options(options, p, a.q);
  if (options.block_mask.present()) fail(ErrorCode::kUnsupported, "block_mask: not with a KV cache (forward_kvcache)");
  if (options.dropout.p != 0.0f) {
    bad("dropout_p: must be 0 with a KV cache (inference only)");
  }
  if (a.num_splits < 0) bad("num_splits: " + str(a.num_splits) + " must be >= 0 (0 = heuristic)");
  kp.num_splits = a.num_splits;
  // flash_attn rotates q row by row when a mask bounds the keys (a window side wider than the
  // cache counts as unbounded there).
  auto bounded = [&](int64_t w) { return w >= 0 && w < capacity; };
  kp.rotary.per_row_q = bounded(p.mask.window_left) || bounded(p.mask.window_right);

  const std::initializer_list<NamedView> indices = {{"cache_seqlens", &a.cache_seqlens},
                                                    {"cache_batch_idx", &a.cache_batch_idx},
                                                    {"cache_leftpad", &a.cache_leftpad},
                                                    {"block_table", &a.block_table},
                                                    {"rotary_cos", &a.rotary_cos},
                                                    {"rotary_sin", &a.rotary_sin},
                                                    {"alibi_slopes", &options.score.alibi_slopes},
                                                    {"learnable_sink", &options.score.learnable_sink},
                                                    {"k_descale", &a.k_descale},
                                                    {"v_descale", &a.v_descale}};
  check_no_overlap(
      {{"out", &a.out}, {"lse", &a.lse}},
      {{"q", &a.q}, {"k_cache", &a.k_cache}, {"v_cache", &a.v_cache}, {"k_new", &a.k_new}, {"v_new", &a.v_new}});
  check_no_overlap({{"out", &a.out}, {"lse", &a.lse}}, indices);
  if (kp.append) {
    // The caches are written: no input may share their bytes, nor may the two caches (one view
    // passed as both). Interleaved halves of one buffer are a valid pair, which the overlap
    // check lets through.
    check_no_overlap({{"k_cache", &a.k_cache}, {"v_cache", &a.v_cache}}, {});
    for (const NamedView& cache : {NamedView{"k_cache", &a.k_cache}, NamedView{"v_cache", &a.v_cache}}) {
      check_no_overlap({cache}, {{"q", &a.q}, {"k_new", &a.k_new}, {"v_new", &a.v_new}});
      check_no_overlap({cache}, indices);
    }
  }

  p.q = operand(a.q, false);
  p.out = operand(a.out, false);
  if (a.lse.present()) p.lse = lse_operand(a.lse, false);
  p.k = operand(a.k_cache, false);
  p.v = operand(a.v_cache, false);
  p.k.cache = p.v.cache = rows;
  p.k.descale = k_descale;
  p.v.descale = v_descale;
  kp.capacity = capacity;
  kp.cache_entries = cache_entries;
  p.seqlen_k = p.max_seqlen_k = capacity;  // until the values give the longest sequence
  check_device_runs_lengths("k_cache", "a KV cache", a.q);
  if (a.index_check != IndexCheck::kHost && a.index_check != IndexCheck::kDevice) {
    bad("index_check: " + str(static_cast<int64_t>(a.index_check)) + " is neither kHost nor kDevice");
  }
  // Device tensors under IndexCheck::kDevice: the kernels check the values as they read them.
  kp.device_checks_indices = a.index_check == IndexCheck::kDevice && p.device.type != DeviceType::kCPU;
  if (lengths == LengthValues::kCheck && !kp.device_checks_indices) {
    check_index_values(a, kp, capacity, cache_entries, stream);
  }
  return kp;
}

}  // namespace flashattn::detail

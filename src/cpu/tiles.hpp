// Tile-level building blocks of the CPU flash path, shared by its forward and backward:
// per-thread scratch, loading tiles of q/k/v/dout (converted to the accumulator type and
// zero-padded), and turning raw q.k products into final scores (softcap, ALiBi, mask) in the
// exp2 domain.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>

#include "../core/mask.hpp"
#include "../core/philox.hpp"
#include "../core/variant.hpp"
#include "elem.hpp"
#include "tile_ops.hpp"

namespace flashattn::cpu {

inline constexpr int64_t kBlockM = 64;  // query rows per tile
inline constexpr int64_t kBlockN = 64;  // keys per tile
static_assert(kBlockM % kTileAlign == 0 && kBlockN % kTileAlign == 0);

// Zero-initialised, 64-byte aligned scratch owned by one thread.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n)
      : data_(static_cast<T*>(std::aligned_alloc(64, static_cast<size_t>(round_up(n * sizeof(T), 64))))) {
    if (!data_) throw std::bad_alloc();
    std::fill(data_.get(), data_.get() + n, T(0));
  }
  T* get() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
};

// Runs body(scratch, item) for items [0, n) over OpenMP threads with dynamic scheduling, each
// thread owning one scratch made by make_scratch(). The first exception thrown by any thread is
// rethrown to the caller (exceptions must not escape an OpenMP region).
template <typename MakeScratch, typename Body>
void parallel_items(int64_t n, MakeScratch make_scratch, Body body) {
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto record = [&] {
#pragma omp critical(flashattn_parallel_error)
    if (!error) error = std::current_exception();
    failed = true;
  };
#pragma omp parallel
  {
    // Every thread must reach the worksharing loop, so failures are recorded, not thrown.
    std::optional<decltype(make_scratch())> scratch;
    try {
      scratch.emplace(make_scratch());
    } catch (...) {
      record();
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n; ++t) {
      if (!scratch || failed) continue;
      try {
        body(*scratch, t);
      } catch (...) {
        record();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// Rows [row0, row0 + n) of one head into dst[n_pad, ld] (row-major, times `scale` and the
// operand's dequantise_factor), zeroing the padding rows [n, n_pad) and columns [d, ld).
template <typename T, typename Acc>
void load_tile(const detail::Operand& op, int64_t b, int64_t row0, int64_t n, int64_t n_pad, int64_t h, int64_t d,
               Acc scale, Acc* dst, int64_t ld) {
  scale *= static_cast<Acc>(dequantise_factor(op, b, h));
  for (int64_t i = 0; i < n_pad; ++i) {
    Acc* out = dst + i * ld;
    if (i < n) {
      const T* src = row_ptr<T>(op, b, row0 + i, h);
      for (int64_t c = 0; c < d; ++c) out[c] = static_cast<Acc>(to_float(src[c])) * scale;
    } else {
      for (int64_t c = 0; c < d; ++c) out[c] = Acc(0);
    }
    for (int64_t c = d; c < ld; ++c) out[c] = Acc(0);
  }
}

// The same rows transposed (times `scale` and the dequantise_factor): dst[d_pad, ld] with
// dst[c][i] = row i, column c.
template <typename T, typename Acc>
void load_tile_transposed(const detail::Operand& op, int64_t b, int64_t row0, int64_t n, int64_t n_pad, int64_t h,
                          int64_t d, int64_t d_pad, Acc scale, Acc* dst, int64_t ld) {
  scale *= static_cast<Acc>(dequantise_factor(op, b, h));
  for (int64_t c = 0; c < d_pad; ++c) {
    for (int64_t i = 0; i < n_pad; ++i) dst[c * ld + i] = Acc(0);
  }
  for (int64_t i = 0; i < n; ++i) {
    const T* src = row_ptr<T>(op, b, row0 + i, h);
    for (int64_t c = 0; c < d; ++c) dst[c * ld + i] = static_cast<Acc>(to_float(src[c])) * scale;
  }
}

template <typename T, typename Acc>
void store_tile(const detail::Operand& op, int64_t b, int64_t row0, int64_t n, int64_t h, int64_t d, const Acc* src,
                int64_t ld, Acc scale) {
  for (int64_t i = 0; i < n; ++i) {
    T* out = row_ptr<T>(op, b, row0 + i, h);
    for (int64_t c = 0; c < d; ++c) out[c] = from_acc<T>(static_cast<double>(src[i * ld + c] * scale));
  }
}

// Where element (query row r, key k) of a score-shaped tile lives. Forward and the dQ pass
// keep tiles transposed, [keys, queries]; the dK/dV pass keeps them [queries, keys]. for_each
// visits every element in memory order.
struct KeysByQueries {
  int64_t ld;
  template <typename T>
  void fill_padding(T* s, int64_t rows, int64_t rows_pad, int64_t keys, int64_t keys_pad, T value) const {
    for (int64_t k = 0; k < keys; ++k) std::fill(s + k * ld + rows, s + k * ld + rows_pad, value);
    for (int64_t k = keys; k < keys_pad; ++k) std::fill(s + k * ld, s + k * ld + rows_pad, value);
  }
  int64_t index(int64_t r, int64_t k) const { return k * ld + r; }
  template <typename F>
  void for_each(int64_t rows, int64_t keys, F&& f) const {
    for (int64_t k = 0; k < keys; ++k) {
      for (int64_t r = 0; r < rows; ++r) f(r, k, k * ld + r);
    }
  }
};
struct QueriesByKeys {
  int64_t ld;
  template <typename T>
  void fill_padding(T* s, int64_t rows, int64_t rows_pad, int64_t keys, int64_t keys_pad, T value) const {
    for (int64_t r = 0; r < rows; ++r) std::fill(s + r * ld + keys, s + r * ld + keys_pad, value);
    for (int64_t r = rows; r < rows_pad; ++r) std::fill(s + r * ld, s + r * ld + keys_pad, value);
  }
  int64_t index(int64_t r, int64_t k) const { return r * ld + k; }
  template <typename F>
  void for_each(int64_t rows, int64_t keys, F&& f) const {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < keys; ++k) f(r, k, r * ld + k);
    }
  }
};

// Turns raw products into scores in the exp2 domain, for one (batch, head).
// The q tile is pre-multiplied by q_scale(), so raw = q_scale * q.k, and then
//   without softcap: score = raw                                  (q_scale = scale * log2 e)
//   with softcap:    score = softcap * log2 e * tanh(raw)         (q_scale = scale / softcap)
//   ALiBi:           score += -slope * |i + sk - sq - j| * log2 e
//   masked (i, j):   score = -inf
//   sink:            the row's (max, sum) start from sink_start(sink * log2 e)
template <typename Acc>
struct ScoreMod {
  core::SinkTokenMask mask;
  const core::BlockMask* block = nullptr;  // the call's block-sparse mask; null: none
  int64_t b = 0, h = 0;                    // (the block mask's coordinates)
  double scale = 1.0, softcap = 0.0;
  double slope = 0.0;
  bool alibi = false;
  double sink = -std::numeric_limits<double>::infinity();  // natural log; -inf: none

  ScoreMod(const detail::Problem& p, const detail::SeqInfo& si, int64_t b_, int64_t h_)
      : mask({si.seqlen_q, si.seqlen_k, p.mask.window_left, p.mask.window_right}, p.mask.sink_tokens),
        block(p.block_mask.present() ? &p.block_mask : nullptr),
        b(b_),
        h(h_),
        scale(p.score.scale),
        softcap(p.score.softcap),
        slope(p.score.alibi_slope(b_, h_)),
        alibi(p.score.alibi != nullptr),
        sink(p.score.sink_logit(h_)) {}

  // Whether row i sees key j: the mask's bounds and window, and the block mask.
  bool visible(int64_t i, int64_t j) const { return mask.visible(i, j) && (!block || block->visible(b, h, i, j)); }
  // What the block mask makes of rows [i0, i1) x keys [j0, j1) (full without one).
  core::BlockMask::Cell block_range(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return block ? block->range(b, h, i0, i1, j0, j1) : core::BlockMask::Cell::kFull;
  }

  Acc q_scale() const { return static_cast<Acc>(softcap > 0.0 ? scale / softcap : scale * core::kLog2e); }
  // The (max, sum) a row starts from, in the exp2 domain.
  core::SinkStart<Acc> row_start() const { return core::sink_start(static_cast<Acc>(sink * core::kLog2e)); }
  // Applies mods and mask to a score tile for query rows i0 + [0, rows) and keys
  // j0 + [0, keys); padding (rows in [rows, rows_pad), keys in [keys, keys_pad)) becomes -inf.
  template <typename Layout>
  void apply(Acc* s, Layout at, int64_t i0, int64_t rows, int64_t rows_pad, int64_t j0, int64_t keys,
             int64_t keys_pad) const {
    const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
    const bool full = mask.tile_fully_visible(i0, i0 + rows, j0, j0 + keys) &&
                      block_range(i0, i0 + rows, j0, j0 + keys) == core::BlockMask::Cell::kFull;
    const Acc cap_log2 = static_cast<Acc>(softcap * core::kLog2e);
    at.fill_padding(s, rows, rows_pad, keys, keys_pad, neg_inf);
    if (full && softcap <= 0.0 && !alibi) return;  // the common case: nothing per element
    at.for_each(rows, keys, [&](int64_t r, int64_t k, int64_t e) {
      Acc x = s[e];
      if (softcap > 0.0) x = cap_log2 * std::tanh(x);
      if (alibi) {
        x += static_cast<Acc>(core::alibi_bias(slope, i0 + r, j0 + k, mask.seqlen_q, mask.seqlen_k) * core::kLog2e);
      }
      if (!full && !visible(i0 + r, j0 + k)) x = neg_inf;
      s[e] = x;
    });
  }
};

// Calls f(j0) for the key tiles (kBlockN keys from j0) that query rows [i0, i1) may see, in key
// order: those of the sink tokens, then those of the window from the first tile past them, less
// those the block mask hides.
template <typename Acc, typename F>
void for_each_key_tile(const ScoreMod<Acc>& mod, int64_t i0, int64_t i1, F&& f) {
  const core::SinkTokenMask& mask = mod.mask;
  const int64_t end = mask.key_end(i1);
  auto visit = [&](int64_t j0) {
    if (mod.block_range(i0, i1, j0, std::min(j0 + kBlockN, mask.seqlen_k)) != core::BlockMask::Cell::kHidden) f(j0);
  };
  const int64_t sink_end = std::min(round_up(mask.sink_key_end(i1), kBlockN), end);
  for (int64_t j0 = 0; j0 < sink_end; j0 += kBlockN) visit(j0);
  for (int64_t j0 = std::max(mask.key_begin(i0) / kBlockN * kBlockN, sink_end); j0 < end; j0 += kBlockN) visit(j0);
}

// Dropout on a score-shaped tile: each element becomes 0 or x / (1 - p). A row's keep bits come
// a 32-key chunk at a time (core::dropout_keep32).
template <typename Acc, typename Layout>
void apply_dropout(const detail::DropoutParams& dp, uint64_t bh, int64_t i0, int64_t rows, int64_t j0, int64_t keys,
                   Acc* t, Layout at) {
  const Acc keep_scale = static_cast<Acc>(1.0 / (1.0 - dp.p));
  for (int64_t r = 0; r < rows; ++r) {
    const auto i = static_cast<uint32_t>(i0 + r);
    for (int64_t k = 0; k < keys;) {
      const int64_t chunk = (j0 + k) >> 5;
      const uint32_t keep = core::dropout_keep32(dp.seed, dp.offset, bh, i, chunk, dp.threshold);
      for (const int64_t end = std::min(keys, 32 * (chunk + 1) - j0); k < end; ++k) {
        Acc& x = t[at.index(r, k)];
        x = (keep >> ((j0 + k) & 31)) & 1 ? x * keep_scale : Acc(0);
      }
    }
  }
}

}  // namespace flashattn::cpu

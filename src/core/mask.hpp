// The attention mask, one definition for every backend: bottom-right aligned causal / sliding
// window. Query row i of a sequence with lengths (seqlen_q, seqlen_k) sees key j iff
//   0 <= j < seqlen_k  and  i + off - window_left <= j <= i + off + window_right,
// off = seqlen_k - seqlen_q, a window side of -1 being unbounded.
#pragma once

#include <algorithm>
#include <cstdint>

#include "host_device.hpp"

namespace flashattn::core {

// Window sides at or beyond this many tokens are unbounded (validation folds them into -1): no
// sequence is that long, and with |window| and the lengths below it diag(i) -+ window fits int64.
inline constexpr int64_t kUnboundedWindow = int64_t{1} << 62;

struct Mask {
  int64_t seqlen_q = 0, seqlen_k = 0;
  int64_t window_left = -1, window_right = -1;

  FA_HOST_DEVICE int64_t diag(int64_t i) const { return i + seqlen_k - seqlen_q; }

  FA_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    if (j < 0 || j >= seqlen_k) return false;
    if (window_right >= 0 && j > diag(i) + window_right) return false;
    if (window_left >= 0 && j < diag(i) - window_left) return false;
    return true;
  }

  // Keys [begin, end) that any row of [row_begin, row_end) may see (empty when end <= begin).
  FA_HOST_DEVICE int64_t key_begin(int64_t row_begin) const {
    return window_left >= 0 ? std::max<int64_t>(0, diag(row_begin) - window_left) : 0;
  }
  FA_HOST_DEVICE int64_t key_end(int64_t row_end) const {
    return window_right >= 0 ? std::min<int64_t>(seqlen_k, diag(row_end - 1) + window_right + 1) : seqlen_k;
  }

  // Rows [begin, end) that may see any key of [col_begin, col_end): the transpose, used by the
  // backward pass that loops over key tiles.
  FA_HOST_DEVICE int64_t row_begin(int64_t col_begin) const {
    // j <= diag(i) + wr  <=>  i >= j - off - wr
    return window_right >= 0 ? std::max<int64_t>(0, col_begin - (seqlen_k - seqlen_q) - window_right) : 0;
  }
  FA_HOST_DEVICE int64_t row_end(int64_t col_end) const {
    // j >= diag(i) - wl  <=>  i <= j - off + wl
    return window_left >= 0 ? std::min<int64_t>(seqlen_q, col_end - 1 - (seqlen_k - seqlen_q) + window_left + 1)
                            : seqlen_q;
  }

  // Rows [begin, end) that see every key of [col_begin, col_end) (a non-empty key range; empty
  // when end <= begin): a tile of those rows needs no per-element mask. The backward pass
  // computes it once per key tile instead of testing every query tile.
  struct Rows {
    int64_t begin, end;
  };
  FA_HOST_DEVICE Rows rows_seeing_all(int64_t col_begin, int64_t col_end) const {
    if (col_end > seqlen_k) return {0, 0};
    const int64_t off = seqlen_k - seqlen_q;
    // col_end - 1 <= diag(i) + wr  and  col_begin >= diag(i) - wl
    const int64_t begin = window_right >= 0 ? std::max<int64_t>(0, col_end - 1 - off - window_right) : 0;
    const int64_t end = window_left >= 0 ? std::min<int64_t>(seqlen_q, col_begin - off + window_left + 1) : seqlen_q;
    return {begin, end};
  }
  // True when every (i, j) of the tile is visible, so per-element masking can be skipped.
  FA_HOST_DEVICE bool tile_fully_visible(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (j1 > seqlen_k || i1 > seqlen_q) return false;
    if (window_right >= 0 && j1 - 1 > diag(i0) + window_right) return false;
    if (window_left >= 0 && j0 < diag(i1 - 1) - window_left) return false;
    return true;
  }
};

// The mask with sink tokens (StreamingLLM's attention sinks): the first sink_tokens keys are
// exempt from window_left, so a sliding window keeps the sequence's first tokens in view
// (window_right, causal, still applies to them). A row's keys are then two ranges: [0,
// sink_key_end) and the window's [key_begin, key_end). A type of its own, so the kernels built on
// Mask compile exactly as they do without the feature.
struct SinkTokenMask : Mask {
  int64_t sink_tokens = 0;

  FA_HOST_DEVICE SinkTokenMask(const Mask& window, int64_t tokens) : Mask(window), sink_tokens(tokens) {}

  FA_HOST_DEVICE bool is_sink(int64_t i, int64_t j) const {
    return j >= 0 && j < sink_tokens && j < seqlen_k && (window_right < 0 || j <= diag(i) + window_right);
  }
  FA_HOST_DEVICE bool visible(int64_t i, int64_t j) const { return Mask::visible(i, j) || is_sink(i, j); }

  // The sink keys row i sees that its window does not: [0, n). They lie left of the window's
  // first key (j < diag(i) - window_left), so the right side holds for them too. The CUDA
  // kernels run the window alone and join these afterwards (cuda/common/sink_tokens.cuh).
  FA_HOST_DEVICE int64_t keys_left_of_window(int64_t i) const {
    if (window_left < 0) return 0;
    return std::max<int64_t>(0, std::min(std::min(sink_tokens, seqlen_k), diag(i) - window_left));
  }

  // The end of the sink keys' range for rows [.., row_end); 0 when window_left is unbounded
  // (key_begin is 0 then: the window's range holds them).
  FA_HOST_DEVICE int64_t sink_key_end(int64_t row_end) const {
    return sink_tokens > 0 && window_left >= 0 ? std::min(sink_tokens, key_end(row_end)) : 0;
  }
  // Rows that may see a key of [col_begin, col_end): all the right side allows if it holds a
  // sink key.
  FA_HOST_DEVICE int64_t row_end(int64_t col_begin, int64_t col_end) const {
    return col_begin < sink_tokens ? seqlen_q : Mask::row_end(col_end);
  }
  FA_HOST_DEVICE Rows rows_seeing_all(int64_t col_begin, int64_t col_end) const {
    if (col_begin >= sink_tokens) return Mask::rows_seeing_all(col_begin, col_end);
    // The sink keys bind by the right side alone; the rest of the tile as in the window.
    const Rows all = Mask::rows_seeing_all(col_begin, col_end);
    if (col_end <= sink_tokens) return {all.begin, col_end > seqlen_k ? int64_t{0} : seqlen_q};
    return {all.begin, Mask::rows_seeing_all(sink_tokens, col_end).end};
  }
  FA_HOST_DEVICE bool tile_fully_visible(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (Mask::tile_fully_visible(i0, i1, j0, j1)) return true;
    if (j0 >= sink_tokens) return false;
    // The sink keys need the right side alone: that of the last key of the tile's sink part.
    const int64_t sink_end = std::min(j1, sink_tokens);
    if (j1 > seqlen_k || i1 > seqlen_q) return false;
    if (window_right >= 0 && sink_end - 1 > diag(i0) + window_right) return false;
    return sink_end == j1 || Mask::tile_fully_visible(i0, i1, sink_end, j1);
  }
};

}  // namespace flashattn::core

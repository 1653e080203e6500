// The attention mask, one definition for every backend: bottom-right aligned causal / sliding
// window. Query row i of a sequence with lengths (seqlen_q, seqlen_k) sees key j iff
//   0 <= j < seqlen_k  and  i + off - window_left <= j <= i + off + window_right,
// off = seqlen_k - seqlen_q, a window side of -1 being unbounded; the first sink_tokens keys are
// exempt from the left side (StreamingLLM's attention sinks: a sliding window that keeps the
// sequence's first tokens), so a row's keys are two ranges, [0, sink_tokens) and its window.
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
  // Keys [0, sink_tokens) ignore window_left. (The tests `sink_tokens > 0` below keep a mask
  // built without them, 0 known at compile time, exactly the plain window's code.)
  int64_t sink_tokens = 0;

  FA_HOST_DEVICE int64_t diag(int64_t i) const { return i + seqlen_k - seqlen_q; }

  FA_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    if (j < 0 || j >= seqlen_k) return false;
    if (window_right >= 0 && j > diag(i) + window_right) return false;
    if (window_left >= 0 && j < diag(i) - window_left && !(sink_tokens > 0 && j < sink_tokens)) return false;
    return true;
  }

  // The end of the sink tokens' key range for rows [.., row_end): keys [0, sink_key_end) are
  // seen apart from the window's [key_begin, key_end); 0 when the window's left side is
  // unbounded (key_begin is 0 then, and one range covers all).
  FA_HOST_DEVICE int64_t sink_key_end(int64_t row_end) const {
    return sink_tokens > 0 && window_left >= 0 ? std::min(sink_tokens, key_end(row_end)) : 0;
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
  // The same for keys [col_begin, col_end), which may hold sink tokens (seen by every row the
  // right side allows).
  FA_HOST_DEVICE int64_t row_end(int64_t col_begin, int64_t col_end) const {
    return sink_tokens > 0 && col_begin < sink_tokens ? seqlen_q : row_end(col_end);
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
    // Sink tokens are seen whatever the window: the left side binds the first key past them.
    const int64_t first_windowed = sink_tokens > 0 && col_begin < sink_tokens ? sink_tokens : col_begin;
    if (sink_tokens > 0 && first_windowed >= col_end) return {begin, seqlen_q};
    const int64_t end =
        window_left >= 0 ? std::min<int64_t>(seqlen_q, first_windowed - off + window_left + 1) : seqlen_q;
    return {begin, end};
  }
  // True when every (i, j) of the tile is visible, so per-element masking can be skipped.
  FA_HOST_DEVICE bool tile_fully_visible(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (j1 > seqlen_k || i1 > seqlen_q) return false;
    if (window_right >= 0 && j1 - 1 > diag(i0) + window_right) return false;
    if (window_left >= 0 && j0 < diag(i1 - 1) - window_left) {
      if (!(sink_tokens > 0)) return false;
      const int64_t first_windowed = j0 < sink_tokens ? sink_tokens : j0;  // sink tokens are seen
      if (first_windowed < j1 && first_windowed < diag(i1 - 1) - window_left) return false;
    }
    return true;
  }
};

}  // namespace flashattn::core

// The order in which the forward kernels' CTAs take the work tiles of a masked call (sm90, and
// sm80 without dropout: forward_cta).
//
// Causal / windowed query tiles differ in work (causal: the last query tile sees every key, the
// first one a tile of them), and CTAs take tiles in index order: in the hardware's launch order
// (sm80, one CTA a tile) or from a counter (sm90's persistent walk). Whatever heavy tile starts
// last decides when the call ends. Each (head, batch entry) pair's tiles heaviest first, pair
// after pair, still starts the last pairs' heavy tiles at the very end; all pairs' tiles dealt
// heaviest first across pairs end on light tiles, but the CTAs running at once then each read
// another pair's K / V, none sharing it in L2.
//
// So the pairs go in groups of `group`, as many as keep their K / V in part of the L2, and within
// a group the tiles are dealt rank by rank, heaviest first (rank 0), across the group's pairs:
// the CTAs running at once read the K / V of a group's pairs. The last group is larger: the
// pairs left after whole groups, plus up to a group's worth more, so that it has tiles for
// `tail_waves` waves of the grid's CTAs where that many fit: the light tiles that end the call
// then outnumber the heavy ones that start beside them. (FlashAttention-3's tile scheduler groups
// heads by L2 the same way.) A group of 1 without a tail is the pair-after-pair order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../core/host_device.hpp"

namespace flashattn::cuda {

// Index -> (rank, pair) over `pairs` pairs of `tiles` tiles each, in groups of `group` pairs from
// pair 0; pairs [last_first, pairs) form the last group. The kernels use Int = int (32-bit
// divisions: 64-bit ones spilled registers), the host tests int64_t too.
template <class Int>
struct TileOrder {
  Int tiles = 1, pairs = 1, group = 1, last_first = 0;

  struct Slot {
    Int rank, pair;  // rank 0: the pair's heaviest tile
  };
  FA_HOST_DEVICE Slot at(Int index) const {
    Int first = index / (group * tiles) * group;  // the group's first pair
    if (first > last_first) first = last_first;
    const Int left = pairs - first;
    const Int size = first == last_first || left < group ? left : group;
    const Int r = index - first * tiles;
    return {r / size, first + r % size};
  }
};

// Pairs a group of a forward call: as many as keep their K / V (16-bit elements) within half the
// L2 (the rest for Q, O and whatever else is cached), at least 1 and at most `pairs`.
// Consecutive pairs are query heads; `heads_per_kv` of them share a K / V head.
inline int forward_tile_group(int64_t l2_bytes, int64_t seqlen_k, int64_t head_dim, int64_t heads_per_kv,
                              int64_t pairs) {
  constexpr int64_t kL2Share = 2;
  const int64_t kv_bytes = std::max<int64_t>(1, 2 * seqlen_k * head_dim * 2 / std::max<int64_t>(1, heads_per_kv));
  const int64_t fit = l2_bytes / kL2Share / kv_bytes;
  return static_cast<int>(std::clamp<int64_t>(fit, 1, std::clamp<int64_t>(pairs, 1, INT32_MAX)));
}

// The first pair of the last group: whole groups of `group` before it, and after it at least the
// pairs whose `tiles` tiles each fill `tail_waves` waves of `ctas_at_once` CTAs, but no more than
// a group's worth of them (their K / V too within the L2 share: at d256 16k, where a group is one
// head, a tail of three heads measured 2-3% slower).
inline int64_t last_group_first(int64_t pairs, int64_t tiles, int group, int tail_waves, int64_t ctas_at_once) {
  group = std::max(group, 1);
  const int64_t tail_tiles = int64_t{tail_waves} * ctas_at_once;
  const int64_t tail_pairs = (tail_tiles + std::max<int64_t>(tiles, 1) - 1) / std::max<int64_t>(tiles, 1);
  return std::max<int64_t>(0, pairs - std::min<int64_t>(tail_pairs, group)) / group * group;
}

}  // namespace flashattn::cuda

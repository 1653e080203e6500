// The FA1-order teaching kernel's contract between its C entry point (fa1_order_api.cpp, plain
// C++) and the kernel: tile shapes, the per-CTA schedule of (key tile, query tile) steps, and the
// launch parameters. Plain data and constexpr code, readable on host and device, no CUDA or CuTe.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../core/host_device.hpp"
#include "../../core/variant.hpp"
#include "../params.hpp"

namespace flashattn::cuda::teaching {

// Query rows x keys per step, and warps (each warp owns 16 query rows, FA2's split). FA1's loop
// order moves O (fp32), m and l of a query tile through HBM once per key tile, so its extra
// traffic per FLOP falls with the key tile's width alone (bytes / FLOP ~ 2.5 / block_n) and does
// not depend on block_m. The key tile is therefore as wide as the registers and shared memory
// allow with 4 warps of 16 rows: 128 keys at d64 (S 64 + O 32 fp32 registers a thread; 80 KB of
// shared memory with two Q and two K/V stages), 64 at d128 (S 32 + O 64; 96 KB: two stages of
// 128 keys would need 160 KB). Both fit the 99 KB that every sm80+ GPU offers a block.
struct Fa1TileShape {
  int block_m = 0, block_n = 0, warps = 0;
};
constexpr Fa1TileShape fa1_tile_shape(int head_dim) {
  return head_dim == 64 ? Fa1TileShape{64, 128, 4} : Fa1TileShape{64, 64, 4};
}
inline constexpr int kFa1HeadDims[] = {64, 128};

// One CTA's steps in FA1's order: key tiles j ascending (outer), and for each the CTA's query
// tiles i in [i_begin, i_end) that see some key of it, ascending (inner). Non-causal: every
// query tile sees every key tile. Causal (seqlen_q == seqlen_k, so row r sees keys <= r): query
// tile i sees key tile j iff its last row (i + 1) * block_m - 1 >= j * block_n, the first key.
struct Fa1Schedule {
  int i_begin = 0, i_end = 0;  // this CTA's query tiles
  int k_tiles = 0;             // key tiles of the sequence
  int block_m = 0, block_n = 0;
  bool causal = false;

  FA_HOST_DEVICE int first_query_tile(int j) const {
    if (!causal) return i_begin;
    const int first = static_cast<int>(int64_t{j} * block_n / block_m);
    return first > i_begin ? first : i_begin;
  }
  // The last key tile query tile i sees: its O is final after that step.
  FA_HOST_DEVICE int last_key_tile(int i) const {
    return causal ? static_cast<int>((int64_t{i + 1} * block_m - 1) / block_n) : k_tiles - 1;
  }
  // (j, i) -> the next step; false after the last one.
  FA_HOST_DEVICE bool next(int& j, int& i) const {
    if (i + 1 < i_end) {
      ++i;
      return true;
    }
    if (j + 1 > last_key_tile(i_end - 1)) return false;
    ++j;
    i = first_query_tile(j);
    return true;
  }
};

// Contiguous [batch, seqlen, heads, head_dim] q, k, v, out; head_dim is the kernel's.
struct Fa1Params {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [batch, heads, seqlen], natural log; nullptr: not written
  // The workspace (unused with o_in_registers): fp32 O accumulators [batch, heads, seqlen,
  // head_dim], not normalised, and the running row max (exp2 domain) and row sum
  // [batch, heads, seqlen] each. Nothing is read before this call wrote it.
  float* o_accum = nullptr;
  float* row_max = nullptr;
  float* row_sum = nullptr;
  int64_t seqlen = 0;
  int heads = 0;
  bool causal = false;
  // The control experiment: one query tile per CTA, whose O, m and l stay in registers across
  // the key loop (FA2's order with this kernel's tiles and code).
  bool o_in_registers = false;
  float scale_log2 = 0.0f;  // softmax_scale * log2(e), folded into the exponent once
};

// Workspace layout, in floats from its start: O, then the row maxima, then the row sums.
inline constexpr int64_t fa1_workspace_floats(int64_t batch, int64_t seqlen, int64_t heads, int64_t head_dim) {
  return batch * heads * seqlen * (head_dim + 2);
}

// The launch of one (checked) fa1_forward call: its parameters and the CTAs per (batch, head).
struct Fa1Launch {
  Fa1Params params;
  int q_groups = 0;
};
inline Fa1Launch fa1_launch(const void* q, const void* k, const void* v, void* out, float* lse, void* workspace,
                            int batch, int seqlen, int heads, int head_dim, bool causal, int q_groups) {
  Fa1Launch l;
  Fa1Params& p = l.params;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  p.seqlen = seqlen;
  p.heads = heads;
  p.causal = causal;
  p.o_in_registers = q_groups == 0;
  p.scale_log2 = static_cast<float>(core::kLog2e / std::sqrt(static_cast<double>(head_dim)));
  if (workspace != nullptr) {
    const int64_t rows = int64_t{batch} * heads * seqlen;
    p.o_accum = static_cast<float*>(workspace);
    p.row_max = p.o_accum + rows * head_dim;
    p.row_sum = p.row_max + rows;
  }
  l.q_groups = q_groups == 0 ? seqlen / fa1_tile_shape(head_dim).block_m : q_groups;
  return l;
}

}  // namespace flashattn::cuda::teaching

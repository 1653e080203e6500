// Tile shapes of the sm80 forward and backward kernels per (head-dim bucket, mask kind, tuning
// target). Plain constexpr C++ (no CuTe), so the dispatcher and the kernel registry see the same
// table the kernels are compiled from.
//
// The warps split the query rows (no inter-warp reduction); each warp keeps its rows' O and S
// accumulators in registers, so larger head dims take fewer query rows per warp or fewer keys per
// tile to stay inside 255 registers per thread without spilling (measured with ptxas -v, checked
// by tests/check_cuda_kernels.py). The shapes won the benchmarks of
// bench/results/gpu/sm80_forward_tuning.md. Shared memory (Q + K + V):
//   d32 128x64 16 KB, d64 128x64 32 KB, d96 128x32 36 KB, d128 128x32 48 KB / 64x128 80 KB
//   (sm90: 128x64 64 KB), d160 64x32 40 KB, d192 64x64 72 KB, d224 64x32 56 KB, d256 64x64 96 KB;
//   where two K / V stages fit the budget (ForwardTraits::kStages), K and V count twice.
//
// Tuning targets: kSm80 shapes run on every sm80+ GPU; a kSm90 shape, where one is listed,
// replaces the kSm80 one in the sm_90 code (H100 / H200). ptxas allocates differently per
// target: d128 at FA2's 128 x 64 x 4 fits 255 registers for sm_90a (with
// ForwardTraits::kAddressesPerStep) but spills 40-56 bytes for sm_80; on H100 it measured
// 3-5% faster than 128 x 48 x 4 in the same run, and 1.03-1.13x FA2 where the sm_80 shapes had
// measured 0.90-1.04x.
#pragma once

#include "../params.hpp"

namespace flashattn::cuda::sm80 {

enum class TileTarget : int { kSm80 = 80, kSm90 = 90 };

struct ForwardTileShape {
  int block_m = 0, block_n = 0, warps = 0;
  friend constexpr bool operator==(const ForwardTileShape& a, const ForwardTileShape& b) {
    return a.block_m == b.block_m && a.block_n == b.block_n && a.warps == b.warps;
  }
};

constexpr ForwardTileShape tuned_tile_shape(int head_dim, MaskKind mask, TileTarget target) {
  // Dropout kernels keep Philox state next to the tiles: their key tiles are narrower where the
  // plain shape would spill (128-row tiles spilled up to d96).
  if (mask == MaskKind::kMaskedDropout) {
    if (head_dim <= 96) return {64, 64, 4};
    if (head_dim <= 128) return {128, 32, 8};
    return {64, 32, 4};
  }
  if (head_dim <= 64) return {128, 64, 4};
  if (head_dim <= 96) return {128, 32, 4};
  if (head_dim <= 128) {
    if (target == TileTarget::kSm90) return {128, 64, 4};
    // 4 warps of 32 rows with 32-key tiles without a mask; 4 warps of 16 rows with 128-key tiles
    // with one (better than 64 x 64 on causal).
    return mask == MaskKind::kNone ? ForwardTileShape{128, 32, 4} : ForwardTileShape{64, 128, 4};
  }
  if (head_dim <= 160) return {64, 32, 4};
  if (head_dim <= 192) return {64, 64, 4};
  if (head_dim <= 224) return {64, 32, 4};
  return {64, 64, 4};  // FA2's H100 shape (96 KB: two CTAs per H100 SM)
}

#if defined(FLASHATTN_SM80_TILE_M) && defined(FLASHATTN_SM80_TILE_N) && defined(FLASHATTN_SM80_TILE_WARPS)
// Tuning builds only (scripts/gpu_bench.sh variants): one shape for every bucket and mask kind,
// of every target, or with FLASHATTN_SM80_TILE_TARGET=90 of the sm90 target only.
constexpr ForwardTileShape forward_tile_shape(int head_dim, MaskKind mask, TileTarget target) {
#if defined(FLASHATTN_SM80_TILE_TARGET)
  if (target != TileTarget(FLASHATTN_SM80_TILE_TARGET)) return tuned_tile_shape(head_dim, mask, target);
#endif
  return {FLASHATTN_SM80_TILE_M, FLASHATTN_SM80_TILE_N, FLASHATTN_SM80_TILE_WARPS};
}
#else
constexpr ForwardTileShape forward_tile_shape(int head_dim, MaskKind mask, TileTarget target) {
  return tuned_tile_shape(head_dim, mask, target);
}
#endif

// The block-sparse kernel's shape (the masked kernel walking a block mask's lists): the masked
// kSm80 shape, with fewer keys a tile where that one leaves no registers for the walk and the
// element bits (d128's 64 x 128 and d256's 64 x 64 spilled 8-24 bytes, for sm_90a or sm_80 by
// turns, as the walk's code moved; 64 x 64 and 64 x 32 have room). Its tiles must divide the
// mask's blocks (FlexAttention's default 128 x 128 holds every one of them).
constexpr ForwardTileShape block_sparse_tile_shape(int head_dim) {
  if (head_dim > 96 && head_dim <= 128) return {64, 64, 4};
  if (head_dim > 224) return {64, 32, 4};
  return forward_tile_shape(head_dim, MaskKind::kMasked, TileTarget::kSm80);
}

// Whether (head_dim bucket, mask) has a kernel of its own for sm_90: then the sm_90 code holds
// only that one and the kSm80 kernel's sm_90 entry is a stub, never launched.
constexpr bool has_sm90_tiles(int head_dim, MaskKind mask) {
  return !(forward_tile_shape(head_dim, mask, TileTarget::kSm90) ==
           forward_tile_shape(head_dim, mask, TileTarget::kSm80));
}

// Whether the code for compute capability `arch` (__CUDA_ARCH__ / 10) holds the kernel of tuning
// target `target`, given whether (head_dim bucket, mask) has an sm90-tuned twin: an sm90-tuned
// kernel is in the sm_90 code only, and an sm80-tuned one everywhere but there when a twin
// replaces it. The dispatcher launches the variant the device's code holds; the others are
// stubs.
constexpr bool target_compiled_for(TileTarget target, bool has_sm90_twin, int arch) {
  const bool sm90 = arch / 10 == 9;
  return target == TileTarget::kSm90 ? sm90 : !(sm90 && has_sm90_twin);
}

// --- backward --------------------------------------------------------------------------------
struct BackwardTileShape {
  int block_m = 0, block_n = 0, warps = 0;
  int atom_m_sdp = 0, atom_n_dkv = 0, atom_m_dq = 0;  // warps along the GEMMs' first mode
};

// dK and dV take N x d fp32 registers per CTA each, S and dP M x N. Up to d64, 128 x 128 tiles
// (FA2's shape there) fit 255 registers without spilling: half the steps of 64 x 128, so half
// the per-step work (loads, barriers, addresses) per FLOP. Up to d128, 64 x 128. Dropout's Philox
// state needs room of its own: its kernels take 64 keys per tile (64 x 128 spilled 448 bytes at
// d128). Beyond d128 the tiles shrink to 64 x 64 (the no-spill rule of tests/check_cuda_kernels.py
// covers the backward up to d128 only, so spills are allowed there).
// The GEMMs over head_dim (dK/dV, dQ) split it over 4 warps (16 columns each) where 64 divides
// it, else over 2 (d32, d96, d160, d224).
constexpr BackwardTileShape backward_tile_shape(int head_dim, MaskKind mask) {
  const int warps_by_d = head_dim % 64 == 0 ? 2 : 4;  // warps along the other mode when d is split in 4
  if (head_dim <= 64 && mask != MaskKind::kMaskedDropout) return {128, 128, 8, 2, 4, 4};
  if (head_dim <= 128 && mask != MaskKind::kMaskedDropout) return {64, 128, 8, 2, 4, warps_by_d};
  return {64, 64, 8, 4, warps_by_d, warps_by_d};
}

// The backward kernel's opt-in shared memory: A100's 163 KB for the sm80-tuned kernels, H100's
// 227 KB for the sm90-tuned ones (one CTA an SM either way).
constexpr int backward_smem_budget(TileTarget target) { return (target == TileTarget::kSm90 ? 227 : 163) * 1024; }
inline constexpr int kBackwardSmemAlign = 128;

// Shared memory of the backward kernel with `stages` query-tile stages (16-bit elements): Q and
// dO per stage, K, V, P and dS once, LSE2 and D (fp32) per stage, and alignment slack.
constexpr int backward_smem_estimate(int head_dim, MaskKind mask, int stages) {
  const BackwardTileShape t = backward_tile_shape(head_dim, mask);
  return 2 * (stages * 2 * t.block_m * head_dim + 2 * t.block_n * head_dim + 2 * t.block_m * t.block_n) +
         stages * 2 * t.block_m * 4 + 6 * kBackwardSmemAlign;
}

// Q and dO get two stages (the next query tile copied during this one's GEMMs) where they fit
// the target's budget, one otherwise: d224 / d256 have one on A100 and two on H100 (which
// measured 1.04-1.07x faster for the d256 backward on H100; sm80_backward_tuning.md).
constexpr int backward_stages(int head_dim, MaskKind mask, TileTarget target) {
  return backward_smem_estimate(head_dim, mask, 2) <= backward_smem_budget(target) ? 2 : 1;
}

// Whether (head_dim bucket, mask) has an sm90-tuned backward kernel (see has_sm90_tiles).
constexpr bool has_sm90_backward_tiles(int head_dim, MaskKind mask) {
  return backward_stages(head_dim, mask, TileTarget::kSm90) != backward_stages(head_dim, mask, TileTarget::kSm80);
}

// The smallest query tile of any bucket: a grid of ceil(seqlen_q / kMinBlockM) CTAs in x
// bounds every bucket's grid.
inline constexpr int kMinBlockM = 64;

}  // namespace flashattn::cuda::sm80

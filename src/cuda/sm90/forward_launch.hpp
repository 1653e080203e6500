// Declaration of the sm90a forward launchers and the host-side check of what they run.
// Plain C++: the registry and the GPU test include it without CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>

#include "../params.hpp"
#include "tile_config.hpp"

namespace flashattn::cuda::sm90 {

// The fewest query rows of a work tile (ForwardTraits::kBlockM: 128, or 192 at d64): bounds the
// tile count.
inline constexpr int kBlockRows = 128;

// The block-sparse kernel checks a tile's lists (IndexCheck::kDevice) against a bitmap of the key
// blocks in shared memory, this many bits (256 bytes: what the d128 kernel's budget leaves);
// masks of more key blocks checked on the device run the sm80 block-sparse kernel.
inline constexpr int64_t kSparseCheckedKeyBlocks = 2048;

// A dense masked d64 call runs the tall kernel (three consumer warpgroups, 192-row tiles;
// forward_traits.cuh kTallConsumers) from this many query rows on. Causal d64, tall against two
// consumers (H100, same run, both dtypes; the tall kernel's consumers skipping the key tiles past
// their own rows): +2% at seqlen 512, +3% at 1k, +10-12% at 2k, and from 4k to 16k +7-11% even
// before the skip (bench/results/gpu/sm90-consumer-skip-h100.md, sm90-d64-tall-threshold-h100.md).
// Shorter calls, not measured, stay on two.
inline constexpr int64_t kD64TallMinSeqlenQ = 512;

// A choice the environment may force: "1" on, "0" off, anything else (or unset) leaves it to the
// dispatch's rule. Read on every call, for A/B runs and the tests.
enum class EnvSwitch { kRule, kOn, kOff };
inline EnvSwitch env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || (v[0] != '0' && v[0] != '1') || v[1] != '\0') return EnvSwitch::kRule;
  return v[0] == '1' ? EnvSwitch::kOn : EnvSwitch::kOff;
}

// Whether such a call runs the tall kernel: by kD64TallMinSeqlenQ, or as FLASHATTN_SM90_D64_TALL
// says.
inline bool d64_tall(int64_t seqlen_q) {
  const EnvSwitch s = env_switch("FLASHATTN_SM90_D64_TALL");
  return s == EnvSwitch::kRule ? seqlen_q >= kD64TallMinSeqlenQ : s == EnvSwitch::kOn;
}

// Varlen d64 batches of short sequences run faster on the sm80 kernels. Same run, H100, bf16 and
// fp16, query rows a sequence (gpu_varlen.py mixes; sm80 kernels / sm90 kernels, no mask and
// causal): 341 rows (48 sequences of 64-1024): 1.21x and 1.25x; 910 rows (18 of 256-2048): 0.96x
// and 1.02-1.03x; 3277 rows (5 of 512-8192): 0.79x and 0.82x. A varlen grid is one CTA per tile
// of the longest sequence's tiling, one CTA an SM, so each short tile's Q load, first GEMM, last
// GEMM and store stand alone, where the sm80 kernels overlap them across the CTAs an SM holds.
// So a d64 varlen batch without dropout (not measured) whose query rows per sequence
// (total_q / batch) are below these runs on sm80: causal / windowed ones below 1024 (sm80 still
// ahead at 910), the others below 512 (between 341 and 910, where sm90 was ahead; the crossover
// itself not measured).
inline constexpr int64_t kVarlenD64MinRowsPerSequenceMasked = 1024;
inline constexpr int64_t kVarlenD64MinRowsPerSequence = 512;

// Whether the dispatch leaves a varlen batch that the sm90 kernel of `mask` (the kernel key's
// kind) supports to the sm80 ones: by the thresholds above, or as FLASHATTN_SM90_VARLEN says ("1":
// never; "0": every varlen batch goes to sm80, forward_unsupported_reason).
inline bool varlen_prefers_sm80(const ForwardParams& p, MaskKind mask) {
  if (p.cu_seqlens_q == nullptr || mask == MaskKind::kMaskedDropout ||
      env_switch("FLASHATTN_SM90_VARLEN") != EnvSwitch::kRule) {
    return false;
  }
  const int64_t min_rows =
      mask == MaskKind::kMasked ? kVarlenD64MinRowsPerSequenceMasked : kVarlenD64MinRowsPerSequence;
  return p.shape.head_dim == 64 && p.shape.batch > 0 && p.total_q < min_rows * p.shape.batch;
}

// Why the sm90a forward cannot run these params with this element size and head dim (a
// message naming the constraint), or nullptr when it can; `dropout_kernel`: the kernel is a
// MaskKind::kMaskedDropout one (the others ignore dropout). TMA needs 16-byte aligned base
// pointers and strides that are multiples of 16 bytes; the dispatcher falls back to sm80.
inline const char* forward_unsupported_reason(const ForwardParams& p, int elem_bytes, int head_dim,
                                              bool dropout_kernel = false) {
  const bool varlen = p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr;
  if (varlen && env_switch("FLASHATTN_SM90_VARLEN") == EnvSwitch::kOff) {
    return "sm90 forward: varlen batches sent to the sm80 kernels (FLASHATTN_SM90_VARLEN=0)";
  }
  if (varlen && (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr)) {
    return "sm90 forward: varlen needs both cu_seqlens_q and cu_seqlens_k";
  }
  if (p.dropout.threshold != 0 && !dropout_kernel) return "sm90 forward: dropout needs a dropout kernel";
  if (p.shape.head_dim != head_dim) return "sm90 forward: head_dim must equal the kernel's head dim (no padding yet)";
  if (p.shape.batch < 0 || p.shape.seqlen_q < 0 || p.shape.seqlen_k < 0 || p.shape.heads_q <= 0 ||
      p.shape.heads_kv <= 0 || p.shape.heads_q % p.shape.heads_kv != 0) {
    return "sm90 forward: invalid shape (heads_q must be a positive multiple of heads_kv)";
  }
  // The scheduler's 32-bit tile index (query tiles of 128 rows x heads_q x batch) and TMA's
  // 32-bit coordinates.
  if (p.shape.seqlen_q >= (int64_t{1} << 31) || p.shape.seqlen_k >= (int64_t{1} << 31) ||
      p.total_q >= (int64_t{1} << 31) || p.total_k >= (int64_t{1} << 31) ||
      (p.shape.seqlen_q + kBlockRows - 1) / kBlockRows * p.shape.heads_q * p.shape.batch >= (int64_t{1} << 31)) {
    return "sm90 forward: seqlens and varlen totals must be < 2^31 and query tiles of 128 rows x heads_q x batch "
           "< 2^31";
  }
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(p.q.data) || !aligned(p.k.data) || !aligned(p.v.data) || !aligned(p.out.data)) {
    return "sm90 forward: q, k, v and out must be 16-byte aligned (TMA)";
  }
  // Strides: positive multiples of 16 bytes below 2^40 bytes (cuTensorMapEncodeTiled's rule).
  auto stride_ok = [&](int64_t stride) {
    const int64_t bytes = stride * elem_bytes;
    return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t{1} << 40);
  };
  // (A varlen tensor's batch stride is unused: its sequences are rows of one batch entry.)
  auto rows_ok = [&](int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return (varlen || stride_ok(batch_stride)) && stride_ok(row_stride) && stride_ok(head_stride);
  };
  if (!rows_ok(p.q.batch_stride, p.q.row_stride, p.q.head_stride) ||
      !rows_ok(p.k.batch_stride, p.k.row_stride, p.k.head_stride) ||
      !rows_ok(p.v.batch_stride, p.v.row_stride, p.v.head_stride) ||
      !rows_ok(p.out.batch_stride, p.out.row_stride, p.out.head_stride)) {
    return "sm90 forward: batch / row / head strides of q, k, v and out must be positive multiples of 16 bytes (TMA)";
  }
  return nullptr;
}

// forward_unsupported_reason for the kernel of (kElem, kHeadDim, kMask): the registry's
// ForwardCheck.
template <ElemType kElem, int kHeadDim, MaskKind kMask>
const char* unsupported(const ForwardParams& p) {
  constexpr int kElemBytes = 2;  // both ElemTypes are 16-bit
  return forward_unsupported_reason(p, kElemBytes, kHeadDim, kMask == MaskKind::kMaskedDropout);
}

// The block-sparse kernel of (kElem, kHeadDim): the masked kernel's shapes with 128-row query
// tiles (two consumers). It reads the user's lists in place, so their blocks must hold whole
// tiles. d64 - d128 have one; d192's 112-key tiles fit no power-of-two block, and at d256 the
// consumers spilled (48 bytes) in the registers the producer's walk and check leave them (232).
// Those run the sm80 block-sparse kernel.
inline constexpr int kSparseBlockM = 128;
inline constexpr bool has_sparse_kernel(int head_dim) { return head_dim <= 128; }

// Why the block-sparse kernel cannot run these params (nullptr when it can); the dispatcher
// then runs the sm80 block-sparse kernel.
template <ElemType kElem, int kHeadDim>
const char* sparse_unsupported(const ForwardParams& p) {
  if (const char* why = forward_unsupported_reason(p, 2, kHeadDim)) return why;
  const core::BlockMask& m = p.block_mask;
  if (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr) return "sm90 block-sparse forward: dense batches only";
  if (m.block_m % kSparseBlockM != 0 || m.block_n % TileConfig<kHeadDim>::kBlockN != 0) {
    return "sm90 block-sparse forward: the mask's blocks must hold whole tiles (128 query rows, the head dim's key "
           "tile)";
  }
  if (p.block_mask_fault.claim != nullptr && m.key_blocks > kSparseCheckedKeyBlocks) {
    return "sm90 block-sparse forward: lists checked on the device need at most 2048 key blocks";
  }
  return nullptr;
}

// Runs the forward on `stream`. Returns cudaErrorNotSupported when forward_unsupported_reason
// names a reason, cudaErrorInvalidValue for a window with MaskKind::kNone, else the launch's
// error (cudaErrorNoKernelImageForDevice on a GPU other than sm_90).
template <ElemType kElem, int kHeadDim, MaskKind kMask>
cudaError_t run_sm90_forward(const ForwardParams& params, cudaStream_t stream);
// The same for the block-sparse kernel (ForwardParams::block_mask; sparse_unsupported).
template <ElemType kElem, int kHeadDim>
cudaError_t run_sm90_sparse_forward(const ForwardParams& params, cudaStream_t stream);

}  // namespace flashattn::cuda::sm90

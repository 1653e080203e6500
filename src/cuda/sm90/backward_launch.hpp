// Declaration of the sm90a backward launchers and the host-side check of what they run. Plain
// C++: the registry and the GPU tests include it without CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.hpp"
#include "forward_launch.hpp"

namespace flashattn::cuda::sm90 {

// The keys a CTA holds (BackwardTraits::kBlockN): 128, or 64 where the consumers split the head
// dim (d192, d256).
constexpr int backward_block_n(int head_dim) { return head_dim > 128 ? 64 : 128; }

// Why the sm90a backward kernel of this head dim cannot run these params (a message naming the
// constraint), or nullptr when it can; the dispatcher then runs the sm80 backward. TMA needs
// 16-byte aligned base pointers and strides that are multiples of 16 bytes (varlen tensors have
// no batch stride). varlen_kernel: the build has the kind's varlen kernel.
// FLASHATTN_SM90_BACKWARD=0 sends every call to the sm80 backward (same-run A/Bs).
inline const char* backward_unsupported_reason(const BackwardParams& p, int elem_bytes, int head_dim,
                                               bool varlen_kernel) {
  const ForwardParams& f = p.fwd;
  if (env_switch("FLASHATTN_SM90_BACKWARD") == EnvSwitch::kOff) {
    return "sm90 backward: sent to the sm80 kernels (FLASHATTN_SM90_BACKWARD=0)";
  }
  const bool varlen = f.cu_seqlens_q != nullptr;
  if (varlen != (f.cu_seqlens_k != nullptr) || (!varlen && f.seqused_k != nullptr)) {
    return "sm90 backward: cu_seqlens_q and cu_seqlens_k go together (and seqused_k with them)";
  }
  if (varlen && !varlen_kernel) return "sm90 backward: this build has no varlen kernel of this kind";
  if (varlen && (f.total_q >= (int64_t{1} << 31) || f.total_k >= (int64_t{1} << 31))) {
    return "sm90 backward: varlen tensors must have < 2^31 rows (TMA's extents)";
  }
  if (f.shape.head_dim != head_dim) return "sm90 backward: head_dim must equal the kernel's head dim";
  if (f.shape.batch < 0 || f.shape.seqlen_q < 0 || f.shape.seqlen_k < 0 || f.shape.heads_q <= 0 ||
      f.shape.heads_kv <= 0 || f.shape.heads_q % f.shape.heads_kv != 0) {
    return "sm90 backward: invalid shape (heads_q must be a positive multiple of heads_kv)";
  }
  // The grid's y and z (< 2^16): the KV heads, or in deterministic mode the key tiles; the batch.
  const int64_t key_tiles = (f.shape.seqlen_k + backward_block_n(head_dim) - 1) / backward_block_n(head_dim);
  if (f.shape.seqlen_q >= (int64_t{1} << 31) || f.shape.seqlen_k >= (int64_t{1} << 31) ||
      f.shape.batch >= (int64_t{1} << 16) || (p.deterministic ? key_tiles : f.shape.heads_kv) >= (int64_t{1} << 16)) {
    return p.deterministic ? "sm90 backward: seqlens must be < 2^31, batch and seqlen_k's key tiles < 2^16 (the grid)"
                           : "sm90 backward: seqlens must be < 2^31, batch and heads_kv < 2^16 (the grid)";
  }
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(f.q.data) || !aligned(f.k.data) || !aligned(f.v.data) || !aligned(p.dout.data) || !aligned(p.dk.data) ||
      !aligned(p.dv.data)) {
    return "sm90 backward: q, k, v, dout, dk and dv must be 16-byte aligned (TMA)";
  }
  auto stride_ok = [&](int64_t stride) {
    const int64_t bytes = stride * elem_bytes;
    return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t{1} << 40);
  };
  auto rows_ok = [&](int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return (varlen || stride_ok(batch_stride)) && stride_ok(row_stride) && stride_ok(head_stride);
  };
  if (!rows_ok(f.q.batch_stride, f.q.row_stride, f.q.head_stride) ||
      !rows_ok(f.k.batch_stride, f.k.row_stride, f.k.head_stride) ||
      !rows_ok(f.v.batch_stride, f.v.row_stride, f.v.head_stride) ||
      !rows_ok(p.dout.batch_stride, p.dout.row_stride, p.dout.head_stride) ||
      !rows_ok(p.dk.batch_stride, p.dk.row_stride, p.dk.head_stride) ||
      !rows_ok(p.dv.batch_stride, p.dv.row_stride, p.dv.head_stride)) {
    return "sm90 backward: batch / row / head strides of q, k, v, dout, dk and dv must be positive multiples of 16 "
           "bytes (TMA)";
  }
  return nullptr;
}

// The registry's check of the kernels of (kElem, kHeadDim, kMask): kScoreMods, kVarlen, whether
// the build has the score-modifier kernels (softcap / ALiBi) and the varlen ones beside the dense
// raw-score one; the dropout kernels (kMaskedDropout) take the calls with dropout.
template <ElemType kElem, int kHeadDim, MaskKind kMask, bool kScoreMods, bool kVarlen>
const char* backward_unsupported(const BackwardParams& p) {
  constexpr int kElemBytes = 2;  // both ElemTypes are 16-bit
  if (!kScoreMods && !p.fwd.score.raw_scores) {
    return "sm90 backward: this build has no softcap / ALiBi kernel of this kind";
  }
  if ((p.fwd.dropout.threshold != 0) != (kMask == MaskKind::kMaskedDropout)) {
    return "sm90 backward: calls with dropout run the dropout kernels, and only they do";
  }
  return backward_unsupported_reason(p, kElemBytes, kHeadDim, kVarlen);
}

// Runs the main backward kernel on `stream` (the scratch prepared and zeroed as for the sm80
// kernel: backward_rows.cuh's prepare and convert kernels run around it): the dense or, for
// varlen batches, the varlen kernel (kVarlen: built), each the raw-score one or with softcap /
// ALiBi the score-modifier one (kScoreMods: built); each kernel has an instantiation file of its
// own. Returns cudaErrorNotSupported when backward_unsupported names a reason, else the launch's
// error.
template <ElemType kElem, int kHeadDim, MaskKind kMask, bool kScoreMods, bool kVarlen>
cudaError_t run_sm90_backward(const BackwardParams& params, cudaStream_t stream);

// The launch of one kernel (kRawScores: the raw-score one; kVarlen: the varlen one), after
// run_sm90_backward's checks.
template <ElemType kElem, int kHeadDim, MaskKind kMask, bool kRawScores, bool kVarlen>
cudaError_t launch_sm90_backward(const BackwardParams& params, cudaStream_t stream);

// Shared memory the kernel needs per block (opt-in).
template <ElemType kElem, int kHeadDim, MaskKind kMask>
int sm90_backward_smem_bytes();

}  // namespace flashattn::cuda::sm90

// Host-side launch of the sm90a backward kernel for one (dtype, head dim, mask kind): checks, TMA
// descriptors from the params' pointers and strides, grid (key tiles, heads_kv, batch; in
// deterministic mode heads_kv, key tiles, batch), opt-in shared memory; the dense or the varlen
// kernel. Included only by the instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "backward_kernel.cuh"
#include "backward_launch.hpp"

namespace flashattn::cuda::sm90 {

template <ElemType kElem, int kHeadDim, MaskKind kMask, bool kScoreMods, bool kVarlenBuilt>
cudaError_t run_sm90_backward(const BackwardParams& params, cudaStream_t stream) {
  if (backward_unsupported<kElem, kHeadDim, kMask, kScoreMods, kVarlenBuilt>(params) != nullptr) {
    return cudaErrorNotSupported;
  }
  const ForwardParams& fp = params.fwd;
  if (kMask == MaskKind::kNone && (fp.window.left >= 0 || fp.window.right >= 0)) {
    return cudaErrorInvalidValue;  // the caller picked the wrong kernel
  }
  if (fp.shape.batch == 0 || fp.shape.seqlen_k == 0) return cudaSuccess;  // no dK / dV rows; dQ's sums stay 0
  // (Only the kernels the build has are named: the others have no definition to link.)
  auto launch = [&](auto varlen) {
    if constexpr (kScoreMods) {
      if (!fp.score.raw_scores) return launch_sm90_backward<kElem, kHeadDim, kMask, false, varlen()>(params, stream);
    }
    return launch_sm90_backward<kElem, kHeadDim, kMask, true, varlen()>(params, stream);
  };
  if constexpr (kVarlenBuilt) {
    if (fp.cu_seqlens_q != nullptr) return launch(std::true_type{});
  }
  return launch(std::false_type{});
}

template <ElemType kElem, int kHeadDim, MaskKind kMask, bool kRawScores, bool kVarlen>
cudaError_t launch_sm90_backward(const BackwardParams& params, cudaStream_t stream) {
  using namespace cute;
  using Traits = BackwardTraits<kElem, kHeadDim>;
  using Element = typename Traits::Element;
  const ForwardParams& fp = params.fwd;
  const ShapeParams& s = fp.shape;
  BackwardKernelParams<Traits> kp{};
  kp.params = params;
  // A tensor map's extents must be >= 1 (seqlen_q = 0 leaves every key tile without steps).
  // Varlen tensors are one batch entry of all the rows (a CTA's loads start at its sequence's
  // first rows); their unused batch stride is given as the row stride, which TMA accepts.
  const int64_t rows_q = kVarlen ? fp.total_q : s.seqlen_q;
  const int64_t rows_k = kVarlen ? fp.total_k : s.seqlen_k;
  const int64_t batch = kVarlen ? 1 : s.batch;
  kp.shape_q = make_shape(static_cast<int32_t>(rows_q > 0 ? rows_q : 1), Int<kHeadDim>{},
                          static_cast<int32_t>(s.heads_q), static_cast<int32_t>(batch));
  kp.shape_kv = make_shape(static_cast<int32_t>(rows_k > 0 ? rows_k : 1), Int<kHeadDim>{},
                           static_cast<int32_t>(s.heads_kv), static_cast<int32_t>(batch));
  auto batch_stride = [](int64_t row_stride, int64_t stride) { return kVarlen ? row_stride : stride; };
  auto gmem_in = [&](const RowsIn& x, const typename Traits::ShapeRows& shape) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(x.data)), shape,
                       make_stride(x.row_stride, _1{}, x.head_stride, batch_stride(x.row_stride, x.batch_stride)));
  };
  auto gmem_out = [&](const RowsOut& x) {
    return make_tensor(make_gmem_ptr(static_cast<Element*>(x.data)), kp.shape_kv,
                       make_stride(x.row_stride, _1{}, x.head_stride, batch_stride(x.row_stride, x.batch_stride)));
  };
  const auto q_tile = take<0, 2>(typename Traits::SmemLayoutQ{});
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(fp.q, kp.shape_q), q_tile);
  kp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.dout, kp.shape_q), q_tile);
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(fp.k, kp.shape_kv), typename Traits::SmemLayoutKV{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(fp.v, kp.shape_kv), typename Traits::SmemLayoutKV{});
  kp.tma_dk = make_tma_copy(SM90_TMA_STORE{}, gmem_out(params.dk), typename Traits::SmemLayoutKVStore{});
  kp.tma_dv = make_tma_copy(SM90_TMA_STORE{}, gmem_out(params.dv), typename Traits::SmemLayoutKVStore{});

  auto* kernel = &backward_kernel<Traits, kMask, kRawScores, kVarlen>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  // Key tiles fastest, then KV heads: a wave holds every key tile of a few heads, which read the
  // same Q and dO rows at about the same time (L2 serves most of them). In deterministic mode the
  // key tiles of a head add into a query tile's dQ sums in turn, lowest tile first; run side by
  // side, key tile n would wait for a chain of n hand-overs before its first add. There the KV
  // heads go fastest: a wave holds the first few key tiles of many heads, whose turns mostly
  // come from tiles of earlier waves, which are ahead (the waits still point to CTAs that
  // started earlier). Causal masks' longest sweeps, key tile 0 of each head, go first either way.
  const unsigned key_tiles = static_cast<unsigned>((s.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  const unsigned heads_kv = static_cast<unsigned>(s.heads_kv);
  static_assert(Traits::kBlockN == backward_block_n(kHeadDim), "backward_unsupported_reason's grid check");
  const dim3 grid(params.deterministic ? heads_kv : key_tiles, params.deterministic ? key_tiles : heads_kv,
                  static_cast<unsigned>(s.batch));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(kp);
  FA_TRACE(trace::dump_backward(stream);)
  return cudaGetLastError();
}

template <ElemType kElem, int kHeadDim, MaskKind kMask>
int sm90_backward_smem_bytes() {
  return BackwardTraits<kElem, kHeadDim>::kSmemBytes;
}

}  // namespace flashattn::cuda::sm90

// The explicit instantiations of one (dtype, head dim, mask kind), each in a generated file:
// FLASHATTN_SM90_BACKWARD_INSTANCE the checks and the dense raw-score kernel's launch (SCORE_MODS,
// VARLEN: the build has the score-modifier and the varlen kernels, declared extern here);
// FLASHATTN_SM90_BACKWARD_KERNEL_INSTANCE one of those other kernels' launches.
#define FLASHATTN_SM90_BACKWARD_LAUNCH(ELEM, HEAD_DIM, MASK, RAW, VARLEN)                                         \
  template cudaError_t flashattn::cuda::sm90::launch_sm90_backward<flashattn::cuda::ElemType::ELEM, HEAD_DIM,     \
                                                                   flashattn::cuda::MaskKind::MASK, RAW, VARLEN>( \
      const flashattn::cuda::BackwardParams&, cudaStream_t)
#define FLASHATTN_SM90_BACKWARD_INSTANCE(ELEM, HEAD_DIM, MASK, SCORE_MODS, VARLEN)                                    \
  extern FLASHATTN_SM90_BACKWARD_LAUNCH(ELEM, HEAD_DIM, MASK, false, false);                                          \
  extern FLASHATTN_SM90_BACKWARD_LAUNCH(ELEM, HEAD_DIM, MASK, true, true);                                            \
  extern FLASHATTN_SM90_BACKWARD_LAUNCH(ELEM, HEAD_DIM, MASK, false, true);                                           \
  FLASHATTN_SM90_BACKWARD_LAUNCH(ELEM, HEAD_DIM, MASK, true, false);                                                  \
  template cudaError_t flashattn::cuda::sm90::run_sm90_backward<flashattn::cuda::ElemType::ELEM, HEAD_DIM,            \
                                                                flashattn::cuda::MaskKind::MASK, SCORE_MODS, VARLEN>( \
      const flashattn::cuda::BackwardParams&, cudaStream_t);                                                          \
  template int flashattn::cuda::sm90::sm90_backward_smem_bytes<flashattn::cuda::ElemType::ELEM, HEAD_DIM,             \
                                                               flashattn::cuda::MaskKind::MASK>();
#define FLASHATTN_SM90_BACKWARD_KERNEL_INSTANCE(ELEM, HEAD_DIM, MASK, RAW, VARLEN) \
  FLASHATTN_SM90_BACKWARD_LAUNCH(ELEM, HEAD_DIM, MASK, RAW, VARLEN);

// Host-side launch of the sm90a forward kernel for one (dtype, head dim, mask kind): checks,
// TMA descriptors from the params' pointers and strides (CuTe's make_tma_copy, which encodes
// them through the driver entry point), the persistent grid, opt-in shared memory. Included
// only by the instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "forward_kernel.cuh"
#include "forward_launch.hpp"

namespace flashattn::cuda::sm90 {

// How the CTAs of a launch cover its work tiles.
enum class GridMode {
  kTilePerCta,  // one CTA per tile; the hardware hands tiles to SMs as they free
  kStatic,      // one CTA per SM, CTA b of G taking tiles b, b + G, ...
  kDynamic,     // one CTA per SM, each taking the next tile from a counter when it finishes one
};

// Without a mask every tile is the same work, and one CTA per SM walks them statically
// (persistent: no CTA launch or prologue per tile, and the next tile's first K / V loads overlap
// this one's epilogue; on an H100, bf16, against one CTA per tile: 1.02-1.04x at seqlen 1k,
// 0.99-1.02x from 2k). With a mask, tiles differ in work: the static walk left CTAs with unequal
// work (causal 0.67-0.99x of one CTA per tile), so masks take tiles from the counter in the
// caller's workspace, or one CTA per tile without one. Causal against one CTA per tile, H100, three
// runs: d64 1.10-1.13x at 1k, 1.01-1.09x at 2k-16k; d128 1.02-1.08x at 1k-4k but 0.97-0.98x at
// 16k; d256 0.98-1.02x (bench/results/gpu/forward-h100-grids-dynamic-*).
// FLASHATTN_SM90_PERSISTENT (read on every call, for A/B runs): "0" one CTA per tile, "1" the
// static walk, "2" the counter (when there is one).
// Varlen: one CTA per tile of the longest sequence's tiling, and a CTA whose tile lies past its
// own sequence's end exits at once (the walks would spend a handoff on each such tile).
template <MaskKind kMask, bool kVarlen>
GridMode forward_grid_mode(const int* tile_counter) {
  if (kVarlen) return GridMode::kTilePerCta;
  const char* v = std::getenv("FLASHATTN_SM90_PERSISTENT");
  GridMode mode = kMask == MaskKind::kNone ? GridMode::kStatic : GridMode::kDynamic;
  if (v != nullptr && v[0] >= '0' && v[0] <= '2' && v[1] == '\0') mode = static_cast<GridMode>(v[0] - '0');
  return mode == GridMode::kDynamic && tile_counter == nullptr ? GridMode::kTilePerCta : mode;
}

// The launch of the dense (kVarlen false) or the varlen kernel, with kConsumers consumer
// warpgroups, or the block-sparse one (kSparse), each instantiated in its own generated file (they
// compile in parallel); run_sm90_forward has checked the params.
template <ElemType kElem, int kHeadDim, MaskKind kMask, bool kVarlen,
          int kConsumers = kConsumerWarpGroupsFor<kHeadDim, kMask>, bool kSparse = false>
cudaError_t launch_sm90_forward(const ForwardParams& params, cudaStream_t stream) {
  using namespace cute;
  using Traits = ForwardTraits<kElem, kHeadDim, kMask, kConsumers, kSparse>;
  using Element = typename Traits::Element;
  const ShapeParams& s = params.shape;

  KernelParams<Traits> kp{};
  kp.params = params;
  // A tensor map's extents must be >= 1: with seqlen_k = 0 no key tile is ever loaded, but the
  // K / V maps still need a valid shape. Varlen tensors are one batch entry of all the rows (a
  // tile's loads start at its sequence's first row; the rows past the sequence that a tail tile
  // reads belong to the next one and are masked); their unused batch stride is given as the row
  // stride, which TMA accepts.
  const int64_t rows_q = kVarlen ? params.total_q : s.seqlen_q;
  const int64_t rows_k = kVarlen ? params.total_k : s.seqlen_k;
  const int64_t batch = kVarlen ? 1 : s.batch;
  kp.shape_q = make_shape(static_cast<int32_t>(rows_q), Int<kHeadDim>{}, static_cast<int32_t>(s.heads_q),
                          static_cast<int32_t>(batch));
  kp.shape_kv = make_shape(static_cast<int32_t>(rows_k > 0 ? rows_k : 1), Int<kHeadDim>{},
                           static_cast<int32_t>(s.heads_kv), static_cast<int32_t>(batch));
  auto gmem_in = [&](const RowsIn& x, const typename Traits::ShapeRows& shape) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(x.data)), shape,
                       make_stride(x.row_stride, _1{}, x.head_stride, kVarlen ? x.row_stride : x.batch_stride));
  };
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.q, kp.shape_q), typename Traits::SmemLayoutQ{});
  kp.tma_k =
      make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.k, kp.shape_kv), take<0, 2>(typename Traits::SmemLayoutKV{}));
  kp.tma_v =
      make_tma_copy(SM90_TMA_LOAD{}, gmem_in(params.v, kp.shape_kv), take<0, 2>(typename Traits::SmemLayoutKV{}));
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(params.out.data)), kp.shape_q,
                          make_stride(params.out.row_stride, _1{}, params.out.head_stride,
                                      kVarlen ? params.out.row_stride : params.out.batch_stride));
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutOConsumer{});  // a consumer's rows

  auto* kernel = &forward_kernel<Traits, kMask, kVarlen>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t m_blocks = (s.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t tiles = m_blocks * s.heads_q * s.batch;
  const GridMode mode = forward_grid_mode<kMask, kVarlen>(params.tile_counter);
  int device = 0, sms = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  sms = std::max(sms, 1);
  // One CTA an SM runs at once, whatever the grid.
  kp.params.tile_last_first =
      last_group_first(s.heads_q * s.batch, m_blocks, params.tile_group, params.tile_tail_waves, sms);
  unsigned ctas = static_cast<unsigned>(tiles);
  if (mode != GridMode::kTilePerCta) ctas = static_cast<unsigned>(std::min<int64_t>(tiles, sms));
  if (mode == GridMode::kDynamic) {
    err = cudaMemsetAsync(params.tile_counter, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
  } else {
    kp.params.tile_counter = nullptr;  // the kernel's sign to walk statically
  }
  kernel<<<ctas, Traits::kNThreads, kSmemBytes, stream>>>(kp);
  FA_TRACE(trace::dump(stream);)
  return cudaGetLastError();
}

template <ElemType kElem, int kHeadDim, MaskKind kMask>
cudaError_t run_sm90_forward(const ForwardParams& params, cudaStream_t stream) {
  static_assert(ForwardTraits<kElem, kHeadDim, kMask>::kBlockM >= kBlockRows,
                "forward_unsupported_reason bounds the tiles by kBlockRows' count");
  if (unsupported<kElem, kHeadDim, kMask>(params) != nullptr) return cudaErrorNotSupported;
  if (kMask == MaskKind::kNone && (params.window.left >= 0 || params.window.right >= 0)) {
    return cudaErrorInvalidValue;  // the caller picked the wrong kernel
  }
  if (params.shape.batch == 0 || params.shape.seqlen_q == 0) return cudaSuccess;  // nothing to write
  if (params.cu_seqlens_q != nullptr) {
    return launch_sm90_forward<kElem, kHeadDim, kMask, true, kVarlenConsumersFor<kHeadDim, kMask>>(params, stream);
  }
  if constexpr (kHeadDim == 64 && kMask == MaskKind::kMasked) {
    if (d64_tall(params.shape.seqlen_q)) {
      return launch_sm90_forward<kElem, kHeadDim, kMask, false, kTallConsumers>(params, stream);
    }
  }
  return launch_sm90_forward<kElem, kHeadDim, kMask, false>(params, stream);
}

template <ElemType kElem, int kHeadDim>
cudaError_t run_sm90_sparse_forward(const ForwardParams& params, cudaStream_t stream) {
  static_assert(has_sparse_kernel(kHeadDim));
  static_assert(ForwardTraits<kElem, kHeadDim, MaskKind::kMasked, 2, true>::kBlockM == kSparseBlockM);
  if (sparse_unsupported<kElem, kHeadDim>(params) != nullptr) return cudaErrorNotSupported;
  if (params.shape.batch == 0 || params.shape.seqlen_q == 0) return cudaSuccess;  // nothing to write
  return launch_sm90_forward<kElem, kHeadDim, MaskKind::kMasked, false, 2, true>(params, stream);
}

}  // namespace flashattn::cuda::sm90

// The explicit instantiations of one (dtype, head dim, mask kind): FLASHATTN_SM90_FORWARD_INSTANCE
// run_sm90_forward and the dense kernel's launch (the varlen one declared extern), in one file;
// FLASHATTN_SM90_VARLEN_INSTANCE the varlen kernel's launch, in another; for d64 masked,
// FLASHATTN_SM90_TALL_INSTANCE the tall kernel's launch in a third (FLASHATTN_SM90_TALL_EXTERN
// declares it in the first).
// (LAUNCH's trailing arguments: kVarlen, then kConsumers where not the default.)
#define FLASHATTN_SM90_LAUNCH(ELEM, HEAD_DIM, MASK, ...)                                                         \
  template cudaError_t flashattn::cuda::sm90::launch_sm90_forward<flashattn::cuda::ElemType::ELEM, HEAD_DIM,     \
                                                                  flashattn::cuda::MaskKind::MASK, __VA_ARGS__>( \
      const flashattn::cuda::ForwardParams&, cudaStream_t)
#define FLASHATTN_SM90_VARLEN_LAUNCH(ELEM, HEAD_DIM, MASK) \
  FLASHATTN_SM90_LAUNCH(ELEM, HEAD_DIM, MASK, true,        \
                        flashattn::cuda::sm90::kVarlenConsumersFor<HEAD_DIM, flashattn::cuda::MaskKind::MASK>)
#define FLASHATTN_SM90_FORWARD_INSTANCE(ELEM, HEAD_DIM, MASK)                                                          \
  extern FLASHATTN_SM90_VARLEN_LAUNCH(ELEM, HEAD_DIM, MASK);                                                           \
  FLASHATTN_SM90_LAUNCH(ELEM, HEAD_DIM, MASK, false);                                                                  \
  template cudaError_t                                                                                                 \
  flashattn::cuda::sm90::run_sm90_forward<flashattn::cuda::ElemType::ELEM, HEAD_DIM, flashattn::cuda::MaskKind::MASK>( \
      const flashattn::cuda::ForwardParams&, cudaStream_t);
#define FLASHATTN_SM90_VARLEN_INSTANCE(ELEM, HEAD_DIM, MASK) FLASHATTN_SM90_VARLEN_LAUNCH(ELEM, HEAD_DIM, MASK);
#define FLASHATTN_SM90_TALL_EXTERN(ELEM, HEAD_DIM, MASK) \
  extern FLASHATTN_SM90_LAUNCH(ELEM, HEAD_DIM, MASK, false, flashattn::cuda::sm90::kTallConsumers);
#define FLASHATTN_SM90_TALL_INSTANCE(ELEM, HEAD_DIM, MASK) \
  FLASHATTN_SM90_LAUNCH(ELEM, HEAD_DIM, MASK, false, flashattn::cuda::sm90::kTallConsumers);
// The block-sparse kernel of (dtype, head dim), in a file of its own.
#define FLASHATTN_SM90_SPARSE_INSTANCE(ELEM, HEAD_DIM)                                                            \
  FLASHATTN_SM90_LAUNCH(ELEM, HEAD_DIM, kMasked, false, 2, true);                                                 \
  template cudaError_t flashattn::cuda::sm90::run_sm90_sparse_forward<flashattn::cuda::ElemType::ELEM, HEAD_DIM>( \
      const flashattn::cuda::ForwardParams&, cudaStream_t);

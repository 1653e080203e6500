// Register fragments of the tensor-core accumulators, as every attention kernel holds them: a
// row of an accumulator spread over the 4 lanes of a quad (the sm80 mma.sync m16n8 and the sm90
// WGMMA layouts alike), reduced across the quad; the warp vote that keeps the softmax's branches
// uniform; fp32 -> 16-bit conversion of a whole fragment; and the views of a WGMMA accumulator
// the sm90 kernels take (by rows and columns, and as an RS WGMMA's A operand). Shared by the sm80
// forward and backward, the sm90 kernels and the teaching kernel, so each family applies the same
// instructions to its own accumulators.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#if defined(__CUDACC__)
#include <cutlass/numeric_conversion.h>  // device intrinsics: nvcc only
#endif

namespace flashattn::cuda {

// A row of an accumulator is spread over the 4 lanes of a quad (lane / 4 equal).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

// True on every lane when the predicate holds on some lane of the warp (a uniform branch).
__device__ __forceinline__ bool warp_any(bool predicate) { return __any_sync(0xffffffffu, predicate); }

// fp32 fragment -> Element fragment of the same size, in storage order (paired cvt
// instructions); the destination may have another layout (a view of the same values). Host builds
// (tests/gpu/test_sm80_emulated.cpp) convert element by element, with the same rounding.
template <class Engine, class Layout, class DstEngine, class DstLayout>
__device__ __forceinline__ void convert_fragment_into(const cute::Tensor<Engine, Layout>& src,
                                                      cute::Tensor<DstEngine, DstLayout>& dst) {
  constexpr int kN = decltype(cute::size(src))::value;
  static_assert(decltype(cute::size(dst))::value == kN, "fragments of different sizes");
#if defined(__CUDACC__)
  using From = typename Engine::value_type;
  using Element = typename DstEngine::value_type;
  cutlass::NumericArrayConverter<Element, From, kN> convert;
  *reinterpret_cast<cutlass::Array<Element, kN>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, kN>*>(src.data()));
#else
  for (int i = 0; i < kN; ++i) dst(i) = typename DstEngine::value_type(src(i));
#endif
}

// The same into a new fragment of src's layout.
template <class Element, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(const cute::Tensor<Engine, Layout>& src) {
  auto dst = cute::make_tensor<Element>(src.layout());
  convert_fragment_into(src, dst);
  return dst;
}

// A 64 x N WGMMA accumulator ((2 cols, 2 row halves, N / 8), MMA_M, MMA_N) viewed as
// (rows (2, MMA_M), cols (2, N / 8, MMA_N)): a row lies in the 4 lanes of a quad, as with
// mma.sync, so the shared softmax (../common/row_softmax.cuh: quad reductions) applies unchanged.
template <class Layout>
__device__ __forceinline__ constexpr auto gmma_accum_rowcol(Layout layout) {
  using namespace cute;
  static_assert(decltype(rank<0>(layout))::value == 3, "expects a WGMMA accumulator ((2, 2, N/8), M, N)");
  auto values = get<0>(layout);
  return make_layout(make_layout(get<1>(values), get<1>(layout)),
                     make_layout(get<0>(values), get<2>(values), get<2>(layout)));
}

// The same accumulator, converted to 16 bits, as the A operand of an RS WGMMA: one k16 slice of
// A holds ((2 cols, 2 row halves, 2 column blocks of 8)), i.e. two neighbouring n8 blocks of C.
// ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)).
template <class Layout>
__device__ __forceinline__ constexpr auto gmma_accum_as_a_operand(Layout layout) {
  using namespace cute;
  auto values = get<0>(layout);
  static_assert(decltype(size<2>(values))::value % 2 == 0, "needs pairs of n8 blocks");
  auto blocks = flatten(logical_divide(get<2>(values), Shape<_2>{}));  // (2, N/16)
  return make_layout(make_layout(get<0>(values), get<1>(values), get<0>(blocks)), get<1>(layout),
                     coalesce(make_layout(get<1>(blocks), get<2>(layout))));
}

}  // namespace flashattn::cuda

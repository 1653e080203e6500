// Register-tile building blocks of the sm80 kernels: views of mma.sync accumulators as
// (row, column) matrices, predicated (zero-filling) cp.async tile loads, and the two tensor-core
// GEMM loops. The pieces the sm90 kernels use too (quad reductions over a row, fp32 -> 16-bit
// fragment conversion) are in ../common/fragment.cuh.
#pragma once

#include <cute/tensor.hpp>
#include <cstring>
#if !defined(__CUDACC__)
#include <atomic>  // host emulation (tests/gpu/test_sm80_emulated.cpp) of the atomics
#include <thread>
#endif

namespace flashattn::cuda::sm80 {

// An m16n8 accumulator fragment ((2 cols, 2 row halves), MMA_M, MMA_N) viewed as
// (rows (2, MMA_M), cols (2, MMA_N)): element (r, c) is one row / column of the C tile.
template <class Layout>
__device__ __forceinline__ constexpr auto accum_rowcol(Layout layout) {
  static_assert(decltype(cute::rank(layout))::value == 3, "expects (MMA, MMA_M, MMA_N)");
  auto values = cute::get<0>(layout);
  return cute::make_layout(cute::make_layout(cute::get<1>(values), cute::get<1>(layout)),
                           cute::make_layout(cute::get<0>(values), cute::get<2>(layout)));
}

// The same accumulator, converted to 16 bits, as the A operand of m16n8k16: two neighbouring
// n8 atoms of C hold exactly the registers of one k16 slice of A. ((2,2), M, N) -> (((2,2),2), M, N/2).
template <class Layout>
__device__ __forceinline__ constexpr auto accum_as_a_operand(Layout layout) {
  static_assert(decltype(cute::size<2>(layout))::value % 2 == 0, "needs pairs of n8 atoms");
  auto n_pairs = cute::flatten(cute::logical_divide(cute::get<2>(layout), cute::Shape<cute::_2>{}));  // (2, N/2)
  return cute::make_layout(cute::make_layout(cute::get<0>(layout), cute::get<0>(n_pairs)), cute::get<1>(layout),
                           cute::get<1>(n_pairs));
}

// threadIdx.x, read anew where it is called (volatile asm: never merged with an earlier read).
// Per-thread coordinates and addresses derived from it after the key loop are then computed
// there instead of being held in registers across the loop, where ptxas would spill them.
// kKnownRange tells the compiler the index lies in [0, 1024): the layouts' divisions by powers of
// two become plain shifts (a signed division rounds toward zero and costs a sign fix-up each).
// The backward kernel's loop gains from it; the forward keeps the plain read (with the range its
// d256 masked kernel spills 28 bytes on sm_90a).
template <bool kKnownRange = false>
__device__ __forceinline__ int thread_index_reread() {
#if defined(__CUDA_ARCH__)
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  if constexpr (kKnownRange) __builtin_assume(tid >= 0 && tid < 1024);
  return tid;
#else
  return static_cast<int>(threadIdx.x);  // host emulation
#endif
}

// cp.async of one tile, chunk by chunk: chunks whose row is < rows_valid and whose first
// column is < cols_valid are read, the others are zero-filled without touching global memory
// (their source address is replaced by `safe_src`, an in-bounds address, for good measure).
// src/dst/coord are partitions (CPY, CPY_ROWS, CPY_COLS) of one tiled copy.
template <class TiledLoad, class Src, class Dst, class Coord, class SafePtr>
__device__ __forceinline__ void load_tile_zfill(const TiledLoad& tiled_load, const Src& src, Dst&& dst,
                                                const Coord& coord, int64_t rows_valid, int64_t cols_valid,
                                                SafePtr safe_src) {
  CUTE_UNROLL
  for (int m = 0; m < cute::size<1>(src); ++m) {
    const bool row_ok = cute::get<0>(coord(0, m, 0)) < rows_valid;
    CUTE_UNROLL
    for (int k = 0; k < cute::size<2>(src); ++k) {
      const bool ok = row_ok && cute::get<1>(coord(0, m, k)) < cols_valid;
      auto chunk = src(cute::_, m, k);
      auto from = cute::make_tensor(ok ? chunk.data() : safe_src, chunk.layout());
      cute::copy(tiled_load.with(ok), from, dst(cute::_, m, k));
    }
  }
}

// load_tile_zfill for a tile whose rows lie anywhere (K / V rows of small pages): row r of the
// tile starts at row_ptr(r), an element pointer, called only for the rows in range. `src` is
// the partition of any tile of the same shape and strides: it gives each chunk's layout.
template <class TiledLoad, class Src, class Dst, class Coord, class RowPtr, class Element>
__device__ __forceinline__ void load_rows_zfill(const TiledLoad& tiled_load, const Src& src, Dst&& dst,
                                                const Coord& coord, int64_t rows_valid, int64_t cols_valid,
                                                const RowPtr& row_ptr, const Element* safe_src) {
#pragma unroll 1  // a row at a time: the kernels that read small pages have no registers to spare
  for (int m = 0; m < cute::size<1>(src); ++m) {
    const int row = static_cast<int>(cute::get<0>(coord(0, m, 0)));
    const bool row_ok = row < rows_valid;
    const Element* row_src = row_ok ? row_ptr(row) : safe_src;
    CUTE_UNROLL
    for (int k = 0; k < cute::size<2>(src); ++k) {
      const int col = static_cast<int>(cute::get<1>(coord(0, m, k)));
      const bool ok = row_ok && col < cols_valid;
      auto from = cute::make_tensor(cute::make_gmem_ptr(ok ? row_src + col : safe_src), src(cute::_, m, k).layout());
      cute::copy(tiled_load.with(ok), from, dst(cute::_, m, k));
    }
  }
}

// acc (MMA, MMA_M, MMA_N) += A (MMA, MMA_M, MMA_K) B (MMA, MMA_N, MMA_K)^T on the tensor cores.
// B comes from shared memory one ldmatrix.x4 chunk (two n8 atoms of one k16 slice) at a time,
// loaded one chunk ahead of the MMAs that use it, and each chunk feeds every M atom at once: a
// handful of B registers is live at any moment, never a whole k16 slice (with head_dim-wide V
// slices that would be 32-64 registers next to the O accumulator). A's k16 slices before
// kASmemFrom are in registers already (Q kept there, or all of P: kANeverFromSmem); the others
// are read from shared memory one slice ahead.
// tCrB_view / tCsB are (CPY, CHUNKS, MMA_K) of the ldmatrix copy; chunk j of slice k holds n8
// atoms 2j and 2j + 1 of tCrB (CuTe's colexicographic order of both modes).
inline constexpr int kANeverFromSmem = 1 << 30;

template <int kASmemFrom, class TiledMma, class Acc, class RegA, class RegAView, class SmemA, class CopyA, class RegB,
          class RegBView, class SmemB, class CopyB>
__device__ __forceinline__ void gemm_b_chunked(const TiledMma& tiled_mma, Acc& acc, RegA& tCrA, RegAView& tCrA_view,
                                               const SmemA& tCsA, const CopyA& copy_a, RegB& tCrB, RegBView& tCrB_view,
                                               const SmemB& tCsB, const CopyB& copy_b) {
  constexpr int kSteps = decltype(cute::size<2>(tCrA))::value;
  constexpr int kChunks = decltype(cute::size<1>(tCrB_view))::value;
  constexpr int kAtomsM = decltype(cute::size<1>(acc))::value;
  static_assert(kSteps == decltype(cute::size<2>(tCrB))::value, "A and B disagree on K");
  static_assert(2 * kChunks == decltype(cute::size<1>(tCrB))::value, "a B chunk is two n8 atoms");
  static_assert(decltype(cute::size<1>(tCrB))::value == decltype(cute::size<2>(acc))::value, "B and acc disagree on N");
  auto load_b = [&](int chunk) {  // chunk = k * kChunks + j
    cute::copy(copy_b, tCsB(cute::_, chunk % kChunks, chunk / kChunks),
               tCrB_view(cute::_, chunk % kChunks, chunk / kChunks));
  };
  if constexpr (kASmemFrom == 0) cute::copy(copy_a, tCsA(cute::_, cute::_, 0), tCrA_view(cute::_, cute::_, 0));
  load_b(0);
  CUTE_UNROLL
  for (int k = 0; k < kSteps; ++k) {
    if constexpr (kASmemFrom < kSteps) {
      if (k + 1 >= kASmemFrom && k + 1 < kSteps) {
        cute::copy(copy_a, tCsA(cute::_, cute::_, k + 1), tCrA_view(cute::_, cute::_, k + 1));
      }
    }
    CUTE_UNROLL
    for (int j = 0; j < kChunks; ++j) {
      if (k * kChunks + j + 1 < kSteps * kChunks) load_b(k * kChunks + j + 1);
      CUTE_UNROLL
      for (int m = 0; m < kAtomsM; ++m) {
        CUTE_UNROLL
        for (int n = 2 * j; n < 2 * j + 2; ++n) {
          cute::gemm(tiled_mma, acc(cute::_, m, n), tCrA(cute::_, m, k), tCrB(cute::_, n, k), acc(cute::_, m, n));
        }
      }
    }
  }
}

// A gemm_smem hook that does nothing after each k16 slice.
struct NoSliceHook {
  template <int kSlice>
  __device__ __forceinline__ void operator()(cute::Int<kSlice>) const {}
};

// acc (MMA, MMA_M, MMA_N) += A (MMA, MMA_M, MMA_K) B (MMA, MMA_N, MMA_K)^T with both operands
// read from shared memory (ldmatrix) one k16 slice ahead of the MMAs that use it. The backward
// kernel's GEMMs: their operands change hands between warp arrangements through shared memory.
// after_slice(Int<k>) runs after slice k's MMAs are issued (work to interleave with them).
template <class TiledMma, class Acc, class RegA, class RegAView, class SmemA, class CopyA, class RegB, class RegBView,
          class SmemB, class CopyB, class AfterSlice = NoSliceHook>
__device__ __forceinline__ void gemm_smem(const TiledMma& tiled_mma, Acc& acc, RegA& tCrA, RegAView& tCrA_view,
                                          const SmemA& tCsA, const CopyA& copy_a, RegB& tCrB, RegBView& tCrB_view,
                                          const SmemB& tCsB, const CopyB& copy_b, AfterSlice after_slice = {}) {
  constexpr int kSteps = decltype(cute::size<2>(tCrA))::value;
  static_assert(kSteps == decltype(cute::size<2>(tCrB))::value, "A and B disagree on K");
  cute::copy(copy_a, tCsA(cute::_, cute::_, 0), tCrA_view(cute::_, cute::_, 0));
  cute::copy(copy_b, tCsB(cute::_, cute::_, 0), tCrB_view(cute::_, cute::_, 0));
  cute::for_each(cute::make_int_sequence<kSteps>{}, [&](auto k) {
    if constexpr (decltype(k)::value + 1 < kSteps) {
      cute::copy(copy_a, tCsA(cute::_, cute::_, k + 1), tCrA_view(cute::_, cute::_, k + 1));
      cute::copy(copy_b, tCsB(cute::_, cute::_, k + 1), tCrB_view(cute::_, cute::_, k + 1));
    }
    cute::gemm(tiled_mma, acc, tCrA(cute::_, cute::_, k), tCrB(cute::_, cute::_, k), acc);
    after_slice(k);
  });
}

// The same for whole shared-memory operands sA (M, K) and sB (N, K): the thread's fragments and
// ldmatrix partitions (CopyAtomA / CopyAtomB) are formed here, from `tid`, right where they are
// used, so nothing of them stays live across the caller's loop.
template <class CopyAtomA, class CopyAtomB, class TiledMma, class Acc, class SmemA, class SmemB,
          class AfterSlice = NoSliceHook>
__device__ __forceinline__ void gemm_smem_tiles(const TiledMma& tiled_mma, Acc& acc, const SmemA& sA, const SmemB& sB,
                                                int tid, AfterSlice after_slice = {}) {
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  auto tCrA = thr_mma.partition_fragment_A(sA);
  auto tCrB = thr_mma.partition_fragment_B(sB);
  auto copy_a = cute::make_tiled_copy_A(CopyAtomA{}, tiled_mma);
  auto copy_b = cute::make_tiled_copy_B(CopyAtomB{}, tiled_mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  auto tCrA_view = thr_a.retile_D(tCrA);
  auto tCrB_view = thr_b.retile_D(tCrB);
  gemm_smem(tiled_mma, acc, tCrA, tCrA_view, thr_a.partition_S(sA), copy_a, tCrB, tCrB_view, thr_b.partition_S(sB),
            copy_b, after_slice);
}

// 16 bytes global -> shared with cp.async (completes with the thread's next cp_async_wait).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__)
  cute::SM80_CP_ASYNC_CACHEALWAYS<cute::uint128_t>::copy(*static_cast<const cute::uint128_t*>(gmem),
                                                         *static_cast<cute::uint128_t*>(smem));
#else
  std::memcpy(smem, gmem, 16);           // host emulation: at once
#endif
}

// 4 bytes global -> shared with cp.async (completes with the thread's next cp_async_wait).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__)
  cute::SM80_CP_ASYNC_CACHEALWAYS<uint32_t>::copy(*static_cast<const uint32_t*>(gmem), *static_cast<uint32_t*>(smem));
#else
  std::memcpy(smem, gmem, 4);            // host emulation: at once
#endif
}

// An fp32 add to global memory, performed at L2 without returning a value (PTX red: the compiler
// turned atomicAdd into ATOMG, whose completion the next cp.async wait then waited for as well).
__device__ __forceinline__ void atomic_add(float* address, float value) {
#if defined(__CUDA_ARCH__)
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(address), "f"(value) : "memory");
#elif !defined(__CUDACC__)
  std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
#endif
}

// A counter in global memory that orders the CTAs taking turns at a shared accumulator: one
// thread waits until it reads `turn` (acquire), the CTA follows through a barrier; after its
// adds the CTA fences them and one thread advances the counter (release).
__device__ __forceinline__ void wait_for_turn(const int* counter, int turn, int tid) {
  if (tid == 0) {
#if defined(__CUDA_ARCH__)
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen != turn);
#elif !defined(__CUDACC__)
    while (std::atomic_ref<int>(const_cast<int&>(*counter)).load(std::memory_order_acquire) != turn)
      std::this_thread::yield();
#endif
  }
  __syncthreads();
}
__device__ __forceinline__ void pass_turn(int* counter, int tid) {
#if defined(__CUDA_ARCH__)
  __threadfence();  // this thread's adds are visible before the counter moves
#elif !defined(__CUDACC__)
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
  __syncthreads();
  if (tid == 0) {
#if defined(__CUDA_ARCH__)
    atomicAdd(counter, 1);
#elif !defined(__CUDACC__)
    std::atomic_ref<int>(*counter).fetch_add(1, std::memory_order_release);
#endif
  }
}

}  // namespace flashattn::cuda::sm80

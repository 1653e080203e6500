// Warpgroup-level building blocks of the sm90a kernels (forward and backward): the issue of one
// warpgroup GEMM, a fresh read of the thread index, the non-tensor bulk copies (global -> shared
// with an mbarrier, shared -> global reduce-add) that CuTe does not wrap, and a reducing named
// barrier. (The WGMMA accumulator's views are in ../common/fragment.cuh, which host-built tests
// include.)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "../common/fragment.cuh"  // the WGMMA accumulator's views

namespace flashattn::cuda::sm90 {

// Issues one warpgroup GEMM over all k blocks, tC (+)= tA tB, as one committed batch; the
// caller waits for it (warpgroup_wait<batches still allowed in flight>) and then fences the
// register operands (warpgroup_fence_operand) before touching them. kZeroInit (or zero_init,
// decided at run time): the first k block overwrites tC (no clear). kARegisters: A is a register
// fragment (RS WGMMA) rather than shared-memory descriptors (SS).
template <bool kZeroInit, bool kARegisters, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm_issue(TiledMma& tiled_mma, TA& tA, const TB& tB, TC& tC,
                                                     bool zero_init = kZeroInit) {
  using namespace cute;
  if constexpr (kARegisters) warpgroup_fence_operand(tA);
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  tiled_mma.accumulate_ = kZeroInit || zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    gemm(tiled_mma, tA(_, _, k), tB(_, _, k), tC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// The thread's index read afresh (asm volatile): what code after the main loop derives from it is
// then computed there, not in the prologue and held (or spilled) through the loop.
__device__ __forceinline__ int fresh_thread_idx() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory, their
// arrival counted on `mbarrier` (which must expect them: arrive_and_expect_tx or a pipeline's
// transaction count).
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* mbarrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))),
               "l"(gmem_src), "r"(bytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(mbarrier)))
               : "memory");
}

// Adds `bytes` of fp32 values (a multiple of 16; 16-byte aligned) from shared memory into global
// memory, element by element, atomically with respect to other adds; part of the issuing thread's
// current bulk group (bulk_commit, then bulk_wait_read before the source is written again).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem_src))), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until the issuing thread's bulk groups but the last kPending have read their shared source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until the issuing thread's bulk groups but the last kPending have completed: their writes (the
// reduce-adds) performed in global memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// A counter in global memory by which the CTAs adding into one accumulator take turns (the
// backward's deterministic dQ): one thread waits until the counter reaches `turn` (acquire);
// after its adds have completed it advances the counter (release).
__device__ __forceinline__ void wait_for_count(const int* counter, int turn) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  } while (seen < turn);
}
__device__ __forceinline__ void advance_count(int* counter) {
  asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk adds (async proxy) before the release
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// Named barriers over `threads` threads on user barrier `id` (numbered as
// cutlass::arch::NamedBarrier numbers them, past CUTLASS's reserved ones). kAligned: bar.sync /
// bar.arrive, which PTX defines for threads that all execute the same barrier instruction; without
// it, barrier.sync / barrier.arrive, for threads that reach the barrier from different instructions
// (compute-sanitizer's synccheck reports the aligned form used so as divergent).
template <bool kAligned = true>
__device__ __forceinline__ void named_barrier_sync(uint32_t threads, uint32_t id) {
  if constexpr (kAligned) {
    cutlass::arch::NamedBarrier::sync(threads, id);
  } else {
    const uint32_t barrier = id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;
    asm volatile("barrier.sync %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
  }
}

template <bool kAligned = true>
__device__ __forceinline__ void named_barrier_arrive(uint32_t threads, uint32_t id) {
  if constexpr (kAligned) {
    cutlass::arch::NamedBarrier::arrive(threads, id);
  } else {
    const uint32_t barrier = id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;
    asm volatile("barrier.arrive %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
  }
}

// The aligned barrier returning whether `pred` held in any of the threads (__syncthreads_or for
// part of a CTA).
__device__ __forceinline__ bool named_barrier_or(uint32_t threads, uint32_t id, bool pred) {
  const uint32_t barrier = id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;
  uint32_t any;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
               : "=r"(any)
               : "r"(static_cast<uint32_t>(pred)), "r"(barrier), "r"(threads)
               : "memory");
  return any != 0;
}

}  // namespace flashattn::cuda::sm90

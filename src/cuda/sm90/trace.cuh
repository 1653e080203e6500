// Consumer timelines of the sm90a forward and backward: with FLASHATTN_SM90_TRACE defined
// (CMake option FLASHATTN_CUDA_SM90_TRACE, never in a release build), thread 0 of each consumer
// warpgroup of CTA 0 stamps clock64() at the steps of its main loop on its second tile (the first
// runs while the other CTAs still start) into a device array; after each launch the host waits for
// the kernel, copies the array back and prints one line a key tile: "sm90trace <consumer> <step>
// <kEvents stamps>" (-1 where a step has no such point). bench/sm90_trace.py runs a call and reads the
// lines. The backward's stamps: dump_backward and bench/sm90_backward_trace.py. (No printf in the
// kernel: a function call there makes ptxas serialize the WGMMAs.)
// Without the macro every FA_TRACE(...) is empty and the epilogue's stamp calls go to a no-op, so
// the kernels' code is unchanged.
#pragma once

namespace flashattn::cuda::sm90::trace {

// The points of a key tile's step, in order; then the epilogue's, stamped in a tile's last
// (PV-only) step alone.
enum Event : int {
  kTurnWait,     // before turn_begin
  kTurnBegin,    // the turn granted
  kIssued,       // its GEMMs issued, the turn passed on
  kSDone,        // the S GEMM waited for
  kScored,       // scores scaled / masked (score_tile)
  kMaxMoved,     // the row max settled (max, quad shuffles, vote, rescale factors)
  kSoftmax,      // the softmax done: exponentials and sums
  kPvDone,       // the PV GEMM waited for
  kStepEnd,      // O rescaled, P converted; in the last (PV-only) step, its epilogue done (none if deferred)
  kNormalised,   // O / rowsum in 16 bits, the LSE
  kLseStored,    // the LSE stores issued
  kOBufferFree,  // O's buffer free (the last O store has read it; the consumer's barrier)
  kOWritten,     // O in shared memory, fenced for the TMA
  kOSynced,      // the consumer's barrier after it
  kEvents
};

// The points of a backward step of each consumer (by keys), in order.
enum BackwardEvent : int {
  kBwdStep,       // the step's start
  kBwdIssued,     // the S^T and dP^T GEMMs issued (includes waiting for the Q / dO stages)
  kBwdSdpDone,    // both waited for
  kBwdElements,   // the element pass done (P^T, dS^T)
  kBwdDkvIssued,  // P^T and dS^T converted, dS^T stored, dV's GEMM issued (by head dim dK's too)
  kBwdSynced,     // both consumers' dS in (their barrier)
  kBwdGemmsDone,  // dQ's GEMM issued (by keys dK's after it) and the others waited for
  kBwdStaged,     // the dQ product staged for the dQ warp (after its buffer's empty barrier)
  kBackwardEvents
};
// The dQ warp's points of a backward step.
enum DqEvent : int {
  kDqWait,  // waiting for the consumers' product
  kDqFull,  // the product in (the full barrier)
  kDqTurn,  // the query tile's turn (deterministic mode; else as kDqFull)
  kDqRead,  // the reduce-adds issued and their reads of the buffer done
  kDqEvents
};

// The epilogue's stamp where no trace is taken (and in a plain build).
struct NoStamp {
  __device__ __forceinline__ void operator()(Event) const {}
};

}  // namespace flashattn::cuda::sm90::trace

#ifdef FLASHATTN_SM90_TRACE
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace flashattn::cuda::sm90::trace {

inline constexpr int kSteps = 512;
inline constexpr int kConsumersMax = 3;
static __device__ long long g_stamps[kConsumersMax][kSteps][kEvents];

__device__ __forceinline__ void clear(int consumer) {
#pragma unroll 1
  for (int s = 0; s < kSteps; ++s) {
    for (int e = 0; e < kEvents; ++e) g_stamps[consumer][s][e] = -1;
  }
}
__device__ __forceinline__ void stamp(bool on, int consumer, int step, Event event) {
  if (on && step >= 0 && step < kSteps) g_stamps[consumer][step][event] = clock64();
}
// Host: after a launch on `stream`, the stamps of the traced tile (nothing where none was).
inline void dump(cudaStream_t stream) {
  static long long host[kConsumersMax][kSteps][kEvents];
  if (cudaStreamSynchronize(stream) != cudaSuccess) return;
  if (cudaMemcpyFromSymbol(host, g_stamps, sizeof host) != cudaSuccess) return;
  for (int c = 0; c < kConsumersMax; ++c) {
    for (int s = 0; s < kSteps && host[c][s][kTurnWait] > 0; ++s) {
      const long long* t = host[c][s];
      std::printf("sm90trace %d %d", c, s);
      for (int e = 0; e < kEvents; ++e) std::printf(" %lld", t[e]);
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  static long long minus_one[kConsumersMax][kSteps][kEvents];
  std::memset(minus_one, 0xff, sizeof minus_one);  // every stamp -1 for the next launch
  (void)cudaMemcpyToSymbol(g_stamps, minus_one, sizeof minus_one);
}

// The backward: CTA (0, 0, 0)'s consumers (thread 0 of each) and dQ warp (lane 0), every step;
// dump_backward prints "sm90bwd <consumer> <step> <kBackwardEvents stamps>" and "sm90dq <step>
// <kDqEvents stamps>" lines (bench/sm90_backward_trace.py). Stamps of 0 were not taken.
static __device__ long long g_backward_stamps[2][kSteps][kBackwardEvents];
static __device__ long long g_dq_stamps[kSteps][kDqEvents];
__device__ __forceinline__ bool traced_cta() { return blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0; }
__device__ __forceinline__ void backward_stamp(int step, BackwardEvent event) {
  const int consumer = static_cast<int>(threadIdx.x) / 128 - 1;  // after the producer warpgroup
  if (traced_cta() && threadIdx.x % 128 == 0 && consumer >= 0 && consumer < 2 && step < kSteps) {
    g_backward_stamps[consumer][step][event] = clock64();
  }
}
__device__ __forceinline__ void dq_stamp(int step, DqEvent event) {  // by one lane of the dQ warp
  if (traced_cta() && step < kSteps) g_dq_stamps[step][event] = clock64();
}
inline void dump_backward(cudaStream_t stream) {
  static long long consumers[2][kSteps][kBackwardEvents], dq[kSteps][kDqEvents];
  if (cudaStreamSynchronize(stream) != cudaSuccess) return;
  if (cudaMemcpyFromSymbol(consumers, g_backward_stamps, sizeof consumers) != cudaSuccess) return;
  if (cudaMemcpyFromSymbol(dq, g_dq_stamps, sizeof dq) != cudaSuccess) return;
  for (int c = 0; c < 2; ++c) {
    for (int s = 0; s < kSteps && consumers[c][s][kBwdStep] > 0; ++s) {
      std::printf("sm90bwd %d %d", c, s);
      for (int e = 0; e < kBackwardEvents; ++e) std::printf(" %lld", consumers[c][s][e]);
      std::printf("\n");
    }
  }
  for (int s = 0; s < kSteps && dq[s][kDqWait] > 0; ++s) {
    std::printf("sm90dq %d", s);
    for (int e = 0; e < kDqEvents; ++e) std::printf(" %lld", dq[s][e]);
    std::printf("\n");
  }
  std::fflush(stdout);
  std::memset(consumers, 0, sizeof consumers);
  std::memset(dq, 0, sizeof dq);
  (void)cudaMemcpyToSymbol(g_backward_stamps, consumers, sizeof consumers);
  (void)cudaMemcpyToSymbol(g_dq_stamps, dq, sizeof dq);
}

}  // namespace flashattn::cuda::sm90::trace
#define FA_TRACE(...) __VA_ARGS__
// In the consumer: stamps event trace::E of key tile step `step` (the consumer's bool `tracing`).
#define FA_STAMP(step, E) trace::stamp(tracing, consumer_wg, step, trace::E)
// The backward's: a consumer's step `step` at event trace::E, and the dQ warp's.
#define FA_BWD_STAMP(step, E) trace::backward_stamp(step, trace::E)
#define FA_DQ_STAMP(step, E) trace::dq_stamp(step, trace::E)
#else
#define FA_TRACE(...)
#define FA_STAMP(step, E) static_cast<void>(0)
#define FA_BWD_STAMP(step, E) static_cast<void>(0)
#define FA_DQ_STAMP(step, E) static_cast<void>(0)
#endif

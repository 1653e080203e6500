// CUDA's thread built-ins for kernels run on host threads: one host thread per CUDA thread, CTAs
// one after another (launch), __syncthreads(_or) / __shfl_xor_sync / __any_sync through per-CTA
// barriers and exchange slots, and the keywords defined away. The sm80 emulation (emulation.hpp)
// adds the tensor-core atoms; kernels written with the built-ins alone (the decode kernels)
// need only this.
#pragma once

#include <barrier>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 thread_idx, block_idx, grid_dim;

// The CTA being run: its barriers and the per-thread exchange slots of the warp collectives.
struct Cta {
  explicit Cta(int threads) : block(threads), slots(static_cast<size_t>(threads)) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  struct Slot {
    float f = 0;
    uint32_t a[4] = {}, b[2] = {};
    const uint16_t* row = nullptr;
  };
  std::vector<Slot> slots;
};
inline Cta* cta = nullptr;

inline int tid() { return static_cast<int>(thread_idx.x); }
inline void warp_sync() { cta->warps[static_cast<size_t>(tid() / 32)]->arrive_and_wait(); }
inline void syncthreads() { cta->block.arrive_and_wait(); }
inline float shfl_xor(float x, int lane_mask) {
  cta->slots[static_cast<size_t>(tid())].f = x;
  warp_sync();
  const float r = cta->slots[static_cast<size_t>((tid() & ~31) | ((tid() & 31) ^ lane_mask))].f;
  warp_sync();
  return r;
}
inline bool syncthreads_or(bool predicate) {
  cta->slots[static_cast<size_t>(tid())].f = predicate ? 1.0f : 0.0f;
  syncthreads();
  bool result = false;
  for (const Cta::Slot& slot : cta->slots) result = result || slot.f != 0.0f;
  syncthreads();
  return result;
}
inline bool any(bool predicate) {
  cta->slots[static_cast<size_t>(tid())].f = predicate ? 1.0f : 0.0f;
  warp_sync();
  bool result = false;
  for (int lane = 0; lane < 32; ++lane) result = result || cta->slots[static_cast<size_t>((tid() & ~31) | lane)].f != 0.0f;
  warp_sync();
  return result;
}

}  // namespace emu

// (The CUDA headers CuTe includes define some of these for host compilers; redefine them all.)
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __shared__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define gridDim emu::grid_dim
#define __syncthreads() emu::syncthreads()
#define __syncthreads_or(predicate) emu::syncthreads_or(predicate)
#define __shfl_xor_sync(mask, x, lane_mask) emu::shfl_xor(x, lane_mask)
#define __any_sync(mask, predicate) emu::any(predicate)

namespace emu {

// Runs `cta_body` (a kernel's per-CTA function) for every CTA of `grid`, one CTA at a time, on
// `threads` host threads.
template <class Body>
void launch(Dim3 grid, int threads, Body&& cta_body) {
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        Cta block(threads);
        cta = &block;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            thread_idx = {static_cast<unsigned>(t), 0, 0};
            block_idx = {x, y, z};
            grid_dim = grid;
            cta_body();
          });
        }
        for (auto& th : pool) th.join();
        cta = nullptr;  // `block` ends here: leave no pointer to it behind
      }
    }
  }
}

}  // namespace emu

// CUDA's thread built-ins for kernels run on the host: each CTA's CUDA threads are fibers
// (ucontext) on the launching thread, CTAs one after another (launch), __syncthreads(_or) /
// __shfl_xor_sync / __any_sync through per-CTA barriers and exchange slots, and the keywords
// defined away. Fibers switch only at barriers (cooperatively), so a CTA costs no OS threads and
// no futex traffic: with one OS thread per CUDA thread, 128-256 of them contending for a 2-core
// CI machine's std::barriers spent more time in the kernel than in the kernels. The sm80
// emulation (emulation.hpp) adds the tensor-core atoms; kernels written with the built-ins alone
// (the decode kernels) need only this.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
// The running fiber's built-ins: all fibers share one OS thread, so the scheduler sets them before
// each resume.
inline Dim3 thread_idx, block_idx, grid_dim;

namespace detail {
struct Barrier;
struct Fiber {
  ucontext_t context;
  void* stack = nullptr;
  const Barrier* waiting = nullptr;  // the barrier it waits at, and that barrier's generation then
  unsigned generation = 0;
  bool done = false;
  std::exception_ptr error;  // what escaped its body: rethrown by launch, never across a switch
};
inline ucontext_t scheduler;
inline Fiber* running = nullptr;
inline void (*run_body)(void*) = nullptr;  // the kernel's per-CTA function, type-erased: makecontext
inline void* body = nullptr;               // passes only ints, so fiber_main reads these globals

// A barrier of `count` fibers: arrivals are counted per generation; the last arrival starts the
// next generation and goes on, the others yield to the scheduler, which resumes them only once
// the generation has moved.
struct Barrier {
  int count, arrived = 0;
  unsigned generation = 0;
  void arrive_and_wait() {
    if (++arrived == count) {
      arrived = 0;
      ++generation;
      return;
    }
    running->waiting = this;
    running->generation = generation;
    swapcontext(&running->context, &scheduler);
  }
};
}  // namespace detail

// The CTA being run: its barriers and the per-thread exchange slots of the warp collectives.
struct Cta {
  explicit Cta(int threads)
      : block{threads}, warps(static_cast<size_t>(threads / 32), {32}), slots(static_cast<size_t>(threads)) {}
  detail::Barrier block;
  std::vector<detail::Barrier> warps;
  struct Slot {
    float f = 0;
    uint32_t a[4] = {}, b[2] = {};
    const uint16_t* row = nullptr;
  };
  std::vector<Slot> slots;
};
inline Cta* cta = nullptr;

inline int tid() { return static_cast<int>(thread_idx.x); }
inline void warp_sync() { cta->warps[static_cast<size_t>(tid() / 32)].arrive_and_wait(); }
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
  for (int lane = 0; lane < 32; ++lane)
    result = result || cta->slots[static_cast<size_t>((tid() & ~31) | lane)].f != 0.0f;
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
#define __syncwarp(...) emu::warp_sync()

namespace emu::detail {

inline void fiber_main() {
  Fiber& self = *running;
  try {
    run_body(body);
  } catch (...) {  // unwinding must stop on the fiber's own stack
    self.error = std::current_exception();
  }
  self.done = true;
}  // returns to uc_link: the scheduler

// One launch's fibers, with their stacks: mapped once and reused by every CTA, 1 MiB each above
// a PROT_NONE guard page, so an overflow faults instead of writing over the neighbour's stack.
// Optimized, the deepest (d256) kernels touch ~6 KiB of theirs; the rest is headroom for
// unoptimized builds, and costs only address space (untouched pages are never backed).
class Fibers {
 public:
  static constexpr size_t kStackBytes = size_t{1} << 20;

  explicit Fibers(int threads) : fibers_(static_cast<size_t>(threads)) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    slot_bytes_ = page + kStackBytes;
    map_bytes_ = slot_bytes_ * fibers_.size();
    map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map_ == MAP_FAILED) throw std::runtime_error("emu::launch: mmap of the fiber stacks failed");
    for (size_t i = 0; i < fibers_.size(); ++i) {
      char* guard = static_cast<char*>(map_) + i * slot_bytes_;
      if (mprotect(guard, page, PROT_NONE) != 0) {
        munmap(map_, map_bytes_);
        throw std::runtime_error("emu::launch: mprotect of a fiber's guard page failed");
      }
      fibers_[i].stack = guard + page;
    }
  }
  Fibers(const Fibers&) = delete;
  Fibers& operator=(const Fibers&) = delete;
  ~Fibers() {
    running = nullptr;
    munmap(map_, map_bytes_);
  }

  // Runs one CTA until all its fibers are done: round-robin passes over the fibers, resuming each
  // that is neither done nor held at a barrier, so each pass takes each fiber over (at most) one
  // barrier. The passes alternate direction (ascending thread index, then descending), and so the
  // threads run the stretches between barriers in alternating order: a missing barrier between
  // one thread's write and another's read lets the read run first (and see stale data) whether
  // the reader's index is below or above the writer's, where a fixed order would hide every such
  // race with the writer first. Stretches an even number of barriers apart would still share a
  // direction in every CTA: the first pass's direction alternates from CTA to CTA as well.
  void run_cta(Dim3 block, Dim3 grid, bool ascending_first) {
    for (Fiber& f : fibers_) {
      f.waiting = nullptr;
      f.done = false;
      f.error = nullptr;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_stack.ss_flags = 0;
      f.context.uc_link = &scheduler;
      makecontext(&f.context, fiber_main, 0);
    }
    const int n = static_cast<int>(fibers_.size());
    int live = n;
    for (bool ascending = ascending_first; live > 0; ascending = !ascending) {
      bool resumed = false;
      for (int i = 0; i < n; ++i) {
        const int t = ascending ? i : n - 1 - i;
        Fiber& f = fibers_[static_cast<size_t>(t)];
        if (f.done || (f.waiting != nullptr && f.waiting->generation == f.generation)) continue;
        f.waiting = nullptr;
        thread_idx = {static_cast<unsigned>(t), 0, 0};
        block_idx = block;
        grid_dim = grid;
        running = &f;
        swapcontext(&scheduler, &f.context);
        resumed = true;
        live -= f.done ? 1 : 0;
      }
      // Every live fiber waits at a barrier that can never fill (threads of the CTA exited or
      // threw before reaching it, or wait at another one): on a GPU, a hang or undefined behaviour.
      if (!resumed) fail(block);
    }
    running = nullptr;
    for (Fiber& f : fibers_) {
      if (f.error) std::rethrow_exception(f.error);
    }
  }

 private:
  [[noreturn]] void fail(Dim3 block) {
    int exited = 0, at_block = 0, at_warp = 0;
    for (const Fiber& f : fibers_) {
      if (f.error) std::rethrow_exception(f.error);  // the cause, more likely than not
      exited += f.done ? 1 : 0;
      at_block += f.waiting == &cta->block ? 1 : 0;
      at_warp += !f.done && f.waiting != &cta->block ? 1 : 0;
    }
    using std::to_string;
    throw std::logic_error("emu::launch: CTA (" + to_string(block.x) + ", " + to_string(block.y) + ", " +
                           to_string(block.z) + ") deadlocked: of its " + to_string(fibers_.size()) + " threads " +
                           to_string(exited) + " exited, " + to_string(at_block) + " wait at __syncthreads, " +
                           to_string(at_warp) + " at warp barriers");
  }

  std::vector<Fiber> fibers_;
  void* map_ = nullptr;
  size_t slot_bytes_ = 0, map_bytes_ = 0;
};

}  // namespace emu::detail

namespace emu {

// Runs `cta_body` (a kernel's per-CTA function) for every CTA of `grid`, one CTA at a time, as
// `threads` fibers on the calling thread.
template <class Body>
void launch(Dim3 grid, int threads, Body&& cta_body) {
  using Fn = std::remove_reference_t<Body>;
  detail::run_body = [](void* f) { (*static_cast<Fn*>(f))(); };
  detail::body = const_cast<void*>(static_cast<const void*>(std::addressof(cta_body)));
  detail::Fibers fibers(threads);
  bool ascending_first = true;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        Cta block(threads);
        cta = &block;
        struct Clear {
          ~Clear() { cta = nullptr; }  // `block` ends here, thrown out of or not: leave no pointer to it
        } clear;
        fibers.run_cta({x, y, z}, grid, ascending_first);
        ascending_first = !ascending_first;
      }
    }
  }
}

}  // namespace emu

// Public entry points: validate, then hand the Problem to the backend that owns the data.
#include "flashattn/flashattn.hpp"

#include <cstdint>
#include <new>
#include <string>

#include "cpu/backend.hpp"
#include "kvcache_problem.hpp"
#include "problem.hpp"
#include "tensor_checks.hpp"

#if FLASHATTN_WITH_CUDA
#include "cuda/backend.hpp"
#endif

#ifndef FLASHATTN_VERSION
#define FLASHATTN_VERSION "0.0.0"
#endif

namespace flashattn {
namespace {

using detail::Direction;
using detail::Problem;

// Device tensors that no compiled CUDA kernel can run: a clear error instead of a wrong-device
// access.
[[noreturn]] void no_backend(const Problem& p, const std::string& why) {
  detail::fail(ErrorCode::kUnsupported, why.empty() ? "q: tensors on " + detail::device_str(p.device) +
                                                          " need the CUDA backend, which this build does not provide"
                                                    : why);
}

// True when the CUDA backend runs this problem; otherwise *why says what it lacks.
bool cuda_runs(const Problem& p, Direction dir, std::string* why) {
#if FLASHATTN_WITH_CUDA
  return dir == Direction::kForward ? cuda::supports_forward(p, why) : cuda::supports_backward(p, why);
#else
  (void)p;
  (void)dir;
  (void)why;
#endif
  return false;
}

void check_workspace(const RunContext& ctx, size_t needed) {
  if (needed > 0 && (ctx.workspace == nullptr || ctx.workspace_bytes < needed)) {
    detail::fail(ErrorCode::kInvalidArgument, "workspace: " + std::to_string(ctx.workspace_bytes) + " bytes given, " +
                                                  std::to_string(needed) + " needed (see *_workspace_size)");
  }
  // (The kernels read and write it in 16-byte vectors; cudaMalloc and framework allocators
  // align far more.)
  if (needed > 0 && reinterpret_cast<uintptr_t>(ctx.workspace) % kWorkspaceAlignment != 0) {
    detail::fail(ErrorCode::kInvalidArgument,
                 "workspace: must be " + std::to_string(kWorkspaceAlignment) + "-byte aligned");
  }
}

// Scratch memory a validated problem needs from the caller. The CPU backend keeps its O(tile)
// per-thread tiles itself and needs none; the CUDA backward needs O(seqlen) fp32 rows (dQ sums,
// row statistics); the CUDA forward a tile counter, which it can do without; a varlen call that
// checks its lengths on the device, O(batch) words for their checked copies.
size_t workspace_bytes(const Problem& p, Direction dir) {
  if (p.device.type == DeviceType::kCPU) return 0;
  std::string why;
  if (!cuda_runs(p, dir, &why)) no_backend(p, why);
#if FLASHATTN_WITH_CUDA
  return dir == Direction::kBackward ? cuda::backward_workspace_size(p) : cuda::forward_workspace_size(p);
#else
  return 0;
#endif
}

void run(const Problem& p, Direction dir, const RunContext& ctx) {
  // The forward's workspace is optional (none given: none used) unless the lengths are checked on
  // the device or the sink-token pass needs an LSE the caller does not want; one given is checked.
  bool optional = dir == Direction::kForward && ctx.workspace == nullptr && ctx.workspace_bytes == 0;
#if FLASHATTN_WITH_CUDA
  if (p.device.type != DeviceType::kCPU) optional = optional && !cuda::forward_workspace_required(p);
#endif
  const size_t needed = workspace_bytes(p, dir);
  if (!optional) check_workspace(ctx, needed);
  if (p.device.type != DeviceType::kCPU) {
#if FLASHATTN_WITH_CUDA
    // workspace_bytes() checked that CUDA runs it
    if (dir == Direction::kForward) {
      cuda::flash_forward(p, ctx.stream, ctx.workspace);  // null when the caller gave none
    } else {
      cuda::flash_backward(p, ctx.stream, ctx.workspace);
    }
#endif
    return;
  }
  if (dir == Direction::kForward) {
    cpu::flash_forward(p);
  } else {
    cpu::flash_backward(p);
  }
  cpu::fill_unused_rows(p, dir);
}

// The reference materialises [seqlen_q, seqlen_k] per (batch, head): an allocation that fails
// is the documented Error, not a std::bad_alloc escaping the API.
template <class Body>
void reporting_exhaustion(Body&& body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    detail::fail(ErrorCode::kOutOfMemory,
                 "reference: host memory exhausted (it holds S and P, seqlen_q x seqlen_k doubles per head)");
  }
}

void run_reference(const Problem& p, Direction dir) {
  if (p.device.type != DeviceType::kCPU) {
    detail::fail(ErrorCode::kInvalidArgument,
                 "q: the reference runs on CPU tensors only, got " + detail::device_str(p.device));
  }
  if (dir == Direction::kForward) {
    cpu::reference_forward(p);
  } else {
    cpu::reference_backward(p);
  }
  cpu::fill_unused_rows(p, dir);
}

// KV cache: the CPU needs no workspace; the CUDA decode kernels their split-KV partials.
size_t kvcache_workspace_bytes(const detail::KvCacheProblem& kp) {
  if (kp.attn.device.type == DeviceType::kCPU) return 0;
#if FLASHATTN_WITH_CUDA
  std::string why;
  if (!cuda::supports_kvcache(kp, &why)) no_backend(kp.attn, why);
  return cuda::kvcache_workspace_size(kp);
#else
  no_backend(kp.attn, "");
#endif
}

void run_kvcache(const detail::KvCacheProblem& kp, const RunContext& ctx, bool reference) {
  if (reference && kp.attn.device.type != DeviceType::kCPU) {
    detail::fail(ErrorCode::kInvalidArgument,
                 "q: the reference runs on CPU tensors only, got " + detail::device_str(kp.attn.device));
  }
  check_workspace(ctx, kvcache_workspace_bytes(kp));
  if (kp.attn.device.type == DeviceType::kCPU) {
    cpu::forward_kvcache(kp, reference);
    return;
  }
#if FLASHATTN_WITH_CUDA
  cuda::forward_kvcache(kp, ctx.stream, ctx.workspace);  // kvcache_workspace_bytes checked it runs
#endif
}

}  // namespace

void forward(const ForwardArgs& a, const AttentionOptions& o, const RunContext& ctx) {
  run(detail::validate_forward(a, nullptr, o), Direction::kForward, ctx);
}
void backward(const BackwardArgs& a, const AttentionOptions& o, const RunContext& ctx) {
  run(detail::validate_backward(a, nullptr, o), Direction::kBackward, ctx);
}
void forward_varlen(const ForwardArgs& a, const VarlenArgs& v, const AttentionOptions& o, const RunContext& ctx) {
  run(detail::validate_forward(a, &v, o, ctx.stream), Direction::kForward, ctx);
}
void backward_varlen(const BackwardArgs& a, const VarlenArgs& v, const AttentionOptions& o, const RunContext& ctx) {
  run(detail::validate_backward(a, &v, o, ctx.stream), Direction::kBackward, ctx);
}

void forward_kvcache(const KvCacheArgs& a, const AttentionOptions& o, const RunContext& ctx) {
  run_kvcache(detail::validate_kvcache(a, o, ctx.stream), ctx, false);
}

size_t forward_workspace_size(const ForwardArgs& a, const AttentionOptions& o) {
  return workspace_bytes(detail::validate_forward(a, nullptr, o), Direction::kForward);
}
size_t backward_workspace_size(const BackwardArgs& a, const AttentionOptions& o) {
  return workspace_bytes(detail::validate_backward(a, nullptr, o), Direction::kBackward);
}
size_t forward_varlen_workspace_size(const ForwardArgs& a, const VarlenArgs& v, const AttentionOptions& o) {
  return workspace_bytes(detail::validate_forward(a, &v, o, nullptr, detail::LengthValues::kUnread),
                         Direction::kForward);
}
size_t backward_varlen_workspace_size(const BackwardArgs& a, const VarlenArgs& v, const AttentionOptions& o) {
  return workspace_bytes(detail::validate_backward(a, &v, o, nullptr, detail::LengthValues::kUnread),
                         Direction::kBackward);
}

size_t forward_kvcache_workspace_size(const KvCacheArgs& a, const AttentionOptions& o) {
  return kvcache_workspace_bytes(detail::validate_kvcache(a, o, nullptr, detail::LengthValues::kUnread));
}

void reference_forward(const ForwardArgs& a, const AttentionOptions& o) {
  reporting_exhaustion([&] { run_reference(detail::validate_forward(a, nullptr, o), Direction::kForward); });
}
void reference_backward(const BackwardArgs& a, const AttentionOptions& o) {
  reporting_exhaustion([&] { run_reference(detail::validate_backward(a, nullptr, o), Direction::kBackward); });
}
void reference_forward_varlen(const ForwardArgs& a, const VarlenArgs& v, const AttentionOptions& o) {
  reporting_exhaustion([&] { run_reference(detail::validate_forward(a, &v, o), Direction::kForward); });
}
void reference_backward_varlen(const BackwardArgs& a, const VarlenArgs& v, const AttentionOptions& o) {
  reporting_exhaustion([&] { run_reference(detail::validate_backward(a, &v, o), Direction::kBackward); });
}

void reference_forward_kvcache(const KvCacheArgs& a, const AttentionOptions& o) {
  reporting_exhaustion([&] { run_kvcache(detail::validate_kvcache(a, o), {}, true); });
}

const char* version() { return FLASHATTN_VERSION; }

}  // namespace flashattn

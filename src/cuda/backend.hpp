// Entry points of the CUDA backend. Problems arrive validated (src/validate.cpp); what the
// compiled kernels cannot run is reported by supports_forward() so the API can raise a clear
// kUnsupported error instead of launching anything.
#pragma once

#include <string>
#include <vector>

#include "../kvcache_problem.hpp"
#include "../problem.hpp"

namespace flashattn::cuda {

// True when a compiled kernel runs `p` on its device (a visible device of compute capability
// >= 8.0; dtype, head-dim bucket, layout alignment, features); otherwise false with the reason,
// naming the argument, in *why.
bool supports_forward(const detail::Problem& p, std::string* why);

// Bytes of device workspace flash_forward uses for `p`: kForwardWorkspaceBytes (the Hopper
// kernels' tile counter, for the balanced grid of masked calls), more when a varlen call checks
// its lengths on the device (their checked copies) or when sink tokens are joined to a call that
// wants no LSE (the window's LSE, which the sink-token pass reads).
size_t forward_workspace_size(const detail::Problem& p);

// Whether flash_forward needs its workspace (forward_workspace_required) or can do without.
bool forward_workspace_required(const detail::Problem& p);

// Runs the forward pass on the device that holds the tensors, on `stream` (a cudaStream_t; null
// is the legacy default stream), with the caller's `workspace` of forward_workspace_size(p)
// bytes, or null where forward_workspace_required(p) is false (no tile counter then).
// Asynchronous: returns once the kernel is queued. Requires supports_forward(p); CUDA errors
// throw Error(kBackendError) with cudaGetErrorString's text.
void flash_forward(const detail::Problem& p, void* stream, void* workspace);

// The same for the backward pass (kernels, and the device's shared memory for them).
bool supports_backward(const detail::Problem& p, std::string* why);

// Bytes of device workspace flash_backward needs for `p` (its fp32 dQ sums, row statistics and
// turn counters); requires supports_backward(p).
size_t backward_workspace_size(const detail::Problem& p);

// Runs the backward pass on `stream` with the caller's `workspace` of at least
// backward_workspace_size(p) bytes (any contents; it must stay allocated until the stream has
// run the call). Asynchronous; requires supports_backward(p).
void flash_backward(const detail::Problem& p, void* stream, void* workspace);

// KV-cache attention (forward_kvcache) on the decode kernels: whether they run `kp` (else the
// reason), the bytes of workspace its split-KV partials need (from shapes alone), and the call:
// append, decode, combine, enqueued on `stream`. Requires supports_kvcache(kp).
bool supports_kvcache(const detail::KvCacheProblem& kp, std::string* why);
size_t kvcache_workspace_size(const detail::KvCacheProblem& kp);
void forward_kvcache(const detail::KvCacheProblem& kp, void* stream, void* workspace);

// Host copies of device memory on device `device`, ordered on `stream`, one wait for them all.
void copy_to_host(const std::vector<detail::HostCopy>& copies, int device, void* stream);

// Names of the kernels this build contains, e.g. "sm80_fwd_bf16_d128_masked".
std::vector<std::string> compiled_kernels();

}  // namespace flashattn::cuda

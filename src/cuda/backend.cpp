// CUDA dispatch of the attention calls: Problem -> ForwardParams / BackwardParams, choice of the
// compiled kernel by KernelKey, their checks and CUDA error reporting (the KV-cache calls:
// kvcache_backend.cpp; the checks both share: device_checks.hpp). Plain C++: the kernels are
// reached through the registry.
#include "backend.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <string>

#include "../core/variant.hpp"
#include "../tensor_checks.hpp"
#include "../validate_common.hpp"
#include "code_arch.hpp"
#include "device_checks.hpp"
#include "runtime.hpp"
#include "index_faults_host.hpp"
#include "kernel_registry.hpp"
#include "params.hpp"
#include "problem_params.hpp"
#include "sm80/backward_launch.hpp"
#include "sm80/forward_launch.hpp"
#include "sink_tokens.hpp"
#include "tile_order.hpp"
#include "varlen_checks.hpp"

namespace flashattn::cuda {
namespace {

using detail::Problem;

// The smallest bucket >= head_dim, or 0.
int head_dim_bucket(int64_t head_dim) {
  for (int b : sm80::kHeadDimBuckets) {
    if (head_dim <= b) return b;
  }
  return 0;
}

// FLASHATTN_DISABLE_SM90=1: the forward and the backward run the sm80 kernels on Hopper too (A/B benchmarks,
// bisecting). Read on every call, unlike FLASHATTN_LOG_KERNELS, so one process can compare both.
bool sm90_allowed() {
  const char* v = std::getenv("FLASHATTN_DISABLE_SM90");
  return v == nullptr || *v == '\0' || std::string(v) == "0";
}

// Masked calls' tile order (tile_order.hpp): groups of pairs whose K / V fit half the device's L2,
// the last one at least kTileTailWaves waves of CTAs. FLASHATTN_TILE_ORDER=<group>,<waves> (read
// on every call, for A/B runs and tests) sets both; "1,0" deals each pair's tiles in turn.
constexpr int kTileTailWaves = 2;
void set_tile_order(const Problem& p, ForwardParams* params) {
  const int64_t pairs = std::max<int64_t>(p.heads_q * p.batch, 1);
  const char* v = std::getenv("FLASHATTN_TILE_ORDER");
  int group = 0, waves = 0;
  char end = 0;
  if (v != nullptr && std::sscanf(v, "%d,%d%c", &group, &waves, &end) == 2 && group >= 1 && waves >= 0) {
    params->tile_group = static_cast<int>(std::min<int64_t>(group, pairs));  // the kernels' int products
    params->tile_tail_waves = waves;
    return;
  }
  int l2_bytes = 0;
  if (cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, p.device.index) != cudaSuccess) {
    cudaGetLastError();
    l2_bytes = 0;  // groups of 1
  }
  params->tile_group = forward_tile_group(l2_bytes, p.max_seqlen_k, p.head_dim, p.group_size(), pairs);
  params->tile_tail_waves = kTileTailWaves;
}

MaskKind mask_kind(const Problem& p) {
  if (p.dropout.enabled()) return MaskKind::kMaskedDropout;
  const bool masked = p.mask.window_left >= 0 || p.mask.window_right >= 0 || p.block_mask.present();
  return masked ? MaskKind::kMasked : MaskKind::kNone;
}

KernelKey kernel_key(const Problem& p, ElemType elem, detail::Direction dir) {
  KernelKey key{kMinComputeCapability, elem, head_dim_bucket(p.head_dim), dir, mask_kind(p)};
  key.paged = p.k.cache.paged();
  key.block_sparse = p.block_mask.present();
  return key;
}

// A block-sparse mask on CUDA tensors: the sm80 kernels read its lists in place, the forward
// query tile by query tile, the backward through their transpose (core::BlockCells, built in the
// workspace); their blocks must hold whole kernel tiles. With the window, softcap, ALiBi, GQA, a
// learnable sink and deterministic mode; not yet dropout or sink tokens. Why not, or empty.
std::string block_mask_refusal(const Problem& p, detail::Direction dir) {
  if (!p.block_mask.present()) return {};
  if (p.dropout.enabled()) return "block_mask: not with dropout on CUDA tensors yet (the CPU backend takes both)";
  if (p.mask.sink_tokens > 0 && p.mask.window_left >= 0) {
    return "block_mask: not with sink_tokens on CUDA tensors yet (the CPU backend takes both)";
  }
  const int bucket = head_dim_bucket(p.head_dim);
  int64_t tile_m = sm80::block_sparse_tile_shape(bucket).block_m,
          tile_n = sm80::block_sparse_tile_shape(bucket).block_n;
  if (dir == detail::Direction::kBackward) {
    const sm80::BackwardTileShape t = sm80::backward_tile_shape(bucket, MaskKind::kMasked);
    tile_m = t.block_m;
    tile_n = t.block_n;
    // The transpose's grid (query blocks, heads_q, batch) and its cells' codes (1 + a bits block).
    if (p.heads_q >= (int64_t{1} << 16) || p.batch >= (int64_t{1} << 16) ||
        p.block_mask.bits_blocks >= std::numeric_limits<int32_t>::max()) {
      return "block_mask: the CUDA backward takes batch and heads_q < 65536 and fewer than 2^31 - 1 blocks of bits";
    }
  }
  if (p.block_mask.block_m % tile_m != 0 || p.block_mask.block_n % tile_n != 0) {
    return "block_mask: block size (" + std::to_string(p.block_mask.block_m) + ", " +
           std::to_string(p.block_mask.block_n) + ") must be a multiple of the CUDA " +
           (dir == detail::Direction::kBackward ? "backward" : "forward") + " kernel's tile (" +
           std::to_string(tile_m) + ", " + std::to_string(tile_n) + ") for head_dim " + std::to_string(p.head_dim) +
           " (128 x 128 suits every head dim)";
  }
  return {};
}

// The device's opt-in shared memory per block, or -1 when it cannot be queried.
int smem_optin_bytes(int device) {
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return bytes;
}

// Whether a compiled kernel of direction `dir` runs `p` on its device (supports_forward /
// supports_backward).
bool supports(const Problem& p, detail::Direction dir, std::string* why) {
  std::string reason;
  std::string* out = why ? why : &reason;
  auto no = [&](std::string r) {
    *out = std::move(r);
    return false;
  };
  if (float8_refused(p, out)) return false;
  // Caches with per-sequence lengths, leftpad or batch indices go to the decode kernels
  // (supports_kvcache) or the CPU; of the caches, these kernels read pages (the varlen forward's
  // block_table) alone, through their kPaged variants.
  const bool paged = p.k.cache.paged();
  if (p.kv_cache || p.k.cache.batch_idx || p.k.cache.leftpad) {
    return no("k: KV-cache calls run on the decode kernels or the CPU, not the attention kernels");
  }
  // The kernels hold one head_dim for q, k and v (tile shapes, shared-memory layouts, the
  // registry's buckets). Checked before the device: the same reason with a GPU or without.
  if (p.head_dim_v != p.head_dim) {
    return no("v: head_dim " + std::to_string(p.head_dim_v) + " differs from q/k's " + std::to_string(p.head_dim) +
              ": the CUDA kernels need equal head dims; the CPU backend takes it");
  }
  if (p.head_dim > detail::kMaxCudaHeadDim) {
    return no("q: head_dim " + std::to_string(p.head_dim) + " exceeds the CUDA kernels' " +
              std::to_string(detail::kMaxCudaHeadDim) + "; the CPU backend takes up to " +
              std::to_string(detail::kMaxHeadDim));
  }
  // The block mask's limits, before the device too.
  if (std::string r = block_mask_refusal(p, dir); !r.empty()) return no(std::move(r));
  if (!device_runs_kernels(p, out)) return false;
  if (paged && p.dropout.enabled()) {
    return no("block_table: paged K/V with dropout runs on CPU tensors only in this version");
  }
  if (paged && p.k.cache.page_size > std::numeric_limits<int32_t>::max()) {  // the kernels' 32-bit key arithmetic
    return no("k: page size " + std::to_string(p.k.cache.page_size) +
              " (dim 1) exceeds the CUDA kernels' limit of 2^31 - 1");
  }
  const int code = code_arch(p.device.index);
  ElemType elem;
  if (!cuda_dtype(p.dtype, &elem)) {
    return no("q: dtype " + std::string(dtype_name(p.dtype)) +
              " is not supported by the CUDA kernels (float16, bfloat16)");
  }
  if (p.head_dim % 8 != 0) {
    return no("q: head_dim " + std::to_string(p.head_dim) +
              " must be a multiple of 8 for the CUDA kernels (16-byte rows)");
  }
  const bool backward = dir == detail::Direction::kBackward;
  const KernelKey key = kernel_key(p, elem, dir);
  const bool compiled = key.head_dim != 0 && (backward ? find_backward_kernel(key, code) != nullptr
                                                       : find_forward_kernel(key, code) != nullptr);
  if (!compiled) {
    return no("q: head_dim " + std::to_string(p.head_dim) + " needs kernel " + kernel_name(key) +
              ", which this build does not compile (see FLASHATTN_CUDA_HEAD_DIMS)");
  }
  if (backward) {
    const int needed = find_backward_kernel(key, code)->smem_bytes, offered = smem_optin_bytes(p.device.index);
    if (offered < needed) {
      return no("q: the backward kernel for head_dim " + std::to_string(p.head_dim) + " needs " +
                std::to_string(needed / 1024) + " KB of shared memory per block; " + detail::device_str(p.device) +
                " offers " + std::to_string(offered / 1024) + " KB (A100 / H100-class GPUs run it)");
    }
  }
  const int64_t elem_bytes = static_cast<int64_t>(dtype_size(p.dtype));
  // Varlen tensors are one batch of total_* rows (batch stride 0).
  const int64_t batches = p.varlen() ? 1 : p.batch;
  const int64_t rows_q = p.varlen() ? p.total_q : p.seqlen_q, rows_k = p.varlen() ? p.total_k : p.seqlen_k;
  // Paged K / V: total_k blocks of page_size rows.
  const int64_t batches_k = paged ? p.total_k : batches, rows_per_batch_k = paged ? p.k.cache.page_size : rows_k;
  if (!check_rows("q", p.q, batches, rows_q, p.heads_q, elem_bytes, out) ||
      !check_rows("k", p.k, batches_k, rows_per_batch_k, p.heads_kv, elem_bytes, out) ||
      !check_rows("v", p.v, batches_k, rows_per_batch_k, p.heads_kv, elem_bytes, out) ||
      !check_rows("out", p.out, batches, rows_q, p.heads_q, elem_bytes, out)) {
    return false;
  }
  if (backward && (!check_rows("dout", p.dout, batches, rows_q, p.heads_q, elem_bytes, out) ||
                   !check_rows("dq", p.dq, batches, rows_q, p.heads_q, elem_bytes, out) ||
                   !check_rows("dk", p.dk, batches, rows_k, p.heads_kv, elem_bytes, out) ||
                   !check_rows("dv", p.dv, batches, rows_k, p.heads_kv, elem_bytes, out))) {
    return false;
  }
  if (p.heads_q > kMaxGridYZ) {
    return no("q: " + std::to_string(p.heads_q) + " heads exceed the CUDA grid limit " + std::to_string(kMaxGridYZ));
  }
  if (p.batch > kMaxGridYZ) {
    return no("q: batch " + std::to_string(p.batch) + " exceeds the CUDA grid limit " + std::to_string(kMaxGridYZ));
  }
  if (p.max_seqlen_k > std::numeric_limits<int32_t>::max()) {  // 32-bit key-tile indices
    return no("k: seqlen " + std::to_string(p.max_seqlen_k) + " exceeds the CUDA kernels' limit of 2^31 - 1 keys");
  }
  if ((p.max_seqlen_q + sm80::kMinBlockM - 1) / sm80::kMinBlockM > std::numeric_limits<int32_t>::max()) {
    return no("q: seqlen " + std::to_string(p.max_seqlen_q) + " exceeds the CUDA grid limit");
  }
  return true;
}

}  // namespace

bool supports_forward(const Problem& p, std::string* why) { return supports(p, detail::Direction::kForward, why); }
bool supports_backward(const Problem& p, std::string* why) { return supports(p, detail::Direction::kBackward, why); }

namespace {
// Pinned host memory that validation's copies land in, one buffer a thread, grown as needed:
// copies into pageable memory would each wait for the stream, into pinned memory they queue
// and a call's copies share one wait.
class PinnedStaging {
 public:
  ~PinnedStaging() {
    if (data_ != nullptr) cudaFreeHost(data_);  // (at exit the runtime may be gone: ignored)
  }
  char* reserve(size_t bytes) {
    if (bytes > bytes_) {
      if (data_ != nullptr) cudaFreeHost(data_);
      data_ = nullptr;
      bytes_ = 0;
      void* p = nullptr;
      cuda_check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc (index copies)");
      data_ = static_cast<char*>(p);
      bytes_ = bytes;
    }
    return data_;
  }

 private:
  char* data_ = nullptr;
  size_t bytes_ = 0;
};
}  // namespace

void copy_to_host(const std::vector<detail::HostCopy>& copies, int device, void* stream) {
  if (device >= cuda_device_count()) {
    detail::fail(ErrorCode::kUnsupported, "cu_seqlens_q: tensors on cuda:" + std::to_string(device) +
                                              " need a CUDA device; this process sees " +
                                              std::to_string(cuda_device_count()));
  }
  auto slot = [](size_t bytes) { return (bytes + 15) / 16 * 16; };  // each copy 16-byte aligned
  size_t total = 0;
  for (const detail::HostCopy& c : copies) total += slot(c.bytes);
  if (total == 0) return;
  thread_local PinnedStaging staging;
  char* const pinned = staging.reserve(total);
  const DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  size_t at = 0;
  try {
    for (const detail::HostCopy& c : copies) {
      cuda_check(cudaMemcpyAsync(pinned + at, c.src, c.bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync (index arrays)");
      at += slot(c.bytes);
    }
  } catch (...) {
    cudaStreamSynchronize(s);  // no copy may still land in the staging buffer the next call reuses
    throw;
  }
  cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (index arrays)");
  at = 0;
  for (const detail::HostCopy& c : copies) {
    std::memcpy(c.dst, pinned + at, c.bytes);
    at += slot(c.bytes);
  }
}

namespace {

// The forward's workspace: the tile counter, then (lengths checked on the device) their scratch.
constexpr size_t kVarlenScratchOffset = 256;
static_assert(kForwardWorkspaceBytes <= kVarlenScratchOffset);

// Lengths checked on the device: raises what an earlier call's kernels recorded (before this call
// writes anything), then queues the check, which writes the copies of the lengths the kernels
// read instead of the caller's (zeros when a rule broke) into `scratch`. Returns the scratch.
varlen::CheckScratch check_lengths_on_device(const Problem& p, FaultingCall call, void* scratch, cudaStream_t s) {
  raise_index_fault(p.device.index, s);
  varlen::VarlenCheckParams c;
  c.cu_seqlens_q = p.cu_seqlens_q;
  c.cu_seqlens_k = p.cu_seqlens_k;
  c.seqused_k = p.seqused_k;
  c.batch = p.batch;
  c.total_q = p.total_q;
  c.total_k = p.total_k;
  c.max_seqlen_q = p.max_seqlen_q;
  c.max_seqlen_k = p.max_seqlen_k;
  if (p.k.cache.paged()) {  // keys through the table: any length its pages hold
    c.block_table = p.k.cache.block_table;
    c.block_table_stride = p.k.cache.block_table_stride;
    c.table_columns = p.table_columns;
    c.page_size = p.k.cache.page_size;
    c.num_blocks = p.total_k;
    c.total_k = std::numeric_limits<int64_t>::max();
  }
  c.scratch = varlen::check_scratch(scratch, p.batch);
  c.sink = index_fault_sink(p.device.index);
  c.call = static_cast<int32_t>(call);
  const cudaError_t err = varlen::launch_check(c, s);
  if (err != cudaSuccess) cuda_fail(err, "CUDA kernel check_varlen failed to launch");
  return c.scratch;
}

// True when some varlen rows belong to no sequence: [0, cu[0]) or [cu[batch], total) is not
// empty (host copies of cu_seqlens).
bool rows_outside(const std::vector<int32_t>& cu, int64_t total) { return cu.front() > 0 || cu.back() < total; }

// Those rows get what every backend writes there (out 0 and LSE -inf; gradients 0), or NaN
// everywhere when the device check (`verdict`, null when checked on the host) failed.
void fill_outside_sequences(const Problem& p, varlen::FillParams f, const int32_t* verdict, cudaStream_t s) {
  f.verdict = verdict;
  f.bf16 = p.dtype == DType::kBFloat16;
  f.head_dim = p.head_dim;
  const cudaError_t err = varlen::launch_fill(f, s);
  if (err != cudaSuccess) cuda_fail(err, "CUDA kernel fill_outside_sequences failed to launch");
}

// The tile counter and the lengths' scratch.
size_t forward_own_workspace(const Problem& p) {
  return p.device_checks_lengths ? kVarlenScratchOffset + varlen::check_scratch_bytes(p.batch) : kForwardWorkspaceBytes;
}

// The LSE the kernels write for the sink-token pass when the caller wants none: fp32 [heads_q,
// rows] (rows: batch * seqlen_q, or the varlen total) after the forward's own workspace.
LseOut sink_token_lse(const Problem& p, void* workspace) {
  auto* data = reinterpret_cast<float*>(static_cast<char*>(workspace) + align_up(forward_own_workspace(p), 256));
  if (p.varlen()) return {data, 0, 1, p.total_q};
  return {data, p.heads_q * p.max_seqlen_q, 1, p.max_seqlen_q};
}

}  // namespace

bool forward_workspace_required(const Problem& p) {
  return p.device_checks_lengths || (sink_tokens_joined(p) && p.lse.data == nullptr);
}

// With sink tokens and no LSE wanted, the pass's LSE scratch follows (sink_token_lse).
size_t forward_workspace_size(const Problem& p) {
  const size_t own = forward_own_workspace(p);
  if (!sink_tokens_joined(p) || p.lse.data != nullptr) return own;
  const int64_t rows = p.varlen() ? p.total_q : p.batch * p.max_seqlen_q;
  return align_up(own, 256) + static_cast<size_t>(p.heads_q * rows) * sizeof(float);
}

void flash_forward(const Problem& p, void* stream, void* workspace) {
  ElemType elem;
  if (!cuda_dtype(p.dtype, &elem)) detail::fail(ErrorCode::kInternal, "flash_forward: unsupported dtype");
  ForwardParams params = forward_params(p);
  params.tile_counter = static_cast<int*>(workspace);
  set_tile_order(p, &params);
  const ForwardKernel* kernel =
      select_forward_kernel(kernel_key(p, elem, detail::Direction::kForward), code_arch(p.device.index),
                            compute_capability(p.device.index), params, sm90_allowed());
  if (kernel == nullptr) detail::fail(ErrorCode::kInternal, "flash_forward: no kernel (supports_forward not checked)");
  const DeviceGuard guard(p.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.block_mask_checked_on_device) {  // an earlier call's recorded fault raises before this call writes
    raise_index_fault(p.device.index, s);
    params.block_mask_fault = index_fault_sink(p.device.index);
  }
  if (p.varlen()) {
    const int32_t* verdict = nullptr;
    if (p.device_checks_lengths) {
      const varlen::CheckScratch checked = check_lengths_on_device(
          p, FaultingCall::kVarlenForward, static_cast<char*>(workspace) + kVarlenScratchOffset, s);
      params.cu_seqlens_q = checked.cu_seqlens_q;
      params.cu_seqlens_k = checked.cu_seqlens_k;
      if (params.seqused_k != nullptr) params.seqused_k = checked.seqused_k;
      verdict = checked.verdict;
    }
    varlen::FillParams fill;
    fill.targets[0] = {params.out, params.lse, params.cu_seqlens_q, p.batch, p.total_q, p.heads_q};
    fill.count = 1;
    if (verdict != nullptr || rows_outside(p.host_cu_seqlens_q, p.total_q)) fill_outside_sequences(p, fill, verdict, s);
  }
  if (p.batch == 0 || p.max_seqlen_q == 0) return;  // no row of any sequence

  if (log_kernels()) {
    std::fprintf(stderr, "flashattn: %s on cuda:%d (batch %lld, heads %lld, seqlen_q %lld, seqlen_k %lld)\n",
                 kernel_name(kernel->key).c_str(), p.device.index, static_cast<long long>(p.batch),
                 static_cast<long long>(p.heads_q), static_cast<long long>(p.max_seqlen_q),
                 static_cast<long long>(p.max_seqlen_k));
  }
  // With sink tokens the kernels run the window and write its LSE where the pass reads it.
  const bool sink_tokens = sink_tokens_joined(p);
  if (sink_tokens && params.lse.data == nullptr) params.lse = sink_token_lse(p, workspace);
  const cudaError_t err = kernel->launch(params, s);
  if (err != cudaSuccess) cuda_fail(err, "CUDA kernel " + kernel_name(kernel->key) + " failed to launch");
  if (sink_tokens) {
    const cudaError_t joined = run_forward_sink_tokens(params, elem, s);
    if (joined != cudaSuccess) cuda_fail(joined, "CUDA kernel forward_sink_tokens failed to launch");
  }
}

namespace {

// Where the backward pass's scratch regions lie in the caller's workspace (params.hpp's
// BackwardScratch): dQ sums, D, LSE2, turn counters, each on a 256-byte boundary.
struct ScratchLayout {
  int64_t rows = 0;
  // byte offsets; end = size
  size_t dq_accum = 0, delta = 0, lse2 = 0, semaphore = 0, sink_tokens = 0, block_cells = 0, end = 0;
  SinkTokenLayout sink_token;  // the sink-token pass's partials (none without sink tokens)
};

// A block mask's transpose for the backward (none without a block mask) at `data`.
core::BlockCells block_cells_of(const Problem& p, int32_t* data) {
  if (!p.block_mask.present()) return {};
  return {data, p.heads_q, p.block_mask.key_blocks, p.block_mask.query_blocks};
}

ScratchLayout scratch_layout(const Problem& p) {
  constexpr size_t kAlign = 256;
  auto align = [](size_t x) { return (x + kAlign - 1) / kAlign * kAlign; };
  ScratchLayout s;
  const int64_t pad = kBackwardRowPad;
  s.rows =
      p.varlen() ? (p.total_q + p.batch * pad + pad - 1) / pad * pad : p.batch * ((p.seqlen_q + pad - 1) / pad * pad);
  const auto heads_rows = static_cast<size_t>(p.heads_q * s.rows);
  s.delta = align(heads_rows * static_cast<size_t>(head_dim_bucket(p.head_dim)) * sizeof(float));
  s.lse2 = s.delta + align(heads_rows * sizeof(float));
  s.semaphore = s.lse2 + align(heads_rows * sizeof(float));
  s.sink_tokens = s.semaphore + align(heads_rows / kBackwardMinBlockM * sizeof(int));
  if (sink_tokens_joined(p)) {
    s.sink_token = sink_token_layout({p.batch, p.heads_q, p.heads_kv, p.head_dim, p.max_seqlen_q, p.max_seqlen_k},
                                     p.mask.sink_tokens);
  }
  s.block_cells = s.sink_tokens + align(s.sink_token.bytes);
  s.end = s.block_cells + align(block_cells_of(p, nullptr).size(p.batch) * sizeof(int32_t));
  return s;
}

BackwardParams backward_params(const Problem& p, void* workspace) {
  auto rows_out = [](const detail::Operand& op) {
    return RowsOut{op.data, op.layout.batch_stride, op.layout.row_stride, op.layout.head_stride};
  };
  BackwardParams bp;
  bp.fwd = forward_params(p);
  bp.dout = {p.dout.data, p.dout.layout.batch_stride, p.dout.layout.row_stride, p.dout.layout.head_stride};
  bp.dq = rows_out(p.dq);
  bp.dk = rows_out(p.dk);
  bp.dv = rows_out(p.dv);
  const ScratchLayout layout = scratch_layout(p);
  auto* base = static_cast<char*>(workspace);
  bp.scratch.dq_accum = reinterpret_cast<float*>(base + layout.dq_accum);
  bp.scratch.delta = reinterpret_cast<float*>(base + layout.delta);
  bp.scratch.lse2 = reinterpret_cast<float*>(base + layout.lse2);
  bp.scratch.dq_semaphore = reinterpret_cast<int*>(base + layout.semaphore);
  bp.scratch.rows = layout.rows;
  bp.scratch.head_dim_bucket = head_dim_bucket(p.head_dim);
  bp.softmax_scale = static_cast<float>(p.score.scale);
  bp.deterministic = p.deterministic;
  bp.dsink = p.dsink;
  bp.dsink_stride = p.dsink_stride;
  bp.block_cells = block_cells_of(p, reinterpret_cast<int32_t*>(base + layout.block_cells));
  return bp;
}

}  // namespace

// The lengths' scratch (checked on the device) follows the backward's own.
size_t backward_workspace_size(const Problem& p) {
  return scratch_layout(p).end + (p.device_checks_lengths ? varlen::check_scratch_bytes(p.batch) : 0);
}

void flash_backward(const Problem& p, void* stream, void* workspace) {
  ElemType elem;
  if (!cuda_dtype(p.dtype, &elem)) detail::fail(ErrorCode::kInternal, "flash_backward: unsupported dtype");
  BackwardParams params = backward_params(p, workspace);
  const BackwardKernel* kernel =
      select_backward_kernel(kernel_key(p, elem, detail::Direction::kBackward), code_arch(p.device.index),
                             compute_capability(p.device.index), params, sm90_allowed());
  if (kernel == nullptr)
    detail::fail(ErrorCode::kInternal, "flash_backward: no kernel (supports_backward not checked)");
  const DeviceGuard guard(p.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.varlen()) {
    const int32_t* verdict = nullptr;
    if (p.device_checks_lengths) {
      const varlen::CheckScratch checked = check_lengths_on_device(
          p, FaultingCall::kVarlenBackward, static_cast<char*>(workspace) + scratch_layout(p).end, s);
      params.fwd.cu_seqlens_q = checked.cu_seqlens_q;
      params.fwd.cu_seqlens_k = checked.cu_seqlens_k;
      if (params.fwd.seqused_k != nullptr) params.fwd.seqused_k = checked.seqused_k;
      verdict = checked.verdict;
      params.length_verdict = verdict;
    }
    varlen::FillParams fill;  // gradient rows outside every sequence are 0
    fill.targets[0] = {params.dq, LseOut{}, params.fwd.cu_seqlens_q, p.batch, p.total_q, p.heads_q};
    fill.targets[1] = {params.dk, LseOut{}, params.fwd.cu_seqlens_k, p.batch, p.total_k, p.heads_kv};
    fill.targets[2] = {params.dv, LseOut{}, params.fwd.cu_seqlens_k, p.batch, p.total_k, p.heads_kv};
    fill.count = 3;
    if (verdict != nullptr || rows_outside(p.host_cu_seqlens_q, p.total_q) ||
        rows_outside(p.host_cu_seqlens_k, p.total_k)) {
      fill_outside_sequences(p, fill, verdict, s);
    }
  }
  auto launched = [&](cudaError_t err, const std::string& what) {
    if (err != cudaSuccess) cuda_fail(err, "CUDA kernel " + what + " failed to launch");
  };
  if (p.batch == 0) {  // no query row: d sink is 0
    if (params.dsink != nullptr) launched(sm80::run_backward_sink_grad(params, s), "backward_sink_grad");
    return;
  }
  if (log_kernels()) {
    std::fprintf(stderr, "flashattn: %s on cuda:%d (batch %lld, heads %lld/%lld, seqlen_q %lld, seqlen_k %lld%s)\n",
                 kernel_name(kernel->key).c_str(), p.device.index, static_cast<long long>(p.batch),
                 static_cast<long long>(p.heads_q), static_cast<long long>(p.heads_kv),
                 static_cast<long long>(p.max_seqlen_q), static_cast<long long>(p.max_seqlen_k),
                 p.deterministic ? ", deterministic" : "");
  }
  // The dQ sums and the turn counters start at 0; the prepare kernel writes D and LSE2.
  const ScratchLayout layout = scratch_layout(p);
  cuda_check(cudaMemsetAsync(workspace, 0, layout.delta, s), "cudaMemsetAsync (dQ sums)");
  if (p.deterministic) {
    cuda_check(cudaMemsetAsync(params.scratch.dq_semaphore, 0, layout.end - layout.semaphore, s),
               "cudaMemsetAsync (dQ turn counters)");
  }
  if (p.max_seqlen_q > 0) launched(sm80::run_backward_prepare(params, elem, s), "backward_prepare");
  if (params.block_cells.present() && p.max_seqlen_k > 0) launched(sm80::run_block_cells(params, s), "block_cells");
  // d sink from the rows the prepare kernel wrote (0 for a head with no query row).
  if (params.dsink != nullptr) launched(sm80::run_backward_sink_grad(params, s), "backward_sink_grad");
  if (p.max_seqlen_k > 0) launched(kernel->launch(params, s), kernel_name(kernel->key));
  if (sink_tokens_joined(p)) {  // the sink keys left of each row's window (the kernels ran the window)
    auto* partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + layout.sink_tokens);
    launched(run_backward_sink_tokens(params, layout.sink_token, partials, elem, s), "backward_sink_tokens");
  }
  if (p.max_seqlen_q > 0) launched(sm80::run_backward_convert_dq(params, elem, s), "backward_convert_dq");
}

std::vector<std::string> compiled_kernels() {
  std::vector<std::string> names;
  for (const ForwardKernel& k : forward_kernels()) names.push_back(kernel_name(k.key));
  for (const BackwardKernel& k : backward_kernels()) names.push_back(kernel_name(k.key));
  return names;
}

}  // namespace flashattn::cuda

// The CUDA backend's KV-cache calls (forward_kvcache) on the decode kernels (src/cuda/decode):
// what they run, their workspace, the launch.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "../tensor_checks.hpp"
#include "../validate_common.hpp"
#include "backend.hpp"
#include "device_checks.hpp"
#include "index_faults_host.hpp"
#include "runtime.hpp"

#if FLASHATTN_WITH_DECODE
#include "decode/decode_launch.hpp"
#include "decode/decode_setup.hpp"
#endif

namespace flashattn::cuda {

using detail::Problem;

bool supports_kvcache(const detail::KvCacheProblem& kp, std::string* why) {
  const Problem& p = kp.attn;
  std::string fp8_reason;
  if (float8_refused(p, why ? why : &fp8_reason)) return false;
#if !FLASHATTN_WITH_DECODE
  (void)p;
  *why =
      "k_cache: KV-cache attention on CUDA tensors needs the decode kernels, which this build does not "
      "compile (-DFLASHATTN_CUDA_DECODE=ON: a draft until tested on a GPU); CPU tensors run it";
  return false;
#else
  std::string reason;
  if (why == nullptr) why = &reason;
  auto no = [&](std::string r) {
    *why = std::move(r);
    return false;
  };
  if (p.head_dim_v != p.head_dim) {
    return no("v_cache: head_dim " + std::to_string(p.head_dim_v) + " differs from q/k's " +
              std::to_string(p.head_dim) + ": the CUDA decode kernels need equal head dims; the CPU backend takes it");
  }
  if (p.head_dim > detail::kMaxCudaHeadDim) {
    return no("q: head_dim " + std::to_string(p.head_dim) + " exceeds the CUDA decode kernels' " +
              std::to_string(detail::kMaxCudaHeadDim) + "; the CPU backend takes up to " +
              std::to_string(detail::kMaxHeadDim));
  }
  if (!device_runs_kernels(p, why)) return false;
  ElemType elem;
  if (!cuda_dtype(p.dtype, &elem)) {
    return no("q: dtype " + std::string(dtype_name(p.dtype)) +
              " is not supported by the CUDA kernels (float16, bfloat16)");
  }
  if (p.head_dim % 8 != 0 || decode::head_dim_bucket(p.head_dim) == 0) {
    return no("q: head_dim " + std::to_string(p.head_dim) +
              " must be a multiple of 8 for the CUDA kernels (16-byte rows)");
  }
  if (kp.rotary.enabled() && kp.rotary.dim % 16 != 0) {
    return no("rotary_cos: rotary_dim " + std::to_string(kp.rotary.dim) +
              " must be a multiple of 16 for the CUDA kernels");
  }
  // Every stride of the caches may be used (pages, batch entries): checked as if all extents were > 1.
  const int64_t e = static_cast<int64_t>(dtype_size(p.dtype));
  if (!check_rows("q", p.q, p.batch, p.seqlen_q, p.heads_q, e, why) ||
      !check_rows("out", p.out, p.batch, p.seqlen_q, p.heads_q, e, why) ||
      !check_rows("k_cache", p.k, 2, 2, 2, e, why) || !check_rows("v_cache", p.v, 2, 2, 2, e, why) ||
      (kp.append && (!check_rows("k_new", kp.k_new, p.batch, kp.seqlen_new, p.heads_kv, e, why) ||
                     !check_rows("v_new", kp.v_new, p.batch, kp.seqlen_new, p.heads_kv, e, why)))) {
    return false;
  }
  const decode::DecodeLayout layout = decode::decode_layout(kp, 1);
  if (p.heads_kv * layout.row_blocks > kMaxGridYZ || p.batch > kMaxGridYZ) {
    return no("q: batch " + std::to_string(p.batch) + " or KV heads x row blocks " +
              std::to_string(p.heads_kv * layout.row_blocks) + " exceed the CUDA grid limit " +
              std::to_string(kMaxGridYZ));
  }
  if (kp.capacity + kp.seqlen_new > decode::kMaxPositions || p.seqlen_q * p.group_size() > decode::kMaxPositions) {
    return no("k_cache: more than 2^31 - 2^16 positions (or query rows) per sequence for the CUDA kernels");
  }
  if (p.batch * p.heads_q * p.seqlen_q > kMaxGridX) {  // the combine kernel's grid
    return no("q: batch x heads x seqlen_q " + std::to_string(p.batch * p.heads_q * p.seqlen_q) +
              " exceeds the CUDA grid limit " + std::to_string(kMaxGridX));
  }
  return true;
#endif
}

#if FLASHATTN_WITH_DECODE
namespace {
int sm_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return n;
}
}  // namespace
#endif

#if FLASHATTN_WITH_DECODE
namespace {
// The split-KV partials, then (sink tokens joined to a call that wants no LSE) the LSE the decode
// kernels write for the sink-token pass, [batch, heads_q, seqlen_q].
size_t kvcache_lse_offset(const decode::DecodeLayout& layout) { return align_up(layout.workspace_bytes(), 256); }
bool kvcache_needs_lse(const detail::KvCacheProblem& kp) {
  return sink_tokens_joined(kp.attn) && kp.attn.lse.data == nullptr;
}
}  // namespace
#endif

size_t kvcache_workspace_size(const detail::KvCacheProblem& kp) {
#if FLASHATTN_WITH_DECODE
  const decode::DecodeLayout layout = decode::decode_layout(kp, sm_count(kp.attn.device.index));
  if (!kvcache_needs_lse(kp)) return layout.workspace_bytes();
  const Problem& p = kp.attn;
  return kvcache_lse_offset(layout) + static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q) * sizeof(float);
#else
  (void)kp;
  return 0;
#endif
}

void forward_kvcache(const detail::KvCacheProblem& kp, void* stream, void* workspace) {
#if FLASHATTN_WITH_DECODE
  const Problem& p = kp.attn;
  if (p.batch == 0) return;
  const DeviceGuard guard(p.device.index);
  decode::DecodeLayout layout = decode::decode_layout(kp, sm_count(p.device.index));
  layout.overlap_combine = code_arch(p.device.index) >= 90;
  // Splits merged in a cluster instead of by the combine kernel: measured (H100) faster for the
  // one-row kernel (MHA batch 8: 62.5 -> 60.4 us at 1k keys, 720 -> 714 us at 16k) and slower
  // for the tensor-core one (GQA batch 8, 1k: 25.6 -> 29.5 us; batch 1 even), whose clusters
  // crowd 2 CTAs an SM.
  layout.cluster_merge = layout.overlap_combine && layout.rows_per_cta == 1 && layout.num_splits > 1 &&
                         layout.num_splits <= decode::kMaxClusterSplits;
  DecodeParams params = decode::decode_params(kp, layout, workspace);
  if (kvcache_needs_lse(kp)) {  // the window's LSE, which the sink-token pass reads
    auto* lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + kvcache_lse_offset(layout));
    params.lse = {lse, p.heads_q * p.seqlen_q, 1, p.seqlen_q};
  }
  if (kp.device_checks_indices) {
    // A bad index an earlier call's kernels recorded is raised now, before this call writes.
    raise_index_fault(p.device.index, stream);
    params.fault = index_fault_sink(p.device.index);
  }
  if (log_kernels()) {
    std::fprintf(stderr, "flashattn: decode_%s_d%d_rows%d on cuda:%d (batch %lld, heads %lld / %lld, splits %d)\n",
                 p.dtype == DType::kFloat16 ? "fp16" : "bf16", decode::head_dim_bucket(p.head_dim), layout.rows_per_cta,
                 p.device.index, static_cast<long long>(p.batch), static_cast<long long>(p.heads_q),
                 static_cast<long long>(p.heads_kv), layout.num_splits);
  }
  const int err = p.dtype == DType::kFloat16 ? decode::launch_fp16(params, layout, kp.append, stream)
                                             : decode::launch_bf16(params, layout, kp.append, stream);
  if (err != 0) cuda_fail(static_cast<cudaError_t>(err), "CUDA decode kernels failed to launch");
#else
  (void)kp;
  (void)stream;
  (void)workspace;
  detail::fail(ErrorCode::kInternal, "forward_kvcache: no decode kernels (supports_kvcache not checked)");
#endif
}

}  // namespace flashattn::cuda

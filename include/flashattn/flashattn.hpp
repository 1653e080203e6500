// flashattn: exact attention (the FlashAttention algorithm), C++ API.
//
// Framework-free: tensors are described by TensorView (pointer, dtype, device, shape, strides);
// every output is allocated by the caller. The backend is chosen from the device the tensors live
// on. Conventions (layout, masks, LSE, errors) are written down in docs/CONVENTIONS.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashattn {

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------
enum class ErrorCode : int {
  kInvalidArgument = 1,  // a value, shape, stride or pointer breaks a documented constraint
  kInvalidDtype = 2,     // a tensor has a dtype the argument does not accept
  kUnsupported = 3,      // valid request this build/device cannot run (e.g. no CUDA backend)
  kBackendError = 4,     // the device runtime failed (CUDA error)
  kOutOfMemory = 5,
  kInternal = 6,
};

// Every failure of the library is an Error; what() names the argument and the constraint.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// ---------------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------------
// FP8 inputs (kFloat8E4M3: OCP e4m3fn, max 448, no infinities; kFloat8E5M2: e5m2) are taken by
// the forward calls on the CPU backend, with descale factors (ForwardArgs, KvCacheArgs); the
// output is bfloat16 or float16. See docs/CONVENTIONS.md, "FP8 inputs".
enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kFloat8E4M3 = 5,
  kFloat8E5M2 = 6,
};

enum class DeviceType : int { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr int kMaxDims = 4;

// A non-owning view. Strides are in elements (not bytes). A view with data == nullptr and
// ndim == 0 is "absent" (used for optional arguments such as lse or alibi_slopes).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};

  bool present() const { return data != nullptr || ndim != 0; }

  // A row-major (C-contiguous) view of `shape`.
  static TensorView contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});
  // A view with explicit element strides.
  static TensorView strided(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = {});
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------
// Masks align bottom-right: query row i of a sequence (lengths sq, sk) sees key j iff
//   i + sk - sq - window_left <= j <= i + sk - sq + window_right   (-1 = unbounded side).
// causal == window_right 0 (window_left stays as given). Sink tokens (StreamingLLM): keys
// j < sink_tokens are exempt from window_left, so a sliding window keeps the sequence's first
// tokens in view (window_right, causal, still applies to them).
struct MaskOptions {
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  int64_t sink_tokens = 0;  // >= 0
};

// Score modifications, applied in this order to s = softmax_scale * q.k:
//   softcap > 0:  s = softcap * tanh(s / softcap)
//   ALiBi:        s -= slope[h] * |i + sk - sq - j|
// A learnable sink adds one logit per query head to every row's softmax, with no value vector:
//   LSE_i = log(exp(sink[h]) + sum_j exp(s_ij)),  out_i = sum_j exp(s_ij - LSE_i) v_j,
// so a row gives probability exp(sink[h] - LSE_i) to "nothing"; a row that sees no key gets
// out 0 and LSE sink[h]; a sink of -inf is exactly no sink. The backward pass returns its
// gradient in BackwardArgs::dsink.
struct ScoreOptions {
  double softmax_scale = 0.0;  // 0 selects 1 / sqrt(head_dim) (q's and k's)
  float softcap = 0.0f;        // 0 = off
  TensorView alibi_slopes;     // absent, fp32 [heads_q] or [batch, heads_q]
  TensorView learnable_sink;   // absent, or fp32 [heads_q], on the device of q
};

// Dropout on the attention probabilities with a counter-based Philox4x32-10 stream keyed by
// (seed, offset) and the element's coordinates: every backend draws the same keep-mask.
struct DropoutOptions {
  float p = 0.0f;  // in [0, 1)
  uint64_t seed = 0;
  uint64_t offset = 0;
};

// Where a call checks the index values it reads (forward_kvcache's; the varlen calls' cu_seqlens,
// seqused_k and block_table; a block mask's lists).
enum class IndexCheck {
  // On the host, before anything runs: an out-of-range entry is an error naming it, and no
  // tensor is written. For device tensors this copies the indices to the host and waits for the
  // stream: one round trip a call, which also keeps the call out of CUDA graphs.
  kHost,
  // On the device, by the kernels (host tensors are checked as with kHost): the call stays
  // asynchronous and can be captured in a CUDA graph. forward_kvcache: a sequence with an
  // out-of-range entry gets NaN in its out and lse rows, and its new tokens may or may not have
  // been appended. Varlen: a call with a bad entry writes NaN to all of its outputs (out and lse,
  // or dq, dk and dv). Block mask: the query rows of a (batch entry, head, query tile) whose lists
  // break a rule get NaN in out and lse. Nothing outside the tensors is read or written. The first bad entry is
  // recorded, and raised as an Error naming it (like a CUDA error of an asynchronous launch,
  // later than the call that caused it): by the next kDevice-checked call on that device, before
  // it writes anything, or by check_device_errors(). A varlen call under kDevice needs the
  // workspace its *_workspace_size() query names (the checked copies of its lengths live there).
  kDevice,
};

// A block-sparse mask in FlexAttention's form (torch.nn.attention.flex_attention.BlockMask), at
// block size (block_m, block_n): per (batch entry, query head, query block) the key blocks that
// are partly visible (kv_num_blocks of them, the first entries of kv_indices' row) and those that
// are wholly visible (full_kv_num_blocks / full_kv_indices, optional); every other key block is
// hidden. Within a partial block the element bits decide (absent: every element is visible):
// bits holds one [block_m, ceil(block_n / 32)] array of 32-bit words per partial block (bit
// j % 32 of word j / 32 of row i: key j of row i, in the block's coordinates), and the partial
// blocks of (b, h, qb) are blocks bits_block[b][h][qb] on, in kv_indices' order. All int32; a
// leading dim of 1 broadcasts over the batch or the heads; query_blocks = kv_num_blocks.shape[2]
// and key_blocks = kv_indices.shape[3] must cover the sequences. It restricts what the other
// mask options allow. Dense calls only. The tensors live on q's device; the lists are checked as
// index_check says: kHost (for CUDA tensors one copy and wait per call), or, CUDA tensors under
// kDevice, by the forward kernel itself before it reads a (b, h, query tile)'s lists (no host
// round trip; up to kDeviceCheckedKeyBlocks key blocks, beyond which the host checks them; the
// backward's lists are checked on the host always). CPU: forward and backward. CUDA: forward
// and backward (the sm80 kernels; on Hopper too), with blocks that are multiples of the kernels'
// tiles (128 x 128 always are), not with dropout or sink_tokens.
struct BlockMaskOptions {
  int64_t block_m = 128, block_n = 128;
  TensorView kv_num_blocks;       // [b|1, h|1, query_blocks]
  TensorView kv_indices;          // [b|1, h|1, query_blocks, key_blocks]
  TensorView full_kv_num_blocks;  // optional, as kv_num_blocks
  TensorView full_kv_indices;     // optional, as kv_indices
  TensorView bits;                // optional [partial blocks, block_m, ceil(block_n / 32)]
  TensorView bits_block;          // with bits: [b|1, h|1, query_blocks] as kv_num_blocks
  IndexCheck index_check = IndexCheck::kHost;

  // The most key blocks (kv_indices.shape[3]) the CUDA kernel checks itself under kDevice.
  static constexpr int64_t kDeviceCheckedKeyBlocks = 32768;

  bool present() const { return kv_num_blocks.present(); }
};

struct AttentionOptions {
  MaskOptions mask;
  ScoreOptions score;
  DropoutOptions dropout;
  bool deterministic =
      false;             // backward: fixed dQ sum order (CPU: always); CUDA ~20% slower, ~2x causal
  bool precise = false;  // CPU: double accumulators + compensated sums (fp32 inputs)
  BlockMaskOptions block_mask;  // absent: no block-sparse mask
};

// ---------------------------------------------------------------------------------------------
// Arguments
// ---------------------------------------------------------------------------------------------
// Dense layout: q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, d_v], out [b, sq, hq, d_v],
// lse fp32 [b, hq, sq]. Varlen layout: q [total_q, hq, d], k [total_k, hkv, d],
// v [total_k, hkv, d_v], out [total_q, hq, d_v], lse fp32 [hq, total_q]. v's head_dim d_v may
// differ from q's and k's d (multi-head latent attention: 192 / 128) on the CPU backend; the
// CUDA kernels need d_v == d (kUnsupported otherwise). Backward: dout and dv take d_v, dq and
// dk d.
// Strides of the leading dims are arbitrary; head_dim must have unit stride.
//
// FP8 inputs (forward only, CPU backend): q, k and v all kFloat8E4M3 or all kFloat8E5M2, out
// bfloat16 or float16. The descale factors (FlashAttention-3's) are fp32 [batch, heads_kv], each
// optional (absent: 1): element x of k or v head hk in batch entry b stands for
// x * k_descale[b][hk] (v_descale), and of q head h for x * q_descale[b][h / (hq / hkv)] (its
// KV head's factor). They are given for FP8 inputs only.
struct ForwardArgs {
  TensorView q, k, v;
  TensorView out;
  TensorView lse;                                             // optional in forward
  TensorView q_descale = {}, k_descale = {}, v_descale = {};  // FP8 inputs: fp32 [batch, heads_kv]
};

struct BackwardArgs {
  TensorView dout, q, k, v, out, lse;  // lse is required
  TensorView dq, dk, dv;
  // With a learnable sink: its gradient, fp32 [heads_q] (summed over the batch), overwritten;
  // absent when not wanted. Without a sink it must be absent.
  TensorView dsink =
      {};  // (an initializer: aggregate initialisations that omit it stay warning-free)
};

// Variable-length batches: int32 prefix sums of the sequence lengths, [batch + 1].
// Forward only: with block_table (int32 [batch, max_blocks]) k / v are paged caches
// [num_blocks, page_size, hkv, d] (chunked prefill against a paged KV cache): key j of sequence b
// is row j % page_size of block block_table[b][j / page_size], and cu_seqlens_k (and seqused_k)
// give the lengths alone. The values (and the table entries of the keys in use) are checked as
// index_check says; with kDevice, max_seqlen_q / max_seqlen_k must bound every length, or the
// check fails.
struct VarlenArgs {
  TensorView cu_seqlens_q, cu_seqlens_k;
  TensorView seqused_k;  // optional int32 [batch]: keys actually used per sequence
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  TensorView block_table;  // optional: paged k / v (forward only)
  IndexCheck index_check = IndexCheck::kHost;
};

// Attention against a KV cache (decoding; chunked prefill against a cache), with flash_attn
// 2.8's flash_attn_with_kvcache semantics:
//  - the cache is contiguous, k_cache / v_cache [b_cache, sk_cache, hkv, d] (batch entry b
//    reads cache entry cache_batch_idx[b], default b), or paged, [num_blocks, page_size, hkv, d]
//    with block_table [b, max_blocks]: position pos of sequence b is row pos % page_size of block
//    block_table[b][pos / page_size]. A sequence holds up to sk_cache (contiguous) or
//    max_blocks * page_size (paged) positions: its capacity.
//  - sequence b's tokens sit at positions [cache_leftpad[b], cache_seqlens[b]) (leftpad default
//    0; cache_seqlens absent: every cache full, capacity tokens each);
//  - k_new / v_new [b, s_new, hkv, d], when given, are written into the cache at positions
//    [cache_seqlens[b], cache_seqlens[b] + s_new) before attention (no other cache element is
//    written; duplicate cache_batch_idx entries write the same rows in an unspecified order);
//  - q [b, sq, hq, d] attends to positions [leftpad, cache_seqlens + s_new): seqlen_k per
//    sequence is cache_seqlens + s_new - leftpad, masks align bottom-right as everywhere;
//  - rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2] (float32 or q's dtype; needs k_new)
//    rotate the first rotary_dim features of k_new at its cache positions, and of q at
//    positions cache_seqlens[b] + i (causal or local) or cache_seqlens[b] (otherwise), pairing
//    features (2i, 2i + 1) when rotary_interleaved, else (i, i + rotary_dim / 2). The rotation
//    is computed in float32 (float64 for float64 tensors), each of the four products rounded
//    (no fused multiply-add), and rounded to the dtype before attention (what the cache
//    stores): every backend stores the same bits;
//  - every index a call reads (cache_seqlens, leftpad, batch_idx, the block_table entries of
//    the positions used, the rotary rows) is checked (index_check below). Table entries past a
//    sequence's last used page are never read.
// Inference only: dropout must be 0. Index tensors are int32 and contiguous. v_cache and v_new may
// have a head_dim of their own, which out then has (CPU backend; multi-head latent attention's
// absorbed decode: q / k_cache 576, v_cache a view of k_cache's first 512 columns).
// FP8 cache (CPU backend): k_cache and v_cache kFloat8E4M3 (or both kFloat8E5M2) with q, k_new,
// v_new and out bfloat16 or float16. k_descale / v_descale are fp32 [batch, heads_kv], per batch
// entry of the call (b, not its cache_batch_idx entry) and KV head, each optional (absent: 1):
// cache element x of sequence b, head hk stands for x * k_descale[b][hk]. Appended rows are
// quantised into the cache in place: the rotated new row, rounded to q's dtype as always, then
// e4m3(float(x) / float(k_descale[b][hk])) in fp32, rounded to nearest even and saturating to
// +-448 (e5m2: +-57344; infinities too; NaN stays NaN). Sequences sharing pages must share
// their factors.

struct KvCacheArgs {
  TensorView q;
  TensorView k_cache, v_cache;
  TensorView k_new, v_new;            // optional, both or neither
  TensorView cache_seqlens;           // optional int32 [b]; required with k_new
  TensorView cache_batch_idx;         // optional int32 [b]; contiguous caches only
  TensorView cache_leftpad;           // optional int32 [b]
  TensorView block_table;             // optional int32 [b, max_blocks]: a paged cache
  TensorView rotary_cos, rotary_sin;  // optional, both or neither
  bool rotary_interleaved = true;
  int64_t num_splits = 0;  // GPU split-KV pieces: 0 = heuristic, 1 = none; CPU ignores it
  TensorView out;          // like q
  TensorView lse;          // optional fp32 [b, hq, sq]
  IndexCheck index_check = IndexCheck::kHost;
  TensorView k_descale = {}, v_descale = {};  // FP8 cache: fp32 [batch, heads_kv]
};

// Where and with what scratch memory a call runs. The CPU backend ignores the stream.
// A workspace smaller than the *_workspace_size() query answer, or not kWorkspaceAlignment-byte
// aligned, is an error; when that answer is 0 no workspace is needed. The forward's (16 bytes on
// CUDA: the Hopper kernels' tile counter) is optional: with none (null and 0 bytes) the call
// still runs, masked calls on Hopper one CTA per query tile instead of the persistent grid that
// balances them (up to ~10% slower for short causal sequences). It is required (and larger) where
// sink tokens meet a window on CUDA and no LSE is wanted: the kernels write the window's LSE
// there for the pass that joins the sink keys.
inline constexpr size_t kWorkspaceAlignment = 16;
inline constexpr size_t kForwardWorkspaceBytes =
    16;  // what forward_workspace_size() answers on CUDA for a dense call without that LSE
struct RunContext {
  void* stream = nullptr;  // cudaStream_t for CUDA tensors
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// ---------------------------------------------------------------------------------------------
// Functions. All validate every argument before reading or writing any tensor.
// ---------------------------------------------------------------------------------------------
void forward(const ForwardArgs& args, const AttentionOptions& options, const RunContext& ctx = {});
void backward(const BackwardArgs& args, const AttentionOptions& options,
              const RunContext& ctx = {});
void forward_varlen(const ForwardArgs& args, const VarlenArgs& varlen,
                    const AttentionOptions& options, const RunContext& ctx = {});
void backward_varlen(const BackwardArgs& args, const VarlenArgs& varlen,
                     const AttentionOptions& options, const RunContext& ctx = {});

// Writes k_new / v_new into the cache (when given), then attends (see KvCacheArgs).
void forward_kvcache(const KvCacheArgs& args, const AttentionOptions& options,
                     const RunContext& ctx = {});

// Workspace sizes depend on shapes, dtype, device and options alone: the varlen queries read no
// values of cu_seqlens / seqused_k (the call checks those), so they need no stream.
size_t forward_workspace_size(const ForwardArgs& args, const AttentionOptions& options);
size_t backward_workspace_size(const BackwardArgs& args, const AttentionOptions& options);
size_t forward_varlen_workspace_size(const ForwardArgs& args, const VarlenArgs& varlen,
                                     const AttentionOptions& options);
size_t backward_varlen_workspace_size(const BackwardArgs& args, const VarlenArgs& varlen,
                                      const AttentionOptions& options);
size_t forward_kvcache_workspace_size(const KvCacheArgs& args, const AttentionOptions& options);

// The fp64 reference (explicit S and P): the oracle of the tests. CPU tensors only; any dtype.
// It materialises [sq, sk] per (batch, head), so it is for checking, not for production.
void reference_forward(const ForwardArgs& args, const AttentionOptions& options);
void reference_backward(const BackwardArgs& args, const AttentionOptions& options);
void reference_forward_varlen(const ForwardArgs& args, const VarlenArgs& varlen,
                              const AttentionOptions& options);
void reference_backward_varlen(const BackwardArgs& args, const VarlenArgs& varlen,
                               const AttentionOptions& options);
void reference_forward_kvcache(const KvCacheArgs& args, const AttentionOptions& options);

// Waits for all work on CUDA device `cuda_device` (-1: every device this process ran a
// kDevice-checked call on), then throws the out-of-range index a kernel of an earlier
// kDevice-checked call recorded there, if any (Error kInvalidArgument, naming the argument, the
// entry and the range), and clears the record. Without the CUDA backend, or with no
// kDevice-checked call made, it returns.
void check_device_errors(int cuda_device = -1);

// ---------------------------------------------------------------------------------------------
// Introspection
// ---------------------------------------------------------------------------------------------
const char* version();
bool cuda_compiled();     // was the CUDA backend built into this library
int cuda_device_count();  // 0 when not compiled or no device/driver
// Names of the CUDA kernels compiled into this library, e.g. "sm80_fwd_bf16_d128_masked"
// (family, dtype, head-dim bucket, mask kind); empty without the CUDA backend. Setting the
// environment variable FLASHATTN_LOG_KERNELS=1 makes every CUDA call print the kernel it runs
// and its grid to stderr.
std::vector<std::string> cuda_kernels();

}  // namespace flashattn

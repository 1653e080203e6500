/* flashattn: exact attention (the FlashAttention algorithm), C ABI.
 *
 * The C++ API of flashattn.hpp over plain structs, for C and for foreign-function interfaces.
 * Semantics (layout, masks, LSE, dtypes) are exactly those of the C++ API; see its comments and
 * docs/ARCHITECTURE.md. No exception crosses this boundary: every fallible function returns an
 * fa_status and leaves a message naming the argument in fa_last_error().
 *
 * Typical use:
 *   fa_options opt;
 *   fa_options_default(&opt);          // zero-filled options are NOT the defaults (windows = -1)
 *   opt.causal = true;
 *   fa_forward_args args = {0};        // fill q, k, v, out (and lse) with fa_tensor_contiguous
 *   if (fa_forward(&args, &opt, NULL) != FA_OK) fprintf(stderr, "%s\n", fa_last_error());
 *
 * Compiles as C99 and later and as C++. */
#ifndef FLASHATTN_FLASHATTN_H_
#define FLASHATTN_FLASHATTN_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------- */
/* Status                                                                                      */
/* ------------------------------------------------------------------------------------------- */
/* Codes 1..6 have the numeric values of flashattn::ErrorCode, so both APIs report alike. */
typedef enum fa_status {
  FA_OK = 0,
  FA_ERROR_INVALID_ARGUMENT = 1, /* a value, shape, stride or pointer breaks a constraint */
  FA_ERROR_INVALID_DTYPE = 2,    /* a tensor has a dtype the argument does not accept */
  FA_ERROR_UNSUPPORTED = 3,      /* valid request this build/device cannot run */
  FA_ERROR_BACKEND = 4,          /* the device runtime failed (CUDA error) */
  FA_ERROR_OUT_OF_MEMORY = 5,
  FA_ERROR_INTERNAL = 6,      /* a bug in flashattn: please report it */
  FA_ERROR_NULL_ARGUMENT = 7, /* a required struct or out pointer was NULL */
  FA_ERROR_UNKNOWN = 8        /* an unexpected failure; the message says what */
} fa_status;

/* ------------------------------------------------------------------------------------------- */
/* Tensors                                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* Values of fa_tensor.dtype; equal to flashattn::DType. */
enum {
  FA_DTYPE_FLOAT16 = 0,
  FA_DTYPE_BFLOAT16 = 1,
  FA_DTYPE_FLOAT32 = 2,
  FA_DTYPE_FLOAT64 = 3,
  FA_DTYPE_INT32 = 4,
  FA_DTYPE_FLOAT8_E4M3 = 5, /* OCP e4m3fn (max 448, no inf): forward inputs, CPU backend */
  FA_DTYPE_FLOAT8_E5M2 = 6  /* e5m2: as FA_DTYPE_FLOAT8_E4M3 */
};

/* Values of fa_tensor.device_type; equal to flashattn::DeviceType. */
enum { FA_DEVICE_CPU = 0, FA_DEVICE_CUDA = 1 };

#define FA_MAX_DIMS 4

/* A non-owning view of memory the caller allocated (outputs too). The enum-valued fields are
 * int32_t rather than C enums so the struct layout does not depend on the compiler's enum size;
 * values outside the FA_DTYPE_* / FA_DEVICE_* sets are rejected, never trusted.
 * A tensor with data == NULL and ndim == 0 is absent: how optional arguments (lse, alibi_slopes,
 * seqused_k) are left out, so a zero-initialised fa_tensor means "not given". */
typedef struct fa_tensor {
  void* data;           /* first element; may be NULL only when the tensor is empty */
  int32_t dtype;        /* FA_DTYPE_* */
  int32_t device_type;  /* FA_DEVICE_*: selects the backend that runs the call */
  int32_t device_index; /* CUDA ordinal; ignored for the CPU */
  int32_t ndim;         /* used entries of shape/strides */
  int64_t shape[FA_MAX_DIMS];
  int64_t strides[FA_MAX_DIMS]; /* in elements, not bytes, so views need no dtype arithmetic */
} fa_tensor;

/* ------------------------------------------------------------------------------------------- */
/* Options                                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* A block-sparse mask in FlexAttention's form (flashattn::BlockMaskOptions, which documents the
 * layout): int32 tensors on q's device, absent when kv_num_blocks is. */
typedef struct fa_block_mask {
  int64_t block_m, block_n;     /* the block size (fa_options_default: 128 x 128) */
  fa_tensor kv_num_blocks;      /* [b|1, h|1, query_blocks]: partly visible key blocks */
  fa_tensor kv_indices;         /* [b|1, h|1, query_blocks, key_blocks] */
  fa_tensor full_kv_num_blocks; /* absent, or as kv_num_blocks: wholly visible key blocks */
  fa_tensor full_kv_indices;    /* absent, or as kv_indices */
  fa_tensor bits;               /* absent (partial blocks wholly visible), or the element bits
                                     * [partial blocks, block_m, ceil(block_n / 32)] */
  fa_tensor bits_block;         /* with bits: as kv_num_blocks, each list's first block in bits */
  int32_t index_check; /* FA_INDEX_CHECK_HOST (default) or FA_INDEX_CHECK_DEVICE: who checks
                                     * the lists of CUDA tensors (flashattn::BlockMaskOptions) */
} fa_block_mask;

/* Start from fa_options_default(): unbounded windows are -1, so an all-zero struct would mean
 * a window of width 0. Meanings are those of flashattn::AttentionOptions. */
typedef struct fa_options {
  bool causal;             /* same as window_right = 0; window_left still applies */
  int64_t window_left;     /* keys visible left of the (bottom-right aligned) diagonal, -1 = all */
  int64_t window_right;    /* keys visible right of it, -1 = all */
  double softmax_scale;    /* 0 selects 1 / sqrt(head_dim) of q and k, the usual scaling */
  float softcap;           /* s = softcap * tanh(s / softcap) before masking; 0 = off */
  fa_tensor alibi_slopes;  /* absent, or fp32 [heads_q] / [batch, heads_q]: linear key bias */
  float dropout_p;         /* in [0, 1) */
  uint64_t dropout_seed;   /* with dropout_offset, keys the Philox stream: same mask everywhere */
  uint64_t dropout_offset; /* advance it between calls that must draw different masks */
  bool deterministic; /* backward: fixed dQ accumulation order; on GPUs ~20% slower, ~2x causal */
  bool precise;       /* CPU, fp32 inputs: double accumulators and compensated sums */
  fa_tensor learnable_sink; /* absent, or fp32 [heads_q]: one logit per head joining every row's
                             * softmax without a value vector (CPU tensors in this version) */
  int64_t sink_tokens;      /* keys j < sink_tokens ignore window_left (StreamingLLM); 0 = none */
  fa_block_mask
      block_mask; /* absent, or a block-sparse mask (dense calls; flashattn.hpp says where it runs) */
} fa_options;

/* Where a call checks the index values it reads (flashattn::IndexCheck): FA_INDEX_CHECK_HOST (0,
 * the default) before anything is written, an error naming a bad entry; FA_INDEX_CHECK_DEVICE on
 * the device, without a host round trip (a bad entry gives NaN outputs and is reported by the
 * next FA_INDEX_CHECK_DEVICE-checked call on that device or by fa_check_device_errors). */
enum { FA_INDEX_CHECK_HOST = 0, FA_INDEX_CHECK_DEVICE = 1 };

/* Variable-length batches: sequences packed along the token dimension. */
typedef struct fa_varlen {
  fa_tensor cu_seqlens_q; /* int32 [batch + 1] prefix sums of the query lengths */
  fa_tensor cu_seqlens_k; /* int32 [batch + 1] prefix sums of the key lengths */
  fa_tensor seqused_k;    /* absent, or int32 [batch]: keys actually used (KV caches) */
  int64_t max_seqlen_q;   /* upper bounds of the lengths: size the launch without reading */
  int64_t max_seqlen_k;   /*   the device-side prefix sums */
  fa_tensor block_table;  /* absent, or int32 [batch, max_blocks] (forward only): k / v are paged
                           * [num_blocks, page_size, hkv, d]; cu_seqlens_k gives lengths alone */
  int32_t index_check;    /* FA_INDEX_CHECK_HOST or FA_INDEX_CHECK_DEVICE (then the call needs the
                           * workspace its *_workspace_size query names) */
} fa_varlen;

/* Where and with what scratch memory a call runs. Passing NULL for it means all zeros. */
typedef struct fa_run_context {
  void* stream;    /* cudaStream_t for CUDA tensors; the CPU backend ignores it */
  void* workspace; /* at least *_workspace_size() bytes on the tensors' device, 16-byte aligned */
  size_t workspace_bytes; /* checked, so an undersized buffer is an error, not corruption */
} fa_run_context;

/* ------------------------------------------------------------------------------------------- */
/* Arguments                                                                                   */
/* ------------------------------------------------------------------------------------------- */
/* Dense layout: q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, d_v], out [b, sq, hq, d_v],
 * lse fp32 [b, hq, sq]. Varlen layout: q [total_q, hq, d], k [total_k, hkv, d],
 * v [total_k, hkv, d_v], out [total_q, hq, d_v], lse fp32 [hq, total_q]. v's head_dim d_v may
 * differ from d on the CPU backend (CUDA: FA_ERROR_UNSUPPORTED); dout and dv take d_v, dq and
 * dk d.
 * Leading strides are free (packed qkv works); head_dim must have unit stride. */
typedef struct fa_forward_args {
  fa_tensor q, k, v;
  fa_tensor out;
  fa_tensor lse; /* optional: needed later by the backward pass */
  /* FP8 inputs (q, k, v all FA_DTYPE_FLOAT8_*, out bfloat16 or float16; CPU backend): absent
   * (factor 1), or fp32 [batch, heads_kv]; an element stands for its value times the factor of
   * its batch entry and KV head (q head h: KV head h / (hq / hkv)). Only for FP8 inputs. */
  fa_tensor q_descale, k_descale, v_descale;
} fa_forward_args;

typedef struct fa_backward_args {
  fa_tensor dout, q, k, v, out;
  fa_tensor lse; /* required: the forward's log-sum-exp lets the backward recompute P */
  fa_tensor dq, dk, dv;
  fa_tensor dsink; /* absent, or fp32 [heads_q]: the learnable sink's gradient (overwritten) */
} fa_backward_args;

/* Attention against a KV cache (flash_attn_with_kvcache; the full semantics are documented at
 * flashattn::KvCacheArgs in flashattn.hpp). Caches are contiguous [b_cache, sk_cache, hkv, d]
 * or, with block_table int32 [b, max_blocks], paged [num_blocks, page_size, hkv, d]. Optional
 * tensors are absent when zeroed. k_new / v_new [b, s_new, hkv, d] are written into the cache
 * at cache_seqlens (int32 [b], required with them) before q [b, sq, hq, d] attends to positions
 * [cache_leftpad, cache_seqlens + s_new). rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2]
 * rotate k_new and q. index_check: see FA_INDEX_CHECK_HOST above (with FA_INDEX_CHECK_DEVICE a
 * sequence with a bad entry gets NaN rows). */
typedef struct fa_kvcache_args {
  fa_tensor q, k_cache, v_cache;
  fa_tensor k_new, v_new;
  fa_tensor cache_seqlens, cache_batch_idx, cache_leftpad, block_table;
  fa_tensor rotary_cos, rotary_sin;
  bool rotary_interleaved; /* pairs (2i, 2i + 1); false: (i, i + rotary_dim / 2) */
  int64_t num_splits;      /* GPU split-KV pieces: 0 = heuristic; the CPU ignores it */
  fa_tensor out;
  fa_tensor lse;       /* optional fp32 [b, hq, sq] */
  int32_t index_check; /* FA_INDEX_CHECK_HOST or FA_INDEX_CHECK_DEVICE */
  /* An FP8 cache (k_cache / v_cache FA_DTYPE_FLOAT8_*, q / k_new / v_new / out bfloat16 or
   * float16; CPU backend): absent (1), or fp32 [b, hkv] per batch entry and KV head; appended
   * rows are quantised by them (flashattn::KvCacheArgs says how). */
  fa_tensor k_descale, v_descale;
} fa_kvcache_args;

/* ------------------------------------------------------------------------------------------- */
/* Functions. Each validates every argument before touching a tensor. args, options and varlen  */
/* must not be NULL (FA_ERROR_NULL_ARGUMENT); ctx may be NULL.                                 */
/* ------------------------------------------------------------------------------------------- */
/* Fills *options with the defaults of flashattn::AttentionOptions; does nothing given NULL. */
void fa_options_default(fa_options* options);

/* A row-major view of shape[0..ndim) on the CPU (set device_type/device_index afterwards for
 * device memory). Spares C callers the stride arithmetic; fails only for ndim outside [0, 4]. */
fa_status fa_tensor_contiguous(fa_tensor* tensor, const void* data, int32_t dtype, int32_t ndim,
                               const int64_t* shape);

fa_status fa_forward(const fa_forward_args* args, const fa_options* options,
                     const fa_run_context* ctx);
fa_status fa_backward(const fa_backward_args* args, const fa_options* options,
                      const fa_run_context* ctx);
fa_status fa_forward_varlen(const fa_forward_args* args, const fa_varlen* varlen,
                            const fa_options* options, const fa_run_context* ctx);
fa_status fa_backward_varlen(const fa_backward_args* args, const fa_varlen* varlen,
                             const fa_options* options, const fa_run_context* ctx);
fa_status fa_forward_kvcache(const fa_kvcache_args* args, const fa_options* options,
                             const fa_run_context* ctx);

/* Scratch bytes the matching call needs in fa_run_context.workspace (0: none). The forward's
 * (16 bytes on CUDA) is optional: without one (NULL, 0 bytes) masked calls on Hopper run a
 * slower grid; it is required where sink tokens meet a window on CUDA and no lse is given (the
 * window's LSE lives there). Validates the arguments like the call itself, except the values inside
 * cu_seqlens / seqused_k, which the size does not depend on and which are left unread (no device
 * access, no stream needed). */
fa_status fa_forward_workspace_size(const fa_forward_args* args, const fa_options* options,
                                    size_t* bytes);
fa_status fa_backward_workspace_size(const fa_backward_args* args, const fa_options* options,
                                     size_t* bytes);
fa_status fa_forward_varlen_workspace_size(const fa_forward_args* args, const fa_varlen* varlen,
                                           const fa_options* options, size_t* bytes);
fa_status fa_backward_varlen_workspace_size(const fa_backward_args* args, const fa_varlen* varlen,
                                            const fa_options* options, size_t* bytes);
fa_status fa_forward_kvcache_workspace_size(const fa_kvcache_args* args, const fa_options* options,
                                            size_t* bytes);

/* Waits for CUDA device cuda_device (-1: every device that ran a call checked with
 * FA_INDEX_CHECK_DEVICE), then reports the out-of-range index a kernel of such a call recorded
 * there, if any (FA_ERROR_INVALID_ARGUMENT, fa_last_error naming the entry), and clears it. */
fa_status fa_check_device_errors(int cuda_device);

/* The fp64 reference (explicit S and P), CPU tensors only: an oracle for testing bindings and
 * kernels, O(sq * sk) memory per head, not for production. */
fa_status fa_reference_forward(const fa_forward_args* args, const fa_options* options);
fa_status fa_reference_backward(const fa_backward_args* args, const fa_options* options);
fa_status fa_reference_forward_varlen(const fa_forward_args* args, const fa_varlen* varlen,
                                      const fa_options* options);
fa_status fa_reference_backward_varlen(const fa_backward_args* args, const fa_varlen* varlen,
                                       const fa_options* options);
/* Appends k_new / v_new like fa_forward_kvcache, then attends with the fp64 reference. */
fa_status fa_reference_forward_kvcache(const fa_kvcache_args* args, const fa_options* options);

/* ------------------------------------------------------------------------------------------- */
/* Introspection and errors                                                                    */
/* ------------------------------------------------------------------------------------------- */
/* Library version "major.minor.patch", to check the loaded library against the header. */
const char* fa_version(void);
bool fa_cuda_compiled(void);    /* was the CUDA backend built into this library */
int fa_cuda_device_count(void); /* 0 when not compiled or no device/driver */
/* The CUDA kernels compiled into this library ("sm80_fwd_bf16_d128_masked", ...): indices
 * [0, fa_cuda_kernel_count()); NULL past the end. The strings live as long as the library. */
size_t fa_cuda_kernel_count(void);
const char* fa_cuda_kernel_name(size_t index);

/* Message of the last failed fa_status call on this thread ("" after a successful one). It is
 * per thread so concurrent callers cannot read each other's errors; the pointer stays valid
 * until the next fa_status call on the same thread. */
const char* fa_last_error(void);

/* A static description of a status ("invalid argument"), for logs; never NULL. */
const char* fa_status_string(fa_status status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHATTN_FLASHATTN_H_ */

/* The FA1-order teaching kernel's C entry points (library flashattn_fa1_teaching, built with
 * FLASHATTN_CUDA=ON). Not part of the product API: a benchmark of FlashAttention-1's loop order
 * (outer loop over K/V tiles, O, m and l through HBM) against FlashAttention-2's, called from
 * Python through ctypes (bench/). The kernel is src/cuda/teaching/fa1_order_kernel.cuh.
 *
 * Shapes it runs (anything else is an argument error):
 *   q, k, v, out  contiguous [batch, seqlen, heads, head_dim] device arrays, dtype 0 = fp16,
 *                 1 = bf16, 16-byte aligned; seqlen_q == seqlen_k == seqlen; heads_q == heads_kv;
 *   head_dim      64 or 128; softmax scale 1 / sqrt(head_dim);
 *   seqlen        a multiple of block_m and block_n (fa1_tile_sizes: 64 x 128 at d64, 64 x 64 at
 *                 d128, so a multiple of 128 / 64); 0 (or batch or heads 0) is a no-op;
 *   causal        0 or 1 (causal: query row r sees keys <= r);
 *   lse           fp32 [batch, heads, seqlen], natural log, or NULL (not written);
 *   q_groups      >= 1: CTAs per (batch, head), each running FA1's loop order over a contiguous
 *                 range of the head's seqlen / block_m query tiles (1 = FA1 as published, which
 *                 parallelises over batch x heads only; seqlen / block_m = one query tile per
 *                 CTA: only the HBM round trip differs from FA2). 0 = the control: one query
 *                 tile per CTA with O, m, l kept in registers across the key loop (FA2's order
 *                 with this kernel's tiles and code); the workspace is not used (may be NULL).
 *   workspace     fa1_workspace_bytes(batch, seqlen, heads, head_dim) bytes of device memory,
 *                 16-byte aligned: fp32 O accumulators [batch, heads, seqlen, head_dim], then
 *                 the row maxima and the row sums [batch, heads, seqlen] each. Needs no
 *                 initialisation: each query tile's state is written before it is read. It is
 *                 in use until the call's work on `stream` has finished.
 *   stream        a cudaStream_t (NULL: the default stream).
 *
 * Returns FA1_OK, or FA1_INVALID_ARGUMENT (nothing launched; the message names the argument) or
 * FA1_CUDA_ERROR (a launch error or a sticky earlier one), with a NUL-terminated message in
 * error[0 .. error_len) when error is not NULL. The call is asynchronous: errors while the
 * kernel runs show at the next synchronisation, as for any CUDA launch. The current device is
 * the one used.
 */
#ifndef FLASHATTN_FA1_ORDER_H_
#define FLASHATTN_FA1_ORDER_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { FA1_OK = 0, FA1_INVALID_ARGUMENT = 1, FA1_CUDA_ERROR = 2 };

/* Bytes of workspace a q_groups >= 1 call needs; 0 for negative arguments. */
size_t fa1_workspace_bytes(int batch, int seqlen, int heads, int head_dim);

/* The kernel's query rows and keys per tile for head_dim; returns FA1_OK, or
 * FA1_INVALID_ARGUMENT for an unsupported head_dim. */
int fa1_tile_sizes(int head_dim, int* block_m, int* block_n);

int fa1_forward(const void* q, const void* k, const void* v, void* out, float* lse, void* workspace, int batch,
                int seqlen, int heads, int head_dim, int dtype, int causal, int q_groups, void* stream, char* error,
                size_t error_len);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_FA1_ORDER_H_ */

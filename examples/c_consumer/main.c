/* One causal attention forward on the CPU through the flashattn C ABI. */
#include <flashattn/flashattn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { kSeqlen = 64, kHeads = 4, kHeadDim = 32, kSize = kSeqlen * kHeads * kHeadDim };

int main(void) {
  static float q[kSize], k[kSize], v[kSize], out[kSize];
  const int64_t shape[4] = {1, kSeqlen, kHeads, kHeadDim}; /* [batch, seqlen, heads, head_dim] */
  fa_forward_args args = {0}; /* zeroed: lse stays absent */
  fa_options options;
  int i, h, c, j;

  for (i = 0; i < kSize; ++i) { /* any values will do; these are reproducible */
    q[i] = sinf(0.37f * (float)i);
    k[i] = cosf(0.11f * (float)i);
    v[i] = sinf(0.07f * (float)i + 1.0f);
  }
  fa_tensor_contiguous(&args.q, q, FA_DTYPE_FLOAT32, 4, shape);
  fa_tensor_contiguous(&args.k, k, FA_DTYPE_FLOAT32, 4, shape);
  fa_tensor_contiguous(&args.v, v, FA_DTYPE_FLOAT32, 4, shape);
  fa_tensor_contiguous(&args.out, out, FA_DTYPE_FLOAT32, 4, shape);
  fa_options_default(&options);
  options.causal = true;
  if (fa_forward(&args, &options, NULL) != FA_OK) {
    fprintf(stderr, "fa_forward failed: %s\n", fa_last_error());
    return EXIT_FAILURE;
  }

  /* Softmax weights are >= 0 and sum to 1, so each output is a convex combination of the V rows
   * its query sees (keys 0..i under the causal mask): finite and within their range. */
  for (i = 0; i < kSeqlen; ++i) {
    for (h = 0; h < kHeads; ++h) {
      for (c = 0; c < kHeadDim; ++c) {
        float lo = INFINITY, hi = -INFINITY;
        const float o = out[(i * kHeads + h) * kHeadDim + c];
        for (j = 0; j <= i; ++j) {
          lo = fminf(lo, v[(j * kHeads + h) * kHeadDim + c]);
          hi = fmaxf(hi, v[(j * kHeads + h) * kHeadDim + c]);
        }
        if (!isfinite(o) || o < lo - 1e-5f || o > hi + 1e-5f) {
          fprintf(stderr, "out[0, %d, %d, %d] = %g is outside [%g, %g]\n", i, h, c, o, lo, hi);
          return EXIT_FAILURE;
        }
      }
    }
  }
  printf("flashattn %s (C ABI): causal forward [1, %d, %d, %d] ok\n", fa_version(), kSeqlen,
         kHeads, kHeadDim);
  return EXIT_SUCCESS;
}

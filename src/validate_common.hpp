// Argument checks shared by the validators of the dense / varlen calls (validate.cpp) and the
// KV-cache call (validate_kvcache.cpp). Each throws flashattn::Error naming the argument.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "problem.hpp"
#include "tensor_checks.hpp"

namespace flashattn::detail {

// The largest head dim a call takes: multi-head latent attention's absorbed q / k (512 latent
// + 64 rope columns; Gemma-class layers use 512). The CUDA kernels stop at kMaxCudaHeadDim and
// refuse the rest by name (cuda::supports); the CPU backend runs them all.
inline constexpr int64_t kMaxHeadDim = 576;
inline constexpr int64_t kMaxCudaHeadDim = 256;

std::string float_str(double x);

void check_same_device(const char* name, const TensorView& t, const TensorView& q);
// A value tensor of q's dtype and device, `ndim` dims, unit stride in the last one.
void check_value_tensor(const char* name, const TensorView& t, const TensorView& q, int ndim);
// The same with a dtype of its own (FP8 inputs: out, an FP8 cache); `dtype_what` names it in the
// message ("k_cache dtype").
void check_value_tensor_as(const char* name, const TensorView& t, const TensorView& q, int ndim, DType dtype,
                           const char* dtype_what);
// The dtype an output of inputs of `input_dtype` must have: that dtype, or for float8 inputs
// bfloat16 or float16 (out's own, checked here: there is no FP8 output).
DType output_dtype(const char* name, const TensorView& out, const char* input_name, DType input_dtype);
// The descale factors of an FP8 operand (named `operand_name`, of `operand_dtype`): absent, or fp32
// [batch, heads_kv] on q's device, and given for float8 operands only. heads_per_kv_head: the
// operand's heads a factor covers (q's GQA group size, 1 for k and v).
core::Descale check_descale(const char* name, const TensorView& t, const TensorView& q, const char* operand_name,
                            DType operand_dtype, const Problem& p, int64_t heads_per_kv_head);
void check_same_shape(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref);
void check_like_q_with_v_head_dim(const char* name, const TensorView& t, const TensorView& q, const Problem& p);
void check_dim(const char* name, const TensorView& t, int dim, const char* what, int64_t expected,
               const char* ref_what);
// A contiguous int32 vector on q's device.
void check_int_vector(const char* name, const TensorView& t, const TensorView& q);
// Index arrays on a device are read on the host: the device must be one this build can reach.
// `what` names the feature in the message ("varlen").
void check_device_runs_lengths(const char* name, const char* what, const TensorView& q);
// Index arrays as host values: host memory is read in place; arrays on a device are copied on
// `stream`, all of them with one wait (fetch).
class HostIndices {
 public:
  HostIndices(const Device& device, void* stream) : device_(device), stream_(stream) {}
  // Where src[0, n) can be read once fetch() has returned: src itself in host memory (or null),
  // else `copy` (sized here).
  const int32_t* add(const int32_t* src, int64_t n, std::vector<int32_t>& copy);
  // block_table's rows (a row stride apart).
  const int32_t* add_block_table(const TensorView& t, std::vector<int32_t>& copy);
  void fetch();

 private:
  Device device_;
  void* stream_;
  std::vector<HostCopy> copies_;
};

// Paged K / V (forward_kvcache, paged varlen): block_table int32 [batch, max_blocks] on q's
// device with a unit last stride; the entries of row b for positions [first, end) name blocks
// in [0, blocks).
void check_block_table(const TensorView& t, const TensorView& q, int64_t batch);
void check_pages(const int32_t* table, const CacheRows& rows, int64_t b, int64_t first, int64_t end, int64_t blocks);

// Dense [b, s, h, d] or varlen [total, h, d] rows; LSE [b, h, sq] or [h, total_q].
Operand operand(const TensorView& t, bool varlen);
Operand lse_operand(const TensorView& t, bool varlen);
void check_lse(const TensorView& lse, const TensorView& q, const Problem& p, bool varlen);
// A per-head fp32 vector [heads] on q's device (learnable_sink, dsink).
void check_head_vector(const char* name, const TensorView& t, const TensorView& q, int64_t heads);
// Masks, score mods, dropout, determinism into p (head_dim and heads_q already set).
void check_options(const AttentionOptions& o, Problem& p, const TensorView& q);
// A block-sparse mask into p.block_mask (validate_block_mask.cpp; p's shapes and device set): its
// tensors, on q's device, then the values of its lists, once no output overlaps them (the call's
// outputs; lists in device memory are copied on `stream` and waited for).
void check_block_mask(const BlockMaskOptions& o, Problem& p, bool varlen, const TensorView& q);
void check_block_mask_values(const Problem& p, const BlockMaskOptions& o, std::initializer_list<NamedView> outputs,
                             void* stream);

}  // namespace flashattn::detail

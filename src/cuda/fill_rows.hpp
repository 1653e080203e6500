// Writes the value every backend gives rows that no sequence owns (varlen tokens outside
// [cu_seqlens_q[0], cu_seqlens_q[batch])): out = 0 and, when wanted, LSE = -inf.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "params.hpp"

namespace flashattn::cuda {

// Rows [row_begin, row_end) of every head of a 16-bit out (and of lse when lse.data is set),
// addressed with batch index 0. Asynchronous on `stream`.
cudaError_t launch_fill_rows(const RowsOut& out, const LseOut& lse, int64_t row_begin, int64_t row_end,
                             int64_t heads, int64_t head_dim, cudaStream_t stream);

}  // namespace flashattn::cuda

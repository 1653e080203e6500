#include "fill_rows.hpp"

#include <cmath>
#include <cstdint>

namespace flashattn::cuda {
namespace {

// One thread per (row, head, element): a grid-stride loop over rows * heads * head_dim.
__global__ void fill_rows_kernel(RowsOut out, LseOut lse, int64_t row_begin, int64_t rows, int64_t heads,
                                 int64_t head_dim) {
  const int64_t total = rows * heads * head_dim;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = e % head_dim, h = e / head_dim % heads, row = row_begin + e / (head_dim * heads);
    static_cast<uint16_t*>(out.data)[row * out.row_stride + h * out.head_stride + c] = 0;  // +0.0
    if (lse.data != nullptr && c == 0) lse.data[row * lse.row_stride + h * lse.head_stride] = -INFINITY;
  }
}

}  // namespace

cudaError_t launch_fill_rows(const RowsOut& out, const LseOut& lse, int64_t row_begin, int64_t row_end,
                             int64_t heads, int64_t head_dim, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = (row_end - row_begin) * heads * head_dim;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  fill_rows_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0, stream>>>(
      out, lse, row_begin, row_end - row_begin, heads, head_dim);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda

// Dense kernels on the small row-major tiles of the CPU flash path. Dimensions passed in are
// multiples of kTileAlign (tiles are zero-padded), so the kernels have no tails to handle.
//
// Layout: score tiles are kept transposed, S^T [keys, queries], so every per-query-row softmax
// quantity (max, sum, LSE, D) is a vector along the contiguous dimension and the kernels below
// vectorise without horizontal reductions.
//
// Vectorisation: plain loops shaped for GCC's auto-vectoriser (register-blocked GEMM,
// branch-free polynomial exp2), compiled for AVX-512, AVX2+FMA and baseline x86-64; the variant
// is picked once from the CPU's features (cpu_isa()). Double versions serve fp64 inputs and the
// precise mode and use std::exp2.
#pragma once

#include <cstdint>

namespace flashattn::cpu {

inline constexpr int64_t kTileAlign = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

enum class CpuIsa { kAvx512, kAvx2, kBaseline };
CpuIsa cpu_isa();  // the instruction set the kernels run with on this machine
const char* cpu_isa_name(CpuIsa isa);

// C[M, N] (+)= A[M, K] * B[K, N]; leading dimensions in elements. M % 4 == 0, N % 16 == 0.
template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
          bool accumulate);

// C[M, N] (+)= At[K, M]^T * B[K, N]: the A operand stored transposed.
template <typename T>
void gemm_tn(int64_t M, int64_t N, int64_t K, const T* At, int64_t ldat, const T* B, int64_t ldb, T* C, int64_t ldc,
             bool accumulate);

// Column kernels on s[rows, cols] (leading dim ld); cols % 16 == 0.
// col_max[c] = max(col_max[c], max_r s[r][c]).
template <typename T>
void column_max(const T* s, int64_t ld, int64_t rows, int64_t cols, T* col_max);
// s[r][c] = 2^(s[r][c] - sub[c]) (-inf -> 0); col_sum[c] += sum_r of the results when non-null.
template <typename T>
void exp2_columns(T* s, int64_t ld, int64_t rows, int64_t cols, const T* sub, T* col_sum);
// s[r][c] = p[r][c] * (s[r][c] - delta[c]): dS from P and dP, in place over dP.
template <typename T>
void ds_columns(const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta);
// The same with one value per row (untransposed tiles): 2^(s[r][c] - sub[r]) and
// p[r][c] * (s[r][c] - delta[r]).
template <typename T>
void exp2_rows(T* s, int64_t ld, int64_t rows, int64_t cols, const T* sub);
template <typename T>
void ds_rows(const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta);
// x[r][c] *= factor[r].
template <typename T>
void scale_rows(T* x, int64_t ld, int64_t rows, int64_t cols, const T* factor);

// dst[N, M] = src[M, N]^T.
template <typename T>
void transpose(int64_t M, int64_t N, const T* src, int64_t lds, T* dst, int64_t ldd) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) dst[j * ldd + i] = src[i * lds + j];
  }
}

}  // namespace flashattn::cpu

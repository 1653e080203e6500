// Dense kernels on the small row-major tiles of the CPU flash path. Every dimension passed in is
// a multiple of kTileAlign (tiles are zero-padded), so the kernels have no tails to handle.
// Vectorisation: the kernels are plain loops shaped for GCC's auto-vectoriser (register-blocked
// GEMM, branch-free exp2), compiled for AVX-512, AVX2+FMA and baseline x86-64; the variant is
// picked once from the CPU's features (cpu_isa()).
#pragma once

#include <cstdint>

namespace flashattn::cpu {

inline constexpr int64_t kTileAlign = 16;

enum class CpuIsa { kAvx512, kAvx2, kBaseline };
CpuIsa cpu_isa();  // the instruction set the kernels run with on this machine
const char* cpu_isa_name(CpuIsa isa);

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C[M, N] (+)= A[M, K] * B[K, N]; leading dimensions in elements. M % 4 == 0, N % 16 == 0.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate);
void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
          int64_t ldb, double* C, int64_t ldc, bool accumulate);

// dst[N, M] = src[M, N]^T.
template <typename T>
void transpose(int64_t M, int64_t N, const T* src, int64_t lds, T* dst, int64_t ldd) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) dst[j * ldd + i] = src[i * lds + j];
  }
}

// x[i] = 2^(x[i] - sub) for n elements (x = -inf gives 0). The float version is a polynomial
// with < 2 ulp error that vectorises; the double version calls std::exp2.
void exp2_sub(float* x, int64_t n, float sub);
void exp2_sub(double* x, int64_t n, double sub);

}  // namespace flashattn::cpu

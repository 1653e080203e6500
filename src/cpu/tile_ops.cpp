#include "tile_ops.hpp"

#include <cmath>
#include <cstring>

// Function multi-versioning: one clone per ISA level, chosen at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define FA_CPU_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define FA_CPU_CLONES
#endif

namespace flashattn::cpu {
namespace {

// Register block of C: kRows x kCols accumulators live in vector registers across the K loop.
template <typename T, int kRows, int kCols>
inline void gemm_block(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                       int64_t ldc, bool accumulate) {
  T acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) acc[r][c] = accumulate ? C[r * ldc + c] : T(0);
  }
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
    for (int r = 0; r < kRows; ++r) {
      const T a = A[r * lda + k];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) C[r * ldc + c] = acc[r][c];
  }
}

template <typename T>
inline void gemm_impl(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                      int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  constexpr int kRows = 4;
  constexpr int kWide = 64 / sizeof(T) * 2;  // two 64-byte vectors per row
  constexpr int kNarrow = 16;
  for (int64_t i = 0; i < M; i += kRows) {
    int64_t j = 0;
    for (; j + kWide <= N; j += kWide) {
      gemm_block<T, kRows, kWide>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc,
                                  accumulate);
    }
    for (; j < N; j += kNarrow) {
      gemm_block<T, kRows, kNarrow>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc,
                                    accumulate);
    }
  }
}

}  // namespace

FA_CPU_CLONES void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                        const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm_impl(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

FA_CPU_CLONES void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                        const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  gemm_impl(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// 2^(x - sub) with x - sub <= 0 in practice (scores minus their row max or LSE):
// t = n + f, n integer, |f| <= 0.5; 2^f by its degree-7 Taylor polynomial (truncation error
// < 6e-9 relative, below float's half-ulp), 2^n by building the exponent bits.
FA_CPU_CLONES void exp2_sub(float* x, int64_t n, float sub) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float raw = x[i] - sub;
    float t = raw < -126.0f ? -126.0f : raw;  // below 2^-126 the result is flushed to 0
    t = t > 127.0f ? 127.0f : t;
    const float fl = std::nearbyint(t);
    const float f = t - fl;
    float p = 1.525273380e-05f;
    p = p * f + 1.540353039e-04f;
    p = p * f + 1.333355815e-03f;
    p = p * f + 9.618129108e-03f;
    p = p * f + 5.550410866e-02f;
    p = p * f + 2.402265070e-01f;
    p = p * f + 6.931471806e-01f;
    p = p * f + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fl) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = raw < -126.0f ? 0.0f : (raw != raw ? raw : p * scale);
  }
}

void exp2_sub(double* x, int64_t n, double sub) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp2(x[i] - sub);
}

}  // namespace flashattn::cpu

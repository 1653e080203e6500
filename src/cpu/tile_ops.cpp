#include "tile_ops.hpp"

#include <cmath>
#include <cstring>

// Each kernel is compiled three times, for AVX-512, AVX2+FMA and baseline x86-64, from one
// always-inlined body, and the variant is picked once from the CPU's features. (GCC's
// target_clones("arch=...") tests the CPU *model*, so newer CPUs fell back to baseline.)
#if defined(__x86_64__) && defined(__GNUC__)
#define FA_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma,bmi2")))
#define FA_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2")))
#define FA_INLINE inline __attribute__((always_inline))
#define FA_HAVE_ISA_VARIANTS 1
#else
#define FA_INLINE inline
#define FA_HAVE_ISA_VARIANTS 0
#endif

namespace flashattn::cpu {
namespace {

// Register block of C: kRows x kCols accumulators live in vector registers across the K loop.
template <typename T, int kRows, int kCols>
FA_INLINE void gemm_block(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
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
FA_INLINE void gemm_impl(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
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

// 2^(x - sub) with x - sub <= 0 in practice (scores minus their row max or LSE):
// t = n + f, n integer, |f| <= 0.5; 2^f by its degree-7 Taylor polynomial (truncation error
// < 6e-9 relative, below float's half-ulp), 2^n by building the exponent bits.
FA_INLINE void exp2_sub_impl(float* x, int64_t n, float sub) {
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

// Defines name##_avx512, name##_avx2, name##_baseline from one always-inlined body.
#if FA_HAVE_ISA_VARIANTS
#define FA_ISA_VARIANTS(ret, name, params, body) \
  FA_TARGET_AVX512 ret name##_avx512 params body  \
  FA_TARGET_AVX2 ret name##_avx2 params body      \
  ret name##_baseline params body
#else
#define FA_ISA_VARIANTS(ret, name, params, body) ret name##_baseline params body
#endif

FA_ISA_VARIANTS(void, gemm_f32,
                (int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate),
                { gemm_impl(M, N, K, A, lda, B, ldb, C, ldc, accumulate); })
FA_ISA_VARIANTS(void, gemm_f64,
                (int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
                 int64_t ldb, double* C, int64_t ldc, bool accumulate),
                { gemm_impl(M, N, K, A, lda, B, ldb, C, ldc, accumulate); })
FA_ISA_VARIANTS(void, exp2_f32, (float* x, int64_t n, float sub), { exp2_sub_impl(x, n, sub); })

CpuIsa detect_isa() {
#if FA_HAVE_ISA_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

const CpuIsa kIsa = detect_isa();

#if FA_HAVE_ISA_VARIANTS
#define FA_DISPATCH(name, ...)                                     \
  switch (kIsa) {                                                  \
    case CpuIsa::kAvx512:                                          \
      return name##_avx512(__VA_ARGS__);                           \
    case CpuIsa::kAvx2:                                            \
      return name##_avx2(__VA_ARGS__);                             \
    case CpuIsa::kBaseline:                                        \
      return name##_baseline(__VA_ARGS__);                         \
  }
#else
#define FA_DISPATCH(name, ...) return name##_baseline(__VA_ARGS__);
#endif

}  // namespace

CpuIsa cpu_isa() { return kIsa; }

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2+fma";
    case CpuIsa::kBaseline:
      return "baseline";
  }
  return "unknown";
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  FA_DISPATCH(gemm_f32, M, N, K, A, lda, B, ldb, C, ldc, accumulate)
}

void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
          int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  FA_DISPATCH(gemm_f64, M, N, K, A, lda, B, ldb, C, ldc, accumulate)
}

void exp2_sub(float* x, int64_t n, float sub) { FA_DISPATCH(exp2_f32, x, n, sub) }

void exp2_sub(double* x, int64_t n, double sub) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp2(x[i] - sub);
}

}  // namespace flashattn::cpu

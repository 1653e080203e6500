#include "tile_ops.hpp"

#include <cmath>
#include <cstring>
#include <limits>

// Each kernel is compiled three times, for AVX-512, AVX2+FMA and baseline x86-64, from one
// always-inlined body, and the variant is picked once from the CPU's features. (GCC's
// target_clones("arch=...") tests the CPU *model*, so newer CPUs would fall back to baseline.)
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
template <typename T, int kRows, int kCols, bool kTransA>
FA_INLINE void gemm_block(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                          bool accumulate) {
  T acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) acc[r][c] = accumulate ? C[r * ldc + c] : T(0);
  }
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
    for (int r = 0; r < kRows; ++r) {
      const T a = kTransA ? A[k * lda + r] : A[r * lda + k];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) C[r * ldc + c] = acc[r][c];
  }
}

template <typename T, bool kTransA>
FA_INLINE void gemm_impl(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                         int64_t ldc, bool accumulate) {
  constexpr int kRows = 4;
  constexpr int kWide = 64 / sizeof(T) * 2;  // two 64-byte vectors per row
  constexpr int kNarrow = 16;
  for (int64_t i = 0; i < M; i += kRows) {
    const T* a = kTransA ? A + i : A + i * lda;
    int64_t j = 0;
    for (; j + kWide <= N; j += kWide) {
      gemm_block<T, kRows, kWide, kTransA>(K, a, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    }
    for (; j < N; j += kNarrow) {
      gemm_block<T, kRows, kNarrow, kTransA>(K, a, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    }
  }
}

// 2^t for float: t = n + f, n integer, |f| <= 0.5; 2^f by its degree-7 Taylor polynomial
// (truncation error < 6e-9 relative, below float's half-ulp), 2^n by building the exponent
// bits. t < -126 flushes to 0 (so -inf gives 0); NaN stays NaN.
FA_INLINE float exp2_value(float t) {
  float c = t < -126.0f ? -126.0f : t;
  c = c > 127.0f ? 127.0f : c;
  const float fl = std::nearbyint(c);
  const float f = c - fl;
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
  return t < -126.0f ? 0.0f : (t != t ? t : p * scale);
}

FA_INLINE double exp2_value(double t) { return std::exp2(t); }

template <typename T>
FA_INLINE void column_max_impl(const T* s, int64_t ld, int64_t rows, int64_t cols, T* col_max) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = s + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) col_max[c] = row[c] > col_max[c] ? row[c] : col_max[c];
  }
}

template <typename T>
FA_INLINE void exp2_columns_impl(T* s, int64_t ld, int64_t rows, int64_t cols, const T* sub, T* col_sum) {
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * ld;
    if (col_sum) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        row[c] = exp2_value(row[c] - sub[c]);
        col_sum[c] += row[c];
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) row[c] = exp2_value(row[c] - sub[c]);
    }
  }
}

template <typename T>
FA_INLINE void ds_columns_impl(const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) s[r * ld + c] = p[r * ld + c] * (s[r * ld + c] - delta[c]);
  }
}

template <typename T>
FA_INLINE void exp2_rows_impl(T* s, int64_t ld, int64_t rows, int64_t cols, const T* sub) {
  for (int64_t r = 0; r < rows; ++r) {
    const T m = sub[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) s[r * ld + c] = exp2_value(s[r * ld + c] - m);
  }
}

template <typename T>
FA_INLINE void ds_rows_impl(const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    const T dr = delta[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) s[r * ld + c] = p[r * ld + c] * (s[r * ld + c] - dr);
  }
}

template <typename T>
FA_INLINE void scale_rows_impl(T* x, int64_t ld, int64_t rows, int64_t cols, const T* factor) {
  for (int64_t r = 0; r < rows; ++r) {
    const T f = factor[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) x[r * ld + c] *= f;
  }
}

// Defines name##_avx512, name##_avx2 and name##_baseline from one always-inlined body.
#if FA_HAVE_ISA_VARIANTS
#define FA_ISA_VARIANTS(name, params, ...)                                                      \
  FA_TARGET_AVX512 void name##_avx512 params __VA_ARGS__ FA_TARGET_AVX2 void name##_avx2 params \
      __VA_ARGS__ void name##_baseline params __VA_ARGS__
#else
#define FA_ISA_VARIANTS(name, params, ...) void name##_baseline params __VA_ARGS__
#endif

#define FA_KERNELS_FOR(T, suffix)                                                                                  \
  FA_ISA_VARIANTS(gemm_##suffix,                                                                                   \
                  (int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,        \
                   int64_t ldc, bool acc),                                                                         \
                  { gemm_impl<T, false>(M, N, K, A, lda, B, ldb, C, ldc, acc); })                                  \
  FA_ISA_VARIANTS(gemm_tn_##suffix,                                                                                \
                  (int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,        \
                   int64_t ldc, bool acc),                                                                         \
                  { gemm_impl<T, true>(M, N, K, A, lda, B, ldb, C, ldc, acc); })                                   \
  FA_ISA_VARIANTS(column_max_##suffix, (const T* s, int64_t ld, int64_t rows, int64_t cols, T* m),                 \
                  { column_max_impl(s, ld, rows, cols, m); })                                                      \
  FA_ISA_VARIANTS(exp2_columns_##suffix, (T * s, int64_t ld, int64_t rows, int64_t cols, const T* sub, T* sum),    \
                  { exp2_columns_impl(s, ld, rows, cols, sub, sum); })                                             \
  FA_ISA_VARIANTS(ds_columns_##suffix, (const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta), \
                  { ds_columns_impl(p, s, ld, rows, cols, delta); })                                               \
  FA_ISA_VARIANTS(exp2_rows_##suffix, (T * s, int64_t ld, int64_t rows, int64_t cols, const T* sub),               \
                  { exp2_rows_impl(s, ld, rows, cols, sub); })                                                     \
  FA_ISA_VARIANTS(ds_rows_##suffix, (const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta),    \
                  { ds_rows_impl(p, s, ld, rows, cols, delta); })                                                  \
  FA_ISA_VARIANTS(scale_rows_##suffix, (T * x, int64_t ld, int64_t rows, int64_t cols, const T* f),                \
                  { scale_rows_impl(x, ld, rows, cols, f); })

FA_KERNELS_FOR(float, f32)
FA_KERNELS_FOR(double, f64)

CpuIsa detect_isa() {
#if FA_HAVE_ISA_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

const CpuIsa kIsa = detect_isa();

#if FA_HAVE_ISA_VARIANTS
#define FA_DISPATCH(name, ...)             \
  switch (kIsa) {                          \
    case CpuIsa::kAvx512:                  \
      return name##_avx512(__VA_ARGS__);   \
    case CpuIsa::kAvx2:                    \
      return name##_avx2(__VA_ARGS__);     \
    case CpuIsa::kBaseline:                \
      return name##_baseline(__VA_ARGS__); \
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
      return "baseline x86-64";
  }
  return "unknown";
}

#define FA_DEFINE_ENTRY_POINTS(T, suffix)                                                                            \
  template <>                                                                                                        \
  void gemm<T>(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, \
               bool acc) {                                                                                           \
    FA_DISPATCH(gemm_##suffix, M, N, K, A, lda, B, ldb, C, ldc, acc)                                                 \
  }                                                                                                                  \
  template <>                                                                                                        \
  void gemm_tn<T>(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,           \
                  int64_t ldc, bool acc) {                                                                           \
    FA_DISPATCH(gemm_tn_##suffix, M, N, K, A, lda, B, ldb, C, ldc, acc)                                              \
  }                                                                                                                  \
  template <>                                                                                                        \
  void column_max<T>(const T* s, int64_t ld, int64_t rows, int64_t cols, T* m) {                                     \
    FA_DISPATCH(column_max_##suffix, s, ld, rows, cols, m)                                                           \
  }                                                                                                                  \
  template <>                                                                                                        \
  void exp2_columns<T>(T * s, int64_t ld, int64_t rows, int64_t cols, const T* sub, T* sum) {                        \
    FA_DISPATCH(exp2_columns_##suffix, s, ld, rows, cols, sub, sum)                                                  \
  }                                                                                                                  \
  template <>                                                                                                        \
  void ds_columns<T>(const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta) {                     \
    FA_DISPATCH(ds_columns_##suffix, p, s, ld, rows, cols, delta)                                                    \
  }                                                                                                                  \
  template <>                                                                                                        \
  void exp2_rows<T>(T * s, int64_t ld, int64_t rows, int64_t cols, const T* sub) {                                   \
    FA_DISPATCH(exp2_rows_##suffix, s, ld, rows, cols, sub)                                                          \
  }                                                                                                                  \
  template <>                                                                                                        \
  void ds_rows<T>(const T* p, T* s, int64_t ld, int64_t rows, int64_t cols, const T* delta) {                        \
    FA_DISPATCH(ds_rows_##suffix, p, s, ld, rows, cols, delta)                                                       \
  }                                                                                                                  \
  template <>                                                                                                        \
  void scale_rows<T>(T * x, int64_t ld, int64_t rows, int64_t cols, const T* f) {                                    \
    FA_DISPATCH(scale_rows_##suffix, x, ld, rows, cols, f)                                                           \
  }

FA_DEFINE_ENTRY_POINTS(float, f32)
FA_DEFINE_ENTRY_POINTS(double, f64)

}  // namespace flashattn::cpu

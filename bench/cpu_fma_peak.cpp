// Measures this machine's fp32 FMA peak (GFLOP/s) with independent AVX-512 FMA chains on every
// OpenMP thread: the ceiling the CPU backend's GFLOP/s are reported against.
// Build: g++ -O2 -march=native -fopenmp bench/cpu_fma_peak.cpp -o cpu_fma_peak
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr int kChains = 12;  // > FMA latency x ports: keeps both FMA pipes busy
  constexpr long kIters = 200'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.001f * c);
      const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
      for (long i = 0; i < kIters / omp_get_num_threads(); ++i) {
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
      }
      for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_ps(acc[c]);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gflops = 2.0 * 16 * kChains * static_cast<double>(kIters) / s / 1e9;  // 16 lanes
    if (gflops > best) best = gflops;
    std::printf("rep %d: %.1f GFLOP/s (sink %g)\n", rep, gflops, sink);
  }
  std::printf("fp32 FMA peak: %.1f GFLOP/s on %d threads\n", best, omp_get_max_threads());
}

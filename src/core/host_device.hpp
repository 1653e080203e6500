// Marks functions shared by the CPU backend and CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define FA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FA_HOST_DEVICE inline
#endif

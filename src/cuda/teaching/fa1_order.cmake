# The FA1-order teaching kernel (fa1_order.h): shared library flashattn_fa1_teaching, outside the
# product API, for the loop-order benchmark (ctypes from bench/). Included by the top-level
# CMakeLists.txt when the CUDA backend is on; same CUDA flags as the backend's kernels
# (kernels.cmake), for CMAKE_CUDA_ARCHITECTURES. One generated instantiation file per
# (dtype, head_dim), from one list.

set(_fa1_dir ${PROJECT_SOURCE_DIR}/src/cuda/teaching)
set(_fa1_gen_dir ${PROJECT_BINARY_DIR}/generated/teaching)
set(_fa1_sources ${_fa1_dir}/fa1_order_api.cpp)
foreach(FA_ELEM IN ITEMS kFloat16 kBFloat16)
  foreach(FA_HEAD_DIM IN ITEMS 64 128)  # = teaching::kFa1HeadDims
    set(_fa1_file ${_fa1_gen_dir}/fa1_order_${FA_ELEM}_d${FA_HEAD_DIM}.cu)
    configure_file(${_fa1_dir}/fa1_order_instance.cu.in ${_fa1_file} @ONLY)
    list(APPEND _fa1_sources ${_fa1_file})
  endforeach()
endforeach()

add_library(flashattn_fa1_teaching SHARED ${_fa1_sources})
target_include_directories(flashattn_fa1_teaching PUBLIC ${_fa1_dir} PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_include_directories(flashattn_fa1_teaching SYSTEM PRIVATE ${FLASHATTN_CUTLASS_DIR})
target_compile_options(flashattn_fa1_teaching PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
target_link_libraries(flashattn_fa1_teaching PRIVATE ${FLASHATTN_CUDART} flashattn_warnings)
set_target_properties(flashattn_fa1_teaching PROPERTIES
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CUDA_EXTENSIONS OFF
  CUDA_RUNTIME_LIBRARY ${FLASHATTN_CUDA_RUNTIME}
  EXPORT_COMPILE_COMMANDS ON)  # tests/check_cuda_kernels.py finds the objects through it

# The draft sm90a forward (issue 7): flashattn_sm90_draft, a static library of its own (not in
# libflashattn until the kernel registry takes it, after GPU validation). Included by the
# top-level CMakeLists.txt when FLASHATTN_SM90_DRAFT and the CUDA backend are on.
#
# One generated .cu per (dtype, head dim, mask kind), so the ~1-minute sm90a CuTe compiles run in
# parallel; compiled for sm_90a alone (WGMMA and setmaxnreg exist only there).

set(_fa_sm90_dir ${PROJECT_SOURCE_DIR}/src/cuda/sm90)
set(_fa_sm90_gen_dir ${PROJECT_BINARY_DIR}/generated/cuda/sm90)
set(_fa_sm90_head_dims 64 128)  # = sm90::kSm90HeadDims
set(_fa_sm90_sources "")
foreach(_fa_dtype IN ITEMS Float16 BFloat16)
  if(_fa_dtype STREQUAL "Float16")
    set(_fa_short fp16)
  else()
    set(_fa_short bf16)
  endif()
  foreach(_fa_d IN LISTS _fa_sm90_head_dims)
    foreach(_fa_mask IN ITEMS None Masked)
      set(FA_INSTANCES "FLASHATTN_SM90_FORWARD_INSTANCE(k${_fa_dtype}, ${_fa_d}, k${_fa_mask})")
      string(TOLOWER ${_fa_mask} _fa_mask_lower)
      set(_fa_file ${_fa_sm90_gen_dir}/sm90_fwd_${_fa_short}_d${_fa_d}_${_fa_mask_lower}.cu)
      configure_file(${_fa_sm90_dir}/instantiate.cu.in ${_fa_file} @ONLY)
      list(APPEND _fa_sm90_sources ${_fa_file})
    endforeach()
  endforeach()
endforeach()

add_library(flashattn_sm90_draft STATIC ${_fa_sm90_sources})
target_include_directories(flashattn_sm90_draft PUBLIC ${PROJECT_SOURCE_DIR}/src)
target_include_directories(flashattn_sm90_draft SYSTEM PRIVATE ${FLASHATTN_CUTLASS_DIR})
target_compile_options(flashattn_sm90_draft PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a>)
target_link_libraries(flashattn_sm90_draft PUBLIC CUDA::cudart PRIVATE flashattn_warnings)
set_target_properties(flashattn_sm90_draft PROPERTIES
  CUDA_ARCHITECTURES OFF  # the -gencode above is the only target
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CUDA_EXTENSIONS OFF
  CUDA_RUNTIME_LIBRARY Shared
  POSITION_INDEPENDENT_CODE ON
  EXPORT_COMPILE_COMMANDS ON)  # for ptxas -v rechecks, like flashattn_cuda_kernels

# The sm90a (Hopper) forward and backward kernels: object library flashattn_sm90_kernels, folded
# into libflashattn, and sm90_{forward,backward}_kernels.inc, the registry's tables of them (empty when the
# family is not built). Included by src/cuda/kernels.cmake.
#
# FLASHATTN_CUDA_SM90: AUTO (default) builds the family when CMAKE_CUDA_ARCHITECTURES names 90a
# (WGMMA and setmaxnreg exist only in sm_90a code); ON builds it regardless (CI compiles it for
# the static checks in a build for "80"); OFF never. Head dims: FLASHATTN_CUDA_HEAD_DIMS that
# have an sm90 kernel (sm90::kSm90HeadDims); the others run the sm80 kernels on Hopper too.
# Two generated .cu per (dtype, head dim, mask kind), the dense and the varlen kernel (three for
# d64 masked: its tall kernel too), and one per backward kernel, so the ~1-minute CuTe compiles
# run in parallel; each is compiled for sm_90a alone.

set(FLASHATTN_CUDA_SM90 AUTO CACHE STRING "Build the sm90a forward kernels: AUTO (when the archs name 90a), ON, OFF")
set_property(CACHE FLASHATTN_CUDA_SM90 PROPERTY STRINGS AUTO ON OFF)
set(_fa_sm90_build OFF)
if(FLASHATTN_CUDA_SM90 STREQUAL "ON" OR (FLASHATTN_CUDA_SM90 STREQUAL "AUTO" AND CMAKE_CUDA_ARCHITECTURES MATCHES "90a"))
  set(_fa_sm90_build ON)
endif()

# FLASHATTN_CUDA_SM90_INSTANCES: empty (default) builds every (dtype, head dim, mask kind) of the
# family; else only the listed ones, named as their files (fp16_d128_none, bf16_d256_masked, ...):
# CI compiles a subset that still covers both dtypes, two head dims and both mask kinds. The
# registry's table lists what was built; the rest runs the sm80 kernels.
set(FLASHATTN_CUDA_SM90_INSTANCES "" CACHE STRING "sm90 forward instances to build (empty: all)")

# FLASHATTN_CUDA_SM90_DROPOUT: also build the dropout kernels of head dims 64-128 (instances
# <dtype>_d<D>_dropout; on by default, GPU-tested and 1.04-1.43x the sm80 dropout kernels on an
# H100); OFF leaves dropout to the sm80 kernels and saves their 12 compiles.
option(FLASHATTN_CUDA_SM90_DROPOUT "Build the sm90a forward kernels with dropout" ON)
# FLASHATTN_CUDA_SM90_BLOCK_SPARSE: also build the block-sparse kernels (instances
# <dtype>_d<D>_blocksparse, head dims 64 - 128: sm90::has_sparse_kernel); without them, and at
# the other head dims, a block mask runs the sm80 block-sparse kernels on Hopper (1.7-2.2x slower
# at d128, 1.06-1.26x at d64 on an H100: bench/results/gpu/blocksparse-sm90-h100-b03e17c).
option(FLASHATTN_CUDA_SM90_BLOCK_SPARSE "Build the sm90a block-sparse forward kernels" ON)
set(_fa_sm90_masks None Masked)
if(FLASHATTN_CUDA_SM90_DROPOUT)
  list(APPEND _fa_sm90_masks MaskedDropout)
endif()

set(_fa_sm90_dir ${PROJECT_SOURCE_DIR}/src/cuda/sm90)
set(_fa_sm90_gen_dir ${PROJECT_BINARY_DIR}/generated/cuda/sm90)
set(_fa_sm90_head_dims 64 96 128 192 256)  # = sm90::kSm90HeadDims
set(_fa_sm90_backward_head_dims 64 128)  # = sm90::kSm90BackwardHeadDims, with the options below
# FLASHATTN_CUDA_SM90_BACKWARD_D96 / _D192 / _D256 / _DROPOUT (on): the d96 backward kernels
# (32-byte swizzled K and V), the d192 and d256 ones (the consumers split the head dim:
# docs/design/hopper-backward.md), and the dropout kernels of head dims 64-128
# (bwd_<dtype>_d<D>_dropout ...). Each passed its GPU tests, race reruns and the four sanitizers
# on an H100 (bench/results/gpu/sm90-backward-d96-dropout-h100-3beea1b,
# sm90-backward-d192-h100-7aade29, sm90-backward-checks-h100-b081f40,
# sm90-backward-grid-h100-554e3aa); turned off, those calls' backward runs the sm80 kernel.
option(FLASHATTN_CUDA_SM90_BACKWARD_D96 "Build the sm90a d96 backward kernels" ON)
option(FLASHATTN_CUDA_SM90_BACKWARD_DROPOUT "Build the sm90a backward kernels with dropout" ON)
option(FLASHATTN_CUDA_SM90_BACKWARD_D192 "Build the sm90a d192 backward kernels" ON)
option(FLASHATTN_CUDA_SM90_BACKWARD_D256 "Build the sm90a d256 backward kernels" ON)
if(FLASHATTN_CUDA_SM90_BACKWARD_D96)
  list(APPEND _fa_sm90_backward_head_dims 96)
endif()
if(FLASHATTN_CUDA_SM90_BACKWARD_D192)
  list(APPEND _fa_sm90_backward_head_dims 192)
endif()
if(FLASHATTN_CUDA_SM90_BACKWARD_D256)
  list(APPEND _fa_sm90_backward_head_dims 256)
endif()
set(_fa_sm90_sources "")
set(_fa_sm90_table "")
set(_fa_sm90_backward_table "")
if(_fa_sm90_build)
  foreach(_fa_dtype IN LISTS _fa_dtypes)
    set(_fa_short ${_fa_short_${_fa_dtype}})
    foreach(_fa_d IN LISTS FLASHATTN_CUDA_HEAD_DIMS)
      if(NOT _fa_d IN_LIST _fa_sm90_head_dims)
        continue()
      endif()
      foreach(_fa_mask IN LISTS _fa_sm90_masks)
        if(_fa_mask STREQUAL "MaskedDropout" AND _fa_d GREATER 128)
          continue()  # spilled (d192 28 bytes, d256 44: O's registers): their dropout runs on sm80
        endif()
        string(TOLOWER ${_fa_mask} _fa_mask_lower)
        string(REPLACE "maskeddropout" "dropout" _fa_mask_lower ${_fa_mask_lower})
        set(_fa_instance ${_fa_short}_d${_fa_d}_${_fa_mask_lower})
        if(FLASHATTN_CUDA_SM90_INSTANCES AND NOT _fa_instance IN_LIST FLASHATTN_CUDA_SM90_INSTANCES)
          continue()
        endif()
        string(APPEND _fa_sm90_table "FLASHATTN_SM90_FORWARD(k${_fa_dtype}, ${_fa_d}, k${_fa_mask})\n")
        # Two files: the dense kernel (with run_sm90_forward) and the varlen one; d64 masked has
        # a third, its tall kernel (three consumers, forward_traits.cuh kTallConsumers).
        set(_fa_kinds FORWARD VARLEN)
        if(_fa_d EQUAL 64 AND _fa_mask STREQUAL "Masked")
          list(APPEND _fa_kinds TALL)
        endif()
        set(_fa_args "k${_fa_dtype}, ${_fa_d}, k${_fa_mask}")
        foreach(_fa_kind IN LISTS _fa_kinds)
          set(FA_INSTANCES "FLASHATTN_SM90_${_fa_kind}_INSTANCE(${_fa_args})")
          set(FA_LAUNCH_HEADER forward_launch.cuh)
          set(_fa_file ${_fa_sm90_gen_dir}/sm90_fwd_${_fa_instance}.cu)
          if(_fa_kind STREQUAL "FORWARD" AND "TALL" IN_LIST _fa_kinds)
            set(FA_INSTANCES "FLASHATTN_SM90_TALL_EXTERN(${_fa_args})\n${FA_INSTANCES}")
          elseif(NOT _fa_kind STREQUAL "FORWARD")
            string(TOLOWER ${_fa_kind} _fa_kind_lower)
            set(_fa_file ${_fa_sm90_gen_dir}/sm90_fwd_${_fa_instance}_${_fa_kind_lower}.cu)
          endif()
          configure_file(${_fa_sm90_dir}/instantiate.cu.in ${_fa_file} @ONLY)
          list(APPEND _fa_sm90_sources ${_fa_file})
        endforeach()
      endforeach()
      set(_fa_instance ${_fa_short}_d${_fa_d}_blocksparse)
      if(FLASHATTN_CUDA_SM90_BLOCK_SPARSE AND _fa_d LESS_EQUAL 128 AND
         (NOT FLASHATTN_CUDA_SM90_INSTANCES OR _fa_instance IN_LIST FLASHATTN_CUDA_SM90_INSTANCES))
        string(APPEND _fa_sm90_table "FLASHATTN_SM90_SPARSE_FORWARD(k${_fa_dtype}, ${_fa_d})\n")
        set(FA_INSTANCES "FLASHATTN_SM90_SPARSE_INSTANCE(k${_fa_dtype}, ${_fa_d})")
        set(FA_LAUNCH_HEADER forward_launch.cuh)
        set(_fa_file ${_fa_sm90_gen_dir}/sm90_fwd_${_fa_instance}.cu)
        configure_file(${_fa_sm90_dir}/instantiate.cu.in ${_fa_file} @ONLY)
        list(APPEND _fa_sm90_sources ${_fa_file})
      endif()
    endforeach()
  endforeach()
  # The backward kernels (sm90::kSm90BackwardHeadDims): per (dtype, head dim, mask kind) a file
  # of the dense raw-score kernel (named bwd_<dtype>_d<D>_<mask> in FLASHATTN_CUDA_SM90_INSTANCES),
  # one of the softcap / ALiBi kernel (..._scoremods), one of the varlen kernel (..._varlen) and
  # one of the varlen softcap / ALiBi kernel (..._varlen_scoremods, with both others); with an
  # instance list, each of the last three is built only beside the first and when listed. Calls a
  # build lacks go to the sm80 backward, as do dropout and the other head dims.
  foreach(_fa_dtype IN LISTS _fa_dtypes)
    set(_fa_short ${_fa_short_${_fa_dtype}})
    foreach(_fa_d IN LISTS FLASHATTN_CUDA_HEAD_DIMS)
      if(NOT _fa_d IN_LIST _fa_sm90_backward_head_dims)
        continue()
      endif()
      set(_fa_backward_masks None Masked)
      if(FLASHATTN_CUDA_SM90_BACKWARD_DROPOUT AND _fa_d LESS_EQUAL 128)
        list(APPEND _fa_backward_masks MaskedDropout)
      endif()
      foreach(_fa_mask IN LISTS _fa_backward_masks)
        string(TOLOWER ${_fa_mask} _fa_mask_lower)
        string(REPLACE "maskeddropout" "dropout" _fa_mask_lower ${_fa_mask_lower})
        set(_fa_instance bwd_${_fa_short}_d${_fa_d}_${_fa_mask_lower})
        if(FLASHATTN_CUDA_SM90_INSTANCES AND NOT _fa_instance IN_LIST FLASHATTN_CUDA_SM90_INSTANCES)
          continue()
        endif()
        foreach(_fa_part scoremods varlen)
          set(_fa_${_fa_part} true)
          if(FLASHATTN_CUDA_SM90_INSTANCES AND NOT ${_fa_instance}_${_fa_part} IN_LIST FLASHATTN_CUDA_SM90_INSTANCES)
            set(_fa_${_fa_part} false)
          endif()
        endforeach()
        set(_fa_args "k${_fa_dtype}, ${_fa_d}, k${_fa_mask}")
        string(APPEND _fa_sm90_backward_table "FLASHATTN_SM90_BACKWARD(${_fa_args}, ${_fa_scoremods}, ${_fa_varlen})\n")
        set(FA_LAUNCH_HEADER backward_launch.cuh)
        # (suffix, raw scores, varlen) of each further kernel file
        set(_fa_kernels "")
        if(_fa_scoremods)
          list(APPEND _fa_kernels "_scoremods,false,false")
        endif()
        if(_fa_varlen)
          list(APPEND _fa_kernels "_varlen,true,true")
          if(_fa_scoremods)
            list(APPEND _fa_kernels "_varlen_scoremods,false,true")
          endif()
        endif()
        set(FA_INSTANCES "FLASHATTN_SM90_BACKWARD_INSTANCE(${_fa_args}, ${_fa_scoremods}, ${_fa_varlen})")
        set(_fa_file ${_fa_sm90_gen_dir}/sm90_${_fa_instance}.cu)
        configure_file(${_fa_sm90_dir}/instantiate.cu.in ${_fa_file} @ONLY)
        list(APPEND _fa_sm90_sources ${_fa_file})
        foreach(_fa_kernel IN LISTS _fa_kernels)
          string(REPLACE "," ";" _fa_kernel ${_fa_kernel})
          list(GET _fa_kernel 0 _fa_suffix)
          list(GET _fa_kernel 1 _fa_raw)
          list(GET _fa_kernel 2 _fa_is_varlen)
          set(FA_INSTANCES "FLASHATTN_SM90_BACKWARD_KERNEL_INSTANCE(${_fa_args}, ${_fa_raw}, ${_fa_is_varlen})")
          set(_fa_file ${_fa_sm90_gen_dir}/sm90_${_fa_instance}${_fa_suffix}.cu)
          configure_file(${_fa_sm90_dir}/instantiate.cu.in ${_fa_file} @ONLY)
          list(APPEND _fa_sm90_sources ${_fa_file})
        endforeach()
      endforeach()
    endforeach()
  endforeach()
  flashattn_check_instances(FLASHATTN_CUDA_SM90_INSTANCES "sm90_(fwd_)?"
    "bf16_d128_masked, bf16_d128_blocksparse, bwd_bf16_d128_none(_scoremods, _varlen, _varlen_scoremods): fp16 or bf16, a head dim of FLASHATTN_CUDA_HEAD_DIMS, none, masked (or dropout)"
    ${_fa_sm90_sources})
endif()
file(CONFIGURE OUTPUT ${_fa_gen_dir}/sm90_forward_kernels.inc
     CONTENT "// Generated by src/cuda/sm90/sm90.cmake: the compiled sm90a forward kernels.\n${_fa_sm90_table}"
     @ONLY)
file(CONFIGURE OUTPUT ${_fa_gen_dir}/sm90_backward_kernels.inc
     CONTENT "// Generated by src/cuda/sm90/sm90.cmake: the compiled sm90a backward kernels.\n${_fa_sm90_backward_table}"
     @ONLY)

if(_fa_sm90_sources)
  add_library(flashattn_sm90_kernels OBJECT ${_fa_sm90_sources})
  flashattn_cuda_objects(flashattn_sm90_kernels)  # (kernels.cmake)
  target_compile_options(flashattn_sm90_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a>)
  set_target_properties(flashattn_sm90_kernels PROPERTIES CUDA_ARCHITECTURES OFF)  # the -gencode above is the only target
  # WGMMA's N in steps of 8 (CuTe's op selector offers N = 80, 112, ... only with this): the key
  # tiles of d192 / d256 are not multiples of 64.
  target_compile_definitions(flashattn_sm90_kernels PRIVATE CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
  target_sources(flashattn PRIVATE $<TARGET_OBJECTS:flashattn_sm90_kernels>)
  # Per-step clock stamps of CTA 0's consumers, printed by the host after each launch
  # (src/cuda/sm90/trace.cuh, bench/sm90_trace.py, bench/sm90_backward_trace.py): a tuning build only.
  option(FLASHATTN_CUDA_SM90_TRACE "Print the sm90 kernels' per-step clock stamps (tuning only)" OFF)
  if(FLASHATTN_CUDA_SM90_TRACE)
    target_compile_definitions(flashattn_sm90_kernels PRIVATE FLASHATTN_SM90_TRACE)
  endif()
endif()

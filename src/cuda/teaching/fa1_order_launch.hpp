// Declaration of the FA1-order teaching kernel's launchers; their definitions are explicit
// instantiations in the .cu files fa1_order.cmake generates (one per dtype x head_dim), so the
// C entry point compiles as plain C++ without CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include "fa1_order_params.hpp"

namespace flashattn::cuda::teaching {

// One launch: grid (q_groups, params.heads, batch). With params.o_in_registers, q_groups must be
// the number of query tiles.
template <ElemType kElem, int kHeadDim>
cudaError_t run_fa1_order(const Fa1Params& params, int batch, int q_groups, cudaStream_t stream);

}  // namespace flashattn::cuda::teaching

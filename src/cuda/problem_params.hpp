// The kernels' parameter structs built from a validated Problem (plain C++, shared by the
// dispatch in backend.cpp and the decode setup).
#pragma once

#include "../problem.hpp"
#include "params.hpp"

namespace flashattn::cuda {

// q, k, v, out, lse rows, shapes (varlen: maxima), window, score mods with log2(e) folded in
// (the one place), dropout.
ForwardParams forward_params(const detail::Problem& p);

}  // namespace flashattn::cuda

// Host side of the decode kernels (plain C++20, no CUDA header): how a KV-cache call is laid out
// on the GPU -- rows per CTA, split-KV count, the partials' workspace -- and its DecodeParams.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../kvcache_problem.hpp"
#include "decode_params.hpp"

namespace flashattn::cuda::decode {

// From shapes alone (so the workspace query and the call agree): num_splits as asked (capped), or
// with 0 enough splits for about two CTAs per SM where the cache is long enough to share.
DecodeLayout decode_layout(const detail::KvCacheProblem& kp, int sm_count);

// `workspace`: decode_layout's bytes (the partials), or null with one split.
DecodeParams decode_params(const detail::KvCacheProblem& kp, const DecodeLayout& layout, void* workspace);

}  // namespace flashattn::cuda::decode

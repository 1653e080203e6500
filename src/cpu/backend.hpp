// Entry points of the CPU backend. Problems arrive validated (src/validate.cpp).
#pragma once

#include "../kvcache_problem.hpp"
#include "../problem.hpp"

namespace flashattn::cpu {

// fp64 reference with explicit S and P (reference.cpp).
void reference_forward(const detail::Problem& p);
void reference_backward(const detail::Problem& p);

// Tiled FlashAttention-2 implementation (flash_forward.cpp, flash_backward.cpp).
void flash_forward(const detail::Problem& p);
void flash_backward(const detail::Problem& p);

// forward_kvcache (kvcache.cpp): appends k_new / v_new (rotated) to the cache, then runs the
// flash forward, or the reference when `reference`, over the cache.
void forward_kvcache(const detail::KvCacheProblem& kp, bool reference);

// Varlen rows that belong to no sequence (past cu_seqlens[batch], or keys beyond seqused_k) get
// defined values: out/dq/dk/dv 0 and lse -inf, so no output element is left unwritten.
void fill_unused_rows(const detail::Problem& p, detail::Direction direction);

}  // namespace flashattn::cpu

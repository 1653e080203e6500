#include "decode_launch.cuh"

namespace flashattn::cuda::decode {
int launch_bf16(const DecodeParams& p, const DecodeLayout& l, bool append, void* stream) {
  return launch<cutlass::bfloat16_t>(p, l, append, stream);
}
}  // namespace flashattn::cuda::decode

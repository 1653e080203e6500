#include "kernel_registry.hpp"

#include "sm80/forward_launch.hpp"

namespace flashattn::cuda {

const std::vector<ForwardKernel>& forward_kernels() {
  // Each entry names an explicit instantiation in a generated .cu file.
#define FLASHATTN_SM80_FORWARD(ELEM, HEAD_DIM, MASK)                                          \
  ForwardKernel{KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::MASK}, \
                &sm80::run_forward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK>},
  static const std::vector<ForwardKernel> kernels = {
#include "sm80_forward_kernels.inc"
  };
#undef FLASHATTN_SM80_FORWARD
  return kernels;
}

const ForwardKernel* find_forward_kernel(const KernelKey& key) {
  for (const ForwardKernel& k : forward_kernels()) {
    if (k.key == key) return &k;
  }
  return nullptr;
}

std::string kernel_name(const KernelKey& key) {
  std::string name = "sm" + std::to_string(key.arch);
  name += key.direction == detail::Direction::kForward ? "_fwd" : "_bwd";
  name += key.dtype == ElemType::kFloat16 ? "_fp16" : "_bf16";
  name += "_d" + std::to_string(key.head_dim);
  name += key.mask == MaskKind::kNone ? "_nomask" : key.mask == MaskKind::kMasked ? "_masked" : "_dropout";
  return name;
}

}  // namespace flashattn::cuda

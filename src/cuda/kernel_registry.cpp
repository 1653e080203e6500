#include "kernel_registry.hpp"

#include "sm80/backward_launch.hpp"
#include "sm80/forward_launch.hpp"
#include "sm90/backward_launch.hpp"
#include "sm90/forward_launch.hpp"

namespace flashattn::cuda {

const std::vector<ForwardKernel>& forward_kernels() {
  // Each line of the generated list names the explicit instantiations in a generated .cu file:
  // the sm80-tuned kernel and, where tile_shapes.hpp gives sm90 its own shape, the sm90-tuned one
  // (the same for the backward kernels, where sm90 gets its own stage count).
  static const std::vector<ForwardKernel> kernels = [] {
    std::vector<ForwardKernel> list;
#define FLASHATTN_SM80_FORWARD(ELEM, HEAD_DIM, MASK)                                                                \
  list.push_back({KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::MASK, 80},         \
                  &sm80::run_forward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::kSm80>});          \
  if (sm80::has_sm90_tiles(HEAD_DIM, MaskKind::MASK)) {                                                             \
    list.push_back({KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::MASK, 90},       \
                    &sm80::run_forward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::kSm90>});        \
  }                                                                                                                 \
  if (MaskKind::MASK != MaskKind::kMaskedDropout) {                                                                 \
    list.push_back({KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::MASK, 80, true}, \
                    &sm80::run_forward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::kSm80, true>});  \
  }                                                                                                                 \
  if (MaskKind::MASK == MaskKind::kMasked) {                                                                        \
    list.push_back(                                                                                                 \
        {KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::MASK, 80, false, true},     \
         &sm80::run_forward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::kSm80, false, true>});      \
  }
#include "sm80_forward_kernels.inc"
#undef FLASHATTN_SM80_FORWARD
#define FLASHATTN_SM90_FORWARD(ELEM, HEAD_DIM, MASK)                                                        \
  list.push_back({KernelKey{90, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::MASK, 90}, \
                  &sm90::run_sm90_forward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK>,                        \
                  &sm90::unsupported<ElemType::ELEM, HEAD_DIM, MaskKind::MASK>});
#define FLASHATTN_SM90_SPARSE_FORWARD(ELEM, HEAD_DIM)                                                            \
  list.push_back(                                                                                                \
      {KernelKey{90, ElemType::ELEM, HEAD_DIM, detail::Direction::kForward, MaskKind::kMasked, 90, false, true}, \
       &sm90::run_sm90_sparse_forward<ElemType::ELEM, HEAD_DIM>,                                                 \
       &sm90::sparse_unsupported<ElemType::ELEM, HEAD_DIM>});
#include "sm90_forward_kernels.inc"
#undef FLASHATTN_SM90_FORWARD
#undef FLASHATTN_SM90_SPARSE_FORWARD
    return list;
  }();
  return kernels;
}

const std::vector<BackwardKernel>& backward_kernels() {
  static const std::vector<BackwardKernel> kernels = [] {
    std::vector<BackwardKernel> list;
#define FLASHATTN_SM80_BACKWARD_FOR(ELEM, HEAD_DIM, MASK, TARGET)                                          \
  list.push_back({KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kBackward, MaskKind::MASK,    \
                            static_cast<int>(sm80::TileTarget::TARGET)},                                   \
                  &sm80::run_backward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::TARGET>, \
                  sm80::backward_smem_bytes<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::TARGET>()});
#define FLASHATTN_SM80_BACKWARD(ELEM, HEAD_DIM, MASK)                                                            \
  FLASHATTN_SM80_BACKWARD_FOR(ELEM, HEAD_DIM, MASK, kSm80)                                                       \
  if (sm80::has_sm90_backward_tiles(HEAD_DIM, MaskKind::MASK)) {                                                 \
    FLASHATTN_SM80_BACKWARD_FOR(ELEM, HEAD_DIM, MASK, kSm90)                                                     \
  }                                                                                                              \
  if (MaskKind::MASK == MaskKind::kMasked) {                                                                     \
    list.push_back(                                                                                              \
        {KernelKey{80, ElemType::ELEM, HEAD_DIM, detail::Direction::kBackward, MaskKind::MASK, 80, false, true}, \
         &sm80::run_backward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::kSm80, true>,           \
         sm80::backward_smem_bytes<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, sm80::TileTarget::kSm80, true>()}); \
  }
#include "sm80_backward_kernels.inc"
#undef FLASHATTN_SM80_BACKWARD
#undef FLASHATTN_SM80_BACKWARD_FOR
#define FLASHATTN_SM90_BACKWARD(ELEM, HEAD_DIM, MASK, SCORE_MODS, VARLEN)                                    \
  list.push_back({KernelKey{90, ElemType::ELEM, HEAD_DIM, detail::Direction::kBackward, MaskKind::MASK, 90}, \
                  &sm90::run_sm90_backward<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, SCORE_MODS, VARLEN>,    \
                  sm90::sm90_backward_smem_bytes<ElemType::ELEM, HEAD_DIM, MaskKind::MASK>(),                \
                  &sm90::backward_unsupported<ElemType::ELEM, HEAD_DIM, MaskKind::MASK, SCORE_MODS, VARLEN>});
#include "sm90_backward_kernels.inc"
#undef FLASHATTN_SM90_BACKWARD
    return list;
  }();
  return kernels;
}

namespace {

template <class Kernel>
const Kernel* find_kernel(const std::vector<Kernel>& kernels, const KernelKey& key) {
  for (const Kernel& k : kernels) {
    if (k.key == key) return &k;
  }
  return nullptr;
}

template <class Kernel>
const Kernel* find_kernel_for_code(const std::vector<Kernel>& kernels, KernelKey key, int code_arch) {
  key.tuned_for = code_arch / 10 == 9 ? 90 : 80;
  if (const Kernel* k = find_kernel(kernels, key)) return k;
  key.tuned_for = 80;
  return find_kernel(kernels, key);
}

}  // namespace

const ForwardKernel* find_forward_kernel(KernelKey key, int code_arch) {
  return find_kernel_for_code(forward_kernels(), key, code_arch);
}
const BackwardKernel* find_backward_kernel(KernelKey key, int code_arch) {
  return find_kernel_for_code(backward_kernels(), key, code_arch);
}

namespace {

// The sm90a kernel of `key` where the device runs it and it takes `params`, else nullptr. sm_90a
// code runs on compute capability 9.0 only, and only a build with sm_90 code loads it (code_arch
// 90; a build for "80" runs JIT-compiled sm_80 code on an H100).
template <class Kernel, class Params>
const Kernel* hopper_kernel(const std::vector<Kernel>& kernels, KernelKey key, int code_arch, int compute_capability,
                            const Params& params, bool allow_sm90) {
  if (!allow_sm90 || code_arch != 90 || compute_capability != 90) return nullptr;
  key.arch = 90;
  key.tuned_for = 90;
  const Kernel* k = find_kernel(kernels, key);
  return k != nullptr && k->unsupported(params) == nullptr ? k : nullptr;
}

}  // namespace

const ForwardKernel* select_forward_kernel(KernelKey key, int code_arch, int compute_capability,
                                           const ForwardParams& params, bool allow_sm90) {
  const ForwardKernel* k = hopper_kernel(forward_kernels(), key, code_arch, compute_capability, params, allow_sm90);
  if (k != nullptr && !sm90::varlen_prefers_sm80(params, key.mask)) return k;
  return find_forward_kernel(key, code_arch);
}

const BackwardKernel* select_backward_kernel(KernelKey key, int code_arch, int compute_capability,
                                             const BackwardParams& params, bool allow_sm90) {
  const BackwardKernel* k = hopper_kernel(backward_kernels(), key, code_arch, compute_capability, params, allow_sm90);
  return k != nullptr ? k : find_backward_kernel(key, code_arch);
}

std::string kernel_name(const KernelKey& key) {
  std::string name = "sm" + std::to_string(key.arch);
  name += key.direction == detail::Direction::kForward ? "_fwd" : "_bwd";
  name += key.dtype == ElemType::kFloat16 ? "_fp16" : "_bf16";
  name += "_d" + std::to_string(key.head_dim);
  name += key.mask == MaskKind::kNone ? "_nomask" : key.mask == MaskKind::kMasked ? "_masked" : "_dropout";
  if (key.tuned_for != key.arch) name += "_sm" + std::to_string(key.tuned_for) + "tiles";
  if (key.paged) name += "_paged";
  if (key.block_sparse) name += "_blocksparse";
  return name;
}

}  // namespace flashattn::cuda

// Validation of a block-sparse mask (AttentionOptions::block_mask) into Problem::block_mask: the
// tensors' dtypes, shapes and strides (check_block_mask), then, once the outputs are known not to
// overlap them, the lists' values by core::block_mask_error, which names the entry
// (check_block_mask_values), on the host: the CPU backend reads the lists where they are; lists in
// device memory are copied to the host for it (one wait for the stream) and the kernels read them
// in place; or, CUDA tensors under IndexCheck::kDevice (and at most kDeviceCheckedKeyBlocks key
// blocks, the kernel's bitmap of listed blocks), left to the kernel.
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tensor_checks.hpp"
#include "validate_common.hpp"

namespace flashattn::detail {
namespace {

static_assert(BlockMaskOptions::kDeviceCheckedKeyBlocks == core::BlockMask::kDeviceCheckedKeyBlocks);

// An int32 tensor of `ndim` dims with a unit last stride, on q's device.
void check_index_tensor(const char* name, const TensorView& t, int ndim, const Device& device) {
  if (!t.present() || t.ndim != ndim) {
    fail(ErrorCode::kInvalidArgument,
         std::string("block_mask.") + name + ": ndim " + std::to_string(t.ndim) + " must be " + std::to_string(ndim));
  }
  check_tensor((std::string("block_mask.") + name).c_str(), t, ndim);
  if (t.dtype != DType::kInt32) {
    fail(ErrorCode::kInvalidDtype,
         std::string("block_mask.") + name + ": dtype " + dtype_name(t.dtype) + " must be int32");
  }
  if (!(t.device == device)) {
    fail(ErrorCode::kInvalidArgument,
         std::string("block_mask.") + name + ": on " + device_str(t.device) + ", but q is on " + device_str(device));
  }
}

// Leading dims [b|1, h|1] of a per-(batch, head) list; returns (batch stride, head stride), 0 where
// the dim broadcasts.
std::pair<int64_t, int64_t> batch_head_strides(const char* name, const TensorView& t, const Problem& p) {
  for (int dim : {0, 1}) {
    const int64_t want = dim == 0 ? p.batch : p.heads_q;
    if (t.shape[dim] != 1 && t.shape[dim] != want) {
      fail(ErrorCode::kInvalidArgument, std::string("block_mask.") + name + ": shape " + shape_str(t) + " dim " +
                                            std::to_string(dim) + " must be 1 or " + std::to_string(want) +
                                            (dim == 0 ? " (batch)" : " (q heads)"));
    }
  }
  return {t.shape[0] == 1 ? 0 : t.strides[0], t.shape[1] == 1 ? 0 : t.strides[1]};
}

}  // namespace

void check_block_mask(const BlockMaskOptions& o, Problem& p, bool varlen, const TensorView& q) {
  if (!o.present()) {
    for (const TensorView* t : {&o.kv_indices, &o.full_kv_num_blocks, &o.full_kv_indices, &o.bits, &o.bits_block}) {
      if (t->present()) fail(ErrorCode::kInvalidArgument, "block_mask: given without kv_num_blocks");
    }
    return;
  }
  if (varlen) fail(ErrorCode::kUnsupported, "block_mask: dense batches only (not with cu_seqlens)");
  if (o.index_check != IndexCheck::kHost && o.index_check != IndexCheck::kDevice) {
    fail(ErrorCode::kInvalidArgument, "block_mask.index_check: " + std::to_string(static_cast<int>(o.index_check)) +
                                          " is neither kHost nor kDevice");
  }
  if (p.device.type != DeviceType::kCPU) check_device_runs_lengths("block_mask", "its lists", q);
  core::BlockMask& m = p.block_mask;
  m.block_m = o.block_m;
  m.block_n = o.block_n;
  if (m.block_m < 1 || m.block_n < 1) {
    fail(ErrorCode::kInvalidArgument, "block_mask: block size (" + std::to_string(m.block_m) + ", " +
                                          std::to_string(m.block_n) + ") must be positive");
  }
  check_index_tensor("kv_num_blocks", o.kv_num_blocks, 3, p.device);
  check_index_tensor("kv_indices", o.kv_indices, 4, p.device);
  const TensorView& counts = o.kv_num_blocks;
  const TensorView& indices = o.kv_indices;
  m.query_blocks = counts.shape[2];
  m.key_blocks = indices.shape[3];
  std::tie(m.count_batch_stride, m.count_head_stride) = batch_head_strides("kv_num_blocks", counts, p);
  std::tie(m.index_batch_stride, m.index_head_stride) = batch_head_strides("kv_indices", indices, p);
  if (indices.shape[2] != m.query_blocks || indices.strides[2] != m.key_blocks) {
    fail(ErrorCode::kInvalidArgument, "block_mask.kv_indices: shape " + shape_str(indices) +
                                          " must have kv_num_blocks' query blocks (" + std::to_string(m.query_blocks) +
                                          ") and rows of contiguous key blocks");
  }
  if (counts.strides[2] != 1) {
    fail(ErrorCode::kInvalidArgument, "block_mask.kv_num_blocks: its last dim must be contiguous");
  }
  // The other per-(batch, head, query block) tensors share kv_num_blocks' shape and strides, and
  // the other index tensor kv_indices' (the kernels address them alike).
  auto like = [&](const char* name, const TensorView& t, const TensorView& ref, const char* ref_name) {
    check_index_tensor(name, t, ref.ndim, p.device);
    for (int i = 0; i < ref.ndim; ++i) {
      const bool broadcast = i < 2 && ref.shape[i] == 1;
      if (t.shape[i] != ref.shape[i] || (!broadcast && t.strides[i] != ref.strides[i])) {
        fail(ErrorCode::kInvalidArgument, std::string("block_mask.") + name + ": shape " + shape_str(t) +
                                              " and strides must be " + ref_name + "'s (" + shape_str(ref) + ")");
      }
    }
  };
  m.partial_count_data = static_cast<const int32_t*>(counts.data);
  m.partial_index_data = static_cast<const int32_t*>(indices.data);
  if (o.full_kv_num_blocks.present() != o.full_kv_indices.present()) {
    fail(ErrorCode::kInvalidArgument, "block_mask: full_kv_num_blocks and full_kv_indices come together");
  }
  if (o.full_kv_num_blocks.present()) {
    like("full_kv_num_blocks", o.full_kv_num_blocks, counts, "kv_num_blocks");
    like("full_kv_indices", o.full_kv_indices, indices, "kv_indices");
    m.full_count_data = static_cast<const int32_t*>(o.full_kv_num_blocks.data);
    m.full_index_data = static_cast<const int32_t*>(o.full_kv_indices.data);
  }
  if (o.bits.present() != o.bits_block.present()) {
    fail(ErrorCode::kInvalidArgument, "block_mask: bits and bits_block come together");
  }
  if (o.bits.present()) {
    like("bits_block", o.bits_block, counts, "kv_num_blocks");
    check_index_tensor("bits", o.bits, 3, p.device);
    const TensorView& bits = o.bits;
    if (bits.shape[1] != m.block_m || bits.shape[2] != m.words_per_row() || bits.strides[1] != bits.shape[2] ||
        bits.strides[0] != bits.shape[1] * bits.shape[2]) {
      fail(ErrorCode::kInvalidArgument, "block_mask.bits: shape " + shape_str(bits) + " must be a contiguous [n, " +
                                            std::to_string(m.block_m) + ", " + std::to_string(m.words_per_row()) +
                                            "] (block_m rows of ceil(block_n / 32) words)");
    }
    m.bits = static_cast<const uint32_t*>(bits.data);
    m.bits_block = static_cast<const int32_t*>(o.bits_block.data);
    m.bits_blocks = bits.shape[0];
  }
  p.block_mask_checked_on_device = o.index_check == IndexCheck::kDevice && p.device.type == DeviceType::kCUDA &&
                                   m.key_blocks <= BlockMaskOptions::kDeviceCheckedKeyBlocks;
}

void check_block_mask_values(const Problem& p, const BlockMaskOptions& o, std::initializer_list<NamedView> outputs,
                             void* stream) {
  if (!p.block_mask.present()) return;
  check_no_overlap(outputs, {{"block_mask.kv_num_blocks", &o.kv_num_blocks},
                             {"block_mask.kv_indices", &o.kv_indices},
                             {"block_mask.full_kv_num_blocks", &o.full_kv_num_blocks},
                             {"block_mask.full_kv_indices", &o.full_kv_indices},
                             {"block_mask.bits", &o.bits},
                             {"block_mask.bits_block", &o.bits_block}});
  if (p.block_mask_checked_on_device) return;
  // The lists block_mask_error reads (not the element bits, whose every value is valid), as host
  // values: the last entry of (batch, head, query block) addressing, plus a row of key blocks
  // for the index lists.
  core::BlockMask host = p.block_mask;
  const int64_t counts = host.count_at(p.batch - 1, p.heads_q - 1, host.query_blocks - 1) + 1;
  const int64_t indices = host.index_at(p.batch - 1, p.heads_q - 1, host.query_blocks - 1) + host.key_blocks;
  std::vector<int32_t> copies[5];
  HostIndices fetch(p.device, stream);
  if (p.batch > 0 && p.heads_q > 0 && host.query_blocks > 0) {
    host.partial_count_data = fetch.add(host.partial_count_data, counts, copies[0]);
    host.partial_index_data = fetch.add(host.partial_index_data, indices, copies[1]);
    host.full_count_data = fetch.add(host.full_count_data, counts, copies[2]);
    host.full_index_data = fetch.add(host.full_index_data, indices, copies[3]);
    host.bits_block = fetch.add(host.bits_block, counts, copies[4]);
    fetch.fetch();
  }
  const std::string error = core::block_mask_error(host, p.batch, p.heads_q, p.seqlen_q, p.seqlen_k);
  if (!error.empty()) fail(ErrorCode::kInvalidArgument, error);
}

}  // namespace flashattn::detail

// The device-side varlen length check (src/cuda/varlen_checks.cuh) run on the CPU, one fiber per
// CUDA thread, against the host's validation of the same arrays: random geometries, each
// corrupted in one to three random places (or not at all). The device must fail exactly when the
// host does, name the same entry in the same words, and hand the kernels zeros (a failure) or the
// values themselves; the fill kernel must write NaN everywhere after a failure, else 0 / -inf
// outside the sequences and nothing inside.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/index_faults_host.hpp"
#include "cuda/varlen_checks.hpp"  // (before the emulation's macros: it includes the CUDA runtime API)
#include "flashattn/flashattn.hpp"
#include "problem.hpp"
#include "test_util.hpp"

#include "emulation_threads.hpp"

#include "cuda/varlen_checks.cuh"

namespace {

using flashattn::DType;
using flashattn::TensorView;
namespace vc = flashattn::cuda::varlen;

// A varlen call's length arrays and the geometry they must fit.
struct Lengths {
  std::vector<int32_t> cu_q, cu_k, used, table;
  int64_t total_q = 0, total_k = 0, max_q = 0, max_k = 0;
  int64_t page_size = 0, columns = 0, blocks = 0;  // paged keys when page_size > 0
  int64_t batch() const { return static_cast<int64_t>(cu_q.size()) - 1; }
};

Lengths random_lengths(std::mt19937_64& rng) {
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  Lengths l;
  const int64_t batch = uniform(0, 3) == 0 ? uniform(257, 700) : uniform(0, 40);  // past one pass of the threads
  const bool paged = uniform(0, 2) == 0, used = uniform(0, 2) == 0;
  l.cu_q = {static_cast<int32_t>(uniform(0, 2))};
  l.cu_k = {paged ? 0 : static_cast<int32_t>(uniform(0, 2))};
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q = uniform(0, 4) == 0 ? 0 : uniform(1, 9), k = uniform(0, 4) == 0 ? 0 : uniform(1, 40);
    l.cu_q.push_back(static_cast<int32_t>(l.cu_q.back() + q));
    l.cu_k.push_back(static_cast<int32_t>(l.cu_k.back() + k));
    l.max_q = std::max(l.max_q, q);
    l.max_k = std::max(l.max_k, k);
    if (used) l.used.push_back(static_cast<int32_t>(uniform(0, k)));
  }
  l.max_q += uniform(0, 2);
  l.max_k += uniform(0, 2);
  l.total_q = l.cu_q.back() + uniform(0, 3);
  l.total_k = l.cu_k.back() + uniform(0, 3);
  if (paged) {
    l.page_size = uniform(1, 16);
    l.columns = (l.max_k + l.page_size - 1) / l.page_size + uniform(0, 2);
    l.blocks = uniform(1, 50);
    l.total_k = l.blocks;
    l.table.resize(static_cast<size_t>(std::max<int64_t>(batch, 1) * std::max<int64_t>(l.columns, 1)));
    for (int32_t& e : l.table) e = static_cast<int32_t>(uniform(0, l.blocks - 1));
  }
  return l;
}

// Breaks one random thing (entry, table entry or bound), or nothing (1 in 5).
void corrupt(Lengths& l, std::mt19937_64& rng) {
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto bad_value = [&](int32_t v) {
    return static_cast<int32_t>(uniform(0, 1) ? v + uniform(1, 60) : v - uniform(1, 60));
  };
  const int64_t batch = l.batch();
  switch (uniform(0, 6)) {
    case 0:
      break;
    case 1: {
      auto& e = l.cu_q[static_cast<size_t>(uniform(0, batch))];
      e = bad_value(e);
      break;
    }
    case 2: {
      auto& e = l.cu_k[static_cast<size_t>(uniform(0, batch))];
      e = bad_value(e);
      break;
    }
    case 3:
      if (!l.used.empty()) {
        auto& e = l.used[static_cast<size_t>(uniform(0, batch - 1))];
        e = bad_value(e);
      }
      break;
    case 4:
      if (!l.table.empty()) {
        auto& e = l.table[static_cast<size_t>(uniform(0, static_cast<int64_t>(l.table.size()) - 1))];
        e = static_cast<int32_t>(uniform(0, 1) ? l.blocks + uniform(0, 5) : -uniform(1, 5));
      }
      break;
    case 5:
      l.max_q = std::max<int64_t>(0, l.max_q - uniform(1, 3));
      break;
    default:
      l.max_k = std::max<int64_t>(0, l.max_k - uniform(1, 3));
      break;
  }
}

// The host's verdict: validation of a forward over these lengths (CPU tensors, values read in
// place); the error's message, or nothing.
std::optional<std::string> host_verdict(const Lengths& l) {
  const int64_t batch = l.batch();
  static std::vector<uint16_t> q_rows, out_rows, k_rows;
  q_rows.assign(static_cast<size_t>(std::max<int64_t>(l.total_q, 1)) * 8, 0);
  out_rows = q_rows;
  const bool paged = l.page_size > 0;
  k_rows.assign(static_cast<size_t>(std::max<int64_t>(paged ? l.blocks * l.page_size : l.total_k, 1)) * 8, 0);
  flashattn::ForwardArgs a;
  a.q = TensorView::contiguous(q_rows.data(), DType::kFloat16, {l.total_q, 1, 8});
  a.out = TensorView::contiguous(out_rows.data(), DType::kFloat16, {l.total_q, 1, 8});
  a.k = paged ? TensorView::contiguous(k_rows.data(), DType::kFloat16, {l.blocks, l.page_size, 1, 8})
              : TensorView::contiguous(k_rows.data(), DType::kFloat16, {l.total_k, 1, 8});
  a.v = a.k;
  flashattn::VarlenArgs v;
  v.cu_seqlens_q = TensorView::contiguous(l.cu_q.data(), DType::kInt32, {batch + 1});
  v.cu_seqlens_k = TensorView::contiguous(l.cu_k.data(), DType::kInt32, {batch + 1});
  if (!l.used.empty()) v.seqused_k = TensorView::contiguous(l.used.data(), DType::kInt32, {batch});
  if (paged) v.block_table = TensorView::contiguous(l.table.data(), DType::kInt32, {batch, l.columns});
  v.max_seqlen_q = l.max_q;
  v.max_seqlen_k = l.max_k;
  try {
    flashattn::detail::validate_forward(a, &v, flashattn::AttentionOptions{});
  } catch (const flashattn::Error& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

struct DeviceVerdict {
  bool failed = false;
  unsigned int claim = 0;
  flashattn::cuda::IndexFault record;
  std::vector<int32_t> cu_q, cu_k, used;  // the kernels' copies
};

DeviceVerdict device_verdict(const Lengths& l) {
  const int64_t batch = l.batch();
  std::vector<unsigned char> scratch_bytes(vc::check_scratch_bytes(batch) + 256);
  void* base = scratch_bytes.data() + (256 - reinterpret_cast<uintptr_t>(scratch_bytes.data()) % 256) % 256;
  std::memset(base, 0xAB, vc::check_scratch_bytes(batch));  // stale contents the check must overwrite
  DeviceVerdict d;
  vc::VarlenCheckParams p;
  p.cu_seqlens_q = l.cu_q.data();
  p.cu_seqlens_k = l.cu_k.data();
  p.seqused_k = l.used.empty() ? nullptr : l.used.data();
  p.batch = batch;
  p.total_q = l.total_q;
  p.total_k = l.total_k;
  p.max_seqlen_q = l.max_q;
  p.max_seqlen_k = l.max_k;
  if (l.page_size > 0) {
    p.block_table = l.table.data();
    p.block_table_stride = l.columns;
    p.table_columns = l.columns;
    p.page_size = l.page_size;
    p.num_blocks = l.blocks;
    p.total_k = INT64_MAX;
  }
  p.scratch = vc::check_scratch(base, batch);
  p.sink = {&d.claim, &d.record};
  p.call = static_cast<int32_t>(flashattn::cuda::FaultingCall::kVarlenForward);
  emu::launch({1, 1, 1}, vc::kCheckThreads, [&] { vc::check_varlen_kernel(p); });
  d.failed = *p.scratch.verdict != 0;
  d.cu_q.assign(p.scratch.cu_seqlens_q, p.scratch.cu_seqlens_q + batch + 1);
  d.cu_k.assign(p.scratch.cu_seqlens_k, p.scratch.cu_seqlens_k + batch + 1);
  if (!l.used.empty()) d.used.assign(p.scratch.seqused_k, p.scratch.seqused_k + batch);
  return d;
}

TEST(VarlenChecksEmulated, AgreeWithTheHostOnRandomCorruptions) {
  auto rng = fa_test::rng_for("varlen checks");
  int failures = 0;
  for (int trial = 0; trial < 300; ++trial) {
    Lengths l = random_lengths(rng);
    for (int i = 0; i <= trial % 3; ++i) corrupt(l, rng);  // several faults: the host's first is named
    SCOPED_TRACE("trial " + std::to_string(trial) + ", batch " + std::to_string(l.batch()) +
                 (l.page_size > 0 ? ", paged" : "") + (l.used.empty() ? "" : ", seqused_k"));
    const std::optional<std::string> host = host_verdict(l);
    const DeviceVerdict device = device_verdict(l);
    ASSERT_EQ(device.failed, host.has_value()) << (host ? *host : std::string("host: valid"));
    if (host) {
      ++failures;
      EXPECT_EQ(device.claim, 1u);
      const std::string message = flashattn::cuda::index_fault_message(device.record, 0);
      EXPECT_EQ(message.rfind(*host, 0), 0u) << "device: " << message << "\nhost:   " << *host;
      EXPECT_NE(message.find("varlen forward call"), std::string::npos) << message;
      for (int32_t e : device.cu_q) ASSERT_EQ(e, 0);
      for (int32_t e : device.cu_k) ASSERT_EQ(e, 0);
      for (int32_t e : device.used) ASSERT_EQ(e, 0);
    } else {
      EXPECT_EQ(device.claim, 0u);
      EXPECT_EQ(device.cu_q, l.cu_q);
      EXPECT_EQ(device.cu_k, l.cu_k);
      EXPECT_EQ(device.used, l.used);
    }
  }
  EXPECT_GT(failures, 100) << "too few corruptions were faults to test the messages";
}

TEST(VarlenChecksEmulated, FillWritesOutsideTheSequencesOrNanEverywhere) {
  const int64_t heads = 3, head_dim = 5, total = 11;
  const std::vector<int32_t> cu = {2, 4, 4, 8};  // rows 0-1 and 8-10 belong to no sequence
  for (const int32_t verdict : {0, 1}) {
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(std::string(verdict ? "failed check" : "valid") + (bf16 ? ", bf16" : ", fp16"));
      std::vector<uint16_t> out(static_cast<size_t>(total * heads * head_dim), 0x1234);
      std::vector<float> lse(static_cast<size_t>(heads * total), 7.0f);
      vc::FillParams f;
      f.targets[0].rows = {out.data(), 0, heads * head_dim, head_dim};
      f.targets[0].lse = {lse.data(), 0, 1, total};
      f.targets[0] = {f.targets[0].rows, f.targets[0].lse, cu.data(), 3, total, heads};
      f.count = 1;
      f.verdict = &verdict;
      f.bf16 = bf16;
      f.head_dim = head_dim;
      emu::launch({3, 1, 1}, vc::kFillThreads, [&] { vc::fill_outside_sequences_kernel(f); });
      const uint16_t nan = bf16 ? 0x7FC0 : 0x7E00;
      for (int64_t row = 0; row < total; ++row) {
        const bool outside = row < cu.front() || row >= cu.back();
        for (int64_t h = 0; h < heads; ++h) {
          const uint16_t want = verdict ? nan : outside ? 0 : 0x1234;
          for (int64_t c = 0; c < head_dim; ++c) {
            ASSERT_EQ(out[static_cast<size_t>((row * heads + h) * head_dim + c)], want) << "row " << row;
          }
          const float l = lse[static_cast<size_t>(h * total + row)];
          if (verdict) {
            EXPECT_TRUE(std::isnan(l)) << "row " << row;
          } else {
            EXPECT_EQ(l, outside ? -INFINITY : 7.0f) << "row " << row;
          }
        }
      }
    }
  }
}

}  // namespace

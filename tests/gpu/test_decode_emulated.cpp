// The KV-cache decode kernels' own code (src/cuda/decode) run on the CPU
// (emulation_threads.hpp) against the CPU backend's forward_kvcache, the oracle of every decode
// test: the append kernel must leave the caches as the CPU does, and decode (+ combine) give the
// CPU's out and lse -- contiguous and paged caches, GQA row packing over several CTAs, split
// counts 1 / 3 / 17, rotary (both layouts), masks, softcap, ALiBi, sequences with no key. Host
// pointers stand in for device ones; unread cache positions are NaN.
#include <gtest/gtest.h>

// (Before emulation_threads.hpp, which defines CUDA's keywords away: the tensor-core kernel's
// NaN repair, ../common/careful_rows.cuh, uses CuTe.)
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "emulation_threads.hpp"

#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_mma_kernel.cuh"
#include "cuda/decode/decode_sink_tokens.cuh"
#include "cuda/decode/decode_setup.hpp"
#include "kvcache_case.hpp"
#include "kvcache_problem.hpp"

namespace flashattn::cuda::decode {
// The kernels' `extern __shared__ smem_raw[]`: one CTA at a time uses it.
alignas(16) inline char smem_raw[std::max({decode_smem_bytes<256>, sizeof(MmaShared<256>)})];
}  // namespace flashattn::cuda::decode

namespace {

// decode_mma_kernel's tensor-core operations emulated: each lane deposits its registers
// (or its ldmatrix row address) in the CTA's exchange slot and reads the warp's, per PTX's
// fragment layouts (g = lane / 4, t = lane % 4): A register i holds (row g + 8 (i % 2), k 2 t +
// 8 (i / 2) + {0, 1}), B register i (k 2 t + 8 i + {0, 1}, column g), D value v (row g + 8 (v / 2),
// column 2 t + v % 2).
template <typename Element>
struct EmulatedOps {
  static float half_of(uint32_t reg, int k) {
    return static_cast<float>(Element::bitcast(static_cast<uint16_t>(reg >> (16 * (k % 2)))));
  }
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    auto& mine = emu::cta->slots[static_cast<size_t>(emu::tid())];
    std::copy(a, a + 4, mine.a);
    mine.b[0] = b0, mine.b[1] = b1;
    emu::warp_sync();
    const int lane = emu::tid() % 32, base = emu::tid() - lane;
    auto slot = [&](int l) -> const emu::Cta::Slot& { return emu::cta->slots[static_cast<size_t>(base + l)]; };
    float out[4];
    for (int v = 0; v < 4; ++v) {
      const int m = lane / 4 + 8 * (v / 2), n = 2 * (lane % 4) + v % 2;
      float acc = d[v];
      for (int k = 0; k < 16; ++k) {
        const float x = half_of(slot((m % 8) * 4 + (k % 8) / 2).a[m / 8 + 2 * (k / 8)], k);
        const float y = half_of(slot(n * 4 + (k % 8) / 2).b[k / 8], k);
        acc += x * y;
      }
      out[v] = acc;
    }
    emu::warp_sync();
    std::copy(out, out + 4, d);
  }
  template <bool kTransposed>
  static void ldsm_x4(const flashattn::cuda::decode::Chunk* row, uint32_t (&r)[4]) {
    emu::cta->slots[static_cast<size_t>(emu::tid())].row = reinterpret_cast<const uint16_t*>(row);
    emu::warp_sync();
    const int lane = emu::tid() % 32, base = emu::tid() - lane;
    auto row_of = [&](int l) { return emu::cta->slots[static_cast<size_t>(base + l)].row; };
    for (int i = 0; i < 4; ++i) {
      uint16_t lo, hi;
      if (kTransposed) {
        lo = row_of(i * 8 + 2 * (lane % 4))[lane / 4];
        hi = row_of(i * 8 + 2 * (lane % 4) + 1)[lane / 4];
      } else {
        lo = row_of(i * 8 + lane / 4)[2 * (lane % 4)];
        hi = row_of(i * 8 + lane / 4)[2 * (lane % 4) + 1];
      }
      r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    emu::warp_sync();
  }
  static void sync_warp() { emu::warp_sync(); }
  static int shfl(int x, int src_lane) {
    emu::cta->slots[static_cast<size_t>(emu::tid())].a[0] = static_cast<uint32_t>(x);
    emu::warp_sync();
    const int lane = emu::tid() % 32;
    const auto r = static_cast<int>(emu::cta->slots[static_cast<size_t>(emu::tid() - lane + src_lane)].a[0]);
    emu::warp_sync();
    return r;
  }
};

}  // namespace

namespace {

using fa_test::KvCase;
using flashattn::DType;
using flashattn::cuda::DecodeParams;
namespace dec = flashattn::cuda::decode;

template <typename Element, int kHeadDim>
void run_decode(const DecodeParams& p, const dec::DecodeLayout& l) {
  const emu::Dim3 grid{static_cast<unsigned>(l.num_splits), static_cast<unsigned>(p.shape.heads_kv * l.row_blocks),
                       static_cast<unsigned>(p.shape.batch)};
  const bool paged = p.cache.paged();
  using Ops = EmulatedOps<Element>;
  if (l.rows_per_cta == 1) {
    emu::launch(grid, dec::kThreads, [&] {
      paged ? dec::decode_kernel<Element, kHeadDim, true>(p) : dec::decode_kernel<Element, kHeadDim, false>(p);
    });
  } else {
    emu::launch(grid, dec::kThreads, [&] {
      paged ? dec::decode_mma_kernel<Element, kHeadDim, true, Ops>(p)
            : dec::decode_mma_kernel<Element, kHeadDim, false, Ops>(p);
    });
  }
}

// The kernels in the order decode_launch.cuh launches them: append, decode, combine.
// With `fault` the kernels record a bad index value there, as under IndexCheck::kDevice.
template <typename Element>
dec::DecodeLayout run_kernels(const flashattn::detail::KvCacheProblem& kp, flashattn::cuda::IndexFaultSink fault = {}) {
  const dec::DecodeLayout l = dec::decode_layout(kp, 132);
  std::vector<float> workspace(l.workspace_bytes() / sizeof(float) + 1, std::nanf(""));  // poisoned
  DecodeParams p = dec::decode_params(kp, l, workspace.data());
  p.fault = fault;
  if (kp.append && kp.seqlen_new > 0) {
    emu::launch({static_cast<unsigned>(kp.seqlen_new), static_cast<unsigned>(p.shape.heads_kv),
                 static_cast<unsigned>(p.shape.batch)},
                32, [&] { dec::append_kernel<Element>(p); });
  }
  switch (dec::head_dim_bucket(p.shape.head_dim)) {
    case 64:
      run_decode<Element, 64>(p, l);
      break;
    case 128:
      run_decode<Element, 128>(p, l);
      break;
    default:
      run_decode<Element, 256>(p, l);
      break;
  }
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.seqlen_q;
  if (l.num_splits > 1 && rows > 0) {
    const emu::Dim3 grid{static_cast<unsigned>(rows), 1, 1};
    switch (dec::head_dim_bucket(p.shape.head_dim)) {
      case 64:
        emu::launch(grid, dec::kThreads, [&] { dec::combine_kernel<Element, 64>(p); });
        break;
      case 128:
        emu::launch(grid, dec::kThreads, [&] { dec::combine_kernel<Element, 128>(p); });
        break;
      default:
        emu::launch(grid, dec::kThreads, [&] { dec::combine_kernel<Element, 256>(p); });
        break;
    }
  }
  if (p.window.sink_tokens > 0 && p.window.left >= 0 && p.shape.seqlen_q > 0) {  // the sink-token pass
    const emu::Dim3 grid{static_cast<unsigned>((p.shape.seqlen_q + flashattn::cuda::kSinkTokenRows - 1) /
                                               flashattn::cuda::kSinkTokenRows),
                         static_cast<unsigned>(p.shape.heads_q), static_cast<unsigned>(p.shape.batch)};
    auto pass = [&](auto max_cols) {
      constexpr int kMaxCols = decltype(max_cols)::value;
      float q_rows[flashattn::cuda::kSinkTokenThreads / 32][kMaxCols * 32];  // (CTAs run one at a time here)
      emu::launch(grid, flashattn::cuda::kSinkTokenThreads, [&] {
        p.cache.paged() ? dec::decode_sink_tokens_block<Element, kMaxCols, true>(p, q_rows)
                        : dec::decode_sink_tokens_block<Element, kMaxCols, false>(p, q_rows);
      });
    };
    switch (dec::head_dim_bucket(p.shape.head_dim)) {
      case 64:
        pass(std::integral_constant<int, 2>{});
        break;
      case 128:
        pass(std::integral_constant<int, 4>{});
        break;
      default:
        pass(std::integral_constant<int, 8>{});
        break;
    }
  }
  return l;
}

void run_case(const KvCase& c) {
  SCOPED_TRACE(c.name());
  auto rng = fa_test::rng_for("decode " + c.name());
  fa_test::KvTensors cpu = fa_test::make_kv_tensors(c, rng);
  fa_test::KvTensors emulated = cpu;  // the same inputs, and caches and outputs of its own
  flashattn::forward_kvcache(fa_test::kv_args(c, cpu), fa_test::kv_options(c, cpu));

  const flashattn::detail::KvCacheProblem kp =
      flashattn::detail::validate_kvcache(fa_test::kv_args(c, emulated), fa_test::kv_options(c, emulated));
  const dec::DecodeLayout layout =
      c.dtype == DType::kBFloat16 ? run_kernels<cutlass::bfloat16_t>(kp) : run_kernels<cutlass::half_t>(kp);
  // A split count asked for is the one run (splits past the keys see none: -inf partials).
  if (c.num_splits > 0) {
    EXPECT_EQ(layout.num_splits, std::min<int64_t>(c.num_splits, dec::kMaxSplits));
  }
  fa_test::expect_matches_cpu(c, emulated, cpu);
}

// The split ranges tile the keys exactly, and no split is longer than it has to be: ceil(n /
// splits) keys rounded up to whole steps (a whole step more, wherever n / splits was already whole
// steps, cost short calls a step each).
TEST(DecodeEmulated, SplitRangesTileTheKeysInTheFewestSteps) {
  constexpr int kStep = 64;
  for (int n : {0, 1, 63, 64, 65, 128, 1000, 1024, 4096, 65536 + 5}) {
    for (int splits : {1, 2, 3, 8, 16, 17, 32, 128}) {
      SCOPED_TRACE("keys " + std::to_string(n) + ", splits " + std::to_string(splits));
      const flashattn::core::FastDivmod by(static_cast<uint32_t>(splits));
      const int lo = 7, hi = lo + n;
      const int need = ((n + splits - 1) / splits + kStep - 1) / kStep * kStep;
      int next = lo;
      for (int s = 0; s < splits; ++s) {
        const dec::KeyRange r = dec::split_range<kStep>(lo, hi, s, by);
        ASSERT_EQ(r.begin, next);
        ASSERT_LE(r.begin, r.end);
        EXPECT_LE(r.end - r.begin, need);
        if (r.end < hi) {
          EXPECT_EQ((r.end - r.begin) % kStep, 0);
        }
        next = r.end;
      }
      EXPECT_EQ(next, hi);
    }
  }
}

// The split heuristic's measured choices (decode_params.hpp, H200 sweeps): short contexts that
// fill a quarter of the SMs unsplit, except the tensor-core kernel on a paged cache; the one-row
// kernel's splits of at least 256 keys; long contexts split to fill the SMs.
TEST(DecodeEmulated, SplitHeuristicChoices) {
  auto splits_for = [](int64_t batch, int64_t context, int64_t heads_kv, int64_t page) {
    KvCase c;
    c.batch = batch;
    c.capacity = context;
    c.seqlen_new = 0;
    c.heads_q = 32;
    c.heads_kv = heads_kv;
    c.head_dim = 64;  // (the choices are the d128 kernels' too: the same CTAs an SM)
    c.page_size = page;
    c.causal = false;
    c.num_splits = 0;
    auto rng = fa_test::rng_for("decode heuristic");
    fa_test::KvTensors t = fa_test::make_kv_tensors(c, rng);
    const flashattn::detail::KvCacheProblem kp =
        flashattn::detail::validate_kvcache(fa_test::kv_args(c, t), fa_test::kv_options(c, t));
    return dec::decode_layout(kp, 132).num_splits;
  };
  EXPECT_EQ(splits_for(8, 1024, 8, 0), 1);    // GQA, tensor-core kernel, contiguous
  EXPECT_EQ(splits_for(8, 1024, 8, 16), 4);   // the same in pages of 16: split to fill the SMs
  EXPECT_EQ(splits_for(8, 1024, 32, 16), 1);  // MHA, one-row kernel, paged: unsplit
  EXPECT_EQ(splits_for(1, 1024, 32, 0), 4);   // MHA batch 1: 4 splits of 256 keys
  EXPECT_EQ(splits_for(1, 1024, 8, 0), 8);    // GQA batch 1: 8 splits of 128 keys
  EXPECT_EQ(splits_for(8, 4096, 8, 0), 4);    // past the short contexts: splits fill the SMs
}

TEST(DecodeEmulated, ContiguousGqaEverySplitCount) {
  for (int64_t splits : {1, 3, 17}) {
    KvCase c;
    c.num_splits = splits;
    c.full_sequence = splits == 3;
    run_case(c);
  }
}

TEST(DecodeEmulated, PagedRotaryLeftpadFp16) {
  for (bool interleaved : {true, false}) {
    KvCase c;
    c.dtype = DType::kFloat16;
    c.page_size = 16;
    c.head_dim = 64;
    c.heads_q = 4;
    c.heads_kv = 4;
    c.leftpad = true;
    c.rotary_dim = 32;
    c.interleaved = interleaved;
    c.num_splits = 3;
    run_case(c);
  }
}

// The one-row (CUDA-core) kernel over many steps of one split: each lane group's running max
// moves and its accumulators are rescaled, step after step (the cases above give it a step or two).
TEST(DecodeEmulated, OneRowKernelLongSplit) {
  for (int64_t head_dim : {64, 128}) {
    KvCase c;
    c.heads_q = 4;
    c.heads_kv = 4;
    c.head_dim = head_dim;
    c.capacity = 1500;
    c.full_sequence = true;
    run_case(c);
  }
}

TEST(DecodeEmulated, ChunkRowsOverSeveralCtasWithMasksAndMods) {
  KvCase c;
  c.seqlen_q = c.seqlen_new = 5;  // 5 x 4 = 20 rows of each KV group: two row blocks
  c.head_dim = 256;
  c.page_size = 64;
  c.window_left = 50;
  c.softcap = 30.0f;
  c.alibi = true;
  c.rotary_dim = 64;
  c.num_splits = 2;
  run_case(c);
}

TEST(DecodeEmulated, SequencesWithoutKeysGiveZeroAndMinusInf) {
  KvCase c;
  c.empty_sequence = true;  // sequence 0: nothing cached, nothing appended
  c.seqlen_new = 0;
  c.head_dim = 96;
  for (int64_t splits : {1, 4}) {
    c.num_splits = splits;
    run_case(c);
  }
}

// The GPU's SanitizerSmall packed-row case, smaller: the tensor-core kernel, pages of 16,
// leftpad, rotary by halves, 3 splits, an appended token.
TEST(DecodeEmulated, PackedRowsPagedLeftpadSplits) {
  KvCase c;
  c.batch = 4;
  c.heads_q = 32;
  c.heads_kv = 8;
  c.capacity = 100;
  c.page_size = 16;
  c.leftpad = true;
  c.rotary_dim = 32;
  c.interleaved = false;
  c.num_splits = 3;
  run_case(c);
}

// The tensor-core kernel's paged copies whether a warp-step's 16 keys lie in one page (pages of
// a multiple of 16 without leftpad) or straddle pages (pages of 24; leftpad), over 3 splits.
TEST(DecodeEmulated, PackedRowsWarpStepsInOnePageOrAcrossPages) {
  for (int64_t page : {16, 48, 24}) {
    for (bool leftpad : {false, true}) {
      if (page == 24 && leftpad) continue;
      KvCase c;
      c.batch = 3;
      c.heads_q = 16;
      c.heads_kv = 4;
      c.capacity = 300;
      c.page_size = page;
      c.leftpad = leftpad;
      c.num_splits = 3;
      run_case(c);
    }
  }
}

// A NaN in one key's value (or key) row reaches exactly the rows that see that key, as the CPU
// computes it, element by element (expect_matches_cpu: NaN for NaN): the tensor-core kernel's
// 16-row tile holds rows that see the key and rows it is masked for (new tokens under the causal
// mask, the left edge of a sliding window), contiguous and paged, one split or several; the
// one-row kernel reads no key its row does not see.
TEST(DecodeEmulated, NanKeyReachesOnlyTheRowsThatSeeIt) {
  KvCase causal;  // 5 new tokens x a group of 4: rows of two 16-row blocks, key -3 seen by tokens 2-4
  causal.seqlen_q = causal.seqlen_new = 5;
  causal.heads_q = 8;
  causal.heads_kv = 2;
  causal.head_dim = 64;
  causal.full_sequence = true;
  causal.has_nan_key = true;
  causal.nan_key = -3;
  std::vector<KvCase> cases;
  for (int64_t page : {0, 16}) {
    for (int64_t splits : {1, 3}) {
      KvCase c = causal;
      c.page_size = page;
      c.num_splits = splits;
      c.leftpad = page != 0;
      cases.push_back(c);
    }
  }
  KvCase in_k = causal;  // a NaN key row: NaN scores, masked for the rows that do not see it
  in_k.nan_in_k = true;
  cases.push_back(in_k);
  KvCase window = causal;  // key -55 in the window of token 0 only
  window.window_left = 50;
  window.nan_key = -55;
  window.softcap = 30.0f;
  window.page_size = 24;
  window.num_splits = 2;
  cases.push_back(window);
  KvCase gqa = window;  // two query rows a group, d128, ALiBi, key -52 seen by tokens 0-2
  gqa.heads_q = 4;
  gqa.head_dim = 128;
  gqa.nan_key = -52;
  gqa.alibi = true;
  gqa.softcap = 0.0f;
  cases.push_back(gqa);
  for (int64_t key : {-40, -10}) {  // the one-row kernel: a key outside the window, one inside
    KvCase c;
    c.heads_q = c.heads_kv = 4;
    c.window_left = 30;
    c.full_sequence = true;
    c.has_nan_key = true;
    c.nan_key = key;
    c.num_splits = 2;
    c.page_size = key == -40 ? 16 : 0;
    cases.push_back(c);
  }
  for (const KvCase& c : cases) run_case(c);
}

// A learnable sink joins split 0's row state (merge_warps), so that the splits' merge counts it
// once: both kernels, 1 / 3 / 17 splits, a sequence with no key (out 0, lse the sink), GQA row
// packing, the NaN rows' recompute, and a head whose sink is -inf (none).
TEST(DecodeEmulated, LearnableSink) {
  std::vector<KvCase> cases;
  for (int64_t heads_kv : {8, 2}) {  // the one-row kernel, the tensor-core kernel
    for (int64_t splits : {1, 3, 17}) {
      KvCase c;
      c.heads_kv = heads_kv;
      c.sink = true;
      c.num_splits = splits;
      c.page_size = splits == 3 ? 16 : 0;
      cases.push_back(c);
    }
  }
  KvCase empty;
  empty.sink = true;
  empty.empty_sequence = true;
  empty.seqlen_new = 0;
  empty.head_dim = 64;
  for (int64_t splits : {1, 4}) {
    empty.num_splits = splits;
    cases.push_back(empty);
  }
  KvCase nan;  // the tensor-core kernel's NaN rows recomputed with the sink (split 0 only)
  nan.seqlen_q = nan.seqlen_new = 5;
  nan.heads_q = 8;
  nan.heads_kv = 2;
  nan.head_dim = 64;
  nan.full_sequence = true;
  nan.has_nan_key = true;
  nan.nan_key = -3;
  nan.sink = true;
  for (int64_t splits : {1, 3}) {
    nan.num_splits = splits;
    cases.push_back(nan);
  }
  for (const KvCase& c : cases) run_case(c);
}

// Sink tokens: the decode kernels run the window, the sink-token pass joins the sink keys left
// of each row's window -- both kernels, split counts 1 / 3, pages, leftpad, rotary (both layouts:
// the pass rotates q as the kernels do), several query tokens, a learnable sink, more sink keys
// than the window holds.
TEST(DecodeEmulated, SinkTokens) {
  std::vector<KvCase> cases;
  for (int64_t heads_kv : {8, 2}) {
    for (int64_t splits : {1, 3}) {
      KvCase c;
      c.heads_kv = heads_kv;
      c.window_left = 20;
      c.sink_tokens = 4;
      c.num_splits = splits;
      c.page_size = splits == 3 ? 16 : 0;
      c.leftpad = heads_kv == 2;
      c.rotary_dim = splits == 1 ? 32 : 0;
      c.interleaved = heads_kv == 8;
      c.seqlen_q = c.seqlen_new = heads_kv == 2 ? 5 : 1;
      c.sink = splits == 3;
      cases.push_back(c);
    }
  }
  KvCase wide;  // more sink keys than the window, head dim 64
  wide.head_dim = 64;
  wide.window_left = 8;
  wide.sink_tokens = 40;
  wide.page_size = 16;
  wide.num_splits = 2;
  cases.push_back(wide);
  for (const KvCase& c : cases) run_case(c);
}

// IndexCheck::kDevice: the kernels meet index values validation has not seen. Each corruption
// of sequence 0's indices, made after validation, must turn sequence 0's out and lse rows NaN
// and leave sequence 1 as the CPU computes it; a bad cache_seqlens / leftpad also keeps
// sequence 0's new token out of the cache (a bad block entry may not: the append of another
// page is unspecified). The corrupt block entries are past the cache, so a read through one
// would be out of bounds.
// The kernels also record the bad value for the host: its argument, sequence 0, the value.
struct Corruption {
  const char* what;
  KvCase c;
  void (*corrupt)(fa_test::KvTensors&, flashattn::detail::KvCacheProblem&);
  bool append_skipped;
  flashattn::cuda::IndexArgument argument;
  int64_t value;  // the recorded value (kBlockCount: the caches' block count)
};
constexpr int64_t kBlockCount = -1000;

void expect_bad_sequence_zero(const Corruption& x) {
  const KvCase& c = x.c;
  SCOPED_TRACE(std::string(x.what) + ": " + c.name());
  auto rng = fa_test::rng_for(std::string("bad indices ") + x.what);
  fa_test::KvTensors cpu = fa_test::make_kv_tensors(c, rng);
  // Sequence 1 at most 5 tokens (the rotary corruption needs more rows for sequence 0); never
  // longer than it was made, since positions past its tokens hold NaN.
  cpu.seqlens.set(1, std::min(cpu.seqlens.get(1), 5.0));
  cpu.leftpad.set(1, std::min(cpu.leftpad.get(1), cpu.seqlens.get(1)));
  fa_test::KvTensors emulated = cpu;
  const fa_test::KvTensors before = cpu;
  flashattn::forward_kvcache(fa_test::kv_args(c, cpu), fa_test::kv_options(c, cpu));
  flashattn::detail::KvCacheProblem kp =
      flashattn::detail::validate_kvcache(fa_test::kv_args(c, emulated), fa_test::kv_options(c, emulated));
  x.corrupt(emulated, kp);
  unsigned int claim = 0;
  flashattn::cuda::IndexFault record;
  if (c.dtype == DType::kBFloat16) {
    run_kernels<cutlass::bfloat16_t>(kp, {&claim, &record});
  } else {
    run_kernels<cutlass::half_t>(kp, {&claim, &record});
  }
  fa_test::expect_only_sequence_zero_bad(c, emulated, cpu, before, x.append_skipped);
  EXPECT_EQ(claim, 1u);
  EXPECT_EQ(record.argument, static_cast<int32_t>(x.argument));
  EXPECT_EQ(record.batch, 0);
  EXPECT_EQ(record.value, x.value == kBlockCount ? emulated.k_cache.shape()[0] : x.value);
  EXPECT_TRUE(record.value < record.low || record.value > record.high)
      << record.value << " recorded with the range [" << record.low << ", " << record.high << "]";
  if (x.argument == flashattn::cuda::IndexArgument::kBlockTable) {
    EXPECT_EQ(record.column, 0);
  }
}

TEST(DecodeEmulated, BadIndicesGiveNanRowsOfTheirSequenceOnly) {
  KvCase contiguous;
  contiguous.num_splits = 3;
  KvCase paged = contiguous;
  paged.page_size = 16;
  paged.num_splits = 1;
  KvCase leftpad = contiguous;
  leftpad.leftpad = true;
  leftpad.num_splits = 1;
  KvCase paged_splits = paged;
  paged_splits.num_splits = 3;
  KvCase rotary = paged;
  rotary.rotary_dim = 32;
  rotary.num_splits = 4;
  using Tensors = fa_test::KvTensors;
  using Problem = flashattn::detail::KvCacheProblem;
  using Arg = flashattn::cuda::IndexArgument;
  const Corruption cases[] = {
      {"cache_seqlens past capacity - seqlen_new", contiguous, [](Tensors& t, Problem&) { t.seqlens.set(0, 200); },
       true, Arg::kCacheSeqlens, 200},
      {"negative cache_seqlens", paged, [](Tensors& t, Problem&) { t.seqlens.set(0, -1); }, true, Arg::kCacheSeqlens,
       -1},
      {"leftpad past cache_seqlens", leftpad, [](Tensors& t, Problem&) { t.leftpad.set(0, 1000); }, true,
       Arg::kCacheLeftpad, 1000},
      {"block_table entry past the blocks", paged,
       [](Tensors& t, Problem&) { t.table.set(0, static_cast<double>(t.k_cache.shape()[0])); }, false, Arg::kBlockTable,
       kBlockCount},
      {"negative block_table entry", paged_splits, [](Tensors& t, Problem&) { t.table.set(0, -7); }, false,
       Arg::kBlockTable, -7},
      {"rotary tables too short for sequence 0", rotary,
       [](Tensors& t, Problem& kp) {
         kp.rotary.rows = 6;  // sequence 1 (5 cached + 1 new) fits
         t.seqlens.set(0, 6);
       },
       true, Arg::kRotaryRows, 6},
  };
  for (const Corruption& x : cases) expect_bad_sequence_zero(x);
}

}  // namespace

// The sm80 forward kernel's own code run on the CPU (emulation.hpp) against the fp64
// reference: the kernel's logic (tile ranges, masks, score mods, online softmax, epilogue, empty
// rows, strides) without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "../cpp/random_block_mask.hpp"
#include "emulation.hpp"

namespace {

using namespace cute;
using flashattn::DType;
using flashattn::cuda::ElemType;
using flashattn::cuda::ForwardParams;
using flashattn::cuda::MaskKind;
using flashattn::cuda::sm80::ElementTypes;
using flashattn::cuda::sm80::ForwardTraits;
using flashattn::cuda::sm80::TileTarget;

// The kernel's traits with the hardware-only atoms swapped for the emulated ones (same layouts).
// The mask kinds share one tile shape here: the emulation checks the kernel's logic per shape;
// the block-sparse kernel (kSparse) has shapes of its own.
template <ElemType kElem, int kHeadDim, TileTarget kTarget, bool kSparse = false>
struct EmulatedTraits
    : ForwardTraits<kElem, kHeadDim, kSparse ? MaskKind::kMasked : MaskKind::kNone, kTarget, kSparse> {
  using Base = ForwardTraits<kElem, kHeadDim, kSparse ? MaskKind::kMasked : MaskKind::kNone, kTarget, kSparse>;
  using Element = typename Base::Element;
  using TiledMma = TiledMMA<MMA_Atom<emu::Mma16816<typename ElementTypes<kElem>::MmaOp, Element>>,
                            Layout<Shape<Int<Base::kNWarps>, _1, _1>>, Tile<Int<Base::kMmaM>, _16, _16>>;
  using SmemCopyAtom = Copy_Atom<emu::Ldsm<false>, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<emu::Ldsm<true>, Element>;
  using GmemTiledLoad = decltype(make_tiled_copy(
      Copy_Atom<emu::CopyZfill16, Element>{}, typename Base::ChunkThreadLayout{}, typename Base::ChunkValueLayout{}));
};

// The kernel, then (sink tokens under a left window) the sink-token pass, as the backend runs them.
template <class Traits, MaskKind kMask, bool kPaged = false, bool kSparse = false>
void emulate_launch(const ForwardParams& p) {
  const emu::Dim3 grid{static_cast<unsigned>((p.shape.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM),
                       static_cast<unsigned>(p.shape.heads_q), static_cast<unsigned>(p.shape.batch)};
  emu::launch(grid, Traits::kNThreads,
              [&] { flashattn::cuda::sm80::forward_kernel<Traits, kMask, kPaged, kSparse>(p); });
  if (p.window.sink_tokens == 0 || p.window.left < 0) return;
  using flashattn::cuda::kSinkTokenRows;
  const emu::Dim3 rows{static_cast<unsigned>((p.shape.seqlen_q + kSinkTokenRows - 1) / kSinkTokenRows),
                       static_cast<unsigned>(p.shape.heads_q), static_cast<unsigned>(p.shape.batch)};
  constexpr int kMaxCols = (Traits::kHeadDim + 31) / 32;
  emu::launch(rows, flashattn::cuda::kSinkTokenThreads,
              [&] { flashattn::cuda::forward_sink_tokens_block<typename Traits::Element, kMaxCols>(p); });
}

// The kernel's out and LSE against the reference's, element by element: logic errors are O(1);
// rounding is ~1e-3 (fp16) / 1e-2 (bf16) of the output's scale. An LSE of -inf (a row that sees
// no key) must match exactly.
struct Errors {
  double out = 0, out_scale = 1e-3, lse = 0;
  int64_t bad = 0;  // non-finite outputs, LSE -inf mismatches
  void add_out(double got, double want) {
    if (std::isnan(want) != std::isnan(got) || (!std::isnan(want) && !std::isfinite(got))) ++bad;
    if (std::isnan(want)) return;  // a row that sees a NaN value: NaN in both
    out = std::max(out, std::abs(got - want));
    out_scale = std::max(out_scale, std::abs(want));
  }
  void add_lse(float got, float want) {
    if (std::isinf(want) || !std::isfinite(got)) {
      if (got != want) ++bad;
    } else {
      lse = std::max(lse, static_cast<double>(std::abs(got - want)));
    }
  }
  void expect_within(ElemType elem) const {
    EXPECT_EQ(bad, 0) << "non-finite outputs where the reference has none (or none where it has NaN), or LSE "
                         "(-inf) mismatches";
    EXPECT_LE(out, (elem == ElemType::kFloat16 ? 4e-3 : 3e-2) * out_scale) << "out";
    EXPECT_LE(lse, 1e-3) << "lse";
  }
};

struct Case {
  DType dtype = DType::kFloat16;
  int64_t batch = 1, sq = 1, sk = 1, hq = 2, hkv = 1, d = 64;
  bool causal = false;
  int64_t wl = -1, wr = -1;
  float softcap = 0;
  bool alibi = false;
  bool strided = false;
  float dropout = 0;
  int64_t nan_key = -1;  // >= 0: v of this key (batch 0, every kv head, column 3) is NaN
  bool sink = false;     // a learnable sink: head 0 a logit that takes much of its rows, head 1 -inf (none)
  int64_t sink_tokens = 0;
  // A random block-sparse mask at blocks of (block_m, block_n) whole kernel tiles (0: none).
  int64_t block_m = 0, block_n = 0;
  // Its lists checked by the kernel (IndexCheck::kDevice) where not kHost; the other values break
  // a rule at (batch 0, head 0, query block 0), whose rows then hold NaN.
  enum class Lists { kHost, kDevice, kIndexOutside, kListedTwice, kCountOutside } lists = Lists::kHost;
  std::string name() const {
    return std::string(flashattn::dtype_name(dtype)) + " b" + std::to_string(batch) + " sq" + std::to_string(sq) +
           " sk" + std::to_string(sk) + " h" + std::to_string(hq) + "/" + std::to_string(hkv) + " d" +
           std::to_string(d) + (causal ? " causal" : "") +
           (wl >= 0 || wr >= 0 ? " window(" + std::to_string(wl) + "," + std::to_string(wr) + ")" : "") +
           (softcap > 0 ? " softcap" : "") + (alibi ? " alibi" : "") + (strided ? " strided" : "") +
           (dropout > 0 ? " dropout" : "") + (nan_key >= 0 ? " nan v key " + std::to_string(nan_key) : "") +
           (sink ? " sink" : "") + (sink_tokens > 0 ? " sink_tokens " + std::to_string(sink_tokens) : "") +
           (block_m > 0 ? " block_mask " + std::to_string(block_m) + "x" + std::to_string(block_n) : "") +
           (lists != Lists::kHost ? " lists checked on the device, case " + std::to_string(static_cast<int>(lists))
                                  : "");
  }
};

template <ElemType kElem, int kBucket, TileTarget kTarget>
void run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  using Element = typename ElementTypes<kElem>::Element;
  std::mt19937_64 rng(emu::test_seed() ^ std::hash<std::string>{}(c.name()));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // [b, s, h, d] buffers; strided: a gap of 8 elements after every head and one head per row.
  const int64_t gap = c.strided ? 8 : 0;
  auto layout = [&](int64_t s, int64_t h) {
    const int64_t hs = c.d + gap, rs = (h + (c.strided ? 1 : 0)) * hs, bs = s * rs;
    return std::array<int64_t, 4>{bs, rs, hs, c.batch * bs};
  };
  const auto lq = layout(c.sq, c.hq), lk = layout(c.sk, c.hkv);
  std::vector<Element> q(static_cast<size_t>(lq[3])), k(static_cast<size_t>(lk[3])), v(k.size()),
      out(q.size(), Element::bitcast(0xFFFF));
  std::vector<float> lse(static_cast<size_t>(c.batch * c.hq * c.sq), NAN);
  for (auto* t : {&q, &k, &v}) {
    for (Element& x : *t) x = Element(normal(rng));
  }
  for (int64_t h = 0; c.nan_key >= 0 && h < c.hkv; ++h)
    v[static_cast<size_t>(c.nan_key * lk[1] + h * lk[2] + 3)] = Element(NAN);
  std::vector<float> slopes(static_cast<size_t>(c.hq));
  for (float& s : slopes) s = std::uniform_real_distribution<float>(0.0f, 0.3f)(rng);
  std::vector<float> sinks(static_cast<size_t>(c.hq));
  for (size_t h = 0; h < sinks.size(); ++h) sinks[h] = h == 1 ? -INFINITY : 2.0f + normal(rng);

  const DType dt = c.dtype;
  auto view = [&](void* p, int64_t s, int64_t h, const std::array<int64_t, 4>& l) {
    return flashattn::TensorView::strided(p, dt, {c.batch, s, h, c.d}, {l[0], l[1], l[2], 1});
  };
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.wl;
  o.mask.window_right = c.wr;
  o.mask.sink_tokens = c.sink_tokens;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = flashattn::TensorView::contiguous(slopes.data(), DType::kFloat32, {c.hq});
  if (c.sink) o.score.learnable_sink = flashattn::TensorView::contiguous(sinks.data(), DType::kFloat32, {c.hq});
  o.dropout.p = c.dropout;
  o.dropout.seed = rng();
  o.dropout.offset = rng() % 1000;
  std::unique_ptr<fa_test::RandomBlockMask> block_mask;
  if (c.block_m > 0) {
    block_mask = std::make_unique<fa_test::RandomBlockMask>(rng, c.batch, c.hq, c.sq, c.sk, c.block_m, c.block_n);
    o.block_mask = block_mask->options();
  }
  std::vector<Element> ref(q.size());
  std::vector<float> lse_ref(lse.size());
  flashattn::reference_forward(
      {view(q.data(), c.sq, c.hq, lq), view(k.data(), c.sk, c.hkv, lk), view(v.data(), c.sk, c.hkv, lk),
       view(ref.data(), c.sq, c.hq, lq),
       flashattn::TensorView::contiguous(lse_ref.data(), DType::kFloat32, {c.batch, c.hq, c.sq})},
      o);

  // The params exactly as src/cuda/backend.cpp builds them.
  ForwardParams p;
  p.q = {q.data(), lq[0], lq[1], lq[2]};
  p.k = {k.data(), lk[0], lk[1], lk[2]};
  p.v = {v.data(), lk[0], lk[1], lk[2]};
  p.out = {out.data(), lq[0], lq[1], lq[2]};
  p.lse = {lse.data(), c.hq * c.sq, 1, c.sq};
  p.shape = {c.batch, c.hq, c.hkv, c.d, c.sq, c.sk};
  p.window = {c.wl, c.causal ? 0 : c.wr, c.sink_tokens};
  // Masked tiles dealt over groups of 2 pairs, the last at least 1: 4 pairs 2 + 2, 3 pairs 2 + 1.
  p.tile_group = 2;
  p.tile_last_first = flashattn::cuda::last_group_first(c.batch * c.hq, 1, 2, 1, 1);
  p.score = emu::score_params(c.d, c.softcap, c.alibi ? slopes.data() : nullptr);
  if (c.sink) {
    p.score.sink = sinks.data();
    p.score.sink_stride = 1;
  }
  p.dropout = emu::dropout_params(o.dropout);
  const bool masked = p.window.left >= 0 || p.window.right >= 0;
  unsigned int fault_claim = 0;
  flashattn::cuda::IndexFault fault;
  const bool bad_lists = c.lists > Case::Lists::kDevice;
  if (block_mask && c.lists != Case::Lists::kHost) {
    // (batch 0, head 0, query block 0)'s lists, after the reference ran on the good ones.
    const int32_t key_blocks = static_cast<int32_t>(block_mask->mask.key_blocks);
    if (c.lists == Case::Lists::kIndexOutside) {
      block_mask->full_count[0] = 1;
      block_mask->full_index[0] = key_blocks;
    } else if (c.lists == Case::Lists::kListedTwice) {
      block_mask->partial_count[0] = 0;
      block_mask->full_count[0] = 2;
      block_mask->full_index[0] = block_mask->full_index[1] = 0;
    } else if (c.lists == Case::Lists::kCountOutside) {
      block_mask->partial_count[0] = key_blocks + 1;
    }
    p.block_mask_fault = {&fault_claim, &fault};
  }
  if (block_mask) {
    p.block_mask = block_mask->mask;
    if constexpr (kTarget == TileTarget::kSm80) {  // (the block-sparse kernel has sm80 tiles only)
      emulate_launch<EmulatedTraits<kElem, kBucket, kTarget, true>, MaskKind::kMasked, false, true>(p);
    } else {
      FAIL() << "no block-sparse kernel with sm90 tiles";
    }
  } else if (c.dropout > 0) {
    emulate_launch<EmulatedTraits<kElem, kBucket, kTarget>, MaskKind::kMaskedDropout>(p);
  } else if (masked) {
    emulate_launch<EmulatedTraits<kElem, kBucket, kTarget>, MaskKind::kMasked>(p);
  } else {
    emulate_launch<EmulatedTraits<kElem, kBucket, kTarget>, MaskKind::kNone>(p);
  }

  Errors err;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.sq; ++i) {
      for (int64_t h = 0; h < c.hq; ++h) {
        const size_t l = static_cast<size_t>((b * c.hq + h) * c.sq + i);
        if (bad_lists && b == 0 && h == 0 && i < c.block_m) {  // the rows of the broken lists: NaN
          for (int64_t x = 0; x < c.d; ++x) {
            const size_t e = static_cast<size_t>(b * lq[0] + i * lq[1] + h * lq[2] + x);
            if (!std::isnan(static_cast<float>(out[e]))) ++err.bad;
          }
          if (!std::isnan(lse[l])) ++err.bad;
          continue;
        }
        for (int64_t x = 0; x < c.d; ++x) {
          const size_t e = static_cast<size_t>(b * lq[0] + i * lq[1] + h * lq[2] + x);
          err.add_out(static_cast<float>(out[e]), static_cast<float>(ref[e]));
        }
        err.add_lse(lse[l], lse_ref[l]);
      }
    }
  }
  err.expect_within(kElem);
  if (c.lists != Case::Lists::kHost) {  // the first broken rule recorded, naming the entry; none for good lists
    using flashattn::cuda::IndexArgument;
    const IndexArgument want = c.lists == Case::Lists::kIndexOutside   ? IndexArgument::kBlockIndex
                               : c.lists == Case::Lists::kListedTwice  ? IndexArgument::kBlockTwice
                               : c.lists == Case::Lists::kCountOutside ? IndexArgument::kBlockCount
                                                                       : IndexArgument::kNone;
    EXPECT_EQ(fault.argument, static_cast<int32_t>(want));
    if (bad_lists) {
      EXPECT_EQ(fault.batch, 0);
      EXPECT_EQ(fault.column, 0);
      EXPECT_EQ(fault.row, 0);
      EXPECT_EQ(fault.rule, c.lists == Case::Lists::kCountOutside ? 0 : 1);  // partial / full lists
    }
  }
  if (c.strided) {  // the gaps between heads and rows stay untouched
    int64_t written = 0;
    for (size_t e = 0; e < out.size(); ++e) {
      const int64_t in_row = static_cast<int64_t>(e) % lq[1];
      const bool in_view = in_row < c.hq * lq[2] && in_row % lq[2] < c.d;
      if (!in_view && out[e].raw() != 0xFFFF) ++written;
    }
    EXPECT_EQ(written, 0) << "gap elements written";
  }
}

// Cases on a base of one dtype / head dim, built by the callable `cases(add)`.
template <ElemType kElem, int kBucket, TileTarget kTarget, class Cases>
void run_cases(int64_t d, Cases&& cases) {
  Case base;
  base.dtype = kElem == ElemType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  base.d = d;
  cases([&](auto f) {
    Case c = base;
    f(c);
    run_case<kElem, kBucket, kTarget>(c);
  });
}

template <ElemType kElem, int kBucket, TileTarget kTarget = TileTarget::kSm80>
void run_set(int64_t d) {
  run_cases<kElem, kBucket, kTarget>(d, [](auto add) {
    add([](Case& c) { c.sq = 130, c.sk = 150; });                   // tails
    add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true; });  // diagonal tiles
    add([](Case& c) { c.sq = 200, c.sk = 70, c.causal = true; });   // empty rows and CTAs
    add([](Case& c) { c.sq = 70, c.sk = 200, c.causal = true, c.batch = 2; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7; });  // window: n_begin > 0
    add([](Case& c) { c.sq = 100, c.sk = 100, c.wl = 0, c.wr = 0, c.alibi = true; });
    add([](Case& c) { c.sq = 90, c.sk = 160, c.causal = true, c.alibi = true, c.softcap = 30; });
    add([](Case& c) { c.sq = 66, c.sk = 130, c.strided = true, c.causal = true, c.hq = 3, c.hkv = 3; });
    add([](Case& c) { c.sq = 40, c.sk = 0; });                                         // seqlen_k 0
    add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true, c.dropout = 0.17f; });  // the CPU's keep-mask
    // A NaN value row reaches only the rows that see its key, not the rest of their tiles.
    add([](Case& c) { c.sq = 130, c.sk = 130, c.causal = true, c.nan_key = 6; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.nan_key = 100, c.softcap = 30; });
    add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true, c.dropout = 0.17f, c.nan_key = 70; });
  });
}

// The variants joined outside the key loop, on three tile shapes (128x64 with Q in registers,
// 128x32 with Q from shared memory, 64x32):
// - the learnable sink, joined after the key loop: rows that see keys, rows and CTAs that see
//   none (LSE = the sink), no key at all, the NaN rows' recompute, dropout, GQA;
// - sink tokens, joined by the sink-token pass: a few or more than a tile of them, a window of
//   one key, dropout, ALiBi, softcap, GQA, with a learnable sink and a NaN row in the window.
template <ElemType kElem, int kBucket, TileTarget kTarget = TileTarget::kSm80>
void run_variant_set(int64_t d) {
  run_cases<kElem, kBucket, kTarget>(d, [](auto add) {
    add([](Case& c) { c.sq = 130, c.sk = 150, c.sink = true; });
    add([](Case& c) { c.sq = 200, c.sk = 70, c.causal = true, c.sink = true, c.hq = 4, c.hkv = 2; });
    add([](Case& c) { c.sq = 40, c.sk = 0, c.sink = true; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.nan_key = 100, c.softcap = 30, c.sink = true; });
    add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true, c.dropout = 0.17f, c.sink = true, c.alibi = true; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.sink_tokens = 4; });
    add([](Case& c) { c.sq = 130, c.sk = 300, c.causal = true, c.wl = 40, c.sink_tokens = 70, c.hq = 4, c.hkv = 2; });
    add([](Case& c) { c.sq = 70, c.sk = 70, c.wl = 0, c.wr = 0, c.sink_tokens = 8, c.alibi = true; });
    add([](Case& c) { c.sq = 200, c.sk = 200, c.causal = true, c.wl = 10, c.sink_tokens = 3, c.dropout = 0.17f; });
    add([](Case& c) {
      c.sq = 100, c.sk = 160, c.causal = true, c.wl = 16, c.sink_tokens = 5, c.softcap = 30, c.sink = true;
      c.nan_key = 120;
    });
  });
}

// Block-sparse masks (random lists, partial blocks with random, all-zero and all-one bits) at
// blocks of one and of several kernel tiles: with tails, the window, softcap and ALiBi, GQA, a
// learnable sink, and a NaN value row (the repair sees only the keys the block mask shows).
template <ElemType kElem, int kBucket, TileTarget kTarget = TileTarget::kSm80>
void run_block_sparse_set(int64_t d) {
  using Traits = EmulatedTraits<kElem, kBucket, kTarget, true>;
  constexpr int64_t bm = Traits::kBlockM, bn = Traits::kBlockN;
  run_cases<kElem, kBucket, kTarget>(d, [](auto add) {
    add([](Case& c) { c.sq = 2 * bm + 5, c.sk = 5 * bn + 7, c.block_m = bm, c.block_n = bn, c.batch = 2; });
    add([](Case& c) {
      c.sq = 3 * bm + 1, c.sk = 7 * bn - 3, c.block_m = 2 * bm, c.block_n = 3 * bn, c.hq = 4, c.hkv = 2;
    });
    add([](Case& c) {
      c.sq = 2 * bm + 9, c.sk = 4 * bn + 1, c.block_m = bm, c.block_n = 2 * bn, c.causal = true, c.softcap = 30;
      c.alibi = true, c.sink = true;
    });
    add([](Case& c) { c.sq = 2 * bm, c.sk = 6 * bn, c.block_m = bm, c.block_n = bn, c.wl = bn, c.wr = 3; });
    add([](Case& c) { c.sq = bm + 3, c.sk = 3 * bn, c.block_m = bm, c.block_n = bn, c.nan_key = bn + 5; });
    // The lists checked by the kernel: good ones, and three broken rules (query block 0 of two
    // tiles, so both of its CTAs find the fault).
    for (const auto lists :
         {Case::Lists::kDevice, Case::Lists::kIndexOutside, Case::Lists::kListedTwice, Case::Lists::kCountOutside}) {
      add([lists](Case& c) {
        c.sq = 2 * bm + 1, c.sk = 2 * bn + 5, c.block_m = 2 * bm, c.block_n = bn, c.causal = true;
        c.lists = lists;
      });
    }
  });
}

// The paged kernels (varlen K / V in pages of `page` keys: whole tiles a page, or a row at a time
// for pages smaller than a tile; each sequence's blocks shuffled among spare ones, every page row
// no key fills NaN) against the reference run of the same paged call: sequences of 300 and 100
// keys (partial last pages), GQA 2 / 1.
template <ElemType kElem, int kBucket>
void run_paged_case(int64_t page, bool causal, int64_t window_left = -1, int64_t sink_tokens = 0) {
  using Element = typename ElementTypes<kElem>::Element;
  const DType dt = kElem == ElemType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  const int64_t d = kBucket, hq = 2, hkv = 1;
  const std::vector<int32_t> cu_q = {0, 70, 200}, cu_k = {0, 300, 400};
  const int64_t lens[2] = {300, 100}, width = (300 + page - 1) / page, total_q = cu_q.back();
  const int64_t blocks = 2 * width + 2;
  SCOPED_TRACE(std::string("paged ") + flashattn::dtype_name(dt) + " d" + std::to_string(d) + " page " +
               std::to_string(page) + (causal ? " causal" : "") + " window_left " + std::to_string(window_left) +
               " sink_tokens " + std::to_string(sink_tokens));
  std::mt19937_64 rng(emu::test_seed() ^ static_cast<uint64_t>(page * 2 + causal));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Element> q(static_cast<size_t>(total_q * hq * d)), out(q.size(), Element::bitcast(0xFFFF)), ref(q.size());
  std::vector<Element> k(static_cast<size_t>(blocks * page * hkv * d), Element(NAN)), v(k);
  for (Element& x : q) x = Element(normal(rng));
  std::vector<int32_t> bt(static_cast<size_t>(blocks));  // [2, width]: the first 2 * width of a shuffle
  std::iota(bt.begin(), bt.end(), 0);
  std::shuffle(bt.begin(), bt.end(), rng);
  bt.resize(static_cast<size_t>(2 * width));
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t row = bt[static_cast<size_t>(b * width + j / page)] * page + j % page;
      for (int64_t e = 0; e < hkv * d; ++e) {
        k[static_cast<size_t>(row * hkv * d + e)] = Element(normal(rng));
        v[static_cast<size_t>(row * hkv * d + e)] = Element(normal(rng));
      }
    }
  }
  std::vector<float> lse(static_cast<size_t>(hq * total_q), NAN), lse_ref(lse.size());

  flashattn::AttentionOptions o;
  o.mask.causal = causal;
  o.mask.window_left = window_left;
  o.mask.sink_tokens = sink_tokens;
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = flashattn::TensorView::contiguous(const_cast<int32_t*>(cu_q.data()), DType::kInt32, {3});
  vl.cu_seqlens_k = flashattn::TensorView::contiguous(const_cast<int32_t*>(cu_k.data()), DType::kInt32, {3});
  vl.block_table = flashattn::TensorView::contiguous(const_cast<int32_t*>(bt.data()), DType::kInt32, {2, width});
  vl.max_seqlen_q = 130;
  vl.max_seqlen_k = 300;
  auto kv_view = [&](std::vector<Element>& x) {
    return flashattn::TensorView::contiguous(x.data(), dt, {blocks, page, hkv, d});
  };
  flashattn::reference_forward_varlen(
      {flashattn::TensorView::contiguous(q.data(), dt, {total_q, hq, d}), kv_view(k), kv_view(v),
       flashattn::TensorView::contiguous(ref.data(), dt, {total_q, hq, d}),
       flashattn::TensorView::contiguous(lse_ref.data(), DType::kFloat32, {hq, total_q})},
      vl, o);

  // The params as src/cuda/problem_params.cpp builds them for this call.
  ForwardParams p;
  p.q = {q.data(), 0, hq * d, d};
  p.k = {k.data(), page * hkv * d, hkv * d, d};
  p.v = {v.data(), page * hkv * d, hkv * d, d};
  p.out = {out.data(), 0, hq * d, d};
  p.lse = {lse.data(), 0, 1, total_q};
  p.shape = {2, hq, hkv, d, vl.max_seqlen_q, vl.max_seqlen_k};
  p.cu_seqlens_q = cu_q.data();
  p.cu_seqlens_k = cu_k.data();
  p.total_q = total_q;
  p.total_k = blocks;
  p.block_table = bt.data();
  p.block_table_stride = width;
  p.page = flashattn::core::FastDivmod(static_cast<uint32_t>(page));
  p.window = {window_left, causal ? 0 : -1, sink_tokens};
  p.tile_group = 2;
  p.tile_last_first = flashattn::cuda::last_group_first(2 * hq, 1, 2, 1, 1);
  p.score = emu::score_params(d, 0.0f, nullptr);
  using Traits = EmulatedTraits<kElem, kBucket, TileTarget::kSm80>;
  if (causal || window_left >= 0) {
    emulate_launch<Traits, MaskKind::kMasked, true>(p);
  } else {
    emulate_launch<Traits, MaskKind::kNone, true>(p);
  }

  Errors err;  // a block read by mistake: NaN (spare blocks) or O(1) errors
  for (size_t e = 0; e < out.size(); ++e) err.add_out(static_cast<float>(out[e]), static_cast<float>(ref[e]));
  // (causal: sequence 1's first 30 rows see no key, LSE -inf)
  for (size_t l = 0; l < lse.size(); ++l) err.add_lse(lse[l], lse_ref[l]);
  err.expect_within(kElem);
}

// Every tile shape: 128x64 (4 warps, Q in registers; Q from smem at d128 with sm90 tiles),
// 128x32 (Q from smem), 64x64, 64x32; with a padded head dim (40 -> 64, 200 -> 224).
TEST(Sm80Emulated, Fp16D64) { run_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80Emulated, Fp16D40Padded) { run_set<ElemType::kFloat16, 64>(40); }
TEST(Sm80Emulated, Bf16D96) { run_set<ElemType::kBFloat16, 96>(96); }
TEST(Sm80Emulated, Fp16D128) { run_set<ElemType::kFloat16, 128>(128); }
TEST(Sm80Emulated, Bf16D128Sm90Tiles) { run_set<ElemType::kBFloat16, 128, TileTarget::kSm90>(128); }
TEST(Sm80Emulated, Bf16D200Padded) { run_set<ElemType::kBFloat16, 224>(200); }
TEST(Sm80Emulated, Fp16D256) { run_set<ElemType::kFloat16, 256>(256); }
TEST(Sm80Emulated, VariantsFp16D64) { run_variant_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80Emulated, VariantsBf16D128Sm90Tiles) { run_variant_set<ElemType::kBFloat16, 128, TileTarget::kSm90>(128); }
TEST(Sm80Emulated, VariantsFp16D256) { run_variant_set<ElemType::kFloat16, 256>(256); }
TEST(Sm80Emulated, BlockSparseFp16D64) { run_block_sparse_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80Emulated, BlockSparseBf16D128) { run_block_sparse_set<ElemType::kBFloat16, 128>(128); }
TEST(Sm80Emulated, BlockSparseFp16D192) { run_block_sparse_set<ElemType::kFloat16, 192>(192); }  // one K / V stage
TEST(Sm80Emulated, PagedVarlen) {
  run_paged_case<ElemType::kFloat16, 64>(128, false);
  run_paged_case<ElemType::kFloat16, 64>(128, true);
  run_paged_case<ElemType::kBFloat16, 128>(256, true);
}
TEST(Sm80Emulated, PagedVarlenSmallPages) {  // a row at a time
  run_paged_case<ElemType::kFloat16, 64>(16, true);
  run_paged_case<ElemType::kBFloat16, 128>(48, false);
  run_paged_case<ElemType::kFloat16, 64>(1, false);
  run_paged_case<ElemType::kFloat16, 64>(16, true, 30, 5);  // sink tokens through the pages
}

}  // namespace

// The sm80 backward kernels' own code (prepare, main, convert) run on the CPU
// (emulation.hpp) against the fp64 reference: query-tile ranges per key tile, masks, score mods
// and their gradients, dropout's keep-mask, GQA sums, the scratch rows of dense and varlen
// batches, deterministic turns, zero gradients for rows that see nothing, block-sparse masks (the
// transpose's cells and the walk over them) -- without a GPU.
#include <gtest/gtest.h>

#include <memory>
#include <sstream>

#include "../cpp/random_block_mask.hpp"

#include "cuda/sink_tokens.hpp"
#include "emulation.hpp"

namespace {

using namespace cute;
using flashattn::DType;
using flashattn::TensorView;
using flashattn::cuda::BackwardParams;
using flashattn::cuda::ElemType;
using flashattn::cuda::MaskKind;
using flashattn::cuda::sm80::BackwardTraits;
using flashattn::cuda::sm80::ElementTypes;
using flashattn::cuda::sm80::TileTarget;

// The kernel's traits with the hardware-only atoms swapped for the emulated ones (same layouts).
template <ElemType kElem, int kHeadDim, MaskKind kMask, TileTarget kTarget>
struct EmulatedTraits : BackwardTraits<kElem, kHeadDim, kMask, kTarget> {
  using Base = BackwardTraits<kElem, kHeadDim, kMask, kTarget>;
  using Element = typename Base::Element;
  template <int kWarpsFirst>
  using WarpTiledMma = TiledMMA<MMA_Atom<emu::Mma16816<typename ElementTypes<kElem>::MmaOp, Element>>,
                                Layout<Shape<Int<kWarpsFirst>, Int<Base::kNWarps / kWarpsFirst>, _1>>,
                                Tile<Int<16 * kWarpsFirst>, Int<16 * (Base::kNWarps / kWarpsFirst)>, _16>>;
  using TiledMmaSdP = WarpTiledMma<Base::kShape.atom_m_sdp>;
  using TiledMmadKV = WarpTiledMma<Base::kShape.atom_n_dkv>;
  using TiledMmadQ = WarpTiledMma<Base::kShape.atom_m_dq>;
  using SmemCopyAtom = Copy_Atom<emu::Ldsm<false>, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<emu::Ldsm<true>, Element>;
  using GmemTiledLoad =
      decltype(make_tiled_copy(Copy_Atom<emu::CopyZfill16, Element>{}, typename Base::ChunkThreadLayout{},
                               typename Base::Fwd::ChunkValueLayout{}));
};

struct Case {
  int64_t batch = 1, sq = 1, sk = 1, hq = 2, hkv = 1, d = 64;
  bool causal = false;
  int64_t wl = -1, wr = -1;
  float softcap = 0;
  bool alibi = false;
  float dropout = 0;
  bool deterministic = false;
  bool sink = false;  // a learnable sink per query head (and its gradient)
  int64_t sink_tokens = 0;
  std::vector<int32_t> lens_q, lens_k;  // varlen when set (batch = lens_q.size())
  int64_t block_m = 0, block_n = 0;     // a random block mask of these blocks (0: none)
  // A NaN in column 3 of row nan_at of batch 0: of q (query head 0), dout (query head 1), or k / v
  // (every KV head) as nan_in says ('q', 'o', 'k', 'v'); none when nan_at < 0.
  char nan_in = 'v';
  int64_t nan_at = -1;
  std::string name() const {
    std::ostringstream n;  // (a chain of std::string += trips GCC 12's bogus -Wrestrict)
    n << "b" << batch << " sq" << sq << " sk" << sk << " h" << hq << "/" << hkv << " d" << d;
    if (causal) n << " causal";
    if (wl >= 0 || wr >= 0) n << " window(" << wl << "," << wr << ")";
    if (softcap > 0) n << " softcap";
    if (alibi) n << " alibi";
    if (dropout > 0) n << " dropout";
    if (deterministic) n << " deterministic";
    if (sink) n << " sink";
    if (sink_tokens > 0) n << " sink_tokens " << sink_tokens;
    if (!lens_q.empty()) n << " varlen";
    if (block_m > 0) n << " block_mask " << block_m << "x" << block_n;
    if (nan_at >= 0) n << " nan " << (nan_in == 'o' ? "dout" : std::string(1, nan_in)) << " row " << nan_at;
    return n.str();
  }
};

template <class Element>
std::vector<Element> random_tensor(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Element> t(n);
  for (Element& x : t) x = Element(normal(rng));
  return t;
}

// max |got - want| <= tol * max |want| over every element, and no NaN.
template <class Element>
void expect_close(const char* what, const std::vector<Element>& got, const std::vector<Element>& want, double tol) {
  double max_err = 0, max_ref = 1e-3;
  int64_t nan = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    const double g = static_cast<float>(got[e]), w = static_cast<float>(want[e]);
    if (!std::isfinite(g)) ++nan;
    max_err = std::max(max_err, std::abs(g - w));
    max_ref = std::max(max_ref, std::abs(w));
  }
  EXPECT_EQ(nan, 0) << what << ": non-finite values";
  EXPECT_LE(max_err, tol * max_ref) << what;
}

// With a NaN input: NaN exactly where the CPU backend has one (it follows the rule, element by
// element), and the other elements as expect_close compares them with the reference.
template <class Element>
int64_t expect_nan_pattern(const char* what, const std::vector<Element>& got, const std::vector<Element>& cpu,
                           const std::vector<Element>& want, double tol) {
  double max_err = 0, max_ref = 1e-3;
  int64_t mismatch = 0, nan = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    const double g = static_cast<float>(got[e]), c = static_cast<float>(cpu[e]), w = static_cast<float>(want[e]);
    nan += std::isnan(c);
    if (std::isnan(g) != std::isnan(c) || (!std::isnan(g) && !std::isfinite(g))) {
      if (++mismatch <= 3) ADD_FAILURE() << what << "[" << e << "] " << g << " vs CPU " << c;
      continue;
    }
    if (std::isnan(c) || std::isnan(w)) continue;
    max_err = std::max(max_err, std::abs(g - w));
    max_ref = std::max(max_ref, std::abs(w));
  }
  EXPECT_EQ(mismatch, 0) << what << ": elements NaN on one side only (or infinite)";
  EXPECT_LE(max_err, tol * max_ref) << what;
  return nan;
}

// The sink-token pass's three kernels (common/sink_tokens.cuh) as the backend launches them.
template <class Element, int kBucket>
void emulate_sink_tokens(const BackwardParams& p) {
  namespace fc = flashattn::cuda;
  constexpr int kMaxCols = (kBucket + 31) / 32;
  const fc::ShapeParams& s = p.fwd.shape;
  const fc::SinkTokenLayout layout = fc::sink_token_layout(s, p.fwd.window.sink_tokens);
  std::vector<float> partials(layout.bytes / sizeof(float), NAN);
  const fc::SinkTokenPartials parts{partials.data(), layout.keys, layout.chunks, layout.chunk_rows};
  const auto heads_kv = static_cast<unsigned>(s.heads_kv), batch = static_cast<unsigned>(s.batch);
  const auto keys = static_cast<unsigned>(heads_kv * layout.keys);
  emu::launch(emu::Dim3{static_cast<unsigned>((s.seqlen_q + fc::kSinkTokenRows - 1) / fc::kSinkTokenRows),
                        static_cast<unsigned>(s.heads_q), batch},
              fc::kSinkTokenThreads, [&] { fc::backward_sink_tokens_dq_block<Element, kMaxCols>(p); });
  float staged[fc::kSinkTokenThreads / 32][2][kMaxCols * 32];  // (blocks run one at a time here)
  emu::launch(emu::Dim3{static_cast<unsigned>(layout.chunks), keys, batch}, fc::kSinkTokenThreads,
              [&] { fc::backward_sink_tokens_dkv_block<Element, kMaxCols>(p, parts, staged); });
  emu::launch(emu::Dim3{keys, batch, 1}, fc::kSinkTokenThreads,
              [&] { fc::backward_sink_tokens_reduce_block<Element>(p, parts); });
}

template <ElemType kElem, int kBucket, TileTarget kTarget>
void run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  using Element = typename ElementTypes<kElem>::Element;
  const DType dt = kElem == ElemType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  std::mt19937_64 rng(emu::test_seed() ^ std::hash<std::string>{}(c.name()));
  const bool varlen = !c.lens_q.empty();
  const int64_t batch = varlen ? static_cast<int64_t>(c.lens_q.size()) : c.batch;
  // Dense [b, s, h, d] or varlen [total, h, d]: rows of batch b from row0(b).
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (size_t b = 0; b < c.lens_q.size(); ++b) {
    cu_q.push_back(cu_q.back() + c.lens_q[b]);
    cu_k.push_back(cu_k.back() + c.lens_k[b]);
  }
  const int64_t rows_q = varlen ? cu_q.back() : batch * c.sq, rows_k = varlen ? cu_k.back() : batch * c.sk;
  const int64_t max_sq = varlen ? *std::max_element(c.lens_q.begin(), c.lens_q.end()) : c.sq;
  const int64_t max_sk = varlen ? *std::max_element(c.lens_k.begin(), c.lens_k.end()) : c.sk;
  auto q = random_tensor<Element>(static_cast<size_t>(rows_q * c.hq * c.d), rng);
  auto k = random_tensor<Element>(static_cast<size_t>(rows_k * c.hkv * c.d), rng);
  auto v = random_tensor<Element>(k.size(), rng);
  auto dout = random_tensor<Element>(q.size(), rng);
  if (c.nan_at >= 0) {
    const bool query = c.nan_in == 'q' || c.nan_in == 'o';
    std::vector<Element>& t = c.nan_in == 'q' ? q : c.nan_in == 'o' ? dout : c.nan_in == 'k' ? k : v;
    const int64_t heads = query ? c.hq : c.hkv, first = c.nan_in == 'o' ? 1 : 0, last = query ? first : heads - 1;
    for (int64_t h = first; h <= last; ++h) t[static_cast<size_t>((c.nan_at * heads + h) * c.d + 3)] = Element(NAN);
  }
  std::vector<Element> out(q.size()), dq_ref(q.size()), dk_ref(k.size()), dv_ref(k.size());
  std::vector<float> lse(static_cast<size_t>(rows_q * c.hq));
  std::vector<float> slopes(static_cast<size_t>(c.hq));
  for (float& s : slopes) s = std::uniform_real_distribution<float>(0.0f, 0.3f)(rng);
  std::vector<float> sinks(static_cast<size_t>(c.hq)), dsink_ref(sinks.size(), NAN), dsink(sinks.size(), NAN);
  for (float& s : sinks) s = std::uniform_real_distribution<float>(-1.0f, 3.0f)(rng);

  // Reference out / lse / gradients through the public API on the host tensors.
  auto rows = [&](void* p, int64_t n, int64_t h) {
    return varlen ? TensorView::contiguous(p, dt, {n, h, c.d})
                  : TensorView::contiguous(p, dt, {batch, n / batch, h, c.d});
  };
  const TensorView lse_view = varlen ? TensorView::contiguous(lse.data(), DType::kFloat32, {c.hq, rows_q})
                                     : TensorView::contiguous(lse.data(), DType::kFloat32, {batch, c.hq, c.sq});
  flashattn::AttentionOptions o;
  o.mask.causal = c.causal;
  o.mask.window_left = c.wl;
  o.mask.window_right = c.wr;
  o.mask.sink_tokens = c.sink_tokens;
  o.score.softcap = c.softcap;
  if (c.alibi) o.score.alibi_slopes = TensorView::contiguous(slopes.data(), DType::kFloat32, {c.hq});
  if (c.sink) o.score.learnable_sink = TensorView::contiguous(sinks.data(), DType::kFloat32, {c.hq});
  o.dropout.p = c.dropout;
  o.dropout.seed = rng();
  o.dropout.offset = rng() % 1000;
  std::unique_ptr<fa_test::RandomBlockMask> block_mask;
  if (c.block_m > 0) {
    block_mask = std::make_unique<fa_test::RandomBlockMask>(rng, batch, c.hq, c.sq, c.sk, c.block_m, c.block_n);
    o.block_mask = block_mask->options();
  }
  flashattn::VarlenArgs vl;
  vl.cu_seqlens_q = TensorView::contiguous(cu_q.data(), DType::kInt32, {batch + 1});
  vl.cu_seqlens_k = TensorView::contiguous(cu_k.data(), DType::kInt32, {batch + 1});
  vl.max_seqlen_q = max_sq;
  vl.max_seqlen_k = max_sk;
  const flashattn::ForwardArgs fa{rows(q.data(), rows_q, c.hq), rows(k.data(), rows_k, c.hkv),
                                  rows(v.data(), rows_k, c.hkv), rows(out.data(), rows_q, c.hq), lse_view};
  flashattn::BackwardArgs ba{rows(dout.data(), rows_q, c.hq),
                             fa.q,
                             fa.k,
                             fa.v,
                             fa.out,
                             lse_view,
                             rows(dq_ref.data(), rows_q, c.hq),
                             rows(dk_ref.data(), rows_k, c.hkv),
                             rows(dv_ref.data(), rows_k, c.hkv)};
  if (c.sink) ba.dsink = TensorView::contiguous(dsink_ref.data(), DType::kFloat32, {c.hq});
  if (varlen) {
    flashattn::reference_forward_varlen(fa, vl, o);
    flashattn::reference_backward_varlen(ba, vl, o);
  } else {
    flashattn::reference_forward(fa, o);
    flashattn::reference_backward(ba, o);
  }
  // With a NaN input, the CPU backend's gradients too: the NaN pattern the rule gives.
  std::vector<Element> dq_cpu(q.size()), dk_cpu(k.size()), dv_cpu(k.size());
  if (c.nan_at >= 0) {
    flashattn::BackwardArgs cpu = ba;
    cpu.dq = rows(dq_cpu.data(), rows_q, c.hq);
    cpu.dk = rows(dk_cpu.data(), rows_k, c.hkv);
    cpu.dv = rows(dv_cpu.data(), rows_k, c.hkv);
    std::vector<float> workspace(flashattn::backward_workspace_size(cpu, o) / sizeof(float) + 4);
    flashattn::backward(cpu, o, {nullptr, workspace.data(), workspace.size() * sizeof(float)});
  }

  // The params as src/cuda/backend.cpp builds them; gradients poisoned.
  std::vector<Element> dq(q.size(), Element::bitcast(0xFFFF)), dk(k.size(), Element::bitcast(0xFFFF)),
      dv(k.size(), Element::bitcast(0xFFFF));
  const int64_t rs_q = c.hq * c.d, rs_k = c.hkv * c.d;
  BackwardParams p;
  auto& f = p.fwd;
  const int64_t bs_q = varlen ? 0 : c.sq * rs_q, bs_k = varlen ? 0 : c.sk * rs_k;
  f.q = {q.data(), bs_q, rs_q, c.d};
  f.k = {k.data(), bs_k, rs_k, c.d};
  f.v = {v.data(), bs_k, rs_k, c.d};
  f.out = {out.data(), bs_q, rs_q, c.d};
  f.lse = varlen ? flashattn::cuda::LseOut{lse.data(), 0, 1, rows_q}
                 : flashattn::cuda::LseOut{lse.data(), c.hq * c.sq, 1, c.sq};
  f.shape = {batch, c.hq, c.hkv, c.d, max_sq, max_sk};
  f.window = {c.wl, c.causal ? 0 : c.wr, c.sink_tokens};
  if (varlen) {
    f.cu_seqlens_q = cu_q.data();
    f.cu_seqlens_k = cu_k.data();
  }
  f.score = emu::score_params(c.d, c.softcap, c.alibi ? slopes.data() : nullptr);
  f.dropout = emu::dropout_params(o.dropout);
  if (c.sink) {
    f.score.sink = sinks.data();
    f.score.sink_stride = 1;
    p.dsink = dsink.data();
    p.dsink_stride = 1;
  }
  p.dout = {dout.data(), bs_q, rs_q, c.d};
  p.dq = {dq.data(), bs_q, rs_q, c.d};
  p.dk = {dk.data(), bs_k, rs_k, c.d};
  p.dv = {dv.data(), bs_k, rs_k, c.d};
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  p.deterministic = c.deterministic;
  std::vector<int32_t> cells;
  if (block_mask) {
    f.block_mask = block_mask->mask;
    p.block_cells = {nullptr, c.hq, block_mask->mask.key_blocks, block_mask->mask.query_blocks};
    cells.assign(static_cast<size_t>(p.block_cells.size(batch)), flashattn::core::kCellHidden);  // (the memset)
    p.block_cells.data = cells.data();
  }
  constexpr int64_t kPad = flashattn::cuda::kBackwardRowPad;
  const int64_t scratch_rows =
      varlen ? (rows_q + batch * kPad + kPad - 1) / kPad * kPad : batch * ((c.sq + kPad - 1) / kPad * kPad);
  std::vector<float> dq_accum(static_cast<size_t>(c.hq * scratch_rows * kBucket), 0.0f);
  std::vector<float> delta(static_cast<size_t>(c.hq * scratch_rows), NAN), lse2(delta.size(), NAN);
  std::vector<int> turns(static_cast<size_t>(c.hq * scratch_rows / flashattn::cuda::kBackwardMinBlockM), 0);
  p.scratch = {dq_accum.data(), delta.data(), lse2.data(), turns.data(), scratch_rows, kBucket};

  using flashattn::cuda::sm80::kRowThreads;
  const emu::Dim3 row_grid{static_cast<unsigned>((max_sq + kPad - 1) / kPad), static_cast<unsigned>(c.hq),
                           static_cast<unsigned>(batch)};
  emu::launch(row_grid, kRowThreads, [&] { flashattn::cuda::sm80::backward_prepare_block<Element>(p); });
  if (c.sink) {  // one block a head (blocks run one at a time here: one shared array serves)
    float warp_sums[kRowThreads / 32];
    emu::launch(emu::Dim3{static_cast<unsigned>(c.hq), 1, 1}, kRowThreads,
                [&] { flashattn::cuda::sm80::backward_sink_grad_block<kRowThreads>(p, warp_sums); });
  }
  auto main_kernel = [&](auto mask_kind, auto sparse) {
    constexpr MaskKind kMask = decltype(mask_kind)::value;
    using Traits = EmulatedTraits<kElem, kBucket, kMask, kTarget>;
    const emu::Dim3 key_grid{static_cast<unsigned>((max_sk + Traits::kBlockN - 1) / Traits::kBlockN),
                             static_cast<unsigned>(c.hkv), static_cast<unsigned>(batch)};
    emu::launch(key_grid, Traits::kNThreads,
                [&] { flashattn::cuda::sm80::backward_tile<Traits, kMask, decltype(sparse)::value>(p); });
  };
  auto main_kernel_dense = [&](auto mask_kind) { main_kernel(mask_kind, std::false_type{}); };
  if (block_mask) {  // the transpose, then the block-sparse kernel
    emu::launch(emu::Dim3{static_cast<unsigned>(p.block_cells.query_blocks), static_cast<unsigned>(c.hq),
                          static_cast<unsigned>(batch)},
                kRowThreads, [&] { flashattn::cuda::sm80::block_cells_block(p); });
    main_kernel(std::integral_constant<MaskKind, MaskKind::kMasked>{}, std::true_type{});
  } else if (c.dropout > 0) {
    main_kernel_dense(std::integral_constant<MaskKind, MaskKind::kMaskedDropout>{});
  } else if (f.window.left >= 0 || f.window.right >= 0) {
    main_kernel_dense(std::integral_constant<MaskKind, MaskKind::kMasked>{});
  } else {
    main_kernel_dense(std::integral_constant<MaskKind, MaskKind::kNone>{});
  }
  if (c.sink_tokens > 0 && c.wl >= 0) emulate_sink_tokens<Element, kBucket>(p);
  emu::launch(row_grid, kRowThreads, [&] { flashattn::cuda::sm80::backward_convert_dq_block<Element>(p); });

  // Logic errors are O(1); rounding (P and dS in 16 bits) is ~1e-2 (fp16) / 5e-2 (bf16) of the
  // gradients' scale. Varlen rows outside every sequence are the dispatcher's (varlen_checks): the
  // cases here leave none.
  const double tol = kElem == ElemType::kFloat16 ? 1e-2 : 5e-2;
  if (c.nan_at >= 0) {
    expect_nan_pattern("dq", dq, dq_cpu, dq_ref, tol);
    const int64_t nan =
        expect_nan_pattern("dk", dk, dk_cpu, dk_ref, tol) + expect_nan_pattern("dv", dv, dv_cpu, dv_ref, tol);
    EXPECT_GT(nan, 0) << "the NaN must reach the dK / dV of the keys its row sees (or of its key)";
    return;
  }
  expect_close("dq", dq, dq_ref, tol);
  expect_close("dk", dk, dk_ref, tol);
  expect_close("dv", dv, dv_ref, tol);
  if (c.sink) {
    // d sink = -sum_i P_sink,i D_i cancels over rows: judged at the scale of its terms,
    // sum_i |P_sink,i D_i| (docs/CONVENTIONS.md), as the CPU tests judge it; at its own scale a
    // few cases of bf16 rounding in out (D's factor) fail it on some seeds.
    for (int64_t h = 0; h < c.hq; ++h) {
      double terms = 0;
      for (int64_t r = 0; r < rows_q; ++r) {
        double d_row = 0;
        for (int64_t col = 0; col < c.d; ++col) {
          const size_t e = static_cast<size_t>((r * c.hq + h) * c.d + col);
          d_row += static_cast<double>(static_cast<float>(dout[e])) * static_cast<float>(out[e]);
        }
        const int64_t lse_at = varlen ? h * rows_q + r : ((r / c.sq) * c.hq + h) * c.sq + r % c.sq;
        terms += std::abs(std::exp(static_cast<double>(sinks[h]) - lse[lse_at]) * d_row);
      }
      const double got = dsink[h], want = dsink_ref[h];
      EXPECT_TRUE(std::isfinite(got)) << "dsink[" << h << "]";
      EXPECT_LE(std::abs(got - want), tol * std::max(terms, 1e-3)) << "dsink[" << h << "] " << got << " vs " << want;
    }
  }
}

// Cases on a base of one head dim, built by the callable `cases(add)`.
template <ElemType kElem, int kBucket, TileTarget kTarget, class Cases>
void run_cases(int64_t d, Cases&& cases) {
  Case base;
  base.d = d;
  cases([&](auto f) {
    Case c = base;
    f(c);
    run_case<kElem, kBucket, kTarget>(c);
  });
}

// nan_cases: the NaN rule's cases too (a twin of a tile shape that differs only in its pipeline's
// stages leaves them to the other: they check the element pass and the repair, not the pipeline).
template <ElemType kElem, int kBucket, TileTarget kTarget = TileTarget::kSm80>
void run_set(int64_t d, bool nan_cases = true) {
  run_cases<kElem, kBucket, kTarget>(d, [nan_cases](auto add) {
    add([](Case& c) { c.sq = 130, c.sk = 150; });  // tails, GQA group of 2
    add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true, c.deterministic = true; });
    add([](Case& c) { c.sq = 200, c.sk = 70, c.causal = true; });               // rows that see nothing
    add([](Case& c) { c.sq = 70, c.sk = 200, c.causal = true, c.batch = 2; });  // keys no row sees
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.alibi = true; });
    add([](Case& c) { c.sq = 90, c.sk = 160, c.causal = true, c.softcap = 2, c.alibi = true; });  // tanh saturates
    add([](Case& c) { c.sq = 100, c.sk = 120, c.dropout = 0.17f, c.hq = 3, c.hkv = 3; });
    add([](Case& c) { c.lens_q = {70, 0, 140}, c.lens_k = {90, 30, 0}, c.causal = true; });  // varlen, empty sequences
    add([](Case& c) { c.sq = 40, c.sk = 0; });                                               // no keys: dq = 0
    if (!nan_cases) return;
    // A NaN reaches exactly the gradients the rule says (docs/CONVENTIONS.md, "NaN"), not the rest
    // of its tiles: a value row (its key masked for part of a query tile), a query and a dout row
    // (masked for part of a key tile), a key row (its NaN kept out of other rows' dQ); under the causal mask, a window, dropout.
    add([](Case& c) { c.sq = 130, c.sk = 130, c.causal = true, c.nan_in = 'v', c.nan_at = 70; });
    add([](Case& c) { c.sq = 130, c.sk = 150, c.causal = true, c.nan_in = 'q', c.nan_at = 60; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.nan_in = 'o', c.nan_at = 100; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.softcap = 2, c.nan_in = 'k', c.nan_at = 90; });
    add([](Case& c) { c.sq = 130, c.sk = 130, c.causal = true, c.nan_in = 'k', c.nan_at = 40; });
    add([](Case& c) { c.sq = 100, c.sk = 120, c.causal = true, c.dropout = 0.17f, c.nan_in = 'o', c.nan_at = 30; });
  });
}

// The variants outside the main kernel's loops, on two tile shapes (128 x 128, 64 x 128):
// - a learnable sink: the LSE carries it into P; d sink from the prepare kernel's rows (every
//   batch entry's, varlen sequences apart; rows that see no key; deterministic mode alike);
// - sink tokens, whose terms the sink-token pass adds (dQ's sums row by row, dK / dV through
//   chunked partials): a few or more than a tile of them, GQA, dropout, ALiBi, softcap, varlen
//   with empty sequences, with a learnable sink, deterministic mode.
template <ElemType kElem, int kBucket, TileTarget kTarget = TileTarget::kSm80>
void run_variant_set(int64_t d) {
  run_cases<kElem, kBucket, kTarget>(d, [](auto add) {
    add([](Case& c) { c.sq = 130, c.sk = 150, c.sink = true, c.batch = 2; });
    add([](Case& c) { c.sq = 200, c.sk = 70, c.causal = true, c.sink = true, c.deterministic = true; });
    add([](Case& c) { c.sq = 100, c.sk = 120, c.dropout = 0.17f, c.hq = 3, c.hkv = 3, c.sink = true; });
    add([](Case& c) { c.lens_q = {70, 0, 140}, c.lens_k = {90, 30, 0}, c.causal = true, c.sink = true; });
    add([](Case& c) { c.sq = 40, c.sk = 0, c.sink = true; });
    add([](Case& c) { c.sq = 150, c.sk = 190, c.wl = 20, c.wr = 7, c.sink_tokens = 4; });
    add([](Case& c) {
      c.sq = 130, c.sk = 300, c.causal = true, c.wl = 40, c.sink_tokens = 70, c.hq = 4, c.hkv = 2;
      c.deterministic = true;
    });
    add([](Case& c) { c.sq = 200, c.sk = 200, c.causal = true, c.wl = 10, c.sink_tokens = 3, c.dropout = 0.17f; });
    add([](Case& c) {
      c.sq = 90, c.sk = 160, c.causal = true, c.wl = 16, c.sink_tokens = 6, c.softcap = 2, c.alibi = true;
    });
    add([](Case& c) {
      c.lens_q = {70, 0, 140}, c.lens_k = {90, 30, 0}, c.causal = true, c.wl = 8, c.sink_tokens = 5, c.sink = true;
    });
  });
}

// Block-sparse masks (random lists in random order; partial blocks with random, all-zero and
// all-one bits) at blocks of one and of several kernel tiles: tails, GQA (each query head its
// own lists), the window and causal masks, softcap and ALiBi, a learnable sink, deterministic
// turns, and a NaN value row (the repair sees only the keys the block mask shows).
template <ElemType kElem, int kBucket>
void run_block_sparse_set(int64_t d) {
  using Traits = EmulatedTraits<kElem, kBucket, MaskKind::kMasked, TileTarget::kSm80>;
  constexpr int64_t bm = Traits::kBlockM, bn = Traits::kBlockN;
  run_cases<kElem, kBucket, TileTarget::kSm80>(d, [](auto add) {
    add([](Case& c) { c.sq = 2 * bm + 5, c.sk = 3 * bn + 7, c.block_m = bm, c.block_n = bn, c.batch = 2; });
    add([](Case& c) {
      c.sq = 3 * bm + 1, c.sk = 4 * bn - 3, c.block_m = 2 * bm, c.block_n = 2 * bn, c.hq = 4, c.hkv = 2;
    });
    add([](Case& c) {
      c.sq = 2 * bm + 9, c.sk = 3 * bn + 1, c.block_m = bm, c.block_n = bn, c.causal = true, c.softcap = 30;
      c.alibi = true, c.sink = true;
    });
    add([](Case& c) { c.sq = 2 * bm, c.sk = 4 * bn, c.block_m = bm, c.block_n = bn, c.wl = bn, c.wr = 3; });
    add([](Case& c) {
      c.sq = 3 * bm + 7, c.sk = 3 * bn + 2, c.block_m = bm, c.block_n = bn, c.hq = 4, c.hkv = 2, c.causal = true;
      c.deterministic = true;
    });
    add([](Case& c) { c.sq = bm + 3, c.sk = 2 * bn, c.block_m = bm, c.block_n = bn, c.nan_in = 'v', c.nan_at = 5; });
  });
}

// Every tile shape: 128 x 128 (d <= 64), 64 x 128 (d <= 128), 64 x 64 with one Q / dO stage
// (d256) and with two (d256 tuned for sm90); padded head dims.
TEST(Sm80BackwardEmulated, Fp16D64) { run_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80BackwardEmulated, Bf16D40Padded) { run_set<ElemType::kBFloat16, 64>(40); }
TEST(Sm80BackwardEmulated, Bf16D128) { run_set<ElemType::kBFloat16, 128>(128); }
TEST(Sm80BackwardEmulated, Fp16D256) { run_set<ElemType::kFloat16, 256>(256); }
TEST(Sm80BackwardEmulated, Bf16D256Sm90Stages) {
  run_set<ElemType::kBFloat16, 256, TileTarget::kSm90>(256, /*nan_cases=*/false);
}
TEST(Sm80BackwardEmulated, VariantsFp16D64) { run_variant_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80BackwardEmulated, VariantsBf16D128) { run_variant_set<ElemType::kBFloat16, 128>(128); }
TEST(Sm80BackwardEmulated, BlockSparseFp16D64) { run_block_sparse_set<ElemType::kFloat16, 64>(64); }
TEST(Sm80BackwardEmulated, BlockSparseBf16D128) { run_block_sparse_set<ElemType::kBFloat16, 128>(128); }

// After varlen lengths that failed their device check (which the kernels see as empty
// sequences), d sink is NaN like every other output; with a passed check it is the rows' sum.
TEST(Sm80BackwardEmulated, SinkGradientNanAfterFailedLengthCheck) {
  using flashattn::cuda::sm80::kRowThreads;
  constexpr int64_t kRows = flashattn::cuda::kBackwardRowPad, kHeads = 2;
  std::vector<float> delta(kHeads * kRows, 0.5f), lse2(delta.size(), 1.0f), sinks = {0.0f, 1.0f};
  for (const int32_t verdict : {0, 1}) {
    std::vector<float> dsink(kHeads, 7.0f);
    BackwardParams p;
    p.fwd.shape = {1, kHeads, 1, 64, 3, 3};
    p.fwd.score.sink = sinks.data();
    p.fwd.score.sink_stride = 1;
    p.scratch.delta = delta.data();
    p.scratch.lse2 = lse2.data();
    p.scratch.rows = kRows;
    p.dsink = dsink.data();
    p.dsink_stride = 1;
    p.length_verdict = &verdict;
    float warp_sums[kRowThreads / 32];
    emu::launch(emu::Dim3{kHeads, 1, 1}, kRowThreads,
                [&] { flashattn::cuda::sm80::backward_sink_grad_block<kRowThreads>(p, warp_sums); });
    for (int64_t h = 0; h < kHeads; ++h) {
      if (verdict != 0) {
        EXPECT_TRUE(std::isnan(dsink[h])) << "head " << h;
      } else {  // -sum over the 3 rows of 2^(sink log2(e) - 1) * 0.5
        const double want = -3 * std::exp2(sinks[h] * 1.4426950408889634 - 1.0) * 0.5;
        EXPECT_NEAR(dsink[h], want, 1e-5) << "head " << h;
      }
    }
  }
}

}  // namespace

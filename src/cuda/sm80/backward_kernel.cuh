// The sm80 FlashAttention-2 backward kernel (mma.sync m16n8k16, ldmatrix, cp.async).
//
// One CTA per (key tile, KV head, batch entry). K and V stay in shared memory and dK / dV in
// registers while the CTA walks every query tile that sees its keys, for every query head of its
// GQA group (so the group's sum needs no atomics and is the same every run), last query tile
// first. Per query tile:
//
//   Q, dO, LSE2, D of the tile arrived; start copying the next tile's into the other stage
//                                                   (one stage, d > 192: copies overlap GEMMs
//                                                    too; see the loop)
//   S = Q K^T, dP = dO V^T                          (tensor cores)
//   P = 2^(S - LSE2) (mask, score mods, dropout), dS = P (dP - D)    (registers, element-wise;
//                                                    per-element masking only on the query tiles
//                                                    that do not see the whole key tile)
//   P, dS -> shared memory
//   dQ  = dS K, added to the fp32 scratch           (tensor cores, then atomics; in deterministic
//                                                    mode the key tiles take turns, in order)
//   dV += P^T dO, dK += dS^T Q                      (tensor cores)
//
// The row statistics (D = rowsum(dO * O), LSE2) come from backward_rows.cuh's prepare kernel,
// and its convert kernel turns the dQ sums into the output. At the end dK (times the softmax
// scale) and dV are staged through shared memory and written with 16-byte stores. The element
// pass (P and dS from S and dP: score modifications, mask, dropout) is ../common/backward_score.cuh.
//
// A NaN (or inf) in q, dO or a row's D reaches, through the masked zeros of P and dS on the
// tensor cores (0 * NaN), the dK / dV of keys its row does not see; the rule (docs/CONVENTIONS.md,
// "NaN") does not allow it. Key rows whose dK or dV holds a NaN at the end (a compare per
// accumulator element, once) are recomputed key by key (repair_key_rows;
// ../common/careful_grads.cuh). dQ is summed across CTAs and has no repair: the masked kernels
// zero their K and V tiles' non-finite elements once after loading them (a bad key row would
// otherwise reach, through dQ += dS K and their masked dS of 0, the dQ of rows that do not see
// it), and a masked dS is 0 (a select in the masked steps' element pass).
#pragma once

#include <cute/tensor.hpp>

#include <climits>
#include <cmath>
#include <cstdint>

#include "../../core/mask.hpp"
#include "../../core/variant.hpp"
#include "../common/backward_score.cuh"
#include "../common/backward_tiles.cuh"
#include "../common/careful_grads.cuh"
#include "../common/fragment.cuh"
#include "../common/mask.cuh"
#include "../common/sequence.cuh"
#include "../params.hpp"
#include "backward_traits.cuh"
#include "tile_ops.cuh"

namespace flashattn::cuda::sm80 {

// The CTA's key tile, KV head and batch entry. Blocks start in linear order, x (the key tile)
// fastest, so the key tiles of one (head, batch) pair run together and share its Q / dO tiles in
// L2. With a mask the key tiles' work differs (causal: key tile 0 sees every query tile, the
// last one a few): the grid's last kTailCtas blocks, whole pairs, are dealt key-tile-major
// instead, heaviest first, so the grid ends on light CTAs rather than on whichever heavy one
// started last (d128 causal 1k-4k: +3-5% fwd+bwd on H100; sm80_backward_tuning.md). In
// deterministic mode a key tile still waits only on blocks that started before it.
struct CtaCoord {
  int n_block, head_kv, batch;
};
inline constexpr int kTailCtas = 2 * 132;  // about two waves of an H100 (one CTA an SM)
template <MaskKind kMask>
__device__ __forceinline__ CtaCoord cta_coord() {
  const int n = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  if constexpr (kMask != MaskKind::kNone) {
    const int tiles = static_cast<int>(gridDim.x), heads = static_cast<int>(gridDim.y);
    const int64_t pairs = int64_t{heads} * gridDim.z;
    const int tail_pairs = static_cast<int>(cute::min(pairs, int64_t{cute::max(1, kTailCtas / tiles)}));
    const int64_t pair = int64_t{b} * heads + h, first_tail = pairs - tail_pairs;
    if (pair >= first_tail) {
      const int l = static_cast<int>(pair - first_tail) * tiles + n;  // position among the tail's blocks
      const int64_t p = first_tail + l % tail_pairs;
      return {l / tail_pairs, static_cast<int>(p % heads), static_cast<int>(p / heads)};
    }
  }
  return {n, h, b};
}

// One CTA's work: the key tile, KV head and batch entry that cta_coord gives it. kSparse: under a
// block-sparse mask (the masked kind), the query tiles its cells show (SparseQueryTiles; the
// element bits of partial blocks join the per-element mask), and in deterministic mode the turns
// the block mask gives (sparse_turn).
template <class Traits, MaskKind kMask, bool kSparse = false>
__device__ __forceinline__ void backward_tile(const BackwardParams& params) {
  static_assert(!kSparse || kMask == MaskKind::kMasked, "block-sparse: the masked kind");
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;

  extern __shared__ __align__(Traits::kSmemAlign) char smem_raw[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int tid = static_cast<int>(threadIdx.x);
#if defined(FLASHATTN_SM80_BWD_HOIST)
  auto fresh_tid = [&] { return tid; };  // tuning: partitions formed once, hoisted by the compiler
#else
  auto fresh_tid = [] { return thread_index_reread<true>(); };
#endif
  const CtaCoord coord = cta_coord<kMask>();
  const int n_block = coord.n_block;
  const int bidh_kv = coord.head_kv;
  const int bidb = coord.batch;
  const ForwardParams& fp = params.fwd;
  const ShapeParams& dims = fp.shape;
  const BackwardScratch& scratch = params.scratch;
  const Sequence seq = sequence(fp, bidb);
  const int64_t n0 = int64_t{n_block} * kBlockN;
  const int64_t k_rows = key_rows(fp, bidb);
  if (n0 >= k_rows) return;  // past this sequence's keys
  const core::Mask mask = make_mask<kMask>(fp, seq.seqlen_q, seq.seqlen_k);
  const TileRange tiles =
      query_tiles<kMask, kBlockM>(mask, n0, cute::min(n0 + kBlockN, seq.seqlen_k));  // empty past seqlen_k
  const int group = static_cast<int>(dims.heads_q / dims.heads_kv);
  const int tiles_per_head = tiles.end - tiles.begin;
  // kSparse: the walk, made where used from the coordinates (not held in registers); its first
  // step and its count.
  auto sparse_walk = [&](int batch, int n, int head_kv) {
    return SparseQueryTiles::make<kBlockM, kBlockN>(params, batch, n, head_kv);
  };
  auto sparse_first = [&] {
    return sparse_walk(bidb, n_block, bidh_kv)
        .visible_from(StepPos::first(bidh_kv * group, tiles.end), tiles.begin, tiles.end);
  };
  const int steps = kSparse ? sparse_walk(bidb, n_block, bidh_kv).steps(sparse_first(), tiles.begin, tiles.end)
                            : group * tiles_per_head;
  const int64_t scratch_base = backward_row_base(fp.cu_seqlens_q, dims.seqlen_q, bidb);

  // --- global tiles (64-bit offsets) ------------------------------------------------------------
  const auto* k_ptr = static_cast<const Element*>(fp.k.data) + bidb * fp.k.batch_stride + bidh_kv * fp.k.head_stride +
                      (seq.k_start + n0) * fp.k.row_stride;
  const auto* v_ptr = static_cast<const Element*>(fp.v.data) + bidb * fp.v.batch_stride + bidh_kv * fp.v.head_stride +
                      (seq.k_start + n0) * fp.v.row_stride;
  const auto tile_q = make_shape(Int<kBlockM>{}, Int<kHeadDim>{});
  const auto tile_kv = make_shape(Int<kBlockN>{}, Int<kHeadDim>{});
  Tensor cQ = make_identity_tensor(tile_q);
  Tensor cKV = make_identity_tensor(tile_kv);

  const TileRange full = unmasked_query_tiles<kMask, kBlockM>(mask, n0, n0 + kBlockN);
  const BackwardCta cta0{seq.q_start, seq.seqlen_q, seq.seqlen_k, scratch_base, tiles.begin, tiles.end,
                         full.begin,  full.end,     n_block,      bidh_kv,      bidb};
  if (tid == 0) storage.cta = cta0;
  // storage.cta, read where its values are used (after a barrier, above which the compiler cannot
  // hoist the read) instead of held in registers across the loop's GEMMs.
  auto read_cta = [&]() { return storage.cta; };

  // --- shared tiles -------------------------------------------------------------------------------
  Tensor sQ = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQ{});        // (M, D)
  Tensor sdO = make_tensor(make_smem_ptr(storage.dout), typename Traits::SmemLayoutQ{});    // (M, D)
  Tensor sQt = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQt{});      // (D, M)
  Tensor sdOt = make_tensor(make_smem_ptr(storage.dout), typename Traits::SmemLayoutQt{});  // (D, M)
  Tensor sK = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKV{});       // (N, D)
  Tensor sV = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutKV{});       // (N, D)
  Tensor sKt = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKt{});      // (D, N)
  Tensor sP = make_tensor(make_smem_ptr(storage.p), typename Traits::SmemLayoutP{});        // (M, N)
  Tensor sdS = make_tensor(make_smem_ptr(storage.ds), typename Traits::SmemLayoutP{});      // (M, N)
  Tensor sPt = make_tensor(make_smem_ptr(storage.p), typename Traits::SmemLayoutPt{});      // (N, M)
  Tensor sdSt = make_tensor(make_smem_ptr(storage.ds), typename Traits::SmemLayoutPt{});    // (N, M)
  auto at_stage = [](const auto& stage0, int stage) {                                       // Q / dO tiles of one stage
    return make_tensor(stage0.data() + stage * Traits::kQTileElems, stage0.layout());
  };

  typename Traits::GmemTiledLoad gmem_load;

  // Query tile `pos`'s rows of Q or dO (`src`) into `stage` of `s_tiles` (rows past the sequence
  // read as 0; their LSE2 is +inf in the scratch, so their P is 0). The thread's copy partitions
  // are formed here, from a fresh read of the thread index, rather than held across the loop.
  // Whole tiles (every row inside the sequence, head_dim a bucket size) copy without per-chunk
  // predicates.
  auto load_query_rows = [&](const RowsIn& src, const auto& s_tiles, const BackwardCta& cta, StepPos pos, int stage) {
    auto gmem_thr_load = gmem_load.get_thread_slice(fresh_tid());
    const int64_t m0 = int64_t{pos.tile} * kBlockM;
    const int64_t rows_valid = cta.seqlen_q - m0;
    const auto* ptr = static_cast<const Element*>(src.data) + bidb * src.batch_stride + pos.head * src.head_stride +
                      (cta.q_start + m0) * src.row_stride;
    Tensor g = make_tensor(make_gmem_ptr(ptr), tile_q, make_stride(src.row_stride, _1{}));
    Tensor s_stage = at_stage(s_tiles, stage);
    if (rows_valid >= kBlockM && dims.head_dim == kHeadDim) {
      copy(gmem_load, gmem_thr_load.partition_S(g), gmem_thr_load.partition_D(s_stage));
    } else {
      load_tile_zfill(gmem_load, gmem_thr_load.partition_S(g), gmem_thr_load.partition_D(s_stage),
                      gmem_thr_load.partition_S(cQ), rows_valid, dims.head_dim, make_gmem_ptr(ptr));
    }
  };
  // ... and its rows' LSE2 and D.
  auto load_row_stats = [&](const BackwardCta& cta, StepPos pos, int stage) {
    constexpr int kStatChunks = kBlockM / 4;  // 16-byte chunks of one row-statistics vector
    const int ltid = fresh_tid();
    if (ltid < 2 * kStatChunks) {
      const int64_t row =
          pos.head * scratch.rows + cta.scratch_base + int64_t{pos.tile} * kBlockM + (ltid % kStatChunks) * 4;
      if (ltid < kStatChunks) {
        cp_async_16(&storage.lse2[stage][(ltid % kStatChunks) * 4], scratch.lse2 + row);
      } else {
        cp_async_16(&storage.delta[stage][(ltid % kStatChunks) * 4], scratch.delta + row);
      }
    }
  };
  auto load_q_and_stats = [&](const BackwardCta& cta, StepPos pos, int stage) {
    load_query_rows(fp.q, sQ, cta, pos, stage);
    load_row_stats(cta, pos, stage);
  };
  // The whole query tile as two cp.async groups, Q's (with LSE2, D) first, then dO's.
  auto load_query_tile = [&](const BackwardCta& cta, StepPos pos, int stage) {
    load_q_and_stats(cta, pos, stage);
    cp_async_fence();
    load_query_rows(params.dout, sdO, cta, pos, stage);
    cp_async_fence();
  };

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  using CopyN = typename Traits::SmemCopyAtom;
  using CopyT = typename Traits::SmemCopyAtomTransposed;
  Tensor acc_dk = partition_fragment_C(mma_dkv, tile_kv);  // (MMA, MMA_N, MMA_D) fp32
  Tensor acc_dv = partition_fragment_C(mma_dkv, tile_kv);
  clear(acc_dk);
  clear(acc_dv);

  if (steps > 0) {
    // --- prologue: K, V (rows past seqlen_k read as 0) and the first query tile ---------------------
    Tensor gK = make_tensor(make_gmem_ptr(k_ptr), tile_kv, make_stride(fp.k.row_stride, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(v_ptr), tile_kv, make_stride(fp.v.row_stride, _1{}));
    auto gmem_thr_load = gmem_load.get_thread_slice(tid);
    Tensor tKVcKV = gmem_thr_load.partition_S(cKV);
    const int64_t keys_valid = seq.seqlen_k - n0;
    load_tile_zfill(gmem_load, gmem_thr_load.partition_S(gK), gmem_thr_load.partition_D(sK), tKVcKV, keys_valid,
                    dims.head_dim, make_gmem_ptr(k_ptr));
    load_tile_zfill(gmem_load, gmem_thr_load.partition_S(gV), gmem_thr_load.partition_D(sV), tKVcKV, keys_valid,
                    dims.head_dim, make_gmem_ptr(v_ptr));
    StepPos pos = kSparse ? sparse_first() : StepPos::first(bidh_kv * group, tiles.end);
    if constexpr (kMask != MaskKind::kNone) cp_async_fence();  // K and V as a group of their own
    load_query_tile(cta0, pos, 0);
    if constexpr (kMask != MaskKind::kNone) {
      // A non-finite key or value element enters dQ as 0 (../common/careful_grads.cuh): zeroed
      // once, while Q and dO are in flight; the loop's first barrier publishes it.
      cp_async_wait<2>();
      __syncthreads();
      zero_nonfinite(storage.k, Traits::kKVTileElems, tid, Traits::kNThreads);
      zero_nonfinite(storage.v, Traits::kKVTileElems, tid, Traits::kNThreads);
    }

    // Every GEMM and fragment copy below forms its thread's partitions from a fresh read of the
    // thread index, so their shared-memory addresses are not held across the loop next to dK, dV.
    //
    // Q (with LSE2, D) and dO arrive as separate cp.async groups, Q's first. With two stages, the
    // next step's are copied during this one. With one, dO of this step may still be in flight
    // during S = Q K^T (waited for before dP = dO V^T), and the next step's Q is copied during
    // the dV GEMM, its dO during the next S GEMM (dK's GEMM, which reads Q, goes first).
    for (int t = 0; t < steps; ++t) {
      cp_async_wait<kStages == 1 ? 1 : 0>();  // step t's Q, LSE2, D (and dO with two stages) landed
      __syncthreads();  // ... for every thread; every warp is done with step t - 1's P, dS and stage
      const BackwardCta cta = read_cta();
      const StepPos next =
          kSparse ? sparse_walk(cta.batch, cta.n_block, cta.head_kv).next(pos, cta.tiles_begin, cta.tiles_end)
                  : pos.next(cta.tiles_begin, cta.tiles_end);
      const int stage = t & (kStages - 1);
      if constexpr (kStages == 2) {
        if (t + 1 < steps) {
          load_query_tile(cta, next, stage ^ 1);
        }
      }
      const int h = pos.head;
      const int64_t m0 = int64_t{pos.tile} * kBlockM;
      const int64_t n0_step = int64_t{n_block} * kBlockN;

      // S = Q K^T and dP = dO V^T, then P and dS element by element: in one pass after both GEMMs
      // where the two accumulators fit the registers together, else in two around dP's GEMM (see
      // softmax_tile).
      constexpr bool kDpFirst = kBlockM * kBlockN / Traits::kNThreads <= 32;
      Tensor acc_s = partition_fragment_C(mma_sdp, make_shape(Int<kBlockM>{}, Int<kBlockN>{}));
      Tensor acc_dp = partition_fragment_C(mma_sdp, make_shape(Int<kBlockM>{}, Int<kBlockN>{}));
      Tensor s = make_tensor(acc_s.data(), accum_rowcol(acc_s.layout()));
      Tensor dp = make_tensor(acc_dp.data(), accum_rowcol(acc_dp.layout()));
      auto score_coords = [&] {
        Tensor tScS = mma_sdp.get_thread_slice(fresh_tid())
                          .partition_C(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kBlockN>{})));
        return make_tensor(tScS.data(), accum_rowcol(tScS.layout()));
      };
      // kSparse: the block's cell (1 + its element bits' block for a partial block with bits).
      auto sparse_cell = [&] {
        const BackwardCta c = read_cta();
        return sparse_walk(c.batch, c.n_block, c.head_kv).cell(pos);
      };
      auto tile_mask = [&] {
        const BackwardCta c = read_cta();
        const TileMask range =
            TileMask::make<kBlockM, kBlockN>(make_mask<kMask>(fp, c.seqlen_q, c.seqlen_k), m0, n0_step);
        if constexpr (kSparse) {
          SparseTileMask sparse{range};
          const core::BlockMask& bm = fp.block_mask;
          if (const int32_t cell = sparse_cell(); cell > 0) {
            sparse.words = static_cast<int>(bm.words_per_row());
            sparse.bits = bm.bits + (cell - 1) * bm.block_m * bm.words_per_row() +
                          (m0 % bm.block_m) * bm.words_per_row() + n0_step % bm.block_n / 32;
          }
          return sparse;
        } else {
          return range;
        }
      };
      auto gemm_dp = [&] {
        if constexpr (kStages == 1) {
          cp_async_wait<0>();  // step t's dO landed
          __syncthreads();
        }
        clear(acc_dp);
        gemm_smem_tiles<CopyN, CopyN>(mma_sdp, acc_dp, at_stage(sdO, stage), sV, fresh_tid());
      };
      const ScoreVariant variant = score_variant(fp.score, bidb, h);
      const uint64_t bh = static_cast<uint64_t>(bidb * dims.heads_q + h);
      constexpr bool kDropout = kMask == MaskKind::kMaskedDropout;
      clear(acc_s);
      gemm_smem_tiles<CopyN, CopyN>(mma_sdp, acc_s, at_stage(sQ, stage), sK, fresh_tid());
      if constexpr (kDpFirst) gemm_dp();
      const BackwardCta cta_mask = read_cta();
      const bool apply_mask =
          pos.tile < cta_mask.full_begin || pos.tile >= cta_mask.full_end || (kSparse && sparse_cell() > 0);
      softmax_tile<kDropout, kDpFirst>(s, dp, score_coords(), storage.lse2[stage], storage.delta[stage], variant,
                                       tile_mask, m0, n0_step, apply_mask, fp.dropout, bh);
      if constexpr (!kDpFirst) {
        gemm_dp();
        softmax_grad_tile<kDropout>(s, dp, score_coords(), storage.lse2[stage], storage.delta[stage], variant,
                                    tile_mask, fp.dropout.keep_scale, apply_mask);
      }
      Tensor p_elem = convert_fragment<Element>(acc_s);
      Tensor ds_elem = convert_fragment<Element>(acc_dp);
      auto copy_store_sdp = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
      auto thr_store_sdp = copy_store_sdp.get_thread_slice(fresh_tid());
      copy(copy_store_sdp, thr_store_sdp.retile_S(p_elem), thr_store_sdp.partition_D(sP));
      copy(copy_store_sdp, thr_store_sdp.retile_S(ds_elem), thr_store_sdp.partition_D(sdS));
      __syncthreads();  // P and dS complete

      // dQ = dS K into the fp32 sums (first, so the atomics drain during the dV / dK GEMMs); rows
      // past the sequence add 0 to the scratch's padding rows. The adds are spread over the dV /
      // dK GEMMs' k16 slices, a few after each: issued in one burst they filled the memory queue,
      // and the next instruction to reuse an address register waited for the whole burst to
      // drain (bench/results/gpu/sm80_backward_tuning.md). Deterministic mode adds them in one
      // burst, in its turn, before the GEMMs.
      Tensor acc_dq = partition_fragment_C(mma_dq, tile_q);
      clear(acc_dq);
      gemm_smem_tiles<CopyN, CopyT>(mma_dq, acc_dq, sdS, sKt, fresh_tid());
      const BackwardCta cta_dq = read_cta();
      const int64_t row0 = h * scratch.rows + cta_dq.scratch_base + m0;
      // The scratch rows are head_dim_bucket = kHeadDim wide (kernels are picked by bucket) and
      // laid out in 8 x 8 blocks (dq_sum_offset; row0 is a multiple of 8): with compile-time
      // strides each element's offset from the thread's first is an immediate, and each add of a
      // warp covers 128 contiguous bytes.
      using DqBlocked = Layout<Shape<Shape<_8, Int<kBlockM / 8>>, Shape<Shape<_2, _4>, Int<kHeadDim / 8>>>,
                               Stride<Stride<_4, Int<8 * kHeadDim>>, Stride<Stride<_32, _1>, _64>>>;
      Tensor gdQ = make_tensor(make_gmem_ptr(scratch.dq_accum + row0 * kHeadDim), DqBlocked{});
      Tensor tdQgdQ = mma_dq.get_thread_slice(fresh_tid()).partition_C(gdQ);
      int* turn = scratch.dq_semaphore + h * (scratch.rows / kBackwardMinBlockM) + (cta_dq.scratch_base + m0) / kBlockM;
      constexpr int kDqElems = decltype(size(acc_dq))::value;
      if (params.deterministic) {
        const core::Mask mask_dq = make_mask<kMask>(fp, cta_dq.seqlen_q, cta_dq.seqlen_k);
        if constexpr (kSparse) {
          wait_for_turn(turn, sparse_turn<kMask, kBlockN>(fp.block_mask, mask_dq, bidb, h, m0, n_block), tid);
        } else {
          wait_for_turn(turn, n_block - first_key_tile<kMask, kBlockN>(mask_dq, m0), tid);
        }
        CUTE_UNROLL
        for (int e = 0; e < kDqElems; ++e) atomic_add(&tdQgdQ(e), acc_dq(e));
        pass_turn(turn, tid);
      }
      // Part `part` (0: the first GEMM below, 1: the second) of the interleaved adds.
      constexpr int kSlices = kBlockM / 16;  // k16 slices of each GEMM
      constexpr int kPerSlice = (kDqElems + 2 * kSlices - 1) / (2 * kSlices);
      const bool interleave = !params.deterministic;
      auto add_dq_after = [&](auto part) {
        return [&](auto k) {
          constexpr int kBegin = (decltype(part)::value * kSlices + decltype(k)::value) * kPerSlice;
          if (interleave) {
            CUTE_UNROLL
            for (int e = kBegin; e < kBegin + kPerSlice && e < kDqElems; ++e) atomic_add(&tdQgdQ(e), acc_dq(e));
          }
        };
      };

      // dV += P^T dO, dK += dS^T Q
      if constexpr (kStages == 2) {
        gemm_smem_tiles<CopyT, CopyT>(mma_dkv, acc_dv, sPt, at_stage(sdOt, stage), fresh_tid(), add_dq_after(_0{}));
        gemm_smem_tiles<CopyT, CopyT>(mma_dkv, acc_dk, sdSt, at_stage(sQt, stage), fresh_tid(), add_dq_after(_1{}));
      } else {
        gemm_smem_tiles<CopyT, CopyT>(mma_dkv, acc_dk, sdSt, sQt, fresh_tid(), add_dq_after(_0{}));
        if (t + 1 < steps) {
          __syncthreads();  // every warp is done reading this step's Q, LSE2 and D
          load_q_and_stats(read_cta(), next, 0);
          cp_async_fence();
        }
        gemm_smem_tiles<CopyT, CopyT>(mma_dkv, acc_dv, sPt, sdOt, fresh_tid(), add_dq_after(_1{}));
        if (t + 1 < steps) {
          __syncthreads();  // ... and its dO
          load_query_rows(params.dout, sdO, read_cta(), next, 0);
          cp_async_fence();
        }
      }
      pos = next;
    }
  }

  // --- epilogue: dK * scale and dV through shared memory (K's and V's buffers), 16-byte stores ---
  // A NaN in dK or dV: an input held NaN or inf, which may have reached keys its row does not see.
  bool nan = false;
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); ++e) {
    acc_dk(e) *= params.softmax_scale;
    nan |= std::isnan(acc_dk(e)) || std::isnan(acc_dv(e));
  }
  Tensor dk_elem = convert_fragment<Element>(acc_dk);
  Tensor dv_elem = convert_fragment<Element>(acc_dv);
  __syncthreads();  // every warp is done reading K and V
  const int epilogue_tid = fresh_tid();
  auto copy_store_kv = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dkv);
  auto thr_store_kv = copy_store_kv.get_thread_slice(epilogue_tid);
  copy(copy_store_kv, thr_store_kv.retile_S(dk_elem), thr_store_kv.partition_D(sK));
  copy(copy_store_kv, thr_store_kv.retile_S(dv_elem), thr_store_kv.partition_D(sV));
  if (__syncthreads_or(nan)) {  // rare: those key rows recomputed in sK / sV
    // Everything is re-derived from the coordinates as read back from shared memory, so that
    // nothing stays live across the loop for it (the masked d128 kernels, at 255 registers,
    // spilled when the coordinates were recomputed here from blockIdx).
    const BackwardCta at = read_cta();
    repair_key_rows<Element, kHeadDim, kBlockN, kMask, kSparse>(params, at.batch, at.head_kv, at.n_block,
                                                                epilogue_tid / 32, kBlockN, Traits::kNWarps,
                                                                epilogue_tid % 32, sK, sV);
    __syncthreads();
  }

  // The rows' addresses from the coordinates as read back from shared memory, not from values
  // held across the loop (with the cold path above, those spilled in the masked d128 kernels).
  typename Traits::GmemTiledStore gmem_store;
  auto gmem_thr_store = gmem_store.get_thread_slice(epilogue_tid);
  const BackwardCta out_at = read_cta();
  const int64_t out_n0 = int64_t{out_at.n_block} * kBlockN;
  const int64_t rows_out = cute::min(int64_t{kBlockN}, key_rows(fp, out_at.batch) - out_n0);
  const int64_t out_row0 = sequence(fp, out_at.batch).k_start + out_n0;
  auto store_rows = [&](const RowsOut& dst, const auto& sX) {
    auto* ptr = static_cast<Element*>(dst.data) + out_at.batch * dst.batch_stride + out_at.head_kv * dst.head_stride +
                out_row0 * dst.row_stride;
    Tensor tXgX =
        gmem_thr_store.partition_D(make_tensor(make_gmem_ptr(ptr), tile_kv, make_stride(dst.row_stride, _1{})));
    Tensor tXsX = gmem_thr_store.partition_S(sX);
    Tensor tXcX = gmem_thr_store.partition_D(cKV);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tXgX); ++m) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tXgX); ++k) {
        if (get<0>(tXcX(0, m, k)) < rows_out && get<1>(tXcX(0, m, k)) < dims.head_dim) {
          copy(gmem_store, tXsX(_, m, k), tXgX(_, m, k));
        }
      }
    }
  };
  store_rows(params.dk, sK);
  store_rows(params.dv, sV);
}

template <class Traits, MaskKind kMask, bool kSparse = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) backward_kernel(const __grid_constant__ BackwardParams params) {
#if defined(__CUDA_ARCH__)
  // Never launched where the device code holds the other tuning target's twin (tile_shapes.hpp;
  // the block-sparse kernel has none).
  if constexpr (!target_compiled_for(Traits::kTarget, has_sm90_backward_tiles(Traits::kHeadDim, kMask) && !kSparse,
                                     __CUDA_ARCH__ / 10)) {
    __trap();
  } else
#endif
  {
    backward_tile<Traits, kMask, kSparse>(params);
  }
}

}  // namespace flashattn::cuda::sm80

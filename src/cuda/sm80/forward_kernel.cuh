// The sm80 FlashAttention-2 forward kernel (mma.sync m16n8k16, ldmatrix, cp.async).
//
// One CTA per (query tile, head, batch). Its warps split the tile's rows, so every softmax row
// lives in one warp (a quad of lanes) and no inter-warp reduction is needed. Per key tile, from
// the last one the mask lets this query tile see down to the first:
//
//   tile n arrived (K[n], V[n]); start copying tile n - 1 into the other stage (cp.async)
//   S = Q K^T (tensor cores); softcap / ALiBi / mask in the exp2 domain
//   online softmax: running max, P = 2^(S - max), rescale O; O += P V (tensor cores)
//
// so each copy overlaps a whole step, behind one barrier per step. Where two K/V stages do not
// fit the shared-memory budget (d256), one stage overlaps V[n] with S = Q K^T and K[n-1] with
// the softmax and O += P V instead (FA2's scheme). At the end O is divided by the row sums,
// staged through shared memory and written with 16-byte stores; LSE goes out in fp32.
//
// This file holds the kernel itself (its CTA order, main loop and epilogue). The steps it applies
// to register tiles -- the score step, the online softmax's row statistics, the mask, dropout --
// are ../common's, which the sm90 forward and the backward kernels include as well.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "../../core/mask.hpp"
#include "../../core/variant.hpp"
#include "../../core/softmax.hpp"
#include "../common/dropout.cuh"
#include "../common/fragment.cuh"
#include "../common/mask.cuh"
#include "../common/join_sink.cuh"
#include "../common/row_softmax.cuh"
#include "../common/score_tile.cuh"
#include "../common/sequence.cuh"
#include "../common/sparse_tiles.cuh"
#include "../params.hpp"
#include "../common/careful_rows.cuh"
#include "../tile_order.hpp"
#include "forward_traits.cuh"
#include "tile_ops.cuh"

namespace flashattn::cuda::sm80 {

// One CTA's query tile, head and batch entry. Blocks start in linear order, x fastest: x is the
// query tile, y the head, z the batch entry (a head's tiles run together and share its K / V in
// L2). Causal / windowed query tiles differ in work: x counts from the heaviest (last) tile, and
// the masked kernels take tile_order.hpp's order instead, the grid's blocks dealt heaviest first
// across a group of heads sharing the L2. Not the dropout kernels: at d256 the coordinates held
// in registers (blockIdx is re-read for free) spilled them, and the order was not measured there.
struct ForwardCta {
  int m_block, head, batch;
};
template <MaskKind kMask>
__device__ __forceinline__ ForwardCta forward_cta(const ForwardParams& p) {
  const ForwardCta launch_order = {static_cast<int>(kMask == MaskKind::kNone ? blockIdx.x : gridDim.x - 1 - blockIdx.x),
                                   static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
  if constexpr (kMask != MaskKind::kMasked) {
    return launch_order;
  } else {
    // In 32 bits (fewer registers than 64-bit divisions): the launcher gives a grid of 2^31 blocks
    // or more tile_group 0, which keeps the launch order.
    if (p.tile_group == 0) return launch_order;
    const int tiles = static_cast<int>(gridDim.x), heads = static_cast<int>(gridDim.y);
    const int index = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    const TileOrder<int>::Slot s =
        TileOrder<int>{tiles, heads * static_cast<int>(gridDim.z), p.tile_group, static_cast<int>(p.tile_last_first)}
            .at(index);
    return {tiles - 1 - s.rank, s.pair % heads, s.pair / heads};
  }
}

// The paged kernels' shared memory after SharedStorage (forward_tile's prefetch_pages; run_forward
// sizes it): this CTA's K / V head bases (in block 0) and block_table row, and the page of each
// row of two key tiles.
template <int kBlockN>
struct PageSlots {
  const void* head[2];  // K, V
  const int32_t* table;
  int32_t page[2][kBlockN];
};

// The kSparse kernels' shared memory after SharedStorage: this query tile's walk of the block
// mask's lists (run_forward sizes it).
struct SparseSlots {
  SparseKeyTiles walk;
};

// The cold path of forward_tile's epilogue: the rows of this thread's warp whose O holds a NaN
// (nan_row: this thread's accumulator rows) recomputed key by key into the output tile sO, which
// the epilogue then stores (careful_rows.cuh); kSparse: only the keys the block mask shows.
// Quad q's rows are those of thread 4q of the warp. Everything is re-read from params and the
// lengths: nothing stays live across the key loop.
template <class Traits, MaskKind kMask, bool kPaged, bool kSparse, class TiledMma, class CoordQ, class SmemO, int kRows>
__device__ __forceinline__ void repair_output_rows(const ForwardParams& params, const TiledMma& tiled_mma,
                                                   const CoordQ& cQ, SmemO& sO, const bool (&nan_row)[kRows], int tid,
                                                   ForwardCta at) {
  using Element = typename Traits::Element;
  if constexpr (kMask != MaskKind::kMasked) at = forward_cta<kMask>(params);
  const Sequence seq = sequence(params, at.batch);
  const int group = static_cast<int>(params.shape.heads_q) / static_cast<int>(params.shape.heads_kv);
  const CarefulRows rows = careful_rows_of<Element>(params, at.batch, at.head, at.head / group, seq.q_start,
                                                    seq.k_start, make_mask<kMask>(params, seq.seqlen_q, seq.seqlen_k));
  const int64_t m0 = int64_t{at.m_block} * Traits::kBlockM;
  const int lane = tid % 32, warp_base = tid - lane;
  auto row_of = [&](int r, int q) {
    auto coord = tiled_mma.get_thread_slice(warp_base + 4 * q).partition_C(cQ);
    return static_cast<int>(cute::get<0>(make_tensor(coord.data(), accum_rowcol(coord.layout()))(r, 0)));
  };
  auto put = [&](int row, int c, float value) { sO(row, c) = Element(value); };
  if constexpr (kSparse) {
    cuda::repair_nan_rows<Element, (Traits::kHeadDim + 31) / 32, kPaged>(
        rows, m0, seq.seqlen_q - m0, nan_row, lane, row_of, put,
        [&](int64_t i, int64_t j) { return params.block_mask.visible(at.batch, at.head, i, j); });
  } else {
    cuda::repair_nan_rows<Element, (Traits::kHeadDim + 31) / 32, kPaged>(rows, m0, seq.seqlen_q - m0, nan_row, lane,
                                                                         row_of, put);
  }
  __syncwarp();
}

// One CTA's work: the query tile, head and batch entry of forward_cta. kPaged: K / V in pages
// (ForwardParams::block_table). kSparse: the key tiles a block-sparse mask lists
// (ForwardParams::block_mask, common/sparse_tiles.cuh), with the masked kernel's window.
template <class Traits, MaskKind kMask, bool kPaged = false, bool kSparse = false>
__device__ __forceinline__ void forward_tile(const ForwardParams& params) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  static_assert(kMask != MaskKind::kMaskedDropout || kBlockN % 32 == 0, "dropout_tile: key tiles of whole groups");
  static_assert(!(kPaged && Traits::kAddressesPerStep), "the per-step addresses know no pages");
  static_assert(!(kPaged && Traits::kPrefetchTwo), "prefetch_pages stages one tile ahead");
  static_assert(!kSparse || (kMask == MaskKind::kMasked && !kPaged && !Traits::kAddressesPerStep),
                "block-sparse: the masked kernel of dense K / V, sm80 tiles (its walk is the plain loop's)");
  [[maybe_unused]] constexpr int kDropoutCallsInFlight = 8;  // a row's calls all unrolled (at most 64 / 8 columns)

  extern __shared__ __align__(Traits::kSmemAlign) char smem_raw[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  [[maybe_unused]] auto& slots = *reinterpret_cast<PageSlots<kBlockN>*>(smem_raw + sizeof(storage));  // kPaged
  [[maybe_unused]] auto& sparse = *reinterpret_cast<SparseSlots*>(smem_raw + sizeof(storage));        // kSparse

  const int tid = static_cast<int>(threadIdx.x);
  const ForwardCta cta = forward_cta<kMask>(params);
  const int m_block = cta.m_block;
  const int bidh = cta.head;
  const int bidb = cta.batch;
  const ShapeParams& dims = params.shape;
  const int64_t bidh_kv = bidh / (dims.heads_q / dims.heads_kv);
  const int64_t m0 = int64_t{m_block} * kBlockM;
  const Sequence seq = sequence(params, bidb);
  if (m0 >= seq.seqlen_q) return;  // varlen: a query tile past this sequence's end
  const int64_t seqlen_k = seq.seqlen_k;
  const int64_t rows_valid = cute::min(int64_t{kBlockM}, seq.seqlen_q - m0);
  const core::Mask mask = make_mask<kMask>(params, seq.seqlen_q, seqlen_k);
  // Key tiles [n_begin, n_end) hold every key some row of this query tile may see.
  // Tile indices are 32-bit (supports_forward bounds seqlen_k); offsets stay 64-bit.
  const int n_tiles = static_cast<int>((seqlen_k + kBlockN - 1) / kBlockN);
  int n_begin = 0, n_end = n_tiles;
  if constexpr (kMask != MaskKind::kNone) {
    n_begin = static_cast<int>(mask.key_begin(m0) / kBlockN);
    const int64_t key_end = mask.key_end(m0 + rows_valid);
    n_end = key_end <= 0 ? 0 : static_cast<int>(cute::min(int64_t{n_tiles}, (key_end + kBlockN - 1) / kBlockN));
  }
  // The loop's steps count visits [v_begin, v_end) downwards: the key tiles themselves, or with
  // kSparse the walk's visits (key_tile(v)), whose tiles outside [n_begin, n_end) the window
  // then hides whole.
  int v_begin = n_begin, v_end = n_end;
  // kSparse under IndexCheck::kDevice: lists that break a rule give this tile's rows NaN.
  [[maybe_unused]] bool lists_bad = false;
  if constexpr (kSparse) {
    if (params.block_mask_fault.claim != nullptr) {  // the lists checked here, before the walk reads them
      static_assert(sizeof(storage.k) * 8 >= core::BlockMask::kDeviceCheckedKeyBlocks, "the listed-block bitmap");
      lists_bad = !block_lists_ok<Traits::kNThreads>(params.block_mask, params.block_mask_fault, bidb, bidh,
                                                     m0 / params.block_mask.block_m,
                                                     reinterpret_cast<uint32_t*>(storage.k), tid);
    }
    const SparseKeyTiles walk = SparseKeyTiles::make<kBlockM, kBlockN>(params.block_mask, bidb, bidh, m0);
    if (tid == 0) sparse.walk = walk;
    v_begin = 0;
    v_end = n_end <= n_begin || lists_bad ? 0 : walk.tiles();
  }
  if (tid == 0) {  // read after the key loop's first barrier
    storage.seq[0] = seq.seqlen_q;
    storage.seq[1] = seqlen_k;
    storage.seq[2] = seq.q_start;
    storage.first_key_tile = v_begin;
    if constexpr (kMask == MaskKind::kMasked) {
      storage.cta[0] = m_block;
      storage.cta[1] = bidh;
      storage.cta[2] = bidb;
    }
  }
  if constexpr (kPaged) {
    if (tid == 0) {
      slots.table = params.block_table + bidb * params.block_table_stride;
      slots.head[0] = static_cast<const Element*>(params.k.data) + bidh_kv * params.k.head_stride;
      slots.head[1] = static_cast<const Element*>(params.v.data) + bidh_kv * params.v.head_stride;
    }
    __syncthreads();  // prefetch_pages and load_kv read them, and storage.seq
  }
  if constexpr (kSparse) __syncthreads();  // key_tile reads the walk, key_rows storage.seq

  // --- global tiles (64-bit offsets throughout) -------------------------------------------------
  const auto* q_ptr = static_cast<const Element*>(params.q.data) + bidb * params.q.batch_stride +
                      bidh * params.q.head_stride + (seq.q_start + m0) * params.q.row_stride;
  // (kPaged: k_ptr / v_ptr and the views built on them go unused; load_kv finds each tile's page.)
  const auto* k_ptr = static_cast<const Element*>(params.k.data) + bidb * params.k.batch_stride +
                      bidh_kv * params.k.head_stride + seq.k_start * params.k.row_stride;
  const auto* v_ptr = static_cast<const Element*>(params.v.data) + bidb * params.v.batch_stride +
                      bidh_kv * params.v.head_stride + seq.k_start * params.v.row_stride;
  if constexpr (Traits::kAddressesPerStep) {
    if (tid == 0) {
      storage.k_ptr = k_ptr;
      storage.v_ptr = v_ptr;
    }
  }
  const auto tile_q = make_shape(Int<kBlockM>{}, Int<kHeadDim>{});
  const auto tile_kv = make_shape(Int<kBlockN>{}, Int<kHeadDim>{}, n_tiles);
  Tensor gQ = make_tensor(make_gmem_ptr(q_ptr), tile_q, make_stride(params.q.row_stride, _1{}));  // (M, D)
  Tensor gK = make_tensor(make_gmem_ptr(k_ptr), tile_kv,
                          make_stride(params.k.row_stride, _1{}, kBlockN * params.k.row_stride));  // (N, D, n)
  Tensor gV = make_tensor(make_gmem_ptr(v_ptr), tile_kv,
                          make_stride(params.v.row_stride, _1{}, kBlockN * params.v.row_stride));  // (N, D, n)
  Tensor cQ = make_identity_tensor(tile_q);                                        // (M, D) -> (row, col)
  Tensor cKV = make_identity_tensor(make_shape(Int<kBlockN>{}, Int<kHeadDim>{}));  // (N, D)

  // The output addresses are formed where they are used (the early exit, the epilogue, from
  // the sequence's first row q_start and the CTA's coordinates, which the epilogue reads back
  // from shared memory), so none of them stays live across the key loop.
  typename Traits::GmemTiledStore gmem_store;
  // (CPY, CPY_M, CPY_D) of the tile of O
  auto out_tile = [&](const auto& gmem_thr_store, int64_t q_start, const ForwardCta& at) {
    const int64_t row = q_start + int64_t{at.m_block} * kBlockM;
    auto* o_ptr = static_cast<Element*>(params.out.data) + at.batch * params.out.batch_stride +
                  at.head * params.out.head_stride + row * params.out.row_stride;
    return gmem_thr_store.partition_D(
        make_tensor(make_gmem_ptr(o_ptr), tile_q, make_stride(params.out.row_stride, _1{})));
  };
  auto lse_rows = [&](int64_t q_start, const ForwardCta& at) -> float* {  // this tile's first LSE row, or null
    return params.lse.data == nullptr
               ? nullptr
               : params.lse.data + at.batch * params.lse.batch_stride + at.head * params.lse.head_stride +
                     (q_start + int64_t{at.m_block} * kBlockM) * params.lse.row_stride;
  };

  if (v_end <= v_begin) {
    // No row of this tile sees any key: O = 0, LSE = -inf (the sink's logit with a sink); or its
    // block mask's lists broke a rule: NaN.
    auto gmem_thr_store = gmem_store.get_thread_slice(tid);
    Tensor tOcO = gmem_thr_store.partition_D(cQ);
    Tensor tOgO = out_tile(gmem_thr_store, seq.q_start, cta);
    float* lse_ptr = lse_rows(seq.q_start, cta);
    Tensor row_values = make_tensor<Element>(shape(tOgO(_, 0, 0)));
    fill(row_values, Element(lists_bad ? NAN : 0.0f));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOgO); ++m) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOgO); ++k) {
        if (get<0>(tOcO(0, m, k)) < rows_valid && get<1>(tOcO(0, m, k)) < dims.head_dim) {
          copy(gmem_store, row_values, tOgO(_, m, k));
        }
      }
    }
    if (lse_ptr != nullptr) {
      const float lse = lists_bad                      ? NAN
                        : params.score.sink == nullptr ? -INFINITY
                                                       : params.score.sink[bidh * params.score.sink_stride];
      for (int r = tid; r < rows_valid; r += Traits::kNThreads) {
        lse_ptr[r * params.lse.row_stride] = lse;
      }
    }
    return;
  }

  // --- shared tiles -------------------------------------------------------------------------------
  Tensor sQ = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQ{});    // (M, D)
  Tensor sK = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKV{});   // (N, D)
  Tensor sV = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutKV{});   // (N, D)
  Tensor sVt = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutVt{});  // (D, N)
  Tensor sO = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutO{});    // (M, D)

  // K / V stage of key tile n (always 0 with one stage); a stage's tensors are the stage-0
  // partitions shifted by whole tiles, which leaves the swizzle pattern unchanged.
  constexpr int kStages = Traits::kStages;
  auto at_stage = [](const auto& stage0, int n) {
    return make_tensor(stage0.data() + (n & (kStages - 1)) * Traits::kKVTileElems, stage0.layout());
  };
  // Visit v's key tile, and the rows of key tile t to copy where the dense walk knows them whole
  // (kBlockN): with kSparse any tile may come at any step, so each copy is bounded by seqlen_k
  // (to [0, kBlockN]: a block may hold tiles wholly past seqlen_k).
  auto key_tile = [&](int v) {
    if constexpr (kSparse) {
      return sparse.walk.tile(v);
    } else {
      return v;
    }
  };
  auto key_rows = [&](int t) -> int64_t {
    if constexpr (kSparse) {
      const int64_t left = storage.seq[1] - int64_t{t} * kBlockN;
      return static_cast<int>(cute::max(int64_t{0}, cute::min(int64_t{kBlockN}, left)));
    } else {
      return int64_t{kBlockN};
    }
  };

  typename Traits::GmemTiledLoad gmem_load;
  auto gmem_thr_load = gmem_load.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr_load.partition_S(gQ);  // (CPY, CPY_M, CPY_D)
  Tensor tQsQ = gmem_thr_load.partition_D(sQ);
  Tensor tQcQ = gmem_thr_load.partition_S(cQ);
  Tensor tKgK = gmem_thr_load.partition_S(gK);  // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr_load.partition_D(sK);
  Tensor tVgV = gmem_thr_load.partition_S(gV);
  Tensor tVsV = gmem_thr_load.partition_D(sV);
  Tensor tKVcKV = gmem_thr_load.partition_S(cKV);
  // kPaged: what the copies need beyond the params sits in shared memory (`slots`), so neither a
  // base pointer stays live across the key loop nor a copy waits on arithmetic: this CTA's K / V
  // head bases and table row (written once), and the page of each row of key tile t (slot t & 1),
  // staged by prefetch_pages a tile ahead of the tile's copies, in the previous tile's cp.async
  // group. Pages of a multiple of kBlockN keys hold whole tiles: slot entry 0 alone. Positions
  // divide by the page size with FastDivmod (the compiler's division by a run-time divisor is tens
  // of dependent instructions; the first paged kernels, which divided per copy and read the table
  // in place, ran at 0.75-0.82 of the packed ones on d64 pages of 256, H200;
  // bench/results/gpu/paged-varlen-speed-h200).
  auto prefetch_pages = [&](int t) {
    if constexpr (kPaged) {
      const int row = thread_index_reread();
      const auto key = static_cast<uint32_t>(t * kBlockN + row);  // < 2^31 (supports_forward bounds seqlen_k)
      const bool whole_tiles = params.page.divisor % kBlockN == 0;
      if (t >= 0 && row < (whole_tiles ? 1 : kBlockN) && key < storage.seq[1]) {
        cp_async_4(&slots.page[t & 1][row], slots.table + params.page.div(key));
      }
    }
  };
  // Key tile n of K or V (`base` and `x` of the same one) into shared memory; kPaged: from the
  // pages that hold it, as staged by prefetch_pages (one page for pages of a multiple of kBlockN
  // keys, else one per row, read a row at a time).
  auto load_kv = [&](auto& tXgX, auto&& tXsX, const Element* base, const RowsIn& x, int n, int64_t rows) {
    if constexpr (kPaged) {
      const int32_t* page = slots.page[n & 1];
      const auto* head = static_cast<const Element*>(slots.head[&x == &params.v]);  // (folds: x is k or v)
      const auto key0 = static_cast<uint32_t>(n * kBlockN);
      auto thr = gmem_load.get_thread_slice(thread_index_reread());
      if (params.page.divisor % kBlockN == 0) {
        uint32_t row0;
        params.page.divmod(key0, &row0);
        const Element* tile = head + int64_t{page[0]} * x.batch_stride + int64_t{row0} * x.row_stride;
        Tensor gX = make_tensor(make_gmem_ptr(tile), make_shape(Int<kBlockN>{}, Int<kHeadDim>{}),
                                make_stride(x.row_stride, _1{}));  // (N, D)
        load_tile_zfill(gmem_load, thr.partition_S(gX), tXsX, thr.partition_S(cKV), rows, dims.head_dim,
                        make_gmem_ptr(tile));
      } else {
        Tensor gX = make_tensor(make_gmem_ptr(head), make_shape(Int<kBlockN>{}, Int<kHeadDim>{}),
                                make_stride(x.row_stride, _1{}));  // (N, D): the chunks' layout
        auto row_ptr = [&](int row) {
          uint32_t in_page;
          params.page.divmod(key0 + row, &in_page);
          return head + int64_t{page[row]} * x.batch_stride + int64_t{in_page} * x.row_stride;
        };
        load_rows_zfill(gmem_load, thr.partition_S(gX), tXsX, thr.partition_S(cKV), rows, dims.head_dim, row_ptr, head);
      }
    } else {
      load_tile_zfill(gmem_load, tXgX(_, _, _, n), tXsX, tKVcKV, rows, dims.head_dim, make_gmem_ptr(base));
    }
  };
  // Traits::kAddressesPerStep: the in-loop copies of full key tiles form their per-thread
  // addresses from the base pointer (read from shared memory) and a fresh read of the thread
  // index, instead of holding them across the loop.
  auto load_full_kv_tile = [&](const Element* base, int64_t row_stride, const auto& sX, int n) {
    auto thr = gmem_load.get_thread_slice(thread_index_reread());
    Tensor gX = make_tensor(make_gmem_ptr(base), tile_kv, make_stride(row_stride, _1{}, kBlockN * row_stride));
    load_tile_zfill(gmem_load, thr.partition_S(gX)(_, _, _, n), at_stage(thr.partition_D(sX), n), thr.partition_S(cKV),
                    int64_t{kBlockN}, dims.head_dim, make_gmem_ptr(base));
  };

  // --- tensor-core partitions ---------------------------------------------------------------------
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);          // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);          // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);        // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, tile_q);  // (MMA, MMA_M, MMA_D) fp32
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  Tensor tSrQ_view = smem_thr_q.retile_D(tSrQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_k.partition_S(sK);
  Tensor tSrK_view = smem_thr_k.retile_D(tSrK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_v.partition_S(sVt);
  Tensor tOrVt_view = smem_thr_v.retile_D(tOrVt);

  Tensor acc_o_rc = make_tensor(acc_o.data(), accum_rowcol(acc_o.layout()));  // (rows, D)
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  RowSoftmax<kRows> softmax;

  const uint64_t dropout_stream = static_cast<uint64_t>(bidb * dims.heads_q + bidh);  // Philox's bh
  const ScoreVariant variant = score_variant(params.score, bidb, bidh);

  // --- prologue: Q and the first key tile (the last one, the only one that can be partial) --------
  // kPaged: that tile's pages, waited for (once a CTA); with two stages, the next tile's pages
  // join its copies' group. FLASHATTN_SM80_PAGED_Q_FIRST=1 (an A/B knob, not yet measured) sends
  // Q's copy before that wait, to overlap the table read.
#if defined(FLASHATTN_SM80_PAGED_Q_FIRST)
  constexpr bool kPagedQFirst = kPaged && FLASHATTN_SM80_PAGED_Q_FIRST;
#else
  constexpr bool kPagedQFirst = false;
#endif
  auto wait_first_pages = [&] {
    prefetch_pages(v_end - 1);
    cp_async_fence();
    cp_async_wait<0>();
    __syncthreads();
  };
  if constexpr (kPaged && !kPagedQFirst) wait_first_pages();
  load_tile_zfill(gmem_load, tQgQ, tQsQ, tQcQ, rows_valid, dims.head_dim, make_gmem_ptr(q_ptr));
  cp_async_fence();
  if constexpr (kPagedQFirst) wait_first_pages();
  const int first_tile = key_tile(v_end - 1);
  const int64_t last_tile_rows = seqlen_k - int64_t{first_tile} * kBlockN;
  load_kv(tKgK, at_stage(tKsK, v_end - 1), k_ptr, params.k, first_tile, last_tile_rows);
  if constexpr (kStages == 2) {
    load_kv(tVgV, at_stage(tVsV, v_end - 1), v_ptr, params.v, first_tile, last_tile_rows);
    prefetch_pages(v_end - 2);
  }
  cp_async_fence();
  // kPrefetchTwo: the second tile (a whole one) into the other stage now, its own group (empty
  // when there is none), instead of after the first step's barrier.
  constexpr bool kPrefetchTwo = Traits::kPrefetchTwo;
  if constexpr (kPrefetchTwo) {
    if (v_end - 2 >= v_begin) {
      load_kv(tKgK, at_stage(tKsK, v_end - 2), k_ptr, params.k, v_end - 2, int64_t{kBlockN});
      load_kv(tVgV, at_stage(tVsV, v_end - 2), v_ptr, params.v, v_end - 2, int64_t{kBlockN});
    }
    cp_async_fence();
  }
  if constexpr (Traits::kQRegSlices > 0) {
    cp_async_wait<kPrefetchTwo ? 2 : 1>();
    __syncthreads();
    CUTE_UNROLL
    for (int k = 0; k < Traits::kQRegSlices; ++k) copy(smem_copy_q, tSsQ(_, _, k), tSrQ_view(_, _, k));
  }

  // --- main loop over key tiles, last to first (the masked edge tiles come first) -----------------
  // One step per key tile. kEdge steps apply the mask element by element (and, with one stage,
  // predicate V's rows: only the last key tile, processed first, can be partial); the
  // steady-state steps between the edges carry neither, which keeps their register footprint
  // down. Tiles prefetched by step n (n - 1 and before) are never partial.
  // `first`: the loop's first step, whose next tile the prologue already copies with kPrefetchTwo.
  auto step = [&](int n, auto edge, bool first) __attribute__((always_inline)) {
    constexpr bool kEdge = decltype(edge)::value;
    Tensor acc_s = partition_fragment_C(tiled_mma, make_shape(Int<kBlockM>{}, Int<kBlockN>{}));  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    const bool next_in_flight = kPrefetchTwo && kEdge && first;
    if (next_in_flight) {
      cp_async_wait<1>();  // K[n], V[n] and Q landed; K[n - 1], V[n - 1] may not have
    } else {
      cp_async_wait<0>();  // K[n] (V[n] with two stages; Q) landed
    }
    __syncthreads();  // ... for every thread, and every warp is done with tile n + 1
    // This step's seqlen_k, read after the barrier; with kAddressesPerStep re-read where it is
    // used instead (volatile: ptxas would load it early and hold it across the S = Q K^T GEMM).
    [[maybe_unused]] const int64_t seqlen_k_at_barrier = storage.seq[1];
    auto step_seqlen_k = [&]() -> int64_t {
      if constexpr (Traits::kAddressesPerStep) {
        return *reinterpret_cast<volatile const int64_t*>(&storage.seq[1]);
      } else {
        return seqlen_k_at_barrier;
      }
    };
    if constexpr (kStages == 2) {
      if (!next_in_flight && n > storage.first_key_tile) {  // tile n - 1 into tile n + 1's stage, a whole step ahead
        if constexpr (Traits::kAddressesPerStep) {
          load_full_kv_tile(storage.k_ptr, params.k.row_stride, sK, n - 1);
          load_full_kv_tile(storage.v_ptr, params.v.row_stride, sV, n - 1);
        } else {
          const int next = key_tile(n - 1);
          load_kv(tKgK, at_stage(tKsK, n - 1), k_ptr, params.k, next, key_rows(next));
          load_kv(tVgV, at_stage(tVsV, n - 1), v_ptr, params.v, next, key_rows(next));
          prefetch_pages(n - 2);
        }
        cp_async_fence();
      }
    } else {
      const int t = key_tile(n);
      load_kv(tVgV, tVsV, v_ptr, params.v, t, kEdge ? step_seqlen_k() - int64_t{t} * kBlockN : int64_t{kBlockN});
      prefetch_pages(n - 1);  // read by K[n - 1]'s copy after this step's second barrier
      cp_async_fence();
    }

    // kAddressesPerStep: the ldmatrix source partitions from a fresh thread-index read.
    const int step_tid = Traits::kAddressesPerStep ? thread_index_reread() : tid;
    const auto step_tSsQ = Traits::kAddressesPerStep ? smem_copy_q.get_thread_slice(step_tid).partition_S(sQ) : tSsQ;
    const auto step_tSsK = Traits::kAddressesPerStep ? smem_copy_k.get_thread_slice(step_tid).partition_S(sK) : tSsK;
    gemm_b_chunked<Traits::kQRegSlices>(tiled_mma, acc_s, tSrQ, tSrQ_view, step_tSsQ, smem_copy_q, tSrK, tSrK_view,
                                        at_stage(step_tSsK, n), smem_copy_k);

    Tensor scores = make_tensor(acc_s.data(), accum_rowcol(acc_s.layout()));  // (rows, N)
    // (row, col) of every score, for the masks, ALiBi and dropout: derived from a fresh read of
    // the thread index in every step, so the per-row values built from them (64-bit) are not
    // hoisted out of the loop and held in registers across it.
    Tensor tScS = tiled_mma.get_thread_slice(thread_index_reread())
                      .partition_C(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kBlockN>{})));
    Tensor tScS_rc = make_tensor(tScS.data(), accum_rowcol(tScS.layout()));
    const core::Mask step_mask = make_mask<kMask>(params, storage.seq[0], step_seqlen_k());
    if constexpr (kSparse) {
      score_tile<kBlockN, true>(scores, tScS_rc, variant, step_mask, m0, int64_t{key_tile(n)} * kBlockN, kEdge,
                                sparse.walk.bits_of<kBlockN>(n), sparse.walk.words_per_row);
    } else {
      score_tile<kBlockN>(scores, tScS_rc, variant, step_mask, m0, int64_t{n} * kBlockN, kEdge);
    }

    if constexpr (kStages == 1) {
      cp_async_wait<0>();  // V[n] landed
      __syncthreads();     // ... for every thread, and every warp is done reading K[n]
      if (n > storage.first_key_tile) {
        const int next = key_tile(n - 1);
        load_kv(tKgK, tKsK, k_ptr, params.k, next, key_rows(next));
        cp_async_fence();
      }
    }

    softmax.update(scores, acc_o_rc, variant.raw() ? variant.params.scale_log2 : 1.0f);
    if constexpr (kMask == MaskKind::kMaskedDropout) {
      dropout_tile<kDropoutCallsInFlight>(scores, tScS_rc, params.dropout, dropout_stream, m0, int64_t{n} * kBlockN);
    }
    Tensor p = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(p.data(), accum_as_a_operand(p.layout()));  // (MMA, MMA_M, MMA_N / 2)
    // A = P is in registers: gemm_b_chunked's A view / smem / copy slots are unused here.
    const auto tOsVt_n = at_stage(
        Traits::kAddressesPerStep ? smem_copy_v.get_thread_slice(thread_index_reread()).partition_S(sVt) : tOsVt, n);
    gemm_b_chunked<kANeverFromSmem>(tiled_mma, acc_o, tOrP, tOrP, tOsVt_n, smem_copy_v, tOrVt, tOrVt_view, tOsVt_n,
                                    smem_copy_v);
  };
  // Key tiles [steady_begin, steady_end) are visible to every row of this query tile: left of
  // the first row's last visible key (which is also <= seqlen_k), right of the last row's first.
  const int steady_begin =
      static_cast<int>(cute::max(int64_t{n_begin}, (mask.key_begin(m0 + rows_valid - 1) + kBlockN - 1) / kBlockN));
  const int steady_end =
      static_cast<int>(cute::max(int64_t{steady_begin}, cute::min(int64_t{n_end}, mask.key_end(m0 + 1) / kBlockN)));
  // One loop with a uniform branch, so each kind of step is inlined once (three call sites made
  // ptxas spill the d64 masked kernel). The loop ends on the first key tile as read from shared
  // memory (after the step's barrier), so n_begin need not stay in a register across the loop
  // (n_end > n_begin here). With kAddressesPerStep the steady bounds come from shared memory as
  // well, read after the previous step's barrier; the first step, which no barrier precedes, is
  // an edge step then (correct for any tile). Two loops: one with both forms changed the other
  // kernels' register allocation.
  if constexpr (Traits::kAddressesPerStep) {
    if (tid == 0) {
      storage.steady[0] = steady_begin;
      storage.steady[1] = steady_end;
    }
    for (int n = v_end - 1, first = 1;; --n, first = 0) {
      if (first || n >= storage.steady[1] || n < storage.steady[0]) {
        step(n, cute::true_type{}, first != 0);
      } else {
        step(n, cute::false_type{}, false);
      }
      if (n <= storage.first_key_tile) break;
    }
  } else {
    // kSparse: a visit whose tile needs the block mask's element bits is an edge step too.
    auto edge_step = [&](int n) {
      if constexpr (kSparse) {
        const int t = key_tile(n);
        return t >= steady_end || t < steady_begin || sparse.walk.bits_of<kBlockN>(n) != nullptr;
      } else {
        return n >= steady_end || n < steady_begin;
      }
    };
    for (int n = v_end - 1;; --n) {
      if (edge_step(n)) {
        step(n, cute::true_type{}, false);
      } else {
        step(n, cute::false_type{}, false);
      }
      if (n <= storage.first_key_tile) break;
    }
  }

  // --- epilogue: O / sum, LSE; O staged through shared memory for 16-byte stores -----------------
  // Rows whose O holds a NaN, found as they are normalised (a compare per element, while O is
  // in fp32 registers anyway): a 0 * NaN of a masked key's value row may have reached them
  // (careful_rows.cuh); repaired below. Without a mask every key of a visited tile is seen by
  // every row, those past the sequence being zero-filled: nothing to repair (and the no-mask
  // kernels, at 255 registers, spill with the repair's code).
  constexpr bool kRepair = kMask != MaskKind::kNone;
  // The masked kernels' coordinates come from the tile order: read back from shared memory. The
  // others' are blockIdx, re-read for free (through shared memory, the d128 no-mask kernel's sm_90a
  // code spilled 40 bytes and ran 4-7% slower on an H200).
  const ForwardCta out_cta = kMask == MaskKind::kMasked ? ForwardCta{storage.cta[0], storage.cta[1], storage.cta[2]}
                                                        : forward_cta<kMask>(params);
  const float sink = sink_log2(params.score, out_cta.head);  // -inf: none
  float lse[kRows];
  bool nan_row[kRows];
  bool any_nan = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float sum = quad_sum(softmax.sum[r]);
    float max = softmax.max[r];
    const float o_factor = join_sink(max, sum, sink);
    // A row that saw no key: O = 0. Dropout's 1 / (1 - p) joins the normalisation.
    const float inv_sum = sum > 0.0f ? params.dropout.keep_scale / sum * o_factor : 0.0f;
    lse[r] = core::lse_natural(max, sum);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc_o_rc); ++c) acc_o_rc(r, c) *= inv_sum;
    nan_row[r] = kRepair && fragment_row_has_nan(acc_o_rc, r);
    any_nan |= nan_row[r];
  }
  Tensor o = convert_fragment<Element>(acc_o);

  __syncthreads();  // every warp is done reading sQ, which now receives O
  const int epilogue_tid = thread_index_reread();
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(epilogue_tid);
  copy(smem_copy_o, smem_thr_o.retile_S(o), smem_thr_o.partition_D(sO));
  if constexpr (kRepair) {
    if (__any_sync(0xffffffffu, any_nan)) {  // rare: the warp recomputes those rows of sO key by key
      __syncwarp();
      repair_output_rows<Traits, kMask, kPaged, kSparse>(params, tiled_mma, cQ, sO, nan_row, epilogue_tid,
                                                         ForwardCta{storage.cta[0], storage.cta[1], storage.cta[2]});
    }
  }

  const int64_t q_start = storage.seq[2];
  const int64_t rows_out =  // = rows_valid
      cute::min(int64_t{kBlockM}, storage.seq[0] - int64_t{out_cta.m_block} * kBlockM);
  float* lse_ptr = lse_rows(q_start, out_cta);
  if (lse_ptr != nullptr && epilogue_tid % 4 == 0) {  // lane 0 of each quad owns its rows' values
    Tensor tOcO_acc = tiled_mma.get_thread_slice(epilogue_tid).partition_C(cQ);
    Tensor tOcO_rc = make_tensor(tOcO_acc.data(), accum_rowcol(tOcO_acc.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = get<0>(tOcO_rc(r, 0));
      if (row < rows_out) lse_ptr[row * params.lse.row_stride] = lse[r];
    }
  }
  __syncthreads();

  auto gmem_thr_store = gmem_store.get_thread_slice(epilogue_tid);
  Tensor tOcO = gmem_thr_store.partition_D(cQ);
  Tensor tOgO = out_tile(gmem_thr_store, q_start, out_cta);
  Tensor tOsO = gmem_thr_store.partition_S(sO);  // (CPY, CPY_M, CPY_D)
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOgO); ++m) {
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOgO); ++k) {
      if (get<0>(tOcO(0, m, k)) < rows_out && get<1>(tOcO(0, m, k)) < dims.head_dim) {
        copy(gmem_store, tOsO(_, m, k), tOgO(_, m, k));
      }
    }
  }
}

// Whether the device code for compute capability `arch` holds this kernel (tile_shapes.hpp). The
// paged kernels have no sm90-tuned twin: theirs is the sm80-tuned one everywhere.
template <class Traits, MaskKind kMask, bool kPaged = false, bool kSparse = false>
constexpr bool compiled_for(int arch) {
  return target_compiled_for(Traits::kTarget, has_sm90_tiles(Traits::kHeadDim, kMask) && !kPaged && !kSparse, arch);
}

template <class Traits, MaskKind kMask, bool kPaged = false, bool kSparse = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) forward_kernel(const __grid_constant__ ForwardParams params) {
#if defined(__CUDA_ARCH__)
  if constexpr (!compiled_for<Traits, kMask, kPaged, kSparse>(__CUDA_ARCH__ / 10)) {
    __trap();  // never launched (see compiled_for)
  } else
#endif
  {
    forward_tile<Traits, kMask, kPaged, kSparse>(params);
  }
}

}  // namespace flashattn::cuda::sm80

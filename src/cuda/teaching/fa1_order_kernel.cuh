// A teaching kernel: the sm80 forward with FlashAttention-1's loop order, to measure what
// FlashAttention-2's loop swap buys. Same tensor-core code as src/cuda/sm80 (mma.sync m16n8k16,
// ldmatrix, cp.async, its online softmax); only the order of the work differs.
//
//   FA2 (sm80/forward_kernel.cuh): one CTA per (query tile, head, batch);
//     for each key tile j: S = Q K_j^T, softmax update, O += P V_j      (O, m, l in registers)
//   FA1 (here): one CTA per (batch, head) -- or per (batch, head, query group), see below;
//     for each key tile j (K_j, V_j into shared memory once):
//       for each query tile i of the CTA:
//         Q_i from HBM; O_i (fp32), m_i, l_i from the HBM workspace
//         S = Q_i K_j^T, softmax update, O_i += P V_j
//         O_i, m_i, l_i back to the workspace (after the last key tile: out and LSE instead)
//
// The published FA1 parallelises over batch x heads only. q_groups = G splits a head's query
// tiles into G contiguous ranges, one CTA each, still in FA1's order: G separates the effect of
// parallelism (FA2 also parallelises over the sequence) from that of the HBM round trip; with G
// = the number of query tiles, every CTA owns one query tile (loaded once) and only the round
// trip of O, m and l differs from FA2's order. With o_in_registers (the control) that CTA keeps
// them in registers instead: FA2's order with this kernel's tiles and code.
//
// The workspace holds O unnormalised, with the running max m (exp2 domain) and sum l, exactly
// the state FA2 keeps in registers; O is divided by l once, at the end (FA1's paper rescales O
// by l in every step instead; the HBM traffic, the point here, is the same). A query tile's first
// key tile (j = 0 in both orders) starts from the empty state rather than reading it, so the
// workspace needs no initialisation (FA1's CUDA code skips that first read too).
//
// What the order costs, per (batch, head), non-causal, N = seqlen, T = N / block_n key tiles:
// O, m, l are read and written T - 1 times (2 (T - 1) N (d + 2) 4 bytes) and Q is read T times
// instead of once: about 2.5 / block_n bytes per FLOP. Whether that reaches HBM depends on how
// soon the state comes back: with q_groups = 1 a head's whole state, N (d + 2) 4 bytes, is
// revisited once per key tile (megabytes per CTA at N = 8k: HBM); with one query tile per CTA
// its 33 KB (d64: 17 KB) return one step later, likely from L2.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "../../core/mask.hpp"
#include "../../core/softmax.hpp"
#include "../common/fragment.cuh"
#include "../common/row_softmax.cuh"
#include "../common/score_tile.cuh"
#include "../params.hpp"
#include "../sm80/tile_ops.cuh"
#include "fa1_order_params.hpp"
#include "fa1_order_traits.cuh"

namespace flashattn::cuda::teaching {

// Two adjacent elements of an accumulator row: a thread holds its C fragments as column pairs
// (2c, 2c + 1), so each pair moves as one 8-byte (fp32) or 4-byte (16-bit) access.
template <class T>
struct alignas(2 * sizeof(T)) Pair {
  T x, y;
};

// f(r, c, row, col) for each column pair (r, c), (r, c + 1) of a thread's accumulator, given as
// (rows, cols) views of its values and of their tile coordinates.
template <class Coord, class F>
__device__ __forceinline__ void for_each_pair(const Coord& coord_rc, F&& f) {
  CUTE_UNROLL
  for (int r = 0; r < cute::size<0>(coord_rc); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(coord_rc); c += 2) {
      f(r, c, cute::get<0>(coord_rc(r, c)), cute::get<1>(coord_rc(r, c)));
    }
  }
}

// K/V or Q tile `stage` of a stage-0 partition: shifted by whole tiles, the swizzle unchanged.
template <int kTileElems, class Tensor>
__device__ __forceinline__ auto at_stage(const Tensor& stage0, int stage) {
  return cute::make_tensor(stage0.data() + stage * kTileElems, stage0.layout());
}

// One CTA: query group blockIdx.x of head blockIdx.y of batch entry blockIdx.z.
template <class Traits>
__device__ __forceinline__ void fa1_order_cta(const Fa1Params& p) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(Traits::kSmemAlign) char smem_raw[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int tid = static_cast<int>(threadIdx.x);
  const int bidh = static_cast<int>(blockIdx.y);
  const int bidb = static_cast<int>(blockIdx.z);
  // Causal groups differ in work: the last (heaviest) ones are launched first.
  const int groups = static_cast<int>(gridDim.x);
  const int group = static_cast<int>(p.causal ? groups - 1 - blockIdx.x : blockIdx.x);
  const int q_tiles = static_cast<int>(p.seqlen / kBlockM);
  Fa1Schedule schedule;
  schedule.i_begin = static_cast<int>(int64_t{group} * q_tiles / groups);
  schedule.i_end = static_cast<int>(int64_t{group + 1} * q_tiles / groups);
  schedule.k_tiles = static_cast<int>(p.seqlen / kBlockN);
  schedule.block_m = kBlockM;
  schedule.block_n = kBlockN;
  schedule.causal = p.causal;
  const core::Mask mask{p.seqlen, p.seqlen, -1, p.causal ? 0 : -1};
  ScoreParams raw_scores;  // score_tile applies the mask only; the scale goes into the exponent
  raw_scores.raw_scores = true;

  // --- global memory: 64-bit offsets; rows of [batch, seqlen, heads, head_dim] ---------------------
  const int64_t row_stride = int64_t{p.heads} * kHeadDim;
  const int64_t head_offset = int64_t{bidb} * p.seqlen * row_stride + int64_t{bidh} * kHeadDim;
  const int64_t state_rows = (int64_t{bidb} * p.heads + bidh) * p.seqlen;  // this head's workspace rows
  const auto tile_q = make_shape(Int<kBlockM>{}, Int<kHeadDim>{});
  const auto tile_kv = make_shape(Int<kBlockN>{}, Int<kHeadDim>{});
  auto rows_of = [&](const void* base, int64_t first_row, auto tile) {  // (rows, D) of q, k or v
    const auto* ptr = static_cast<const Element*>(base) + head_offset + first_row * row_stride;
    return make_tensor(make_gmem_ptr(ptr), tile, make_stride(row_stride, _1{}));
  };

  // --- shared memory and copies -----------------------------------------------------------------------
  Tensor sQ = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQ{});    // (M, D), stage 0
  Tensor sK = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKV{});   // (N, D)
  Tensor sVt = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutVt{});  // (D, N)
  Tensor sV = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutKV{});   // (N, D)
  constexpr int kQElems = Traits::kQTileElems;
  constexpr int kKVElems = Traits::kKVTileElems;

  typename Traits::GmemTiledLoad gmem_load;  // whole tiles: every cp.async predicate is true
  auto gmem_thr_load = gmem_load.get_thread_slice(tid);
  auto load_q = [&](int i, int stage) {
    copy(gmem_load, gmem_thr_load.partition_S(rows_of(p.q, int64_t{i} * kBlockM, tile_q)),
         at_stage<kQElems>(gmem_thr_load.partition_D(sQ), stage));
  };
  auto load_kv = [&](int j) {
    copy(gmem_load, gmem_thr_load.partition_S(rows_of(p.k, int64_t{j} * kBlockN, tile_kv)),
         at_stage<kKVElems>(gmem_thr_load.partition_D(sK), j & 1));
    copy(gmem_load, gmem_thr_load.partition_S(rows_of(p.v, int64_t{j} * kBlockN, tile_kv)),
         at_stage<kKVElems>(gmem_thr_load.partition_D(sV), j & 1));
  };

  // --- tensor cores ---------------------------------------------------------------------------------
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);  // (MMA, MMA_D, MMA_N)
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

  Tensor acc_o = partition_fragment_C(tiled_mma, tile_q);                           // (MMA, MMA_M, MMA_D) fp32
  Tensor acc_o_rc = make_tensor(acc_o.data(), sm80::accum_rowcol(acc_o.layout()));  // (rows, D)
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  RowSoftmax<kRows> softmax;
  // Tile coordinates (row, col) of each O accumulator value, and of each score.
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(tile_q));
  Tensor tOcO_rc = make_tensor(tOcO.data(), sm80::accum_rowcol(tOcO.layout()));
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kBlockN>{})));
  Tensor tScS_rc = make_tensor(tScS.data(), sm80::accum_rowcol(tScS.layout()));
  // A row's values are spread over the 4 lanes of a quad; each lane sums its own columns
  // (RowSoftmax). The workspace holds whole-row sums: lane 0 of the quad carries the sum in,
  // the others start from 0, and the quad's shares are added on the way out.
  const bool quad_leader = tid % 4 == 0;

  // O, m, l of query tile i: the workspace <-> registers.
  auto load_state = [&](int i) {
    const float* o_tile = p.o_accum + (state_rows + int64_t{i} * kBlockM) * kHeadDim;
    for_each_pair(tOcO_rc, [&](int r, int c, int row, int col) {
      const auto v = *reinterpret_cast<const Pair<float>*>(o_tile + row * kHeadDim + col);
      acc_o_rc(r, c) = v.x;
      acc_o_rc(r, c + 1) = v.y;
    });
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = state_rows + int64_t{i} * kBlockM + get<0>(tOcO_rc(r, 0));
      softmax.max[r] = p.row_max[row];
      softmax.sum[r] = quad_leader ? p.row_sum[row] : 0.0f;
    }
  };
  auto store_state = [&](int i) {
    float* o_tile = p.o_accum + (state_rows + int64_t{i} * kBlockM) * kHeadDim;
    for_each_pair(tOcO_rc, [&](int r, int c, int row, int col) {
      *reinterpret_cast<Pair<float>*>(o_tile + row * kHeadDim + col) = {acc_o_rc(r, c), acc_o_rc(r, c + 1)};
    });
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(softmax.sum[r]);
      const int64_t row = state_rows + int64_t{i} * kBlockM + get<0>(tOcO_rc(r, 0));
      if (quad_leader) {
        p.row_max[row] = softmax.max[r];
        p.row_sum[row] = sum;
      }
    }
  };
  // After query tile i's last key tile: out = O / l (16-bit, [b, s, h, d]) and LSE. Every row
  // sees key 0, so l > 0.
  auto write_output = [&](int i) {
    float lse[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(softmax.sum[r]);
      lse[r] = core::lse_natural(softmax.max[r], sum);
      const float inv_sum = 1.0f / sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o_rc); ++c) acc_o_rc(r, c) *= inv_sum;
    }
    Tensor o = convert_fragment<Element>(acc_o);
    Tensor o_rc = make_tensor(o.data(), sm80::accum_rowcol(o.layout()));
    auto* out_tile = static_cast<Element*>(p.out) + head_offset + int64_t{i} * kBlockM * row_stride;
    for_each_pair(tOcO_rc, [&](int r, int c, int row, int col) {
      *reinterpret_cast<Pair<Element>*>(out_tile + row * row_stride + col) = {o_rc(r, c), o_rc(r, c + 1)};
    });
    if (p.lse != nullptr && quad_leader) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) p.lse[state_rows + int64_t{i} * kBlockM + get<0>(tOcO_rc(r, 0))] = lse[r];
    }
  };

  // --- the loops, as one sequence of steps (j, i) with a two-stage copy pipeline ---------------------
  // The next step's tiles are copied into the other stage during this step: its Q tile when the
  // query tile changes (never, in a CTA of one query tile), its K/V tile when the key tile
  // changes. The other stage's last reader finished before this step's barrier.
  int j = 0, i = schedule.i_begin, q_stage = 0;
  load_q(i, q_stage);
  load_kv(0);
  cp_async_fence();
  for (;;) {
    cp_async_wait<0>();  // this step's Q_i (and K_j, V_j) landed
    __syncthreads();     // ... for every thread, and every warp is done with the previous step
    int next_j = j, next_i = i;
    const bool more = schedule.next(next_j, next_i);
    if (more) {
      if (next_i != i) load_q(next_i, q_stage ^ 1);
      if (next_j != j) load_kv(next_j);
      cp_async_fence();
    }

    // O_i, m_i, l_i: empty at the first key tile, else from the workspace (the loads overlap
    // S = Q K^T). This thread stored those O values itself, and its quad's leader m and l, before
    // a barrier.
    if (j == 0) {
      clear(acc_o);
      softmax = RowSoftmax<kRows>();
    } else if (!p.o_in_registers) {
      load_state(i);
    }

    Tensor acc_s = partition_fragment_C(tiled_mma, make_shape(Int<kBlockM>{}, Int<kBlockN>{}));  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    sm80::gemm_b_chunked<0>(tiled_mma, acc_s, tSrQ, tSrQ_view, at_stage<kQElems>(tSsQ, q_stage), smem_copy_q, tSrK,
                            tSrK_view, at_stage<kKVElems>(tSsK, j & 1), smem_copy_k);
    Tensor scores = make_tensor(acc_s.data(), sm80::accum_rowcol(acc_s.layout()));  // (rows, N)
    const int64_t m0 = int64_t{i} * kBlockM, n0 = int64_t{j} * kBlockN;
    const bool diagonal = !mask.tile_fully_visible(m0, m0 + kBlockM, n0, n0 + kBlockN);
    score_tile<kBlockN>(scores, tScS_rc, ScoreVariant{raw_scores, 0.0f}, mask, m0, n0, diagonal);
    softmax.update(scores, acc_o_rc, p.scale_log2);

    Tensor p_16 = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(p_16.data(), sm80::accum_as_a_operand(p_16.layout()));  // (MMA, MMA_M, MMA_N / 2)
    const auto tOsVt_j = at_stage<kKVElems>(tOsVt, j & 1);
    sm80::gemm_b_chunked<sm80::kANeverFromSmem>(tiled_mma, acc_o, tOrP, tOrP, tOsVt_j, smem_copy_v, tOrVt, tOrVt_view,
                                                tOsVt_j, smem_copy_v);

    if (j == schedule.last_key_tile(i)) {
      write_output(i);
    } else if (!p.o_in_registers) {
      store_state(i);
    }
    if (!more) break;
    if (next_i != i) q_stage ^= 1;
    j = next_j;
    i = next_i;
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fa1_order_kernel(const __grid_constant__ Fa1Params params) {
  fa1_order_cta<Traits>(params);
}

}  // namespace flashattn::cuda::teaching

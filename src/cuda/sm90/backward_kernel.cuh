// The sm90a (Hopper) backward kernel: warp-specialized TMA + WGMMA
// (docs/design/hopper-backward.md: the work split and the register and shared-memory budget).
// Its bases: backward_cta.cuh (what every role shares: the CTA's coordinates and work, the named
// barriers, the pipeline's consumer side) and backward_epilogue.cuh (dK and dV's stores).
//
// One CTA per (key tile of kBlockN keys, KV head, batch entry). K and V are loaded once; dK and dV
// stay in registers while the CTA walks every query tile that sees its keys, for every query head
// of its GQA group (the group's sum needs no atomics), last query tile first. Warpgroups:
//   producer   its first warp (one lane issues): K and V, then per step the query tile's Q with its
//              rows' LSE2 and its dO with their D (the prepare kernel's row statistics, one bulk
//              copy each beside the tile's TMA load), through kStages-deep pipelines;
//              its second warp, the dQ warp: per step, once the consumers have staged the step's
//              dQ product in shared memory, the bulk reduce-adds of it into the fp32 sums in
//              global memory (one per row group of 8 rows of a part: a consumer's half, 2 KiB at
//              d128, or by head dim a pass's 64 columns; instead of an atomic per element), and
//              in deterministic mode the query tile's turn (add_dq); the consumers wait for it only when every dQ buffer is still being read;
//   consumers  two, 64 of the tile's keys each. Per step:
//                S^T = K Q^T, dP^T = V dO^T         (SS WGMMA, or RS with K and V in registers at
//                                                    d64; a key per accumulator row)
//                P^T, dS^T = P^T (dP^T - D)         (registers: ../common/backward_score.cuh's
//                                                    transposed pass, mask and score modifiers)
//                dS^T -> shared memory (stmatrix.trans: dS, keys contiguous)
//                dV += P^T dO                        (RS WGMMA: P^T in 16 bits, in place)
//                dQ = dS K                           (SS WGMMA, each consumer half of the head dim,
//                                                    once both consumers' dS is in)
//                dK += dS^T Q                        (RS WGMMA, last: it runs while dQ is staged)
//                dQ -> shared memory                 (the scratch's blocked layout, one of
//                                                    kDqBuffers; handed to the dQ warp)
//              The convert kernel scales and rounds the sums (../sm80/backward_rows.cuh, shared).
//              At d192 and d256 (Traits::kSplitHeadDim) the consumers share the CTA's 64 keys
//              instead: each computes S^T and dP^T for half of the query tile's columns, P^T and
//              dS^T go to shared memory, and each forms dV^T += dO^T P and dK^T += Q^T dS (SS
//              WGMMA, head dim x keys) for its block of the head dim's rows (128 and 128, or 128
//              and 64 at d192), and the dQ product in passes of 64 columns (step_by_head_dim: dV
//              and dK of 64 keys would take a consumer's every register).
// At the end dK (times the softmax scale) and dV go through K's and V's buffers to TMA stores,
// which clip the rows past seqlen_k.
//
// Varlen (kVarlen, its own instantiation so that the dense kernels stay as tuned): the sequences
// lie one after another in [total, heads, d] tensors, which TMA sees as one batch entry; a CTA's
// loads start at its sequence's first rows. The rows a tail tile reads past its sequence belong to
// the next one (or, for keys past seqused_k, were never written) and may hold NaN or Inf, which
// P = 0 does not cancel in a GEMM (0 x NaN = NaN): the consumers zero them in shared memory, the
// key tile's once and a query tile's before its first GEMM. dK and dV are written with plain
// stores of the sequence's key rows (a TMA store would clip only at the packed tensor's end).
//
// NaN (docs/CONVENTIONS.md): with a mask, the consumers zero the non-finite elements of the K and
// V tiles once (so a bad key or value row reaches dQ only through the dS of rows that see it), and
// key rows whose dK or dV holds a NaN at the end are recomputed key by key before the stores
// (../common/careful_grads.cuh), as in the sm80 backward.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

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
#include "backward_epilogue.cuh"
#include "backward_traits.cuh"
#include "trace.cuh"
#include "warpgroup.cuh"

namespace flashattn::cuda::sm90 {

// kRawScores: no softcap or ALiBi (ScoreParams::raw_scores), a kernel of its own: with both
// element passes in one kernel, its registers spilled (each alone compiles without).
template <class Traits, MaskKind kMask, bool kRawScores, bool kVarlen>
struct BackwardKernel : BackwardEpilogue<Traits, kMask, kVarlen> {
  using Cta = BackwardCta<Traits, kMask, kVarlen>;
  using Epilogue = BackwardEpilogue<Traits, kMask, kVarlen>;
  using Cta::bidb;
  using Cta::bidh_kv;
  using Cta::consumers_sync;
  using Cta::dkv_rows;
  using Cta::dq_buffer;
  using Cta::k_rows_of;
  using Cta::kBlockM;
  using Cta::kBlockN;
  using Cta::kDqEmptyBarrier;
  using Cta::kDqFullBarrier;
  using Cta::kDqHandOverThreads;
  using Cta::kHeadDim;
  using Cta::kSameBodies;
  using Cta::kWarpGroupThreads;
  using Cta::make_work;
  using Cta::n_block;
  using Cta::stage_release;
  using Cta::stage_wait;
  using Cta::step_pos;
  using Cta::work_of;
  using Epilogue::epilogue;
  using typename Cta::Element;
  using typename Cta::PipelineQ;
  using typename Cta::PipelineState;
  using typename Cta::SharedStorage;
  static __device__ __forceinline__ void producer(const BackwardKernelParams<Traits>& kp, SharedStorage& storage,
                                                  PipelineQ& pipeline_q, PipelineQ& pipeline_do, bool leader) {
    using namespace cute;
    const BackwardParams& params = kp.params;
    const volatile BackwardWork& w = work_of(storage);
    if (w.steps == 0) return;
    // Varlen: one batch entry of all the rows, the sequence's from its first row on. (The batch
    // index read at each use, as before varlen existed: the dense kernels' code stays the same.)
    auto batch = [] { return kVarlen ? 0 : bidb(); };
    auto rows_from = [](auto rows, int64_t start) {
      if constexpr (kVarlen) {
        return domain_offset(make_coord(static_cast<int32_t>(start), _0{}), rows);
      } else {
        return rows;
      }
    };
    if (leader) {
      Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_kv);
      Tensor mV = kp.tma_v.get_tma_tensor(kp.shape_kv);
      Tensor gK = local_tile(rows_from(mK(_, _, bidh_kv(params), batch()), kVarlen ? w.k_start : 0),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block(params), _0{}));
      Tensor gV = local_tile(rows_from(mV(_, _, bidh_kv(params), batch()), kVarlen ? w.k_start : 0),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block(params), _0{}));
      Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
      Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
      auto [tKgK, tKsK] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&storage.kv_full, Traits::kTmaBytesKV);
      copy(kp.tma_k.with(storage.kv_full, 0), tKgK, tKsK);
      copy(kp.tma_v.with(storage.kv_full, 0), tVgV, tVsV);
    }
    Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q);
    Tensor mdO = kp.tma_do.get_tma_tensor(kp.shape_q);
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQ{});
    PipelineState write = cutlass::make_producer_start_state<PipelineQ>();
    for (int t = 0; t < w.steps; ++t) {
      const StepPos pos = step_pos(params, w, t);
      const int64_t stat_row = pos.head * params.scratch.rows + w.scratch_base + int64_t{pos.tile} * kBlockM;
      auto load_rows = [&](auto& tma, const auto& m_rows, const auto& s_rows, PipelineQ& pipeline, const float* stats,
                           float* s_stats) {
        pipeline.producer_acquire(write);
        if (leader) {
          Tensor g = local_tile(rows_from(m_rows(_, _, pos.head, batch()), kVarlen ? w.q_start : 0),
                                Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(pos.tile, _0{}));
          auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s_rows(_, _, write.index())),
                                        group_modes<0, 2>(g));
          uint64_t* full = pipeline.producer_get_barrier(write);
          copy(tma.with(*full, 0), tg, ts);
          bulk_load(s_stats, stats + stat_row, Traits::kRowStatBytes, full);
        }
      };
      load_rows(kp.tma_q, mQ, sQ, pipeline_q, params.scratch.lse2, storage.lse2[write.index()]);
      load_rows(kp.tma_do, mdO, sdO, pipeline_do, params.scratch.delta, storage.delta[write.index()]);
      ++write;
    }
    pipeline_q.producer_tail(write);
    pipeline_do.producer_tail(write);
  }

  // kDkvRows: by head dim, the rows of dV^T and dK^T the consumer holds (Traits::kDkvRowsFirst or
  // kDkvRowsSecond, from row consumer_wg * kDkvRowsFirst on).
  template <int kDkvRows>
  static __device__ __forceinline__ void consumer(const BackwardKernelParams<Traits>& kp, SharedStorage& storage) {
    using namespace cute;
    const BackwardParams& params = kp.params;
    const ForwardParams& fp = params.fwd;

    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});      // (M, D, stages)
    Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQ{});  // (M, D, stages)
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});     // (N, D)
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});     // (N, D)

    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::template TiledMmadKV<kDkvRows> mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    // The GEMMs' operand descriptors and the thread's partitions are formed where each is used,
    // from a fresh read of the thread index: formed once before the loop, the compiler held them
    // in registers through it, beside dK and dV (and spilled).
    auto fresh_tid = [] { return fresh_thread_idx() - kWarpGroupThreads; };
    Tensor acc_dk = partition_fragment_C(mma_dkv, typename Traits::template ShapedKV<kDkvRows>{});  // fp32
    Tensor acc_dv = partition_fragment_C(mma_dkv, typename Traits::template ShapedKV<kDkvRows>{});
    clear(acc_dk);
    clear(acc_dv);
    // Traits::kKVInRegisters: the consumer's keys of K and V, S^T's and dP^T's A operands through
    // the main loop (loaded once K and V are final in shared memory).
    auto kv_regs = [&] {
      if constexpr (Traits::kKVInRegisters) {
        auto thr_sdp = mma_sdp.get_thread_slice(fresh_tid());
        return make_tuple(thr_sdp.partition_fragment_A(sK), thr_sdp.partition_fragment_A(sV));
      } else {
        return 0;
      }
    }();

    if (work_of(storage).steps > 0) {
      cutlass::arch::ClusterTransactionBarrier::wait(&storage.kv_full, 0);
      if constexpr (kMask != MaskKind::kNone || kVarlen) {
        // A non-finite key or value element enters dQ as 0 (../common/careful_grads.cuh): with a
        // mask, every element's; without one, those of a varlen tile's rows past its sequence's
        // keys (each of which the element pass masks: finite, they add 0), whole rows zeroed.
        // Once, by both consumers, before their first GEMM reads K and V.
        if constexpr (kMask != MaskKind::kNone) {
          const int tid = fresh_tid();
          zero_nonfinite(storage.k.data(), cute::cosize_v<typename Traits::SmemLayoutKV>, tid,
                         Traits::kConsumerThreads);
          zero_nonfinite(storage.v.data(), cute::cosize_v<typename Traits::SmemLayoutKV>, tid,
                         Traits::kConsumerThreads);
        } else {
          const volatile BackwardWork& w = work_of(storage);
          const int64_t first = w.seqlen_k - w.n0;
          zero_rows_from(sK, first);
          zero_rows_from(sV, first);
        }
        cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before the WGMMAs read them
        consumers_sync();
      }
      if constexpr (Traits::kKVInRegisters) {
        auto copy_kv = make_tiled_copy_A(typename Traits::SmemCopyAtomKV_A{}, mma_sdp);
        auto thr_copy_kv = copy_kv.get_thread_slice(fresh_tid());
        copy(copy_kv, thr_copy_kv.partition_S(sK), thr_copy_kv.retile_D(get<0>(kv_regs)));
        copy(copy_kv, thr_copy_kv.partition_S(sV), thr_copy_kv.retile_D(get<1>(kv_regs)));
      }
      for (int t = 0; t < work_of(storage).steps; ++t) {
        // The step's stage and query tile derived from t alone: the loop carries nothing else
        // through the element pass, whose softcap / ALiBi variant takes nearly every register.
        const PipelineState read(t % Traits::kStages, (t / Traits::kStages) & 1, t);
        const StepPos pos = step_pos(params, work_of(storage), t);
        const int stage = read.index();
        const int ds_buffer = t % Traits::kDsBuffers;
        const int64_t m0 = int64_t{pos.tile} * kBlockM;
        FA_BWD_STAMP(t, kBwdStep);
        if constexpr (kVarlen) zero_query_tail(storage, sQ(_, _, stage), sdO(_, _, stage), read, m0);
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (keys, queries)
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        {
          auto thr_sdp = mma_sdp.get_thread_slice(fresh_tid());
          Tensor tSrQ = thr_sdp.partition_fragment_B(sQ(_, _, stage));  // (MMA, MMA_M, MMA_D)
          Tensor tSrdO = thr_sdp.partition_fragment_B(sdO(_, _, stage));
          stage_wait(storage.pipeline_q, read);
          if constexpr (Traits::kKVInRegisters) {
            warpgroup_gemm_issue<true, true>(mma_sdp, get<0>(kv_regs), tSrQ, acc_s);
            stage_wait(storage.pipeline_do, read);
            warpgroup_gemm_issue<true, true>(mma_sdp, get<1>(kv_regs), tSrdO, acc_dp);
          } else {
            Tensor tSrK = thr_sdp.partition_fragment_A(sK);  // (MMA, MMA_N, MMA_D)
            warpgroup_gemm_issue<true, false>(mma_sdp, tSrK, tSrQ, acc_s);
            Tensor tSrV = thr_sdp.partition_fragment_A(sV);
            stage_wait(storage.pipeline_do, read);
            warpgroup_gemm_issue<true, false>(mma_sdp, tSrV, tSrdO, acc_dp);
          }
        }
        FA_BWD_STAMP(t, kBwdIssued);

        Tensor st = make_tensor(acc_s.data(), gmma_accum_rowcol(acc_s.layout()));
        Tensor dpt = make_tensor(acc_dp.data(), gmma_accum_rowcol(acc_dp.layout()));
        Tensor tScS = mma_sdp.get_thread_slice(fresh_tid())
                          .partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));  // (key, query)
        Tensor coord = make_tensor(tScS.data(), gmma_accum_rowcol(tScS.layout()));
        const ScoreVariant variant = score_variant(fp.score, bidb(), pos.head);
        auto tile_mask = [&] {
          const volatile BackwardWork& w = work_of(storage);
          return TileMask::make<kBlockM, kBlockN>(make_mask<kMask>(fp, w.seqlen_q, w.seqlen_k), m0, w.n0);
        };
        const bool apply_mask = pos.tile < work_of(storage).full_begin || pos.tile >= work_of(storage).full_end;
        cute::warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        warpgroup_fence_operand(acc_dp);
        FA_BWD_STAMP(t, kBwdSdpDone);
        // (batch x heads_q + query head: dropout's Philox stream, as the forward's; n0 read from
        // shared memory only by the dropout kernels, the others' steps keep their loads)
        constexpr bool kDropout = kMask == MaskKind::kMaskedDropout;
        const uint64_t bh =
            static_cast<uint64_t>(bidb()) * static_cast<uint64_t>(fp.shape.heads_q) + static_cast<uint64_t>(pos.head);
        softmax_grad_tile_transposed<kDropout>(cute::bool_constant<kRawScores>{}, st, dpt, coord, storage.lse2[stage],
                                               storage.delta[stage], variant, tile_mask, apply_mask, fp.dropout, bh, m0,
                                               kDropout ? work_of(storage).n0 : int64_t{0});
        FA_BWD_STAMP(t, kBwdElements);
        if constexpr (Traits::kSplitHeadDim) {
          step_by_head_dim<kDkvRows>(storage, mma_sdp, mma_dkv, mma_dq, acc_s, acc_dp, acc_dk, acc_dv, read, ds_buffer,
                                     t);
        } else {
          step_by_keys(storage, mma_sdp, mma_dkv, mma_dq, acc_s, acc_dp, acc_dk, acc_dv, read, ds_buffer, t);
        }
      }
    }
    epilogue<kDkvRows>(kp, storage, mma_dkv, acc_dk, acc_dv);
  }

  // The rest of step t after the element pass, by keys: P^T and dS^T in 16 bits in place, dS^T to
  // shared memory for the dQ GEMM, the dV and dK GEMMs issued with them from registers; once both
  // consumers' dS is in, the dQ GEMM; then the stage released and the dQ product staged.
  template <class MmadKV, class AccS, class AccKV>
  static __device__ __forceinline__ void step_by_keys(SharedStorage& storage, typename Traits::TiledMmaSdP& mma_sdp,
                                                      MmadKV& mma_dkv, typename Traits::TiledMmadQ& mma_dq, AccS& acc_s,
                                                      AccS& acc_dp, AccKV& acc_dk, AccKV& acc_dv,
                                                      const PipelineState& read, int ds_buffer, int t) {
    using namespace cute;
    const int stage = read.index();
    auto fresh_tid = [] { return fresh_thread_idx() - kWarpGroupThreads; };
    Tensor sQt = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{});      // (D, M, stages)
    Tensor sdOt = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQt{});  // (D, M, stages)
    Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});      // (D, N)
    Tensor sdS = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdS{});     // (M, N, 2)
    Tensor sdSt = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdSt{});   // (N, M, 2)
    Tensor rP = make_tensor<Element>(gmma_accum_as_a_operand(acc_s.layout()));
    Tensor rdS = make_tensor<Element>(gmma_accum_as_a_operand(acc_dp.layout()));
    convert_fragment_into(acc_s, rP);
    convert_fragment_into(acc_dp, rdS);
    // dS^T into the step's dS buffer (its last reader, the dQ GEMM two steps back, waited for
    // by both consumers before they passed the last step's barrier below).
    {
      auto copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdSt{}, mma_sdp);
      auto thr_copy_ds = copy_ds.get_thread_slice(fresh_tid());
      copy(copy_ds, thr_copy_ds.retile_S(make_tensor(rdS.data(), acc_dp.layout())),
           thr_copy_ds.partition_D(sdSt(_, _, ds_buffer)));
    }
    {
      auto thr_dkv = mma_dkv.get_thread_slice(fresh_tid());
      Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt(_, _, stage));  // (MMA, MMA_D, MMA_M)
      warpgroup_gemm_issue<false, true>(mma_dkv, rP, tdVrdOt, acc_dv);
    }
    FA_BWD_STAMP(t, kBwdDkvIssued);
    cutlass::arch::fence_view_async_shared();  // dS's generic-proxy writes before the WGMMAs read it
    consumers_sync();
    FA_BWD_STAMP(t, kBwdSynced);
    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    {
      auto thr_dq = mma_dq.get_thread_slice(fresh_tid());
      Tensor tdQrdS = thr_dq.partition_fragment_A(sdS(_, _, ds_buffer));  // (MMA, MMA_M, MMA_N)
      Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);                   // (MMA, MMA_D, MMA_N)
      warpgroup_gemm_issue<true, false>(mma_dq, tdQrdS, tdQrKt, acc_dq);
    }
    // dK's GEMM last: the dQ product is staged for the dQ warp while it runs.
    {
      auto thr_dkv = mma_dkv.get_thread_slice(fresh_tid());
      Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt(_, _, stage));
      warpgroup_gemm_issue<false, true>(mma_dkv, rdS, tdKrQt, acc_dk);
    }
    cute::warpgroup_wait<1>();  // dV's and dQ's GEMMs done (WGMMA groups complete in order)
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dq);
    FA_BWD_STAMP(t, kBwdGemmsDone);
    stage_release(storage.pipeline_do, read);
    stage_dq(storage, mma_dq, acc_dq, t);
    FA_BWD_STAMP(t, kBwdStaged);
    cute::warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dk);
    stage_release(storage.pipeline_q, read);
  }

  // The rest of step t after the element pass, by head dim: P^T and dS^T in 16 bits, each
  // consumer's query columns stored to shared memory, where the consumers meet (both halves in).
  // Then, every operand read from shared memory: dV^T += dO^T P and dK^T += Q^T dS, and the dQ
  // product in kDqPasses passes of kDqPassCols columns, each staged for the dQ warp while the
  // next one runs. The stage goes back to the producer once dV^T and dK^T are done, during the
  // first pass (with one stage, the producer's next loads wait for it).
  template <int kDkvRows, class MmadKV, class AccS, class AccKV>
  static __device__ __forceinline__ void step_by_head_dim(SharedStorage& storage, typename Traits::TiledMmaSdP& mma_sdp,
                                                          MmadKV& mma_dkv, typename Traits::TiledMmadQ& mma_dq,
                                                          AccS& acc_s, AccS& acc_dp, AccKV& acc_dk, AccKV& acc_dv,
                                                          const PipelineState& read, int ds_buffer, int t) {
    using namespace cute;
    const int stage = read.index();
    auto fresh_tid = [] { return fresh_thread_idx() - kWarpGroupThreads; };
    Tensor sQt = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{});      // (D, M, stages)
    Tensor sdOt = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQt{});  // (D, M, stages)
    Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});      // (D, N)
    Tensor sdS = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdS{});     // (M, N, 2)
    Tensor sdSt = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdSt{});   // (N, M, 2)
    Tensor sPt = make_tensor(make_smem_ptr(storage.pt.data()), typename Traits::SmemLayoutPt{});     // (N, M, stages)
    {
      Tensor rP = make_tensor<Element>(acc_s.layout());
      Tensor rdS = make_tensor<Element>(acc_dp.layout());
      convert_fragment_into(acc_s, rP);
      convert_fragment_into(acc_dp, rdS);
      // P^T into the stage's buffer (its last reader, the dV^T GEMM of the stage's last use, was
      // waited for by both consumers before they released the stage), dS^T into the step's buffer
      // (its last readers, the GEMMs two steps back, waited for by both consumers before they
      // passed the last step's barrier).
      auto copy_st = make_tiled_copy_C(typename Traits::SmemCopyAtomdSt{}, mma_sdp);
      auto thr_copy_st = copy_st.get_thread_slice(fresh_tid());
      copy(copy_st, thr_copy_st.retile_S(rP), thr_copy_st.partition_D(sPt(_, _, stage)));
      copy(copy_st, thr_copy_st.retile_S(rdS), thr_copy_st.partition_D(sdSt(_, _, ds_buffer)));
    }
    cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before the WGMMAs read them
    consumers_sync();
    constexpr int kPassCols = Traits::kDqPassCols;
    // (The accumulators are not returned from here: a copy of registers a WGMMA still writes
    // makes ptxas serialize every WGMMA of the kernel.)
    auto issue_dq = [&](auto pass, auto& acc_dq) {
      auto thr_dq = mma_dq.get_thread_slice(fresh_tid());
      Tensor tdQsdS = thr_dq.partition_fragment_A(sdS(_, _, ds_buffer));  // (MMA, MMA_M, MMA_N)
      Tensor tdQsKt = thr_dq.partition_fragment_B(
          local_tile(sKt, Shape<Int<kPassCols>, Int<kBlockN>>{}, make_coord(pass, _0{})));  // (MMA, MMA_D, MMA_N)
      warpgroup_gemm_issue<true, false>(mma_dq, tdQsdS, tdQsKt, acc_dq);
    };
    {
      // The consumer's rows of dO^T and Q^T (its warpgroup's tiled MMA).
      auto thr_dkv = mma_dkv.get_thread_slice(fresh_tid() % kWarpGroupThreads);
      Tensor tdVsdOt = thr_dkv.partition_fragment_A(dkv_rows<kDkvRows>(sdOt(_, _, stage)));  // (MMA, MMA_D, MMA_M)
      Tensor tdVsPt = thr_dkv.partition_fragment_B(sPt(_, _, stage));                        // (MMA, MMA_N, MMA_M)
      warpgroup_gemm_issue<false, false>(mma_dkv, tdVsdOt, tdVsPt, acc_dv);
      Tensor tdKsQt = thr_dkv.partition_fragment_A(dkv_rows<kDkvRows>(sQt(_, _, stage)));
      Tensor tdKsdSt = thr_dkv.partition_fragment_B(sdSt(_, _, ds_buffer));
      warpgroup_gemm_issue<false, false>(mma_dkv, tdKsQt, tdKsdSt, acc_dk);
    }
    // Two passes in flight at a time, in two accumulators taken in turn: pass p + 1 runs while
    // pass p is staged. The stage is released once dV^T and dK^T (issued before the first pass)
    // are done.
    Tensor acc_even = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kPassCols>>{});
    Tensor acc_odd = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kPassCols>>{});
    // Pass p: pass p + 1 issued into `next`, then pass p's `acc` staged once it is done.
    auto run_pass = [&](auto pass, auto& acc, auto& next) {
      constexpr int kPass = decltype(pass)::value;
      if constexpr (kPass + 1 < Traits::kDqPasses) {
        issue_dq(Int<kPass + 1>{}, next);
        cute::warpgroup_wait<1>();
      } else {
        cute::warpgroup_wait<0>();
      }
      warpgroup_fence_operand(acc);
      stage_dq<kPass>(storage, mma_dq, acc, t);
    };
    issue_dq(_0{}, acc_even);
    cute::warpgroup_wait<1>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    stage_release(storage.pipeline_q, read);
    stage_release(storage.pipeline_do, read);
    cute::for_each(cute::make_int_sequence<Traits::kDqPasses>{}, [&](auto pass) {
      if constexpr (decltype(pass)::value % 2 == 0) {
        run_pass(pass, acc_even, acc_odd);
      } else {
        run_pass(pass, acc_odd, acc_even);
      }
    });
  }

  // Zeroes rows [first, rows) of a (rows, kHeadDim) tile in shared memory, the consumers' threads
  // taking 16-byte chunks in turn (contiguous under the swizzle); the caller fences and syncs.
  template <class Tile>
  static __device__ __forceinline__ void zero_rows_from(Tile&& tile, int64_t first) {
    constexpr int kRows = decltype(cute::size<0>(tile))::value;
    constexpr int kChunks = kHeadDim / 8;
    if (first >= kRows) return;
    const int begin = static_cast<int>(cute::max(first, int64_t{0}));
#pragma unroll 1
    for (int i = fresh_thread_idx() - kWarpGroupThreads; i < (kRows - begin) * kChunks; i += Traits::kConsumerThreads) {
      *reinterpret_cast<uint4*>(&tile(begin + i / kChunks, i % kChunks * 8)) = make_uint4(0, 0, 0, 0);
    }
  }

  // Varlen: a query tile reaching past its sequence's rows (the first step of each head's sweep)
  // has Q and dO rows of the next sequence, which may hold NaN or Inf: a masked P of 0 would not
  // cancel them in the dV and dK GEMMs. Both consumers wait for the stage, zero those rows and
  // sync before either's first GEMM reads it. (Their LSE2 is +inf in the scratch: P is 0.)
  template <class TileQ, class TiledO>
  static __device__ __forceinline__ void zero_query_tail(SharedStorage& storage, TileQ&& q, TiledO&& dout,
                                                         const PipelineState& read, int64_t m0) {
    const int64_t first = work_of(storage).seqlen_q - m0;
    if (first >= kBlockM) return;  // the same for both consumers
    stage_wait(storage.pipeline_q, read);
    stage_wait(storage.pipeline_do, read);
    zero_rows_from(q, first);
    zero_rows_from(dout, first);
    cutlass::arch::fence_view_async_shared();  // the zeros before the WGMMAs' (async proxy) reads
    consumers_sync();
  }

  // The consumer's part of step t's dQ product (pass kPass of kDqPasses: its columns) into dQ buffer
  // t % kDqBuffers (the first pass once the dQ warp has read what the buffer held, kDqBuffers
  // steps back), handed to the dQ warp after the last pass.
  template <int kPass = 0, class AccDq>
  static __device__ __forceinline__ void stage_dq(SharedStorage& storage, typename Traits::TiledMmadQ& mma_dq,
                                                  const AccDq& acc_dq, int t) {
    using namespace cute;
    const int buffer = t % Traits::kDqBuffers;
    Tensor sdQ = make_tensor(make_smem_ptr(dq_buffer(storage, buffer)), typename Traits::SmemLayoutdQ{});  // (M, D)
    if constexpr (kPass == 0) named_barrier_sync<kSameBodies>(kDqHandOverThreads, kDqEmptyBarrier + buffer);
    auto part = [&] {
      if constexpr (Traits::kDqPasses == 1) {
        return sdQ;
      } else {
        return local_tile(sdQ, Shape<Int<kBlockM>, Int<Traits::kDqPassCols>>{}, make_coord(_0{}, Int<kPass>{}));
      }
    };
    Tensor tdQsdQ = mma_dq.get_thread_slice(fresh_thread_idx() - kWarpGroupThreads).partition_C(part());
    CUTE_UNROLL
    for (int e = 0; e < size(acc_dq); ++e) tdQsdQ(e) = acc_dq(e);
    if constexpr (kPass + 1 == Traits::kDqPasses) {
      cutlass::arch::fence_view_async_shared();  // the writes before the bulk operations read them
      named_barrier_arrive<kSameBodies>(kDqHandOverThreads, kDqFullBarrier + buffer);
    }
  }

  // The dQ warp: each step's staged product added into the fp32 sums of the scratch (the query
  // tile's rows of its head), one bulk reduce-add per row group of each part (Traits::kDqParts),
  // issued by one lane; the buffer goes back to the consumers once the adds have read it.
  // Deterministic mode: the key tiles that see a query tile add into its sums in order, first key
  // tile first (the sm80 backward's order): the warp waits until the key tiles before its own have
  // passed, and passes once its adds have completed. A key tile waits only on key tiles of lower
  // block index, which started before it; its consumers go on meanwhile until every dQ buffer is
  // waiting.
  static __device__ __forceinline__ void add_dq(const BackwardParams& params, SharedStorage& storage) {
    const volatile BackwardWork& w = work_of(storage);
    const int steps = w.steps;
    const bool lead = cute::elect_one_sync();
    // Each buffer's first use needs no wait; each arrival below is matched by a later step's wait.
    for (int b = 0; b < Traits::kDqBuffers && b < steps; ++b) {
      cutlass::arch::NamedBarrier::arrive(kDqHandOverThreads, kDqEmptyBarrier + b);
    }
    for (int t = 0; t < steps; ++t) {
      const int buffer = t % Traits::kDqBuffers;
      if (lead) FA_DQ_STAMP(t, kDqWait);
      cutlass::arch::NamedBarrier::sync(kDqHandOverThreads, kDqFullBarrier + buffer);
      int* turn = nullptr;
      if (lead) {
        FA_DQ_STAMP(t, kDqFull);
        const StepPos pos = step_pos(params, w, t);
        const int64_t m0 = int64_t{pos.tile} * kBlockM;
        const int64_t row0 = pos.head * params.scratch.rows + w.scratch_base + m0;
        if (params.deterministic) {
          const core::Mask mask = make_mask<kMask>(params.fwd, w.seqlen_q, w.seqlen_k);
          turn = params.scratch.dq_semaphore + pos.head * (params.scratch.rows / kBackwardMinBlockM) +
                 (w.scratch_base + m0) / kBlockM;
          wait_for_count(turn, n_block(params) - first_key_tile<kMask, kBlockN>(mask, m0));
        }
        FA_DQ_STAMP(t, kDqTurn);
        constexpr int kGroups = kBlockM / 8;
        const float* src = dq_buffer(storage, buffer);
        float* dst = params.scratch.dq_accum + row0 * kHeadDim;
        CUTE_UNROLL
        for (int c = 0; c < Traits::kDqParts; ++c) {
          CUTE_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            bulk_reduce_add_f32(dst + c * Traits::kDqGroupFloats + g * 8 * kHeadDim,
                                src + c * kBlockM * Traits::kDqPartCols + g * Traits::kDqGroupFloats,
                                Traits::kDqGroupFloats * sizeof(float));
          }
        }
        bulk_commit();
        bulk_wait_read<0>();
        FA_DQ_STAMP(t, kDqRead);
      }
      __syncwarp();
      if (t + Traits::kDqBuffers < steps) {
        cutlass::arch::NamedBarrier::arrive(kDqHandOverThreads, kDqEmptyBarrier + buffer);
      }
      if (turn != nullptr) {
        bulk_wait<0>();
        advance_count(turn);
      }
    }
    if (lead) bulk_wait<0>();
  }

  static __device__ __forceinline__ void run(const BackwardKernelParams<Traits>& kp) {
    extern __shared__ __align__(Traits::kSmemAlign) char smem_raw[];
    auto& storage = *reinterpret_cast<SharedStorage*>(smem_raw);
    // Past the sequence's keys: nothing to write (uniform over the CTA, before any barrier).
    if (int64_t{n_block(kp.params)} * kBlockN >= k_rows_of(kp.params.fwd)) return;
    const int warp_group = cutlass::canonical_warp_group_idx();
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const bool is_producer = warp_group == 0;
    const bool is_producer_warp = is_producer && warp_in_group == 0;
    const bool is_producer_leader = is_producer_warp && cute::elect_one_sync();
    if (threadIdx.x == 0) storage.work = make_work(kp.params);
    if (is_producer_leader) {
      cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_do.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
      cutlass::arch::ClusterBarrier::init(&storage.kv_full, 1);
    }
    typename PipelineQ::Params pipeline_params;
    pipeline_params.transaction_bytes = Traits::kTmaBytesQ;
    pipeline_params.role = is_producer ? PipelineQ::ThreadCategory::Producer : PipelineQ::ThreadCategory::Consumer;
    pipeline_params.is_leader = is_producer_leader;
    pipeline_params.num_consumers = Traits::kConsumerThreads;
    PipelineQ pipeline_q(storage.pipeline_q, pipeline_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
    PipelineQ pipeline_do(storage.pipeline_do, pipeline_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
    __syncthreads();  // the barriers' initialisation is visible to every warpgroup

    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (is_producer_warp) {
        producer(kp, storage, pipeline_q, pipeline_do, is_producer_leader);
      } else if (warp_in_group == 1) {
        add_dq(kp.params, storage);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
      // (d192: the second consumer holds fewer rows of dV^T and dK^T, a body of its own)
      if (Traits::kDkvRowsSecond != Traits::kDkvRowsFirst && warp_group == 2) {
        consumer<Traits::kDkvRowsSecond>(kp, storage);
      } else {
        consumer<Traits::kDkvRowsFirst>(kp, storage);
      }
    }
  }
};

template <class Traits, MaskKind kMask, bool kRawScores, bool kVarlen>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    backward_kernel(const __grid_constant__ BackwardKernelParams<Traits> kp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  BackwardKernel<Traits, kMask, kRawScores, kVarlen>::run(kp);
#else
  (void)kp;  // WGMMA and setmaxnreg exist only in sm_90a code: other targets get an empty stub
#endif
}

}  // namespace flashattn::cuda::sm90

// The sm90a backward kernel's epilogue (a base of BackwardKernel, backward_kernel.cuh): dK (times
// the softmax scale) and dV staged through K's and V's buffers, NaN rows repaired key by key
// (../common/careful_grads.cuh), and stored: TMA stores, or for varlen plain stores of the
// sequence's key rows.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "../common/careful_grads.cuh"
#include "../common/fragment.cuh"
#include "../params.hpp"
#include "backward_cta.cuh"
#include "warpgroup.cuh"

namespace flashattn::cuda::sm90 {

template <class Traits, MaskKind kMask, bool kVarlen>
struct BackwardEpilogue : BackwardCta<Traits, kMask, kVarlen> {
  using Cta = BackwardCta<Traits, kMask, kVarlen>;
  using Cta::bidb;
  using Cta::bidh_kv;
  using Cta::consumer_sync;
  using Cta::consumers_any;
  using Cta::consumers_sync;
  using Cta::dkv_rows;
  using Cta::kBlockN;
  using Cta::kConsumerBarrier;
  using Cta::kConsumers;
  using Cta::kHeadDim;
  using Cta::kWarpGroupThreads;
  using Cta::n_block;
  using Cta::work_of;
  using typename Cta::Element;
  using typename Cta::SharedStorage;

  // dK * scale and dV through K's and V's buffers (once both consumers are done reading K in their
  // dQ GEMMs; by keys each consumer its own 64 rows, by head dim its columns, transposed), then TMA
  // stores: by keys each consumer's rows, by head dim the whole tile (both consumers' columns: they
  // meet before it).
  template <int kDkvRows, class MmadKV, class AccKV>
  static __device__ __forceinline__ void epilogue(const BackwardKernelParams<Traits>& kp, SharedStorage& storage,
                                                  MmadKV& mma_dkv, AccKV& acc_dk, AccKV& acc_dv) {
    using namespace cute;
    const int consumer_tid = fresh_thread_idx() - kWarpGroupThreads;
    const int consumer_wg = consumer_tid / kWarpGroupThreads;
    const bool lead = consumer_tid % kWarpGroupThreads == 0;
    // A NaN in dK or dV: an input held NaN or inf, which may have reached keys its row does not
    // see (with a mask; without one every row sees every key).
    bool nan = false;
    CUTE_UNROLL
    for (int e = 0; e < size(acc_dk); ++e) {
      acc_dk(e) *= kp.params.softmax_scale;
      if constexpr (kMask != MaskKind::kNone) nan |= std::isnan(acc_dk(e)) || std::isnan(acc_dv(e));
    }
    Tensor dk = make_tensor<Element>(acc_dk.layout());
    Tensor dv = make_tensor<Element>(acc_dv.layout());
    convert_fragment_into(acc_dk, dk);
    convert_fragment_into(acc_dv, dv);
    consumers_sync();  // both consumers are done with K and V
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
    {
      auto copy_kv = make_tiled_copy_C(typename Traits::SmemCopyAtomKV{}, mma_dkv);
      if constexpr (Traits::kSplitHeadDim) {
        auto thr_copy_kv = copy_kv.get_thread_slice(consumer_tid % kWarpGroupThreads);
        Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});  // (D, N)
        Tensor sVt = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKt{});
        copy(copy_kv, thr_copy_kv.retile_S(dk), thr_copy_kv.partition_D(dkv_rows<kDkvRows>(sKt)));
        copy(copy_kv, thr_copy_kv.retile_S(dv), thr_copy_kv.partition_D(dkv_rows<kDkvRows>(sVt)));
      } else {
        auto thr_copy_kv = copy_kv.get_thread_slice(consumer_tid);
        copy(copy_kv, thr_copy_kv.retile_S(dk), thr_copy_kv.partition_D(sK));
        copy(copy_kv, thr_copy_kv.retile_S(dv), thr_copy_kv.partition_D(sV));
      }
    }
    constexpr int kRows = Traits::kStoreRows;
    if constexpr (kMask != MaskKind::kNone) {
      if constexpr (Traits::kSplitHeadDim) {
        // A key row's NaN may lie in either consumer's half: both vote, and the rows holding one
        // are recomputed by the eight warps (whole rows: both consumers' columns).
        if (consumers_any(storage, nan)) {
          repair_key_rows<Element, kHeadDim, kBlockN, kMask>(kp.params, bidb(), bidh_kv(kp.params), n_block(kp.params),
                                                             consumer_tid / 32, kBlockN, Traits::kConsumerThreads / 32,
                                                             consumer_tid % 32, sK, sV);
        }
      } else if (named_barrier_or(kWarpGroupThreads, kConsumerBarrier + consumer_wg, nan)) {
        // Rare: the consumer's key rows holding a NaN recomputed in sK / sV by its four warps.
        const int in_group = consumer_tid % kWarpGroupThreads;
        repair_key_rows<Element, kHeadDim, kBlockN, kMask>(
            kp.params, bidb(), bidh_kv(kp.params), n_block(kp.params), consumer_wg * kRows + in_group / 32,
            (consumer_wg + 1) * kRows, kWarpGroupThreads / 32, in_group % 32, sK, sV);
      }
    }
    // The staged part complete before it is stored: by keys the consumer's own rows; by head dim
    // the whole tile, both consumers' columns.
    auto staged_sync = [&] {
      if constexpr (Traits::kSplitHeadDim) {
        consumers_sync();
      } else {
        consumer_sync(consumer_wg);
      }
    };
    if constexpr (kVarlen) {
      staged_sync();
      store_key_rows(kp.params, kp.params.dk, sK, storage, consumer_wg, consumer_tid);
      store_key_rows(kp.params, kp.params.dv, sV, storage, consumer_wg, consumer_tid);
      return;
    }
    tma_store_fence();
    staged_sync();
    if (lead && (!Traits::kSplitHeadDim || consumer_wg == 0)) {
      // The stored rows of the (keys, head dim) plane: by keys the consumer's, by head dim the
      // CTA's.
      auto part = [&](auto row_block) {
        return make_coord(Traits::kSplitHeadDim ? row_block : row_block * kConsumers + consumer_wg, _0{});
      };
      auto store = [&](auto& tma, const auto& s_full) {
        Tensor m = tma.get_tma_tensor(kp.shape_kv);
        Tensor g = local_tile(m(_, _, bidh_kv(kp.params), bidb()), Shape<Int<kRows>, Int<kHeadDim>>{},
                              part(n_block(kp.params)));
        Tensor s = local_tile(s_full, Shape<Int<kRows>, Int<kHeadDim>>{}, part(0));
        auto thr = tma.get_slice(_0{});
        copy(tma, thr.partition_S(s), thr.partition_D(g));
      };
      store(kp.tma_dk, sK);
      store(kp.tma_dv, sV);
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }

  // Varlen: dK or dV's rows (by keys the consumer's, by head dim the CTA's, by both consumers),
  // staged in `staged`, stored into the sequence's key rows (those past k_rows belong to the next
  // sequence), 16 bytes a thread at a time.
  template <class Staged>
  static __device__ __forceinline__ void store_key_rows(const BackwardParams& params, const RowsOut& out,
                                                        const Staged& staged, SharedStorage& storage, int consumer_wg,
                                                        int consumer_tid) {
    constexpr int kRows = Traits::kStoreRows;
    constexpr int kChunks = kHeadDim / 8;
    constexpr int kThreads = Traits::kSplitHeadDim ? Traits::kConsumerThreads : kWarpGroupThreads;
    const int first_row = Traits::kSplitHeadDim ? 0 : consumer_wg * kRows;
    const volatile BackwardWork& w = work_of(storage);
    const int64_t row0 = w.n0 + first_row;
    const int64_t rows = cute::min(int64_t{kRows}, w.k_rows - row0);
    Element* dst =
        static_cast<Element*>(out.data) + bidh_kv(params) * out.head_stride + (w.k_start + row0) * out.row_stride;
#pragma unroll 1
    for (int i = consumer_tid % kThreads; i < rows * kChunks; i += kThreads) {
      const int row = i / kChunks, col = i % kChunks * 8;
      *reinterpret_cast<uint4*>(dst + row * out.row_stride + col) =
          *reinterpret_cast<const uint4*>(&staged(first_row + row, col));
    }
  }
};

}  // namespace flashattn::cuda::sm90

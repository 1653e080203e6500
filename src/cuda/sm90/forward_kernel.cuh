// The sm90a (Hopper) forward kernel: warp-specialized TMA + WGMMA.
//
// Work tiles are (query tile of kBlockM rows, head, batch), in one fixed order (Scheduler). CTA b
// of G starts with tile b; its next tiles are b + G, b + 2G, ... (static walk) or, with a tile
// counter, whichever tile is next in the order when it frees. The host picks G and the walk
// (forward_grid_mode). Warpgroups:
//   producer   its first warp (one lane issues), per tile: K[n] and V[n] for every key tile n
//              the mask lets this query tile see, last to first, through kStages-deep circular
//              buffers (cutlass::PipelineTmaAsync: a "full" mbarrier the TMA completes and an
//              "empty" one the consumers arrive on when done with a stage); then it picks the next
//              tile and loads its Q into the next Q buffer (Q's own full / empty mbarriers), the
//              tile decoded into a shared-memory slot beside it (TileSlot): that is how the
//              consumers learn their next tile, and they read it there whenever they need it.
//              With two Q buffers (d64 - d128) the next Q loads under this tile's last key tiles;
//              with one, it waits until every consumer is done with this tile (its O stored, where
//              O is staged in Q's buffer), and the next tile's first kStages K / V loads go first.
//              The stages run on across tiles.
//   consumers  two or three, 64 query rows each: S = Q K^T (SS WGMMA), the online softmax in
//              registers (exp2 domain, the scale folded into the exponent's FMA for raw scores),
//              P converted to 16 bits in registers, O += P V (RS WGMMA, V^T a transposed view of
//              V's buffer).
//              Intra-warpgroup overlap: S of tile n is issued with the PV GEMM of tile n + 1 and
//              the softmax of tile n runs under that GEMM. Pingpong: the consumers take turns
//              issuing GEMMs (named barriers), so one's softmax overlaps the others' GEMMs. The
//              turns run on across tiles: no consumer waits for another at a tile's end, so one's
//              epilogue and next tile's start run under the others' last GEMMs. Where key tiles
//              are narrower than the query tile (kSkipTiles), a consumer takes the key tiles its
//              own rows do not see as empty turns.
// Registers move from the producer to the consumers with setmaxnreg. The epilogue normalises O,
// and each consumer writes its 64 rows into shared memory (stmatrix; O's own buffer where there is
// room, else Q's) and stores them with TMA (rows past seqlen_q are clipped by the tensor map); LSE
// goes out with plain stores. The tall d64 kernel stores a tile's O in its next tile, under that
// tile's first S GEMM (kDeferEpilogue).
//
// Varlen (kVarlen, its own instantiation so that the dense kernels stay as tuned): one CTA per
// tile of the longest sequence's tiling; loads start at the sequence's first rows of
// [total, heads, D] tensors; the V rows of the last key tile past seqlen_k are zeroed
// (zero_v_tail); O goes out with plain stores (store_rows).
//
// Block-sparse (Traits::kSparse, its own instantiation: the masked kernel with 128-row tiles): a
// tile's key tiles are the walk of its block mask's lists (common/sparse_tiles.cuh), whose
// blocks hold whole tiles. The producer derives the walk at the tile's start (after its warp has
// checked the lists under IndexCheck::kDevice) and loads by visits, counted down as the dense
// kernel counts tiles; the walk goes to the consumers in shared memory beside the tile's slot, and
// they step through the same visits, a visit of a partial block being an edge step whose score
// tile ANDs the block's element bits. Lists that break a rule give the tile's rows NaN.
//
// What limits it, and what was tried against each limit: docs/history/TUNING.md ("What limits the
// Hopper forward").
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../core/mask.hpp"
#include "../../core/variant.hpp"
#include "../../core/softmax.hpp"
#include "../common/dropout.cuh"
#include "../common/fragment.cuh"
#include "../common/mask.cuh"
#include "../common/row_softmax.cuh"
#include "../common/score_tile.cuh"
#include "../common/sequence.cuh"
#include "../common/sparse_tiles.cuh"
#include "../params.hpp"
#include "../tile_order.hpp"
#include "forward_epilogue.cuh"
#include "forward_sparse.cuh"
#include "forward_tiles.cuh"
#include "forward_traits.cuh"
#include "trace.cuh"
#include "warpgroup.cuh"

namespace flashattn::cuda::sm90 {

// The tile walk (forward_tiles.cuh) and the epilogue (forward_epilogue.cuh) are its bases.
template <class Traits, MaskKind kMask, bool kVarlen>
struct ForwardKernel : ForwardEpilogue<Traits, kMask, kVarlen> {
  using Tiles = ForwardTiles<Traits, kMask, kVarlen>;
  using Epilogue = ForwardEpilogue<Traits, kMask, kVarlen>;
  using Epilogue::consumer_index;
  using Epilogue::consumer_sync;
  using Epilogue::epilogue;
  using Epilogue::fresh_consumer_index;
  using Epilogue::kConsumerBarrier;
  using Epilogue::kEpilogueBarrier;
  using Epilogue::kPingpongBarrier;
  using Epilogue::normalise;
  using Epilogue::release_q;
  using Epilogue::store_out;
  using Tiles::decode;
  using Tiles::kSkipTiles;
  using Tiles::own_key_tiles;
  using Tiles::own_rows;
  using Tiles::tile;
  using Tiles::tile_of;
  using typename Tiles::Rows;
  using typename Tiles::Scheduler;
  using typename Tiles::Tile;
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = cutlass::PipelineState<Traits::kStages>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kConsumers = Traits::kConsumerWarpGroups;
  static constexpr bool kSparse = Traits::kSparse;
  using Walks = SparseWalks<Traits>;
  static_assert(!kSparse || (!kVarlen && kConsumers == 2), "block-sparse: dense batches, 128-row tiles");
  static constexpr int kDropoutInFlight = 4;  // Philox calls unrolled together (dropout_tile)
  // The steady loop's softmax takes the exponentials against the current max, off the row max's
  // dependency chain (bf16 d128 on an H200: 1-5% faster in same-run A/Bs, sm90_forward_tuning.md):
  //   kPairs    P into a second, 16-bit P (RowSoftmax::update_stale), S kept for the rare step
  //             whose max must move; where the registers hold it beside S and O: two consumers up
  //             to d128 (three consumers' 160 spilled 216-296 bytes with it, d192 / d256 8-40);
  //   kInPlace  P in place of S (RowSoftmax::update_stale_in_place): a step whose max must move
  //             computes S again (its K stage is held until the softmax is done); the WGMMA
  //             needs the whole warpgroup, so the vote is the warpgroup's (consumer_any).
  // Not with dropout, which zeroes P in scores after the sums took it. In place in the dense
  // unmasked kernels (d64's three consumers: +3-8%, d256: +1-3%, d192 alike, not measured) and
  // the tall d64 kernel (causal +2-5%); the other masked ones lost with it (d256 causal -2-3%),
  // the varlen kernels spilled (8-24 bytes).
  enum class Stale { kNo, kPairs, kInPlace };
  static constexpr Stale kStale = kMask == MaskKind::kMaskedDropout    ? Stale::kNo
                                  : kConsumers == 2 && kHeadDim <= 128 ? Stale::kPairs
                                  : (kMask == MaskKind::kNone || kConsumers == kTallConsumers) && !kVarlen
                                      ? Stale::kInPlace
                                      : Stale::kNo;
  static_assert(kMask != MaskKind::kMaskedDropout || kBlockN % 32 == 0, "dropout_tile: key tiles of whole groups");
  static constexpr int kQBuffers = Traits::kQBuffers;
  // A tile's O stores deferred to the next tile, under its first S GEMM, so that a consumer's turns
  // at a tile boundary (the last PV GEMM, the next first S GEMM) are not held apart by them; the
  // next tile's first PV GEMM starts O afresh (zero-init), no clear while they run. In the tall
  // d64 kernel (masked, three consumers; the next Q and O in buffers of their own): bf16 d64
  // causal +2-3% at 1k-2k in a same-run A/B on an H200. Not kept elsewhere: level in the unmasked
  // three-consumer kernel, d128 1-3% slower at 1k-4k (sm90_forward_tuning.md).
  static constexpr bool kDeferEpilogue =
      Traits::kSeparateO && kQBuffers == 2 && !kVarlen && kConsumers == kTallConsumers && kMask != MaskKind::kNone;
  // True on every thread of the calling consumer when pred holds on one of them (its named
  // barrier, as a reduction: barrier.red.or). Its index read afresh (held through the key loop,
  // the tall d64 kernel spilled it).
  static __device__ __forceinline__ bool consumer_any(bool pred) {
    const uint32_t id =
        cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + kConsumerBarrier + fresh_consumer_index();
    uint32_t any;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\tbarrier.red.or.pred q, %2, %3, p;\n\t"
        "selp.u32 %0, 1, 0, q;\n\t}"
        : "=r"(any)
        : "r"(static_cast<uint32_t>(pred)), "r"(id), "n"(Traits::kWarpGroupThreads));
    return any != 0;
  }

  // The mask of an edge key tile, derived again at each one rather than held through the main
  // loop: from the kernel parameters (a dense call's lengths; held, they spilled the tall d64
  // masked kernel's 160 registers) or from the tile's slot (varlen: a sequence's lengths, held,
  // spilled d64 / d256).
  static __device__ __forceinline__ core::Mask edge_mask(const ForwardParams& p, SharedStorage& storage, int load) {
    if constexpr (kVarlen) {
      const TileSlot d = read_slot(storage, load, p);
      return make_mask<kMask>(p, d.seqlen_q, d.seqlen_k);
    } else {
      return make_mask<kMask>(p, p.shape.seqlen_q, p.shape.seqlen_k);
    }
  }

  // Run by the producer warpgroup's first warp; `leader` is its one lane that issues the TMA.
  static __device__ __forceinline__ void producer(const KernelParams<Traits>& kp, SharedStorage& storage,
                                                  PipelineKV& pipeline_k, PipelineKV& pipeline_v, bool leader) {
    // The whole warp walks the loops (its state stays warp-uniform, in uniform registers, within
    // the producer's few registers); the leader's acquire also expects the stage's bytes.
    const Scheduler sched(kp.params);
    PipelineState write = cutlass::make_producer_start_state<PipelineKV>();
    int q_loads = 0;
    int index = sched.first();
    while (sched.valid(index)) {
      producer_tile(kp, storage, pipeline_k, pipeline_v, decode(kp.params, sched, index), q_loads, write, leader);
      // The next tile is picked once this one's loads are all issued, a few key tiles before its
      // end: late enough that the CTAs take tiles in the order they free (picked at a tile's start,
      // a CTA would hold its next tile through the whole of this one), early enough that the
      // counter's round trip and the next tile's loads overlap this tile's last GEMMs.
      index = sched.next(index, kp.params.tile_counter);
    }
    // No next tile: an invalid index in the next Q buffer, its full barrier completed by a plain
    // arrive (no bytes), ends the consumers' loop.
    const int buffer = acquire_q_buffer(storage, q_loads);
    if (leader) {
      *static_cast<volatile int32_t*>(&slot_of(storage, q_loads - 1).index) = index;
      compiler_fence();
      cutlass::arch::ClusterBarrier::arrive(&storage.q_full[buffer]);
    }
    // Stay until the consumers have released every stage (required once clusters multicast).
    pipeline_k.producer_tail(write);
    pipeline_v.producer_tail(write);
  }

  // Keeps the compiler from moving shared-memory accesses across the mbarrier operations (CUTLASS's
  // asm statements for them declare no memory effects); the hardware orders them (arrive releases,
  // wait acquires).
  static __device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

  // The producer's next Q buffer, once every consumer is done with it (its last tile's GEMMs and,
  // with O staged there, its O stores).
  static __device__ __forceinline__ int acquire_q_buffer(SharedStorage& storage, int& q_loads) {
    const int buffer = q_loads % kQBuffers;
    // (A fresh mbarrier is in phase 0: the wait on the phase before it returns at once.)
    cutlass::arch::ClusterBarrier::wait(&storage.q_empty[buffer], ((q_loads / kQBuffers) & 1) ^ 1);
    ++q_loads;
    return buffer;
  }
  // The tile of the Q load `load` (its count from 0), in the ring beside the Q buffers: written
  // before the producer's arrive on the Q buffer's full barrier, read by the consumers after
  // their wait on it (volatile: read where it is used, not held in registers through the loop).
  static __device__ __forceinline__ TileSlot& slot_of(SharedStorage& storage, int load) {
    return storage.tiles[load % Traits::kTileSlots];
  }
  // Field by field (a volatile struct has no copy), the sequence only for varlen: a dense call's is
  // the parameters' for every tile.
  template <class To, class From>
  static __device__ __forceinline__ void copy_slot(To& to, From& from) {
    to.index = from.index;
    to.m_block = from.m_block;
    to.bidh = from.bidh;
    to.bidb = from.bidb;
    to.bidh_kv = from.bidh_kv;
    if constexpr (kVarlen) {
      to.q_start = from.q_start;
      to.k_start = from.k_start;
      to.seqlen_q = from.seqlen_q;
      to.seqlen_k = from.seqlen_k;
    }
  }
  static __device__ __forceinline__ void publish(SharedStorage& storage, int load, const TileSlot& d) {
    volatile TileSlot& v = slot_of(storage, load);
    copy_slot(v, d);
    compiler_fence();
  }
  // The tile of Q load `load`, from its slot.
  static __device__ __forceinline__ Tile tile_at(const ForwardParams& p, SharedStorage& storage, int load) {
    return tile_of(p, read_slot(storage, load, p));
  }
  static __device__ __forceinline__ int read_index(SharedStorage& storage, int load) {
    return static_cast<volatile TileSlot&>(slot_of(storage, load)).index;
  }
  static __device__ __forceinline__ TileSlot read_slot(SharedStorage& storage, int load, const ForwardParams& p) {
    const volatile TileSlot& v = slot_of(storage, load);
    TileSlot d;
    copy_slot(d, v);
    if constexpr (!kVarlen) {
      d.q_start = d.k_start = 0;
      d.seqlen_q = p.shape.seqlen_q;
      d.seqlen_k = p.shape.seqlen_k;
    }
    return d;
  }

  static __device__ __forceinline__ Element* q_data(SharedStorage& storage, int buffer) {
    return storage.q.data() + buffer * cute::cosize_v<typename Traits::SmemLayoutQ>;
  }
  static __device__ __forceinline__ auto q_buffer(SharedStorage& storage, int buffer) {
    return cute::make_tensor(cute::make_smem_ptr(q_data(storage, buffer)), typename Traits::SmemLayoutQ{});  // (M, D)
  }

  // Issues the tile's loads: Q into the next Q buffer, with the tile's index beside it; K / V for
  // each key tile, last to first. With one Q buffer, a tile after the first (a Q loaded before)
  // has its first kStages key tiles go before its Q: they only wait for stages the last
  // tile's GEMMs free, so they load while its last GEMMs and its epilogue run.
  static __device__ __forceinline__ void producer_tile(const KernelParams<Traits>& kp, SharedStorage& storage,
                                                       PipelineKV& pipeline_k, PipelineKV& pipeline_v,
                                                       const TileSlot& decoded, int& q_loads, PipelineState& write,
                                                       bool leader) {
    using namespace cute;
    // The loads go by visits, counted down: the tile's key tiles themselves, or the walk of its
    // block mask's lists (key tile Walks::tile(v); checked first under IndexCheck::kDevice, lists
    // that break a rule getting no visit).
    [[maybe_unused]] int visits = 0;
    if constexpr (kSparse) visits = Walks::producer_walk(kp.params, storage, decoded);
    const Tile t = tile_of(kp.params, decoded);
    int v_begin = t.n.begin, v_end = t.n.end;
    if constexpr (kSparse) {
      v_begin = 0;
      v_end = t.n.end <= t.n.begin ? 0 : cute::max(0, visits);
    }
    auto key_tile = [&](int v) {
      if constexpr (kSparse) {
        return Walks::tile(storage.sparse.producer_walk, v);
      } else {
        return v;
      }
    };
    Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q);   // (seqlen_q, D, heads_q, batch)
    Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_kv);  // (seqlen_k, D, heads_kv, batch)
    Tensor mV = kp.tma_v.get_tma_tensor(kp.shape_kv);
    // Varlen: one batch entry of all the rows, the sequence's from its first row on.
    const int batch = kVarlen ? 0 : t.bidb;
    auto rows_from = [](auto rows, int64_t start) {
      if constexpr (kVarlen) {
        return domain_offset(make_coord(static_cast<int32_t>(start), _0{}), rows);
      } else {
        return rows;
      }
    };
    Tensor gK = local_tile(rows_from(mK(_, _, t.bidh_kv, batch), t.k_start), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(rows_from(mV(_, _, t.bidh_kv, batch), t.k_start), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));                                                // (N, D, n)
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});  // (N, D, stages)
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});  // (N, D, stages)
    // One CTA per cluster: the whole box from CTA 0, no multicast.
    // (Tuples, not structured bindings: load_kv captures them, which C++17 does not allow for those.)
    const auto k_part = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    const auto v_part = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    const auto& tKgK = get<0>(k_part);
    const auto& tKsK = get<1>(k_part);
    const auto& tVgV = get<0>(v_part);
    const auto& tVsV = get<1>(v_part);

    auto load_kv = [&](int n) {
      pipeline_k.producer_acquire(write);
      if (leader) copy(kp.tma_k.with(*pipeline_k.producer_get_barrier(write), 0), tKgK(_, n), tKsK(_, write.index()));
      pipeline_v.producer_acquire(write);
      if (leader) copy(kp.tma_v.with(*pipeline_v.producer_get_barrier(write), 0), tVgV(_, n), tVsV(_, write.index()));
      ++write;
    };
    int v = v_end - 1;
    if (kQBuffers == 1 && q_loads > 0) {
      for (const int early_end = v - Traits::kStages; v >= v_begin && v > early_end; --v) load_kv(key_tile(v));
    }
    const int buffer = acquire_q_buffer(storage, q_loads);
    if (leader) {
      Tensor gQ = local_tile(rows_from(mQ(_, _, t.bidh, batch), t.q_start), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(t.m_block, _0{}));  // (M, D)
      Tensor sQ = q_buffer(storage, buffer);
      auto [tQgQ, tQsQ] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      publish(storage, q_loads - 1, decoded);
      if constexpr (kSparse) Walks::publish(storage, q_loads - 1);
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&storage.q_full[buffer], Traits::kTmaBytesQ);
      copy(kp.tma_q.with(storage.q_full[buffer], 0), tQgQ, tQsQ);
    }
    for (; v >= v_begin; --v) load_kv(key_tile(v));
  }

  // Block-sparse lists the producer found broken: the first consumer checks them again and
  // records the first broken rule (SparseWalks::record_fault, a cold path).
  struct ConsumerMeet {
    static __device__ __forceinline__ void barrier() { consumer_sync(fresh_consumer_index()); }
    static __device__ __forceinline__ bool any(bool pred) { return consumer_any(pred); }
  };

  static __device__ __forceinline__ void consumer(const KernelParams<Traits>& kp, SharedStorage& storage,
                                                  PipelineKV& pipeline_k, PipelineKV& pipeline_v, int consumer_tid) {
    using namespace cute;
    const Scheduler sched(kp.params);
    PipelineState k_read, v_read;  // the K stage of the next S GEMM, the V stage of the next PV GEMM
    // Pingpong: the consumers take turns issuing their GEMMs, in a ring (named barrier
    // kPingpong + w opens consumer w's turn: w syncs it, its predecessor arrives on it when its
    // own GEMMs are issued), so one's softmax runs while the others' GEMMs keep the tensor cores
    // busy. Every consumer takes the same turns (the same tiles), so the ring runs on across
    // tiles. Consumer 0 goes first (the last one opens its first turn); its last sync below takes
    // the last one's last arrival, so every barrier is balanced at exit.
    const int consumer_wg = consumer_index();
    if (consumer_wg == kConsumers - 1) cutlass::arch::NamedBarrier::arrive(kTurnThreads, kPingpongBarrier);
    // O and the softmax's row state of the consumer's tile. With kDeferEpilogue its epilogue is
    // split: normalise at its end (rO, lse), store_out in the next tile, under its first S GEMM.
    typename Traits::TiledMmaPV mma_pv;
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D) fp32
    constexpr int kRows = decltype(size<0>(gmma_accum_rowcol(tOrO.layout())))::value;
    RowSoftmax<kRows> softmax;
    [[maybe_unused]] auto rO = make_tensor<Element>(tOrO.layout());  // the pending tile's O, in 16 bits
    [[maybe_unused]] float lse[kRows];
    int pending = -1;  // the Q load of the tile whose rO / lse await store_out (kDeferEpilogue)
    auto store_pending = [&] {
      if (kDeferEpilogue && pending >= 0) {
        Tensor sO = make_tensor(make_smem_ptr(storage.o.data()), typename Traits::SmemLayoutO{});  // (M, D)
        // (Buffer 0: unused, O has its own.)
        store_out(kp, storage, sO, mma_pv, rO, lse, tile_at(kp.params, storage, pending), 0);
      }
    };
    for (int q_reads = 0;; ++q_reads) {
      const int buffer = q_reads % kQBuffers;
      cutlass::arch::ClusterTransactionBarrier::wait(&storage.q_full[buffer], (q_reads / kQBuffers) & 1);
      compiler_fence();
      if (!sched.valid(read_index(storage, q_reads))) break;
      consumer_tile(kp, storage, pipeline_k, pipeline_v, q_reads, k_read, v_read, consumer_tid, mma_pv, tOrO, softmax,
                    store_pending, blockIdx.x == 0 && q_reads == 1);
      if constexpr (kDeferEpilogue) {
        const float sink = kp.params.score.sink == nullptr  // (the slot's reads only with a sink)
                               ? -INFINITY
                               : sink_log2(kp.params.score, tile_at(kp.params, storage, q_reads).bidh);
        normalise(kp.params, tOrO, softmax, rO, lse, sink);
        pending = q_reads;
      }
    }
    store_pending();
    if (consumer_index() == 0) turn_begin(0);
    // The last O store has read shared memory before the CTA exits.
    if (Traits::kSeparateO && consumer_tid % Traits::kWarpGroupThreads == 0) cute::tma_store_wait<0>();
  }

  static constexpr int kTurnThreads = 2 * Traits::kWarpGroupThreads;  // the consumer and its predecessor
  static __device__ __forceinline__ void turn_begin(int consumer_wg) {
    cutlass::arch::NamedBarrier::sync(kTurnThreads, kPingpongBarrier + consumer_wg);
  }
  static __device__ __forceinline__ void turn_end(int consumer_wg) {
    cutlass::arch::NamedBarrier::arrive(kTurnThreads, kPingpongBarrier + (consumer_wg + 1) % kConsumers);
  }

  // Runs the tile of Q load `load` (its Q landed in Q buffer load % kQBuffers), in tOrO and
  // softmax (made fresh); store_pending() (the last tile's deferred O stores) runs once, after its
  // first S GEMM's issue where it has one.
  template <class AccO, class Softmax, class StorePending>
  static __device__ __forceinline__ void consumer_tile(const KernelParams<Traits>& kp, SharedStorage& storage,
                                                       PipelineKV& pipeline_k, PipelineKV& pipeline_v, int load,
                                                       PipelineState& k_read, PipelineState& v_read, int consumer_tid,
                                                       typename Traits::TiledMmaPV& mma_pv, AccO& tOrO,
                                                       Softmax& softmax, StorePending& store_pending,
                                                       [[maybe_unused]] bool traced) {
    using namespace cute;
    const ForwardParams& params = kp.params;
    const int buffer = load % kQBuffers;
    const Tile t = tile_at(params, storage, load);
    const int consumer_wg = consumer_index();
    Tensor sQ = q_buffer(storage, buffer);                                                       // (M, D)
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});   // (N, D, stages)
    Tensor sVt = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutVt{});  // (D, N, stages)
    Tensor sO = make_tensor(make_smem_ptr(Traits::kSeparateO ? storage.o.data() : q_data(storage, buffer)),
                            typename Traits::SmemLayoutO{});  // (M, D)

    typename Traits::TiledMmaQK mma_qk;
    auto thr_qk = mma_qk.get_thread_slice(consumer_tid);
    auto thr_pv = mma_pv.get_thread_slice(consumer_tid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_D) smem descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_D, stages)
    Tensor tOrVt = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_D, MMA_N, stages)
    Tensor tOrO_rc = make_tensor(tOrO.data(), gmma_accum_rowcol(tOrO.layout()));  // (rows, D)
    softmax = Softmax{};
    if constexpr (!kDeferEpilogue) clear(tOrO);
    constexpr int kRows = decltype(size<0>(tOrO_rc))::value;

    const ScoreVariant variant = score_variant(params.score, t.bidb, t.bidh);
    const float softmax_scale = variant.raw() ? variant.params.scale_log2 : 1.0f;

    // The key loop's visits, counted down: the key tiles this consumer's own rows see
    // (own_key_tiles), or the block mask's walk (visit v is key tile key_tile(v); none where the
    // tile's lists broke a rule). Of the tiles (`span`), those every one of its rows sees whole
    // (no per-element mask): right of its last row's first visible key, left of its first row's
    // last one (and within seqlen_k).
    const Rows rows = own_rows(t, consumer_wg);
    const KeyTiles own = [&] {
      if constexpr (kSparse) {
        return KeyTiles{0, cute::max(0, Walks::visits(Walks::of(storage, load)))};
      } else {
        return own_key_tiles(t, rows);
      }
    }();
    const KeyTiles span = kSparse ? t.n : own;
    const int steady_begin = static_cast<int>(
        cute::max(int64_t{span.begin}, (t.mask.key_begin(rows.m0 + rows.rows - 1) + kBlockN - 1) / kBlockN));
    const int steady_end = static_cast<int>(
        cute::max(int64_t{steady_begin}, cute::min(int64_t{span.end}, t.mask.key_end(rows.m0 + 1) / kBlockN)));
    // Visit v's key tile; with a block mask, the words of its element bits (null: none needed).
    auto key_tile = [&](int v) {
      if constexpr (kSparse) {
        return Walks::tile(Walks::of(storage, load), v);
      } else {
        return v;
      }
    };
    auto block_bits = [&](int v) -> const uint32_t* {
      if constexpr (kSparse) {
        return Walks::bits(Walks::of(storage, load), v);
      } else {
        return nullptr;
      }
    };

    // Deferred: O starts at the first PV GEMM (zero-init), or here for a consumer whose rows see
    // no key; its registers are free while the last tile's O is stored (with O cleared before,
    // the tall kernel spilled).
    const bool first_s = t.n.end > t.n.begin && own.end > own.begin;
    if (kDeferEpilogue && !first_s) {
      store_pending();
      clear(tOrO);
    }

    if constexpr (kVarlen) zero_v_tail(storage, pipeline_v, v_read, t);

    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N) fp32
    Tensor scores = make_tensor(tSrS.data(), gmma_accum_rowcol(tSrS.layout()));       // (rows, N)
    Tensor tOrP = make_tensor<Element>(gmma_accum_as_a_operand(tSrS.layout()));       // P of the previous tile
    // (rows, N) -> (row, key) of the thread's scores. The tall d64 kernel (masked, in place)
    // derives them at each use from a fresh thread index: held through the key loop, they spilled.
    auto score_coords = [&] {
      constexpr bool kFresh = kStale == Stale::kInPlace && kMask != MaskKind::kNone;
      const int tid = kFresh ? fresh_thread_idx() - Traits::kWarpGroupThreads : consumer_tid;
      Tensor tScS = mma_qk.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      return make_tensor(tScS.data(), gmma_accum_rowcol(tScS.layout()));
    };

    auto issue_s = [&] {
      pipeline_k.consumer_wait(k_read);
      Tensor tSrK_n = tSrK(_, _, _, k_read.index());
      warpgroup_gemm_issue<true, false>(mma_qk, tSrQ, tSrK_n, tSrS);
    };
    auto issue_pv = [&](bool first) {  // the tile's first PV GEMM overwrites O
      pipeline_v.consumer_wait(v_read);
      Tensor tOrVt_n = tOrVt(_, _, _, v_read.index());
      warpgroup_gemm_issue<false, true>(mma_pv, tOrP, tOrVt_n, tOrO, kDeferEpilogue && first);
    };
    auto s_done = [&] {  // after the S GEMM's wait
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(k_read);
      ++k_read;
    };
    auto pv_done = [&] {  // after the PV GEMM's wait
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      pipeline_v.consumer_release(v_read);
      ++v_read;
    };
    // Scores of key tile n -> P (in tSrS, fp32) and the sums; whether O must then be rescaled by
    // factor. Edge tiles mask element by element, steady ones skip it. Dropout zeroes P's dropped
    // elements after the sums took them (../common/dropout.cuh, the sm80 kernels' keep-mask:
    // Philox of (batch x heads_q + head, row, key / 4)).
    float factor[kRows];
    FA_TRACE(const bool tracing = traced && consumer_tid % Traits::kWarpGroupThreads == 0;
             if (tracing) trace::clear(consumer_wg);)
    // Stale-max steps (kStale, after the first): P against the current max, with no row max
    // unless the sums say it must move. kPairs: P goes straight to p16; where the max stood
    // (rescale false) p16 holds this tile's P either way (the fallback's P in scores is the same,
    // against the same max), so it becomes tOrP as it is. kInPlace (steady tiles only): the step
    // returns true when the max must move (the caller computes S again and redoes it as kNo).
    // (P's pairs, in tOrP's register order)
    [[maybe_unused]] uint32_t p16[kStale == Stale::kPairs ? decltype(size(tOrP))::value / 2 : 1];
    // One key tile's softmax, edge (masked element by element) or steady, as stale says.
    auto softmax_tile = [&](int n, auto edge, auto stale) __attribute__((always_inline)) {
      if constexpr (kSparse) {
        score_tile<kBlockN, true>(scores, score_coords(), variant, edge_mask(params, storage, load), t.m0,
                                  int64_t{key_tile(n)} * kBlockN, decltype(edge)::value, block_bits(n),
                                  Walks::words_per_row(Walks::of(storage, load)));
      } else {
        score_tile<kBlockN>(scores, score_coords(), variant, edge_mask(params, storage, load), t.m0,
                            int64_t{n} * kBlockN, decltype(edge)::value);
      }
      FA_STAMP(own.end - 1 - n, kScored);
      [[maybe_unused]] auto settled = [&] { FA_STAMP(own.end - 1 - n, kMaxMoved); };
      if constexpr (decltype(stale)::value == Stale::kPairs) {
        return softmax.template update_stale<Element>(scores, softmax_scale, factor, p16, settled);
      } else if constexpr (decltype(stale)::value == Stale::kInPlace) {
        const bool stood = softmax.update_stale_in_place(scores, softmax_scale, [](bool p) { return consumer_any(p); });
        settled();
        return !stood;
      } else {
        return softmax.update_deferred(scores, softmax_scale, factor, settled);
      }
    };
    // (A block mask's visit needs the element mask where its tile needs the bits.)
    const auto edge_tile = [&](int n) {
      if constexpr (kSparse) {
        const int tile = key_tile(n);
        return tile >= steady_end || tile < steady_begin || block_bits(n) != nullptr;
      } else {
        return n >= steady_end || n < steady_begin;
      }
    };
    // The step's softmax (two inlined copies behind a uniform branch, as in sm80), then dropout.
    auto softmax_step = [&](int n, auto stale) __attribute__((always_inline)) {
      const bool result =
          edge_tile(n) ? softmax_tile(n, cute::true_type{}, stale) : softmax_tile(n, cute::false_type{}, stale);
      if constexpr (kMask == MaskKind::kMaskedDropout) {
        // (batch x heads_q + head, from the tile's slot)
        const TileSlot d = read_slot(storage, load, params);
        const auto bh =
            static_cast<uint64_t>(d.bidb) * static_cast<uint64_t>(params.shape.heads_q) + static_cast<uint64_t>(d.bidh);
        dropout_tile<kDropoutInFlight>(scores, score_coords(), params.dropout, bh, t.m0, int64_t{n} * kBlockN);
      }
      return result;
    };
    using NoStale = std::integral_constant<Stale, Stale::kNo>;
    // The step of the key loop's tiles that do not take the in-place step (handled apart there).
    using LoopStale = std::integral_constant<Stale, kStale == Stale::kPairs ? Stale::kPairs : Stale::kNo>;

    // A key tile none of this consumer's rows sees: an empty pingpong turn (every consumer takes
    // the same turns, one per key tile and one for the last PV GEMM), then its K / V stages are
    // released once loaded (a release before the load could count towards the stage's previous
    // round).
    auto skip_step = [&] {
      turn_begin(consumer_wg);
      turn_end(consumer_wg);
      pipeline_k.consumer_wait(k_read);
      pipeline_k.consumer_release(k_read);
      ++k_read;
      pipeline_v.consumer_wait(v_read);
      pipeline_v.consumer_release(v_read);
      ++v_read;
    };

    // Key tiles last to first: those above this consumer's rows skipped, then its own. Intra-
    // warpgroup overlap: the S GEMM of tile n is issued together with the PV GEMM of tile n + 1,
    // and the softmax of tile n runs while that PV GEMM does.
    if (t.n.end > t.n.begin) {
      if constexpr (kSkipTiles) {
        for (int n = t.n.end - 1; n >= own.end; --n) skip_step();
      }
      if (own.end > own.begin) {
        FA_STAMP(0, kTurnWait);
        turn_begin(consumer_wg);
        FA_STAMP(0, kTurnBegin);
        issue_s();
        turn_end(consumer_wg);
        FA_STAMP(0, kIssued);
        store_pending();  // under the S GEMM
        cute::warpgroup_wait<0>();
        s_done();
        FA_STAMP(0, kSDone);
        softmax_step(own.end - 1, NoStale{});  // O is still 0: no rescale
        FA_STAMP(0, kSoftmax);
        convert_fragment_into(tSrS, tOrP);
        FA_STAMP(0, kStepEnd);
        for (int n = own.end - 2; n >= own.begin; --n) {
          FA_TRACE(const int step = own.end - 1 - n;)
          FA_STAMP(step, kTurnWait);
          turn_begin(consumer_wg);
          FA_STAMP(step, kTurnBegin);
          issue_s();
          issue_pv(n == own.end - 2);
          turn_end(consumer_wg);
          FA_STAMP(step, kIssued);
          cute::warpgroup_wait<1>();  // S; the PV GEMM may still run
          bool rescale;
          if (kStale == Stale::kInPlace && !edge_tile(n)) {  // (edge tiles take the old step)
            warpgroup_fence_operand(tSrS);
            FA_STAMP(step, kSDone);
            rescale = false;
            if (softmax_tile(n, cute::false_type{}, std::integral_constant<Stale, Stale::kInPlace>{})) {
              // The max must move (rare; the whole consumer): S again from its K stage, still
              // held, then the step as update_deferred takes it (the zero-init GEMM overwrites P).
              warpgroup_gemm_issue<true, false>(mma_qk, tSrQ, tSrK(_, _, _, k_read.index()), tSrS);
              cute::warpgroup_wait<0>();
              warpgroup_fence_operand(tSrS);
              rescale = softmax_tile(n, cute::false_type{}, NoStale{});
            }
            s_done();
          } else {
            s_done();
            FA_STAMP(step, kSDone);
            rescale = softmax_step(n, LoopStale{});
          }
          FA_STAMP(step, kSoftmax);
          cute::warpgroup_wait<0>();
          pv_done();
          FA_STAMP(step, kPvDone);
          if (rescale) {
            CUTE_UNROLL
            for (int r = 0; r < kRows; ++r) {
              CUTE_UNROLL
              for (int c = 0; c < size<1>(tOrO_rc); ++c) tOrO_rc(r, c) *= factor[r];
            }
          }
          if (kStale == Stale::kPairs && !rescale) {
            // (Fenced on both sides: without, ptxas gave p16 tOrP's registers, written during the
            // softmax while the PV GEMM still read them, and serialized the WGMMAs: C7513.)
            Tensor p16_view = make_tensor(make_rmem_ptr(p16), make_layout(Int<size(tOrP) / 2>{}));
            warpgroup_fence_operand(p16_view);
            Tensor tOrP_pairs = recast<uint32_t>(tOrP);
            CUTE_UNROLL
            for (int i = 0; i < size(p16_view); ++i) tOrP_pairs(i) = p16[i];
            warpgroup_fence_operand(tOrP);
          } else {
            convert_fragment_into(tSrS, tOrP);
          }
          FA_STAMP(step, kStepEnd);
        }
        FA_TRACE(const int last = own.end - own.begin;)
        FA_STAMP(last, kTurnWait);
        turn_begin(consumer_wg);
        FA_STAMP(last, kTurnBegin);
        issue_pv(own.end - own.begin == 1);
        turn_end(consumer_wg);
        FA_STAMP(last, kIssued);
        cute::warpgroup_wait<0>();
        pv_done();
        FA_STAMP(last, kPvDone);
      } else {
        turn_begin(consumer_wg);  // the last PV GEMM's turn
        turn_end(consumer_wg);
      }
      if constexpr (kSkipTiles) {
        // Those below its rows (a window's left edge), from the tile read again from its slot: held
        // through the main loop, its first key tile is one more live register.
        const Tile again = tile_at(params, storage, load);
        const int own_begin = own_key_tiles(again, own_rows(again, consumer_index())).begin;
        for (int n = own_begin - 1; n >= again.n.begin; --n) skip_step();
      }
    }
    // With O in its own buffer, Q's is free once the GEMMs are done; with O in Q's buffer, once
    // the epilogue's O store has read it (the epilogue releases it).
    if constexpr (Traits::kSeparateO) release_q(storage, buffer);
    // Lists that broke a rule: the tile's rows are NaN, O and LSE (normalise keeps a NaN max).
    if constexpr (kSparse) {
      if (Walks::visits(Walks::of(storage, load)) < 0) {
        Walks::template record_fault<ConsumerMeet>(params, storage, tile_at(params, storage, load));
        fill(tOrO, NAN);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          softmax.max[r] = NAN;
          softmax.sum[r] = 1.0f;
        }
      }
    }

    // The tile read again from its slot (still there after release_q: kTileSlots) rather than held
    // in registers through the main loop, where d256's O takes 128 of each thread's 240.
    if constexpr (!kDeferEpilogue) {
      Tile done = tile_at(params, storage, load);
      if constexpr (kSparse) done.lists_bad = Walks::visits(Walks::of(storage, load)) < 0;
      epilogue(kp, storage, sO, mma_pv, tOrO, softmax, done, buffer, [&]([[maybe_unused]] trace::Event e) {
        FA_TRACE(trace::stamp(tracing, consumer_wg, own.end - own.begin, e));
      });
    }
    FA_STAMP(own.end - own.begin, kStepEnd);  // the last (PV-only) step's end: after the epilogue
  }

  // Varlen: the last key tile's rows past seqlen_k come from the next sequence (or past seqused_k,
  // from rows the caller never wrote) and may hold NaN or Inf, and P = 0 there does not cancel
  // them in the PV GEMM (0 x NaN = NaN). So before the tile's first GEMM the consumers wait for
  // that V stage (the first PV GEMM's) and zero those rows, then sync: the pingpong turns have not
  // begun, so every consumer reaches the barrier. (Dense tiles get zeros from TMA's bounds.)
  static __device__ __forceinline__ void zero_v_tail(SharedStorage& storage, PipelineKV& pipeline_v,
                                                     const PipelineState& v_read, const Tile& t) {
    using namespace cute;
    const int64_t tail = int64_t{t.n.end} * kBlockN - t.mask.seqlen_k;  // rows past seqlen_k in the last tile
    if (t.n.end <= t.n.begin || tail <= 0) return;                      // the same on every consumer
    pipeline_v.consumer_wait(v_read);
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});  // (N, D, stages)
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a row (contiguous under the swizzle)
    const int first = kBlockN - static_cast<int>(tail);
    // The thread index read afresh, and no unrolling: reusing values derived from it earlier (live
    // for the epilogue) spilled at d256.
#pragma unroll 1
    for (int i = fresh_thread_idx() - Traits::kWarpGroupThreads; i < static_cast<int>(tail) * kChunks;
         i += Traits::kConsumerThreads) {
      *reinterpret_cast<uint4*>(&sV(first + i / kChunks, i % kChunks * 8, v_read.index())) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();  // the zeros before the WGMMAs' (async proxy) reads
    cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kEpilogueBarrier);
  }

  static __device__ __forceinline__ void run(const KernelParams<Traits>& kp) {
    extern __shared__ __align__(Traits::kSmemAlign) char smem_raw[];
    auto& storage = *reinterpret_cast<SharedStorage*>(smem_raw);
    const auto role = static_cast<WarpGroupRole>(cutlass::canonical_warp_group_idx());
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const bool is_producer = role == WarpGroupRole::kProducer;
    const bool is_producer_warp = is_producer && warp_in_group == 0;
    const bool is_producer_leader = is_producer_warp && cute::elect_one_sync();
    if constexpr (kVarlen) {  // one CTA per tile: past its sequence, nothing to do
      const Scheduler sched(kp.params);
      if (tile(kp.params, sched, sched.first()).rows_valid <= 0) return;
    }

    if (is_producer_leader) {
      cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_o.get_tma_descriptor());
      for (int b = 0; b < kQBuffers; ++b) {
        cutlass::arch::ClusterBarrier::init(&storage.q_full[b], 1);
        cutlass::arch::ClusterBarrier::init(&storage.q_empty[b], Traits::kConsumerThreads);
      }
    }
    // Warp 0 (the producer's) initialises the pipelines' mbarriers.
    typename PipelineKV::Params pipeline_params;
    pipeline_params.transaction_bytes = Traits::kTmaBytesKV;
    pipeline_params.role = is_producer ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
    pipeline_params.is_leader = is_producer_leader;
    pipeline_params.num_consumers = Traits::kConsumerThreads;
    PipelineKV pipeline_k(storage.pipeline_k, pipeline_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
    PipelineKV pipeline_v(storage.pipeline_v, pipeline_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
    __syncthreads();  // the barriers' initialisation is visible to every warpgroup

    // setmaxnreg acts only with each role in one branch of a single if / else. Each role derives
    // its tiles after it, so nothing but the pipelines is live across the producer's shrink.
    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (is_producer_warp) producer(kp, storage, pipeline_k, pipeline_v, is_producer_leader);
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
      consumer(kp, storage, pipeline_k, pipeline_v, static_cast<int>(threadIdx.x) - Traits::kWarpGroupThreads);
    }
  }
};

template <class Traits, MaskKind kMask, bool kVarlen>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    forward_kernel(const __grid_constant__ KernelParams<Traits> kp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  ForwardKernel<Traits, kMask, kVarlen>::run(kp);
#else
  (void)kp;  // WGMMA and setmaxnreg exist only in sm_90a code: other targets get an empty stub
#endif
}

}  // namespace flashattn::cuda::sm90

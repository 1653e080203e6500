// Index faults: how a kernel that checks index values itself (IndexCheck::kDevice) tells the host
// which value was out of range, without the call ever waiting for the device.
//
// A call that leaves its index values to the kernels returns as soon as its work is queued, so no
// error can be raised at that call. Instead the first kernel to meet a bad value records it in a
// per-device record (IndexFault) in mapped, page-locked host memory, and the library raises it as
// an Error naming the argument and the entry: at the next call that checks indices on the device,
// and from check_device_errors(), which waits for the device first. Until then the record is read
// by plain host loads (no CUDA call, no synchronisation), so the check costs nanoseconds and a
// call stays capturable in a CUDA graph.
//
// Plain data and one reporting function, shared by the host (index_faults.cpp) and the kernels.
#pragma once

#include <cstdint>

namespace flashattn::cuda {

// The index arguments a kernel checks (the values of IndexFault::argument; 0: no fault).
enum class IndexArgument : int32_t {
  kNone = 0,
  kCacheSeqlens = 1,   // cache_seqlens[batch]: leaves room for the new tokens in the cache
  kCacheLeftpad = 2,   // cache_leftpad[batch]: within [0, cache_seqlens[batch]]
  kCacheBatchIdx = 3,  // cache_batch_idx[batch]: an entry of the caches
  kBlockTable = 4,     // block_table[batch, column]: a block of the caches
  kRotaryRows = 5,     // cache_seqlens[batch] with the new tokens: positions the rotary tables hold
  kCuSeqlensQ = 6,     // cu_seqlens_q[batch]: see VarlenRule
  kCuSeqlensK = 7,     // cu_seqlens_k[batch]: see VarlenRule
  kSequsedK = 8,       // seqused_k[batch]: within [0, high], the sequence's keys
  // A block mask's lists at (batch, head = column, query block = row); rule 1: the full lists.
  kBlockCount = 9,       // kv_num_blocks (full_kv_num_blocks): within [0, high], the key blocks
  kBlockIndex = 10,      // kv_indices (full_kv_indices): an entry within [0, high], the key blocks
  kBlockTwice = 11,      // kv_indices / full_kv_indices: key block `value` listed twice
  kBlockBitsFirst = 12,  // bits_block: `value` + the partial blocks (low) past the high blocks of bits
};

// Which rule a cu_seqlens entry broke (IndexFault::rule), in the order the host checks them.
enum class VarlenRule : int32_t {
  kNegativeStart = 0,  // entry 0 < 0
  kNotMonotone = 1,    // entry batch < entry batch - 1 (= low)
  kLongerThanMax = 2,  // sequence batch's length `value` > max_seqlen (= high)
  kPastEnd = 3,        // last entry `value` > the tensor's rows (= high)
  kTooFewPages = 4,    // paged keys: `value` keys > the `low` pages of `high` rows a sequence has
};

// The call whose kernels found the fault (IndexFault::call), for the message.
enum class FaultingCall : int32_t { kKvCache = 0, kVarlenForward = 1, kVarlenBackward = 2, kBlockSparseForward = 3 };

// One out-of-range value: `argument`[batch(, column)] = value, where [low, high] was allowed.
struct IndexFault {
  int32_t argument = 0;  // an IndexArgument; written last, so the host reads it as "recorded"
  int64_t batch = 0;
  int64_t column = -1;  // block_table's column; -1 for the per-sequence arguments
  int64_t value = 0;
  int64_t low = 0, high = 0;
  int32_t rule = 0;  // a VarlenRule, for the cu_seqlens arguments
  int32_t call = 0;  // a FaultingCall
  int64_t row = -1;  // a block mask's query block
};

// Where a kernel records a fault: `claim` (device memory, 0 until a kernel claims the record)
// makes one kernel thread the writer of `record` (mapped host memory). Null claim: the call's
// indices were checked on the host, and no kernel records anything.
struct IndexFaultSink {
  unsigned int* claim = nullptr;
  IndexFault* record = nullptr;
};

// Records `fault` unless a fault is already recorded (the first one found is kept). Called on the
// cold path of a kernel that found a bad value, by one thread. Inlined: a call would make the
// kernel copy the arguments it passes by reference, its whole params among them, to a stack
// frame at every launch (672 bytes, measured), where the good path pays for it.
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
    void
    record_index_fault(const IndexFaultSink& sink, const IndexFault& fault) {
  if (sink.claim == nullptr) return;
#if defined(__CUDA_ARCH__)
  if (atomicCAS(sink.claim, 0u, 1u) != 0u) return;
  volatile IndexFault* r = sink.record;
  r->batch = fault.batch;
  r->column = fault.column;
  r->value = fault.value;
  r->low = fault.low;
  r->high = fault.high;
  r->rule = fault.rule;
  r->call = fault.call;
  r->row = fault.row;
  __threadfence_system();  // the fields reach host memory before the argument that publishes them
  r->argument = fault.argument;
#else  // the kernels' code run on CPU threads (tests): the same protocol with host atomics
  unsigned int expected = 0;
  if (!__atomic_compare_exchange_n(sink.claim, &expected, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  IndexFault* r = sink.record;
  r->batch = fault.batch;
  r->column = fault.column;
  r->value = fault.value;
  r->low = fault.low;
  r->high = fault.high;
  r->rule = fault.rule;
  r->call = fault.call;
  r->row = fault.row;
  __atomic_store_n(&r->argument, fault.argument, __ATOMIC_RELEASE);
#endif
}

}  // namespace flashattn::cuda

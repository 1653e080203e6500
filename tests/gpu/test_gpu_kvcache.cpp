// KV-cache attention on the GPU (the decode kernels, src/cuda/decode) against the CPU backend's
// forward_kvcache on the same inputs: caches after the append (cache positions no call may read
// hold NaN and must stay NaN; nothing but the new rows may change), out and lse. Page sizes 1,
// 16, 64, 256 and contiguous caches; split counts 1, 3, 17 and the heuristic; rotary in both
// layouts; cache_seqlens 0 and full; GQA 32 / 8; masks, softcap, ALiBi; a 2^22-token context; an
// out-of-range block_table entry an error before any write, and (IndexCheck::kDevice) bad indices
// met by the kernels and a decode step captured in a CUDA graph. Every output and the queried workspace are NaN-poisoned before the call.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "kvcache_case.hpp"

namespace {

using fa_gpu_test::cuda_ok;
using fa_gpu_test::DeviceBuffer;
using fa_test::HostTensor;
using fa_test::KvCase;
using fa_test::KvTensors;
using flashattn::DType;
using flashattn::TensorView;

bool have_gpu() { return flashattn::cuda_device_count() > 0; }

// A device copy of a host tensor (same shape and strides); absent stays absent.
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};

DeviceTensor to_device(const HostTensor& h) {
  DeviceTensor d;
  d.view = h.view();
  if (!d.view.present()) return d;
  const TensorView v = h.view();
  int64_t extent = 1;
  for (int i = 0; i < v.ndim; ++i) extent += (std::max<int64_t>(v.shape[i], 1) - 1) * v.strides[i];
  d.buffer = DeviceBuffer(static_cast<size_t>(extent) * flashattn::dtype_size(v.dtype));
  d.buffer.upload(h.data());
  d.view.data = d.buffer.get();
  d.view.device = {flashattn::DeviceType::kCUDA, 0};
  return d;
}

void to_host(const DeviceTensor& d, HostTensor& h) {
  if (d.view.present()) d.buffer.download(h.data());
}

// A case's tensors on the device, and the arguments that name them.
struct DeviceKv {
  DeviceTensor q, k_cache, v_cache, k_new, v_new, seqlens, leftpad, table, cos, sin, alibi, sink, out, lse;

  explicit DeviceKv(const KvTensors& t)
      : q(to_device(t.q)),
        k_cache(to_device(t.k_cache)),
        v_cache(to_device(t.v_cache)),
        k_new(to_device(t.k_new)),
        v_new(to_device(t.v_new)),
        seqlens(to_device(t.seqlens)),
        leftpad(to_device(t.leftpad)),
        table(to_device(t.table)),
        cos(to_device(t.cos)),
        sin(to_device(t.sin)),
        alibi(to_device(t.alibi)),
        sink(to_device(t.sink)),
        out(to_device(t.out)),
        lse(to_device(t.lse)) {}

  flashattn::KvCacheArgs args(const KvCase& c) const {
    flashattn::KvCacheArgs a;
    a.q = q.view;
    a.k_cache = k_cache.view;
    a.v_cache = v_cache.view;
    a.k_new = k_new.view;
    a.v_new = v_new.view;
    a.cache_seqlens = seqlens.view;
    if (c.leftpad) a.cache_leftpad = leftpad.view;
    a.block_table = table.view;
    a.rotary_cos = cos.view;
    a.rotary_sin = sin.view;
    a.rotary_interleaved = c.interleaved;
    a.num_splits = c.num_splits;
    a.out = out.view;
    a.lse = lse.view;
    return a;
  }
};

// Runs the case on the GPU into `gpu` (inputs uploaded from it, outputs and caches downloaded
// into it).
void run_on_gpu(const KvCase& c, KvTensors& gpu, flashattn::IndexCheck check = flashattn::IndexCheck::kHost) {
  DeviceKv d(gpu);
  flashattn::KvCacheArgs a = d.args(c);
  a.index_check = check;
  flashattn::AttentionOptions o = fa_test::kv_options(c, gpu);
  if (c.alibi) o.score.alibi_slopes = d.alibi.view;
  if (c.sink) o.score.learnable_sink = d.sink.view;
  const size_t bytes = flashattn::forward_kvcache_workspace_size(a, o);
  DeviceBuffer workspace(bytes);
  workspace.poison();
  d.out.buffer.poison();
  d.lse.buffer.poison();
  flashattn::forward_kvcache(a, o, {nullptr, workspace.get(), bytes});
  cuda_ok(cudaDeviceSynchronize(), "forward_kvcache");
  to_host(d.k_cache, gpu.k_cache);
  to_host(d.v_cache, gpu.v_cache);
  to_host(d.out, gpu.out);
  to_host(d.lse, gpu.lse);
}

void run_case(const KvCase& c) {
  SCOPED_TRACE(c.name());
  auto rng = fa_test::rng_for("gpu kvcache " + c.name());
  KvTensors cpu = fa_test::make_kv_tensors(c, rng);
  KvTensors gpu = cpu;
  flashattn::forward_kvcache(fa_test::kv_args(c, cpu), fa_test::kv_options(c, cpu));
  run_on_gpu(c, gpu);
  fa_test::expect_matches_cpu(c, gpu, cpu);
}

class GpuKvCache : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(GpuKvCache, PageSizesAndContiguous) {
  for (int64_t page : {0, 1, 16, 64, 256}) {
    KvCase c;
    c.batch = 3;
    c.page_size = page;
    c.capacity = 700;
    c.leftpad = page != 0;
    c.empty_sequence = true;
    c.full_sequence = true;
    c.rotary_dim = 64;
    c.num_splits = 0;
    run_case(c);
  }
}

// GQA (the tensor-core kernel) and MHA (the one-row kernel, whose 2-8 splits merge in a
// thread-block cluster on sm90 instead of the combine kernel).
TEST_F(GpuKvCache, SplitCountsAgree) {
  for (int64_t heads_kv : {8, 32}) {
    for (int64_t splits : {1, 3, 8, 17, 0}) {
      KvCase c;
      c.heads_q = 32;
      c.heads_kv = heads_kv;
      c.capacity = 3000;
      c.page_size = 64;
      c.num_splits = splits;
      run_case(c);
    }
  }
}

TEST_F(GpuKvCache, RotaryLayoutsDtypesHeadDims) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int64_t d : {64, 96, 128, 256}) {
      KvCase c;
      c.dtype = dtype;
      c.head_dim = d;
      c.rotary_dim = 32;
      c.interleaved = d % 128 != 0;
      c.num_splits = 0;
      run_case(c);
    }
  }
}

// KV groups of 4 and 2 query rows (the tensor-core kernel, its 16-row tile partly filled), with
// many CTAs.
TEST_F(GpuKvCache, PackedRowKernels) {
  for (int64_t heads_q : {32, 16}) {
    for (int64_t page : {0, 16}) {
      KvCase c;
      c.batch = 40;
      c.heads_q = heads_q;
      c.heads_kv = 8;
      c.capacity = 300;
      c.page_size = page;
      c.softcap = page != 0 ? 30.0f : 0.0f;
      c.num_splits = page != 0 ? 2 : 0;
      run_case(c);
    }
  }
}

TEST_F(GpuKvCache, ChunkedPrefillMasksAndMods) {
  KvCase c;
  c.seqlen_q = c.seqlen_new = 9;
  c.page_size = 16;
  c.window_left = 40;
  c.softcap = 30.0f;
  c.alibi = true;
  c.rotary_dim = 128;
  c.num_splits = 0;
  run_case(c);
  c.causal = false;
  c.window_left = -1;
  run_case(c);
}

// A NaN in one key's value (or key) row reaches exactly the rows that see that key, as the CPU
// computes it, element by element: the tensor-core kernel's tile holds rows the key is masked for
// (new tokens under the causal mask, a sliding window's left edge), contiguous and paged, one
// split or several (the heuristic's, and a cluster merge on sm90); the one-row kernel.
TEST_F(GpuKvCache, NanKeyReachesOnlyTheRowsThatSeeIt) {
  for (int64_t page : {0, 16}) {
    for (bool in_k : {false, true}) {
      for (int64_t splits : {1, 0}) {
        KvCase c;  // 9 new tokens, GQA 32 / 8: 36 rows of each KV group, three row blocks
        c.batch = 3;
        c.seqlen_q = c.seqlen_new = 9;
        c.heads_q = 32;
        c.heads_kv = 8;
        c.capacity = 700;
        c.page_size = page;
        c.leftpad = page != 0;
        c.full_sequence = true;
        c.has_nan_key = true;
        c.nan_in_k = in_k;
        c.nan_key = -4;  // seen by tokens 5-8
        c.num_splits = splits;
        run_case(c);
        c.window_left = 100;  // key -105 in the window of token 0 only
        c.nan_key = -105;
        c.softcap = 30.0f;
        run_case(c);
      }
    }
  }
  for (int64_t key : {-300, -20}) {  // the one-row kernel: a key outside the window, one inside
    KvCase c;
    c.heads_q = c.heads_kv = 32;
    c.capacity = 3000;
    c.window_left = 256;
    c.full_sequence = true;
    c.has_nan_key = true;
    c.nan_key = key;
    c.num_splits = 0;
    run_case(c);
  }
}

// A learnable sink (split 0 counts it): both kernels, the heuristic's split counts and a cluster
// merge, paged, a sequence with no key, the NaN rows' recompute.
TEST_F(GpuKvCache, LearnableSink) {
  for (int64_t heads_kv : {32, 8}) {
    for (int64_t splits : {1, 3, 0}) {
      KvCase c;
      c.batch = 3;
      c.heads_q = 32;
      c.heads_kv = heads_kv;
      c.capacity = 2000;
      c.page_size = splits == 3 ? 64 : 0;
      c.num_splits = splits;
      c.sink = true;
      c.alibi = splits == 0;
      run_case(c);
    }
  }
  KvCase empty;
  empty.sink = true;
  empty.empty_sequence = true;
  empty.seqlen_new = 0;
  empty.num_splits = 0;
  run_case(empty);
  KvCase nan;
  nan.batch = 3;
  nan.seqlen_q = nan.seqlen_new = 9;
  nan.heads_q = 32;
  nan.heads_kv = 8;
  nan.capacity = 700;
  nan.full_sequence = true;
  nan.has_nan_key = true;
  nan.nan_key = -4;
  nan.sink = true;
  for (int64_t splits : {1, 0}) {
    nan.num_splits = splits;
    run_case(nan);
  }
}

// Sink tokens past a window (the sink-token pass after the decode kernels): both kernels, the
// heuristic's split counts and a cluster merge, pages, leftpad, rotary, several query tokens, a
// learnable sink beside them, more sink keys than the window.
TEST_F(GpuKvCache, SinkTokens) {
  for (int64_t heads_kv : {32, 8}) {
    for (int64_t splits : {1, 3, 0}) {
      KvCase c;
      c.batch = 3;
      c.heads_q = 32;
      c.heads_kv = heads_kv;
      c.capacity = 2000;
      c.page_size = splits == 3 ? 64 : 0;
      c.num_splits = splits;
      c.window_left = 100;
      c.sink_tokens = 4;
      c.leftpad = splits == 1;
      c.rotary_dim = splits == 0 ? 64 : 0;
      c.seqlen_q = c.seqlen_new = heads_kv == 8 ? 4 : 1;
      c.sink = splits == 3;
      run_case(c);
    }
  }
  KvCase wide;
  wide.head_dim = 64;
  wide.window_left = 16;
  wide.sink_tokens = 200;
  wide.page_size = 16;
  wide.num_splits = 0;
  run_case(wide);
}

TEST_F(GpuKvCache, FourMillionTokenContext) {
  KvCase c;
  c.batch = 1;
  c.heads_q = 4;
  c.heads_kv = 1;
  c.capacity = int64_t{1} << 22;
  c.page_size = 256;
  c.full_sequence = true;
  c.num_splits = 0;
  run_case(c);
}

// An out-of-range block_table entry of a position in use: an Error naming it, raised before any
// kernel runs (the device cache is unchanged).
TEST_F(GpuKvCache, BadBlockTableIsAnErrorBeforeAnyWrite) {
  KvCase c;
  c.page_size = 16;
  c.full_sequence = true;
  auto rng = fa_test::rng_for("gpu kvcache bad table");
  KvTensors t = fa_test::make_kv_tensors(c, rng);
  t.table.set(t.table.numel() - 1, 1e6);  // the full sequence's last page
  DeviceKv d(t);
  try {
    flashattn::forward_kvcache(d.args(c), {});
    ADD_FAILURE() << "no error for block_table entry 1000000";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_table: entry [1, "), std::string::npos) << e.what();
  }
  HostTensor after = t.k_cache;
  to_host(d.k_cache, after);
  fa_test::expect_near("k_cache", after, t.k_cache, 0.0, "bad table");
}

// The split partials are read in 16-byte vectors: a workspace off that alignment is an Error
// naming it.
TEST_F(GpuKvCache, MisalignedWorkspaceIsAnError) {
  KvCase c;
  c.num_splits = 3;
  auto rng = fa_test::rng_for("gpu kvcache misaligned workspace");
  KvTensors t = fa_test::make_kv_tensors(c, rng);
  DeviceKv d(t);
  const flashattn::KvCacheArgs a = d.args(c);
  const flashattn::AttentionOptions o = fa_test::kv_options(c, t);
  const size_t bytes = flashattn::forward_kvcache_workspace_size(a, o);
  ASSERT_GT(bytes, 0u);
  DeviceBuffer workspace(bytes + 16);
  try {
    flashattn::forward_kvcache(a, o, {nullptr, static_cast<char*>(workspace.get()) + 4, bytes});
    ADD_FAILURE() << "no error for a workspace 4 bytes off";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace: must be 16-byte aligned"), std::string::npos) << e.what();
  }
}

// The error check_device_errors raises for the fault recorded on device 0 (empty: none).
std::string recorded_fault() {
  try {
    flashattn::check_device_errors(0);
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), flashattn::ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

// IndexCheck::kDevice: no host round trip; the kernels check the values they read. Sequence 0's
// corrupt index (past the capacity, past the blocks, negative) turns its rows NaN and leaves
// sequence 1 as the CPU computes it, with one split or several (the combine kernel); nothing
// outside the tensors is touched (compute-sanitizer runs this test too). The kernels record the
// bad entry, which check_device_errors raises once, naming it.
TEST_F(GpuKvCache, BadIndicesCheckedOnTheDevice) {
  struct Bad {
    const char* what;
    bool paged;
    int64_t splits;
    void (*corrupt)(KvTensors&);
    bool append_skipped;
    const char* error;
    bool mha = false;  // the one-row kernel (its splits merged in a cluster on sm90)
  };
  const Bad cases[] = {
      {"cache_seqlens past the capacity", false, 1, [](KvTensors& t) { t.seqlens.set(0, 1e6); }, true,
       "cache_seqlens: entry 0 is 1000000, outside [0, "},
      {"negative cache_seqlens", true, 3, [](KvTensors& t) { t.seqlens.set(0, -2); }, true,
       "cache_seqlens: entry 0 is -2, outside [0, "},
      {"block_table entry past the blocks", true, 1, [](KvTensors& t) { t.table.set(0, 1e6); }, false,
       "block_table: entry [0, 0] is 1000000, outside [0, "},
      {"negative block_table entry", true, 3, [](KvTensors& t) { t.table.set(0, -3); }, false,
       "block_table: entry [0, 0] is -3, outside [0, "},
      {"negative block_table entry, MHA", true, 3, [](KvTensors& t) { t.table.set(0, -3); }, false,
       "block_table: entry [0, 0] is -3, outside [0, ", true},
  };
  EXPECT_EQ(recorded_fault(), "");
  for (const Bad& x : cases) {
    KvCase c;
    c.page_size = x.paged ? 16 : 0;
    c.num_splits = x.splits;
    if (x.mha) c.heads_kv = c.heads_q;
    SCOPED_TRACE(std::string(x.what) + ": " + c.name());
    auto rng = fa_test::rng_for(std::string("gpu kvcache bad indices ") + x.what);
    KvTensors cpu = fa_test::make_kv_tensors(c, rng);
    const KvTensors before = cpu;
    KvTensors gpu = cpu;
    flashattn::forward_kvcache(fa_test::kv_args(c, cpu), fa_test::kv_options(c, cpu));
    x.corrupt(gpu);
    run_on_gpu(c, gpu, flashattn::IndexCheck::kDevice);
    fa_test::expect_only_sequence_zero_bad(c, gpu, cpu, before, x.append_skipped);
    const std::string error = recorded_fault();
    EXPECT_NE(error.find(x.error), std::string::npos) << error;
    EXPECT_EQ(recorded_fault(), "");  // raised once
  }
}

// A fault recorded by one kDevice-checked call is raised by the device's next kDevice-checked
// call, before that
// call writes anything (its outputs keep their poison); the call after that runs.
TEST_F(GpuKvCache, RecordedFaultRaisedByTheNextDeviceCheckedCall) {
  KvCase c;
  c.page_size = 16;
  auto rng = fa_test::rng_for("gpu kvcache fault raised by the next call");
  KvTensors good = fa_test::make_kv_tensors(c, rng);
  KvTensors bad = good;
  bad.table.set(0, -5);
  run_on_gpu(c, bad, flashattn::IndexCheck::kDevice);
  DeviceKv d(good);
  flashattn::KvCacheArgs a = d.args(c);
  a.index_check = flashattn::IndexCheck::kDevice;
  const flashattn::AttentionOptions o = fa_test::kv_options(c, good);
  const size_t bytes = flashattn::forward_kvcache_workspace_size(a, o);
  DeviceBuffer workspace(bytes);
  d.out.buffer.poison();
  try {
    flashattn::forward_kvcache(a, o, {nullptr, workspace.get(), bytes});
    ADD_FAILURE() << "the recorded fault was not raised";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_table: entry [0, 0] is -5, outside [0, "), std::string::npos)
        << e.what();
  }
  KvTensors untouched = good;
  to_host(d.out, untouched.out);
  for (int64_t i = 0; i < untouched.out.numel(); ++i) ASSERT_TRUE(std::isnan(untouched.out.get(i))) << i;
  flashattn::forward_kvcache(a, o, {nullptr, workspace.get(), bytes});  // the record was cleared
  cuda_ok(cudaDeviceSynchronize(), "forward_kvcache");
  EXPECT_EQ(recorded_fault(), "");
}

// IndexCheck::kDevice makes a decode step capturable in a CUDA graph (global capture mode, as
// PyTorch's): the call neither waits on the stream nor copies to the host. The captured step,
// replayed twice (the append writes the same row again), gives the CPU's caches, out and lse.
TEST_F(GpuKvCache, DeviceIndexCheckCapturesInACudaGraph) {
  KvCase c;
  c.page_size = 16;
  c.rotary_dim = 32;
  c.num_splits = 3;
  auto rng = fa_test::rng_for("gpu kvcache cuda graph");
  KvTensors cpu = fa_test::make_kv_tensors(c, rng);
  KvTensors gpu = cpu;
  flashattn::forward_kvcache(fa_test::kv_args(c, cpu), fa_test::kv_options(c, cpu));

  DeviceKv d(gpu);
  flashattn::KvCacheArgs a = d.args(c);
  a.index_check = flashattn::IndexCheck::kDevice;
  const flashattn::AttentionOptions o = fa_test::kv_options(c, gpu);
  const size_t bytes = flashattn::forward_kvcache_workspace_size(a, o);
  DeviceBuffer workspace(bytes);
  d.out.buffer.poison();
  d.lse.buffer.poison();
  fa_gpu_test::DeviceStream stream(true);
  cudaGraph_t graph = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  try {
    flashattn::forward_kvcache(a, o, {stream.get(), workspace.get(), bytes});
  } catch (...) {
    cudaStreamEndCapture(stream.get(), &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  cuda_ok(cudaStreamEndCapture(stream.get(), &graph), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  cuda_ok(instantiated, "cudaGraphInstantiate");
  for (int replay = 0; replay < 2; ++replay) cuda_ok(cudaGraphLaunch(exec, stream.get()), "cudaGraphLaunch");
  const cudaError_t done = cudaStreamSynchronize(stream.get());
  cudaGraphExecDestroy(exec);
  cuda_ok(done, "graph replay");
  to_host(d.k_cache, gpu.k_cache);
  to_host(d.v_cache, gpu.v_cache);
  to_host(d.out, gpu.out);
  to_host(d.lse, gpu.lse);
  fa_test::expect_matches_cpu(c, gpu, cpu);
}

// For compute-sanitizer (scripts/gpu_check.sh, gpu_decode.sh): small paged cases with splits
// and append, GQA and MHA, then with more CTAs than SMs.
TEST_F(GpuKvCache, SanitizerSmall) {
  KvCase c;
  c.capacity = 100;
  c.page_size = 16;
  c.leftpad = true;
  c.rotary_dim = 32;
  c.interleaved = false;
  c.num_splits = 3;
  run_case(c);
  c.heads_kv = c.heads_q;  // the one-row kernel, its splits merged in a cluster on sm90
  run_case(c);
  c.heads_kv = 2;
  c.batch = 40;
  c.heads_q = 32;
  c.heads_kv = 8;
  run_case(c);
  c.sink = true;  // split 0 joins the sink in its warp merge
  run_case(c);
}

}  // namespace

// Varlen lengths checked on the device (IndexCheck::kDevice): a bad cu_seqlens / seqused_k /
// max_seqlen gives NaN in every output, nothing else, and the host check's error -- raised by
// check_device_errors() or, before it writes anything, by the next device-checked call; the
// call never waits for the stream, so a CUDA graph captures it. (That valid lengths give the
// host-checked results bitwise is part of every varlen case of test_gpu_forward /
// test_gpu_backward, which run each case both ways.)
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "flashattn/flashattn.hpp"

namespace {

using fa_gpu_test::cuda_ok;
using fa_gpu_test::DeviceBuffer;
using flashattn::DType;
using flashattn::IndexCheck;
using flashattn::TensorView;

bool have_gpu() { return flashattn::cuda_compiled() && flashattn::cuda_device_count() > 0; }

constexpr int64_t kHeads = 2, kHeadDim = 64;

// One fp16 varlen problem in device memory: lengths q {5, 0, 7}, k {9, 4, 6}, two rows of q and
// one of k outside every sequence.
struct Varlen {
  std::vector<int32_t> cu_q = {1, 6, 6, 13}, cu_k = {0, 9, 13, 19}, used = {9, 4, 6};
  int64_t total_q = 15, total_k = 20, max_q = 7, max_k = 9;
  DeviceBuffer q, k, v, out, lse, dout, dq, dk, dv, d_cu_q, d_cu_k, d_used;

  Varlen() {
    auto rows = [](int64_t n) { return static_cast<size_t>(n * kHeads * kHeadDim) * 2; };
    q = DeviceBuffer(rows(total_q));
    out = DeviceBuffer(rows(total_q));
    dout = DeviceBuffer(rows(total_q));
    dq = DeviceBuffer(rows(total_q));
    k = DeviceBuffer(rows(total_k));
    v = DeviceBuffer(rows(total_k));
    dk = DeviceBuffer(rows(total_k));
    dv = DeviceBuffer(rows(total_k));
    lse = DeviceBuffer(static_cast<size_t>(kHeads * total_q) * 4);
    d_cu_q = DeviceBuffer(cu_q.size() * 4);
    d_cu_k = DeviceBuffer(cu_k.size() * 4);
    d_used = DeviceBuffer(used.size() * 4);
    std::mt19937 rng(7);
    const uint16_t values[] = {0x3800, 0xB800, 0x3400, 0xB400, 0x3C00, 0x0000};  // +-0.5, +-0.25, 1, 0
    for (DeviceBuffer* b : {&q, &k, &v, &dout}) {
      std::vector<uint16_t> host(b->bytes() / 2);
      for (uint16_t& x : host) x = values[rng() % 6];
      b->upload(host.data());
    }
    upload_lengths();
  }
  void upload_lengths() {
    d_cu_q.upload(cu_q.data());
    d_cu_k.upload(cu_k.data());
    d_used.upload(used.data());
  }
  TensorView rows(const DeviceBuffer& b, int64_t n) const {
    return TensorView::contiguous(b.get(), DType::kFloat16, {n, kHeads, kHeadDim}, {flashattn::DeviceType::kCUDA, 0});
  }
  TensorView ints(const DeviceBuffer& b, int64_t n) const {
    return TensorView::contiguous(b.get(), DType::kInt32, {n}, {flashattn::DeviceType::kCUDA, 0});
  }
  flashattn::ForwardArgs forward_args() const {
    return {rows(q, total_q), rows(k, total_k), rows(v, total_k), rows(out, total_q),
            TensorView::contiguous(lse.get(), DType::kFloat32, {kHeads, total_q}, {flashattn::DeviceType::kCUDA, 0})};
  }
  flashattn::BackwardArgs backward_args() const {
    const flashattn::ForwardArgs f = forward_args();
    return {rows(dout, total_q), f.q, f.k, f.v, f.out, f.lse, rows(dq, total_q), rows(dk, total_k), rows(dv, total_k)};
  }
  flashattn::VarlenArgs varlen(IndexCheck check) const {
    flashattn::VarlenArgs vl;
    vl.cu_seqlens_q = ints(d_cu_q, 4);
    vl.cu_seqlens_k = ints(d_cu_k, 4);
    vl.seqused_k = ints(d_used, 3);
    vl.max_seqlen_q = max_q;
    vl.max_seqlen_k = max_k;
    vl.index_check = check;
    return vl;
  }
};

// Causal, and a deterministic backward (dQ summed in a fixed order: results comparable bitwise).
flashattn::AttentionOptions causal() {
  flashattn::AttentionOptions o;
  o.mask.causal = true;
  o.deterministic = true;
  return o;
}

void forward(const Varlen& x, IndexCheck check, cudaStream_t stream = nullptr) {
  const flashattn::VarlenArgs vl = x.varlen(check);
  const size_t bytes = flashattn::forward_varlen_workspace_size(x.forward_args(), vl, causal());
  static DeviceBuffer workspace;
  if (workspace.bytes() < bytes) workspace = DeviceBuffer(bytes);
  flashattn::forward_varlen(x.forward_args(), vl, causal(), {stream, workspace.get(), workspace.bytes()});
}

void backward(const Varlen& x, IndexCheck check, cudaStream_t stream = nullptr) {
  const flashattn::VarlenArgs vl = x.varlen(check);
  const size_t bytes = flashattn::backward_varlen_workspace_size(x.backward_args(), vl, causal());
  static DeviceBuffer workspace;
  if (workspace.bytes() < bytes) workspace = DeviceBuffer(bytes);
  flashattn::backward_varlen(x.backward_args(), vl, causal(), {stream, workspace.get(), workspace.bytes()});
}

// The error check_device_errors() raises, or "" (it clears what it raises).
std::string recorded_fault() {
  try {
    flashattn::check_device_errors(0);
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), flashattn::ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

std::vector<uint16_t> halves(const DeviceBuffer& b) {
  std::vector<uint16_t> h(b.bytes() / 2);
  b.download(h.data());
  return h;
}

bool all_nan_half(const DeviceBuffer& b) {
  for (uint16_t x : halves(b)) {
    if ((x & 0x7C00) != 0x7C00 || (x & 0x03FF) == 0) return false;
  }
  return true;
}

bool all_nan_float(const DeviceBuffer& b) {
  std::vector<float> h(b.bytes() / 4);
  b.download(h.data());
  for (float x : h) {
    if (!std::isnan(x)) return false;
  }
  return true;
}

struct Corruption {
  const char* what;
  std::function<void(Varlen&)> apply;
  const char* error;  // what the host check says, and so the device's message must start with
};

const std::vector<Corruption>& corruptions() {
  static const std::vector<Corruption> c = {
      {"cu_seqlens_q going backwards", [](Varlen& x) { x.cu_q[2] = 3; },
       "cu_seqlens_q: not monotone at entry 2 (3 < 6)"},
      {"cu_seqlens_k past the tensor", [](Varlen& x) { x.cu_k[3] = 21; },
       "cu_seqlens_k: last entry 21 is past the end of the tensor (20 tokens)"},
      {"a sequence longer than max_seqlen_q", [](Varlen& x) { x.max_q = 6; },
       "max_seqlen_q: 6 < length 7 of sequence 2"},
      {"seqused_k past its sequence", [](Varlen& x) { x.used[1] = 5; }, "seqused_k: entry 1 is 5, outside [0, 4]"},
      {"negative first entry", [](Varlen& x) { x.cu_q[0] = -4; }, "cu_seqlens_q: entry 0 is -4 < 0"},
  };
  return c;
}

class GpuVarlenChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    recorded_fault();  // nothing left over from another suite
  }
};

TEST_F(GpuVarlenChecks, BadLengthsGiveNanOutputsAndTheHostsError) {
  for (const Corruption& c : corruptions()) {
    SCOPED_TRACE(c.what);
    Varlen x;
    c.apply(x);
    x.upload_lengths();
    // The host check: an error at the call, nothing written.
    x.out.fill(0x11);
    try {
      forward(x, IndexCheck::kHost);
      ADD_FAILURE() << "the host check passed";
    } catch (const flashattn::Error& e) {
      EXPECT_EQ(std::string(e.what()), c.error);
    }
    for (uint16_t h : halves(x.out)) ASSERT_EQ(h, 0x1111);
    // The device check: the call returns; every output NaN; the same error, raised once.
    forward(x, IndexCheck::kDevice);
    cuda_ok(cudaDeviceSynchronize(), "forward");
    EXPECT_TRUE(all_nan_half(x.out));
    EXPECT_TRUE(all_nan_float(x.lse));
    const std::string forward_error = recorded_fault();
    EXPECT_EQ(forward_error.rfind(c.error, 0), 0u) << forward_error;
    EXPECT_NE(forward_error.find("varlen forward call"), std::string::npos) << forward_error;
    EXPECT_EQ(recorded_fault(), "");
    backward(x, IndexCheck::kDevice);
    cuda_ok(cudaDeviceSynchronize(), "backward");
    EXPECT_TRUE(all_nan_half(x.dq));
    EXPECT_TRUE(all_nan_half(x.dk));
    EXPECT_TRUE(all_nan_half(x.dv));
    const std::string backward_error = recorded_fault();
    EXPECT_EQ(backward_error.rfind(c.error, 0), 0u) << backward_error;
    EXPECT_NE(backward_error.find("varlen backward call"), std::string::npos) << backward_error;
  }
}

// Valid lengths: the device check gives the host check's results bitwise.
TEST_F(GpuVarlenChecks, ValidLengthsSameBitsEitherWay) {
  Varlen x;
  forward(x, IndexCheck::kHost);
  backward(x, IndexCheck::kHost);
  cuda_ok(cudaDeviceSynchronize(), "host-checked");
  const auto out = halves(x.out), dq = halves(x.dq), dk = halves(x.dk), dv = halves(x.dv);
  for (DeviceBuffer* b : {&x.out, &x.dq, &x.dk, &x.dv}) b->poison();
  forward(x, IndexCheck::kDevice);
  backward(x, IndexCheck::kDevice);
  cuda_ok(cudaDeviceSynchronize(), "device-checked");
  EXPECT_EQ(halves(x.out), out);
  EXPECT_EQ(halves(x.dq), dq);
  EXPECT_EQ(halves(x.dk), dk);
  EXPECT_EQ(halves(x.dv), dv);
  EXPECT_EQ(recorded_fault(), "");
}

// The next device-checked call raises the recorded fault before it writes anything; the call
// after it runs.
TEST_F(GpuVarlenChecks, RecordedFaultRaisedByTheNextDeviceCheckedCall) {
  Varlen bad;
  bad.cu_k[1] = 30;
  bad.upload_lengths();
  forward(bad, IndexCheck::kDevice);
  cuda_ok(cudaDeviceSynchronize(), "forward");
  Varlen good;
  good.out.fill(0x11);
  try {
    forward(good, IndexCheck::kDevice);
    ADD_FAILURE() << "the recorded fault was not raised";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("max_seqlen_k: 9 < length 30 of sequence 0", 0), 0u) << e.what();
  }
  cuda_ok(cudaDeviceSynchronize(), "raised");
  for (uint16_t h : halves(good.out)) ASSERT_EQ(h, 0x1111);
  forward(good, IndexCheck::kDevice);
  cuda_ok(cudaDeviceSynchronize(), "forward");
  EXPECT_FALSE(all_nan_half(good.out));
  EXPECT_EQ(recorded_fault(), "");
}

// No host round trip: a forward and backward captured in a CUDA graph (global mode) replay to
// the eager results.
TEST_F(GpuVarlenChecks, DeviceCheckedCallsCaptureInACudaGraph) {
  Varlen x;
  fa_gpu_test::DeviceStream stream(true);
  forward(x, IndexCheck::kDevice, stream.get());  // workspaces allocated outside the capture
  backward(x, IndexCheck::kDevice, stream.get());
  cuda_ok(cudaStreamSynchronize(stream.get()), "eager");
  const auto out = halves(x.out), dq = halves(x.dq);
  for (DeviceBuffer* b : {&x.out, &x.dq}) b->poison();
  cudaGraph_t graph = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "begin capture");
  forward(x, IndexCheck::kDevice, stream.get());
  backward(x, IndexCheck::kDevice, stream.get());
  cuda_ok(cudaStreamEndCapture(stream.get(), &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cuda_ok(cudaGraphLaunch(exec, stream.get()), "launch");
  cuda_ok(cudaStreamSynchronize(stream.get()), "replay");
  EXPECT_EQ(halves(x.out), out);
  EXPECT_EQ(halves(x.dq), dq);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace

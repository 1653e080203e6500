// `flashattn run`: validate, allocate and fill one dense attention problem, time the chosen
// implementation (median of --repeats) on the CPU or on CUDA device 0, measure each call's extra
// memory, check one slice against the fp64 reference by the tolerance rule, and report.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "device.hpp"
#include "device_memory.hpp"
#include "memory.hpp"
#include "progress.hpp"
#include "reference_check.hpp"
#include "report.hpp"
#include "tensors.hpp"

namespace flashattn_cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Query/key pairs the mask leaves visible (bottom-right aligned: row i sees j in
// [i + sk - sq - window_left, i + sk - sq + window_right], -1 = unbounded; causal = right 0).
double visible_pairs(const Dims& d, const flashattn::MaskOptions& m) {
  const int64_t right = m.causal ? 0 : m.window_right;
  double pairs = 0.0;
  for (int64_t i = 0; i < d.seqlen_q; ++i) {
    const int64_t diag = i + d.seqlen_k - d.seqlen_q;
    const int64_t lo = m.window_left < 0 ? 0 : std::max<int64_t>(0, diag - m.window_left);
    const int64_t hi = right < 0 ? d.seqlen_k - 1 : std::min(d.seqlen_k - 1, diag + right);
    if (hi >= lo) pairs += static_cast<double>(hi - lo + 1);
  }
  return pairs;
}

// Times `call` `repeats` times; each call's peak extra memory is measured, the max is kept.
PassResult time_pass(const std::string& phase, int repeats, Progress& progress, std::string& memory_note,
                     const std::function<void()>& call) {
  PassResult pass;
  PeakMemory memory;
  for (int i = 0; i < repeats; ++i) {
    progress.show(phase, i + 1, repeats);
    const bool measured = memory.start();
    if (!measured) memory_note = memory.why();
    const Clock::time_point t0 = Clock::now();
    call();
    pass.seconds.push_back(seconds_since(t0));
    if (measured) pass.peak_extra_bytes = std::max(pass.peak_extra_bytes, memory.extra_bytes());
  }
  return pass;
}

// CUDA: one untimed warm-up call (module loading, first touch of the tensors), then `repeats`
// calls timed with CUDA events, each waited for.
PassResult time_cuda_pass(const std::string& phase, int repeats, Progress& progress, CudaTimer& timer,
                          const std::function<void()>& call) {
  progress.show(phase + ": warm-up");
  timer.time(call);
  PassResult pass;
  for (int i = 0; i < repeats; ++i) {
    progress.show(phase, i + 1, repeats);
    pass.seconds.push_back(timer.time(call));
  }
  return pass;
}

// The CPU: each call timed with the steady clock and its peak extra host memory measured.
void run_on_cpu(const RunOptions& o, const flashattn::AttentionOptions& options, const Tensors& t, Progress& progress,
                RunResult& r) {
  // Start the OpenMP pool now: its threads' stacks belong to the process, not to the call.
#pragma omp parallel
  {
    volatile int touch = omp_get_thread_num();
    (void)touch;
  }
  const bool flash = o.impl == Impl::kFlash;
  const std::string impl = flash ? "flash" : "reference";
  const flashattn::ForwardArgs fa = forward_args(t);
  r.forward = time_pass("forward (" + impl + ")", o.repeats, progress, r.memory_note,
                        [&] { flash ? flashattn::forward(fa, options) : flashattn::reference_forward(fa, options); });
  if (o.backward) {
    const flashattn::BackwardArgs ba = backward_args(t);
    r.backward = time_pass("backward (" + impl + ")", o.repeats, progress, r.memory_note, [&] {
      flash ? flashattn::backward(ba, options) : flashattn::reference_backward(ba, options);
    });
  }
}

// The flash implementation on CUDA device 0. The inputs generated on the host are copied to
// device memory, the outputs poisoned before the first call (NaN wherever no call writes) and
// copied back after the last, so the reference check reads what the GPU wrote. A call's extra
// memory is the workspace it asks for: the library allocates no device memory itself.
void run_on_cuda(const RunOptions& o, flashattn::AttentionOptions options, const std::vector<float>& slopes, Tensors& t,
                 Progress& progress, RunResult& r) {
  r.device_name = cuda_device_name(r.device.device.index);
  progress.show("copying the inputs to " + r.device_name);
  const DeviceTensors d(t, o.backward);
  DeviceBuffer d_slopes(slopes.size() * sizeof(float), "alibi_slopes");
  if (o.alibi) {  // the slopes live with the tensors
    d_slopes.upload(slopes.data());
    options.score.alibi_slopes =
        make_view(d_slopes.data(), flashattn::DType::kFloat32, {o.dims.heads}, r.device.device);
  }
  CudaTimer timer;
  const flashattn::ForwardArgs fa = d.forward_args();
  const DeviceBuffer forward_ws(flashattn::forward_workspace_size(fa, options), "forward workspace");
  r.forward = time_cuda_pass("forward (flash, CUDA)", o.repeats, progress, timer, [&] {
    flashattn::forward(fa, options, {nullptr, forward_ws.data(), forward_ws.bytes()});
  });
  r.forward.peak_extra_bytes = static_cast<int64_t>(forward_ws.bytes());
  if (o.backward) {
    const flashattn::BackwardArgs ba = d.backward_args();
    const DeviceBuffer backward_ws(flashattn::backward_workspace_size(ba, options), "backward workspace");
    r.backward = time_cuda_pass("backward (flash, CUDA)", o.repeats, progress, timer, [&] {
      flashattn::backward(ba, options, {nullptr, backward_ws.data(), backward_ws.bytes()});
    });
    r.backward.peak_extra_bytes = static_cast<int64_t>(backward_ws.bytes());
  }
  progress.show("copying the outputs back");
  d.download_outputs(t);
}

// Host memory the run will hold at once: every tensor, plus the fp64 reference's S, P and
// dropout scale (24 bytes per score) for each head it runs concurrently when it is timed, plus
// the checked slice (the whole head, or its last --check-rows rows when a head has more than
// kMaxFullCheckPairs scores): its fp64 copies, the reference's and the naive attention's
// results for it, and the run's values it compares, about 12 fp64 rows per checked query row
// and per key. An estimate, to refuse a run up front instead of meeting the OOM killer.
double host_bytes_needed(const RunOptions& o, int threads) {
  const Dims& d = o.dims;
  const double b = static_cast<double>(d.batch), h = static_cast<double>(d.heads);
  const double sq = static_cast<double>(d.seqlen_q), sk = static_cast<double>(d.seqlen_k);
  const double hd = static_cast<double>(d.head_dim);
  const double elem = static_cast<double>(flashattn::dtype_size(d.dtype));
  const double out_elem = static_cast<double>(flashattn::dtype_size(d.out_dtype()));
  const double q = b * sq * h * hd * elem, kv = b * sk * static_cast<double>(d.heads_kv) * hd * elem;
  // q, k, v, out (wider than q with FP8 inputs), the LSE; the backward's dout, dq, dk, dv.
  const double tensors = (o.backward ? 4.0 : 2.0) * (q + kv) + q / elem * (out_elem - elem) + 4.0 * b * h * sq;
  const double reference_heads = std::min(static_cast<double>(threads), b * h);
  const double timed_reference =
      o.impl == Impl::kReference || o.time_reference ? 24.0 * sq * sk * reference_heads : 0.0;
  const double checked_rows =
      sq * sk <= static_cast<double>(kMaxFullCheckPairs) ? sq : std::min(static_cast<double>(o.check_rows), sq);
  const double check = 24.0 * checked_rows * sk + 8.0 * hd * (12.0 * checked_rows + 12.0 * sk);
  return tensors + timed_reference + check;
}

flashattn::AttentionOptions attention_options(const RunOptions& o, const std::vector<float>& slopes) {
  flashattn::AttentionOptions a;
  a.mask = {o.causal, o.window_left, o.window_right};
  a.score.softcap = o.softcap;
  if (o.alibi) {
    a.score.alibi_slopes = make_view(slopes.data(), flashattn::DType::kFloat32, {o.dims.heads});
  }
  a.dropout = {o.dropout, o.seed, 0};
  a.precise = o.precise;
  return a;
}

}  // namespace

int run_command(const RunOptions& o) {
  const Dims& dims = o.dims;
  const std::vector<float> slopes = o.alibi ? alibi_slopes(dims.heads) : std::vector<float>{};
  const flashattn::AttentionOptions options = attention_options(o, slopes);

  RunResult r;
  r.options = o;
  r.device = choose_device(o, options);
  {
    // The whole call is validated before anything is allocated: a wrong shape or option gets the
    // library's own message at once, not after gigabytes of random numbers.
    const ProbeArgs probe = probe_args(dims, options, r.device.device);
    flashattn::forward_workspace_size(probe.forward, probe.options);
    if (o.backward) flashattn::backward_workspace_size(probe.backward, probe.options);
  }

  r.threads = omp_get_max_threads();
  const double needed = host_bytes_needed(o, r.threads);
  const int64_t available = available_memory_bytes();
  if (available >= 0 && needed > static_cast<double>(available)) {
    throw CliError("this run needs about " + format_bytes(static_cast<int64_t>(needed)) + " of host memory, " +
                   format_bytes(available) + " is available");
  }

  Progress progress;
  progress.show("allocating and filling inputs");
  Tensors t = allocate_tensors(dims, o.backward);  // zero-filled: outputs are resident too
  const uint64_t base = o.seed * 0x9e3779b97f4a7c15ull;
  t.q.fill_normal(base + 1);
  t.k.fill_normal(base + 2);
  t.v.fill_normal(base + 3);
  if (o.backward) t.dout.fill_normal(base + 4);

  if (r.device.device.type == flashattn::DeviceType::kCUDA) {
    run_on_cuda(o, options, slopes, t, progress, r);
  } else {
    run_on_cpu(o, options, t, progress, r);
  }
  r.flops_exact =
      4.0 * static_cast<double>(dims.batch * dims.heads * dims.head_dim) * visible_pairs(dims, options.mask);
  r.flops_guide = 4.0 * static_cast<double>(dims.batch * dims.heads * dims.head_dim) *
                  static_cast<double>(dims.seqlen_q) * static_cast<double>(dims.seqlen_k) * (o.causal ? 0.5 : 1.0);

  progress.show("checking against the fp64 reference");
  r.check = check_against_reference(dims, t, options, slopes, o.check_rows, o.backward, o.seed);

  if (o.time_reference) {
    // After the check: the reference overwrites the outputs the check compared.
    progress.show("timing the fp64 reference (one run)");
    Clock::time_point t0 = Clock::now();
    flashattn::reference_forward(forward_args(t), options);
    r.reference_forward_s = seconds_since(t0);
    if (o.backward) {
      t0 = Clock::now();
      flashattn::reference_backward(backward_args(t), options);
      r.reference_backward_s = seconds_since(t0);
    }
  }
  progress.clear();
  o.json ? print_json(r) : print_text(r);
  // Nothing checked is no failure (the report says why and claims no pass).
  return r.check.done && !r.check.passed() ? kExitCheckFailed : kExitOk;
}

}  // namespace flashattn_cli

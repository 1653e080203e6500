// `flashattn info`: what this build of the library is and can do, as plain aligned text or one
// JSON object (--json) holding the same facts. Everything comes from the public API (version,
// cuda_compiled, cuda_device_count, cuda_kernels) or from the documented contract of
// flashattn.hpp; nothing here includes CUDA headers.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
#include "device.hpp"
#include "json.hpp"

namespace flashattn_cli {
namespace {

// What the API contract promises on every build: one table, so the text and the JSON cannot
// drift apart.
struct Feature {
  const char* label;     // text output
  const char* json_key;  // JSON output, under "features"
  const char* value;
};
constexpr Feature kFeatures[] = {
    {"dtypes", "dtypes",
     "float32, float16, bfloat16, float64 (q/k/v/out, grads); float8 e4m3 / e5m2 q/k/v with a "
     "bfloat16 or float16 out (forward, CPU); lse float32; "
     "cu_seqlens/seqused_k int32"},
    {"head_dim", "head_dim", "1..256"},
    {"heads", "heads", "MHA, GQA, MQA (heads_q % heads_kv == 0)"},
    {"masks", "masks", "causal, sliding window (left, right), bottom-right aligned"},
    {"score mods", "score_mods", "softcap, ALiBi (fp32 slopes [heads] or [batch, heads])"},
    {"dropout", "dropout", "Philox4x32-10 keyed by (seed, offset, coordinates): same mask on every backend"},
    {"varlen", "varlen", "cu_seqlens_q/k + optional seqused_k"},
    {"outputs", "outputs", "out, LSE (fp32, natural log)"},
    {"backward", "backward", "dq, dk, dv (deterministic option)"},
    {"precise mode", "precise_mode", "CPU: double accumulators + compensated sums (fp32 inputs)"},
};
constexpr const char* kCpuBackend = "flash (tiled, online softmax, OpenMP) + reference (fp64, explicit S and P)";

// The facts that depend on this build and this machine.
struct BuildFacts {
  bool compiled = false;
  int devices = 0;
  std::string cuda_status;  // "not in this build", "kernels available", ...
  std::vector<std::string> kernels;
  int threads = 1;
};

BuildFacts build_facts() {
  BuildFacts f;
  f.compiled = flashattn::cuda_compiled();
  f.devices = flashattn::cuda_device_count();
  f.cuda_status = !f.compiled                ? "not in this build"
                  : cuda_kernels_available() ? "kernels available"
                                             : "kernels not yet available";
  f.kernels = flashattn::cuda_kernels();
  f.threads = omp_get_max_threads();
  return f;
}

void row(const char* key, const std::string& value) { std::printf("  %-16s %s\n", key, value.c_str()); }

void print_text(const BuildFacts& f) {
  std::printf("flashattn %s\n", flashattn::version());
  row("CUDA backend", f.compiled ? "compiled into this build" : "not compiled into this build");
  // Without the backend the library cannot ask the driver, so 0 says nothing about the machine.
  row("CUDA devices", std::to_string(f.devices) + " visible" + (f.compiled ? "" : " (not queried: no CUDA backend)"));
  row("backends", std::string("cpu: ") + kCpuBackend);
  row("", "cuda: " + f.cuda_status);
  row("CUDA kernels", std::to_string(f.kernels.size()) + " compiled" + (f.kernels.empty() ? "" : ":"));
  for (size_t i = 0; i < f.kernels.size(); i += 3) {  // three names per line
    std::string line;
    for (size_t j = i; j < std::min(f.kernels.size(), i + 3); ++j) line += (j == i ? "" : "  ") + f.kernels[j];
    row("", line);
  }
  for (const Feature& feature : kFeatures) row(feature.label, feature.value);
  row("OpenMP threads", std::to_string(f.threads));
}

void print_json(const BuildFacts& f) {
  Json j;
  j.open(nullptr, '{');
  j.str("version", flashattn::version());
  j.boolean("cuda_compiled", f.compiled);
  j.integer("cuda_device_count", f.devices);
  // Without the backend the count is 0 whatever the machine has: the driver was not asked.
  j.boolean("cuda_devices_queried", f.compiled);
  j.open("backends", '{');
  j.str("cpu", kCpuBackend);
  j.str("cuda", f.cuda_status);
  j.close('}');
  j.boolean("cuda_kernels_available", f.cuda_status == "kernels available");
  j.strings("cuda_kernels", f.kernels);
  j.open("features", '{');
  for (const Feature& feature : kFeatures) j.str(feature.json_key, feature.value);
  j.close('}');
  j.integer("openmp_threads", f.threads);
  j.close('}');
  std::printf("%s\n", j.text().c_str());
}

}  // namespace

int info_command(bool json) {
  const BuildFacts facts = build_facts();
  if (json) {
    print_json(facts);
  } else {
    print_text(facts);
  }
  return 0;
}

}  // namespace flashattn_cli

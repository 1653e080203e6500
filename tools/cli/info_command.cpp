// `flashattn info`: what this build of the library is and can do, as plain aligned text.
// Everything comes from the public API (version, cuda_compiled, cuda_device_count, cuda_kernels) or from the
// documented contract of flashattn.hpp; nothing here includes CUDA headers.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
#include "device.hpp"

namespace flashattn_cli {
namespace {

void row(const char* key, const std::string& value) {
  std::printf("  %-16s %s\n", key, value.c_str());
}

}  // namespace

int info_command() {
  std::printf("flashattn %s\n", flashattn::version());
  const bool compiled = flashattn::cuda_compiled();
  row("CUDA backend", compiled ? "compiled into this build" : "not compiled into this build");
  // Without the backend the library cannot ask the driver, so 0 says nothing about the machine.
  row("CUDA devices", std::to_string(flashattn::cuda_device_count()) + " visible" +
                          (compiled ? "" : " (not queried: no CUDA backend)"));
  row("backends", "cpu: flash (tiled, online softmax, OpenMP) + reference (fp64, explicit S and P)");
  row("", std::string("cuda: ") + (!compiled                  ? "not in this build"
                                   : cuda_kernels_available() ? "kernels available"
                                                              : "kernels not yet available"));
  const std::vector<std::string> kernels = flashattn::cuda_kernels();
  row("CUDA kernels", std::to_string(kernels.size()) + " compiled" + (kernels.empty() ? "" : ":"));
  for (size_t i = 0; i < kernels.size(); i += 3) {  // three names per line
    std::string line;
    for (size_t j = i; j < std::min(kernels.size(), i + 3); ++j) line += (j == i ? "" : "  ") + kernels[j];
    row("", line);
  }
  row("dtypes", "float32, float16, bfloat16, float64 (q/k/v/out, grads); lse float32; "
                "cu_seqlens/seqused_k int32");
  row("head_dim", "1..256");
  row("heads", "MHA, GQA, MQA (heads_q % heads_kv == 0)");
  row("masks", "causal, sliding window (left, right), bottom-right aligned");
  row("score mods", "softcap, ALiBi (fp32 slopes [heads] or [batch, heads])");
  row("dropout", "Philox4x32-10 keyed by (seed, offset, coordinates): same mask on every backend");
  row("varlen", "cu_seqlens_q/k + optional seqused_k");
  row("outputs", "out, LSE (fp32, natural log)");
  row("backward", "dq, dk, dv (deterministic option)");
  row("precise mode", "CPU: double accumulators + compensated sums (fp32 inputs)");
  row("OpenMP threads", std::to_string(omp_get_max_threads()));
  return 0;
}

}  // namespace flashattn_cli

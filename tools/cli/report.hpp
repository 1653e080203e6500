// The results of `flashattn run` and their two renderings: aligned text and one JSON object.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli.hpp"
#include "device.hpp"
#include "reference_check.hpp"

namespace flashattn_cli {

struct PassResult {
  std::vector<double> seconds;  // one per repeat
  // Memory the call used beyond its tensors. CPU: max over repeats of the peak host RSS growth,
  // -1 when not measurable (see memory_note). CUDA: the device workspace it was given.
  int64_t peak_extra_bytes = -1;
  double median() const;
};

struct RunResult {
  RunOptions options;
  DeviceDecision device;
  std::string device_name;  // the GPU's, when the call ran on CUDA
  int threads = 1;
  // FLOPs of one forward: the usual count (4*b*h*sq*sk*d, halved when causal) and the
  // exact count over the (i, j) pairs the mask leaves visible.
  double flops_guide = 0.0, flops_exact = 0.0;
  PassResult forward, backward;                                    // backward: empty unless --backward
  double reference_forward_s = -1.0, reference_backward_s = -1.0;  // --reference, one run each
  std::string memory_note;                                         // why memory is n/a, when it is
  CheckResult check;
};

void print_text(const RunResult& r);
void print_json(const RunResult& r);

}  // namespace flashattn_cli

// Accuracy check of a run against the library's fp64 reference, on one (batch, head) slice so
// that it stays cheap for long sequences, judged by the tests' tolerance rule (tools/oracle).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli.hpp"
#include "oracle/tolerance.hpp"
#include "tensors.hpp"

namespace flashattn_cli {

struct CheckResult {
  bool done = false;
  std::string what;  // "batch 0 head 3, all 1024 rows", or why nothing was checked
  int64_t batch = 0, head = 0, row0 = 0, rows = 0;
  // The tolerance rule's verdict on each result checked, in the order out, lse, dq, dk, dv: the
  // gradients only when backward ran, dk and dv only where the slice determines them
  // (dkdv_note).
  std::vector<flashattn_oracle::Verdict> verdicts;
  std::string dkdv_note;  // why dk/dv were not checked, when backward ran

  // Something was checked and every result is within the rule. False when nothing was checked:
  // a check that did not run passes nothing (callers tell the two apart with `done`).
  bool passed() const;
};

// Checks one (batch, head), picked from the seed, against reference_forward (and
// reference_backward) run in fp64 on the rounded inputs, with the naive attention in the run's
// dtype on the same slice as the rule's baseline. The whole head when its score matrix
// has at most kMaxFullCheckPairs entries, else its last `check_rows` query rows (exact: masks
// and ALiBi align bottom-right, so the last rows against all keys see what they saw).
// `options` must be those of the run (alibi_slopes pointing at `slopes`).
CheckResult check_against_reference(const Dims& dims, const Tensors& t, const flashattn::AttentionOptions& options,
                                    const std::vector<float>& slopes, int64_t check_rows, bool backward, uint64_t seed);

// The reference keeps S, P and the dropout scale in fp64 for one head at a time (24 bytes per
// score) and runs one thread per head: 2^24 scores = 384 MiB and a few seconds (the naive
// attention, one thread too, about as long).
inline constexpr int64_t kMaxFullCheckPairs = int64_t{1} << 24;

}  // namespace flashattn_cli

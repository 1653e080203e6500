// Text and JSON rendering of a RunResult.
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "json.hpp"
#include "memory.hpp"

namespace flashattn_cli {
namespace {

constexpr double kBackwardFlopsFactor = 2.5;  // the usual count: bwd = 2.5x fwd

const char* impl_name(Impl i) { return i == Impl::kFlash ? "flash" : "reference"; }

bool on_cuda(const RunResult& r) { return r.device.device.type == flashattn::DeviceType::kCUDA; }

std::string device_str(const RunResult& r) {
  return on_cuda(r) ? "cuda:" + std::to_string(r.device.device.index) : "cpu";
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string options_summary(const RunOptions& o) {
  std::string s;
  auto add = [&](const std::string& part) { s += (s.empty() ? "" : ", ") + part; };
  if (o.causal) add("causal");
  if (o.window_left >= 0 || o.window_right >= 0) {
    add("window " + std::to_string(o.window_left) + "," + std::to_string(o.window_right));
  }
  if (o.softcap != 0.0f) add(fmt("softcap %g", o.softcap));
  if (o.alibi) add("ALiBi");
  if (o.dropout != 0.0f) add(fmt("dropout %g", o.dropout));
  if (o.precise) add("precise");
  add("seed " + std::to_string(o.seed));
  return s;
}

void row(const char* key, const std::string& value) { std::printf("  %-15s %s\n", key, value.c_str()); }

void print_pass(const char* name, const PassResult& p, double flops_guide, double flops_exact,
                const std::string& memory_note, bool cuda) {
  const auto [lo, hi] = std::minmax_element(p.seconds.begin(), p.seconds.end());
  const double med = p.median();
  row(name, fmt("%.3f ms", med * 1e3) + " median of " + std::to_string(p.seconds.size()) + " (min " +
                fmt("%.3f", *lo * 1e3) + ", max " + fmt("%.3f", *hi * 1e3) + ")");
  row("", fmt("%.2f GFLOP/s", flops_guide / med * 1e-9) + " (counted as 4*b*h*sq*sk*d" +
              (flops_guide != flops_exact ? ", halved if causal" : "") + "); " + fmt("%.2f", flops_exact / med * 1e-9) +
              " on exact visible pairs");
  if (cuda) {  // the host's RSS says nothing about the GPU
    row("",
        "device workspace " + format_bytes(p.peak_extra_bytes) + " (the call's only device memory beyond its tensors)");
    return;
  }
  row("", "peak extra memory " +
              (p.peak_extra_bytes >= 0 ? format_bytes(p.peak_extra_bytes) : "n/a (" + memory_note + ")"));
}

constexpr const char* kResultNames[] = {"out", "lse", "dq", "dk", "dv"};

// The verdict on result `name`, nullptr where it was not checked.
const flashattn_oracle::Verdict* find_verdict(const CheckResult& c, const char* name) {
  for (const flashattn_oracle::Verdict& v : c.verdicts) {
    if (v.what == name) return &v;
  }
  return nullptr;
}

// The max error shown: NaN when NaN broke the rule (a max over the other elements would hide it).
double shown_error(const flashattn_oracle::Verdict& v) {
  return v.ours.has_nan ? static_cast<double>(NAN) : v.ours.max_abs;
}

// "out 4.79e-07, lse 4.77e-07, ..." of `value` over the checked results.
template <typename Value>
std::string per_result(const CheckResult& c, Value value) {
  std::string s;
  for (const flashattn_oracle::Verdict& v : c.verdicts) {
    s += (s.empty() ? "" : ", ") + v.what + " " + fmt("%.3g", value(v));
  }
  return s;
}

// A number of the check in JSON: non-finite ones as the strings "nan" / "inf" (JSON has no such
// numbers, and the JSON writer's null would read as "not checked").
void json_error(Json& j, const char* key, double x) {
  if (std::isfinite(x)) {
    j.num(key, x);
  } else {
    j.str(key, fmt("%g", x));
  }
}

void json_verdict(Json& j, const flashattn_oracle::Verdict& v) {
  j.open(v.what.c_str(), '{');
  json_error(j, "max_abs_error", shown_error(v));
  json_error(j, "tolerance", v.max_bound);
  json_error(j, "mean_abs_error", v.ours.mean_abs);
  json_error(j, "mean_tolerance", v.mean_bound);
  json_error(j, "naive_max_abs_error", v.naive.max_abs);
  json_error(j, "naive_mean_abs_error", v.naive.mean_abs);
  j.num("factor", v.factor);
  j.num("atol", v.atol);
  j.boolean("nan_mismatch", v.ours.has_nan);
  j.boolean("passed", v.passed);
  j.close('}');
}

void json_pass(Json& j, const char* key, const PassResult& p, double flops_guide, double flops_exact, bool cuda) {
  if (p.seconds.empty()) return j.null(key);
  j.open(key, '{');
  j.num("median_s", p.median());
  j.num("min_s", *std::min_element(p.seconds.begin(), p.seconds.end()));
  j.num("max_s", *std::max_element(p.seconds.begin(), p.seconds.end()));
  j.open("times_s", '[');
  for (double s : p.seconds) j.num(nullptr, s);
  j.close(']');
  j.num("flops_guide", flops_guide);
  j.num("flops_exact", flops_exact);
  j.num("gflops_guide", flops_guide / p.median() * 1e-9);
  j.num("gflops_exact", flops_exact / p.median() * 1e-9);
  if (cuda) {
    j.integer("device_workspace_bytes", p.peak_extra_bytes);
  } else if (p.peak_extra_bytes >= 0) {
    j.integer("peak_extra_bytes", p.peak_extra_bytes);
  } else {
    j.null("peak_extra_bytes");
  }
  j.close('}');
}

}  // namespace

double PassResult::median() const {
  std::vector<double> s = seconds;
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

void print_text(const RunResult& r) {
  const RunOptions& o = r.options;
  const Dims& d = o.dims;
  std::printf("flashattn %s run\n", flashattn::version());
  row("problem", "batch " + std::to_string(d.batch) + ", seqlen_q " + std::to_string(d.seqlen_q) + ", seqlen_k " +
                     std::to_string(d.seqlen_k) + ", heads " + std::to_string(d.heads) + " (kv " +
                     std::to_string(d.heads_kv) + "), head_dim " + std::to_string(d.head_dim) + ", " +
                     flashattn::dtype_name(d.dtype) +
                     (d.out_dtype() != d.dtype ? std::string(" (out ") + flashattn::dtype_name(d.out_dtype()) + ")"
                                               : std::string()));
  row("options", options_summary(o));
  const bool cuda = on_cuda(r);
  row("backend", device_str(r) + (cuda ? " " + r.device_name : "") + ", " + impl_name(o.impl) + " implementation, " +
                     (cuda ? "CUDA events after one warm-up call" : std::to_string(r.threads) + " OpenMP threads") +
                     " (" + r.device.why + ")");
  print_pass("forward", r.forward, r.flops_guide, r.flops_exact, r.memory_note, cuda);
  if (!r.backward.seconds.empty()) {
    print_pass("backward", r.backward, kBackwardFlopsFactor * r.flops_guide, kBackwardFlopsFactor * r.flops_exact,
               r.memory_note, cuda);
  }
  if (r.reference_forward_s >= 0) {
    std::string s = "forward " + fmt("%.3f ms", r.reference_forward_s * 1e3);
    if (r.reference_backward_s >= 0) s += ", backward " + fmt("%.3f ms", r.reference_backward_s * 1e3);
    row("fp64 reference", s + " (one run each, whole problem)");
  }
  const CheckResult& c = r.check;
  row("checked", c.done ? c.what + ", vs the fp64 reference" : c.what);
  if (!c.done) {
    row("verdict", "none: nothing was checked");
    return;
  }
  row("max abs error", per_result(c, shown_error));
  row("tolerance", per_result(c, [](const flashattn_oracle::Verdict& v) { return v.max_bound; }));
  row("", std::string("2x (gradients 3x) a naive ") + flashattn::dtype_name(d.dtype) +
              " attention's error + atol; the mean error alike");
  if (!c.dkdv_note.empty()) row("", c.dkdv_note);
  if (c.passed()) {
    row("verdict", "PASS: every checked result within the tolerance");
    return;
  }
  bool first = true;
  for (const flashattn_oracle::Verdict& v : c.verdicts) {
    if (v.passed) continue;
    row(first ? "verdict" : "", "FAIL: " + v.failure);
    first = false;
  }
}

void print_json(const RunResult& r) {
  const RunOptions& o = r.options;
  const Dims& d = o.dims;
  Json j;
  j.open(nullptr, '{');
  j.str("version", flashattn::version());
  const bool cuda = on_cuda(r);
  j.str("device", device_str(r));
  if (cuda) {
    j.str("device_name", r.device_name);
  } else {
    j.null("device_name");
  }
  j.str("device_reason", r.device.why);
  j.str("impl", impl_name(o.impl));
  j.integer("threads", r.threads);
  j.open("problem", '{');
  j.integer("batch", d.batch);
  j.integer("seqlen_q", d.seqlen_q);
  j.integer("seqlen_k", d.seqlen_k);
  j.integer("heads", d.heads);
  j.integer("heads_kv", d.heads_kv);
  j.integer("head_dim", d.head_dim);
  j.str("dtype", flashattn::dtype_name(d.dtype));
  if (d.float8()) j.str("out_dtype", flashattn::dtype_name(d.out_dtype()));
  j.close('}');
  j.open("options", '{');
  j.boolean("causal", o.causal);
  j.integer("window_left", o.window_left);
  j.integer("window_right", o.window_right);
  j.num("softcap", o.softcap);
  j.boolean("alibi", o.alibi);
  j.num("dropout", o.dropout);
  j.integer("seed", static_cast<int64_t>(o.seed));
  j.boolean("precise", o.precise);
  j.integer("repeats", o.repeats);
  j.close('}');
  json_pass(j, "forward", r.forward, r.flops_guide, r.flops_exact, cuda);
  json_pass(j, "backward", r.backward, kBackwardFlopsFactor * r.flops_guide, kBackwardFlopsFactor * r.flops_exact,
            cuda);
  if (r.memory_note.empty()) {
    j.null("memory_note");
  } else {
    j.str("memory_note", r.memory_note);
  }
  j.num("reference_forward_s", r.reference_forward_s >= 0 ? r.reference_forward_s : NAN);
  j.num("reference_backward_s", r.reference_backward_s >= 0 ? r.reference_backward_s : NAN);
  const CheckResult& c = r.check;
  j.open("check", '{');
  j.boolean("done", c.done);
  j.str("what", c.what);
  if (c.done) {
    j.integer("batch", c.batch);
    j.integer("head", c.head);
    j.integer("first_row", c.row0);
    j.integer("rows", c.rows);
    j.open("max_abs_error", '{');
    for (const char* name : kResultNames) {
      const flashattn_oracle::Verdict* v = find_verdict(c, name);
      v ? json_error(j, name, shown_error(*v)) : j.null(name);
    }
    j.close('}');
    if (!c.dkdv_note.empty()) j.str("note", c.dkdv_note);
    // Per checked result: its errors, the rule's bounds (factor x the naive attention's error
    // + atol) and whether it is within them.
    j.open("results", '{');
    for (const flashattn_oracle::Verdict& v : c.verdicts) json_verdict(j, v);
    j.close('}');
    std::vector<std::string> failures;
    for (const flashattn_oracle::Verdict& v : c.verdicts) {
      if (!v.passed) failures.push_back(v.failure);
    }
    j.strings("failures", failures);
  }
  j.close('}');
  // The verdict: true / false, null when nothing was checked (a skipped check passes nothing).
  if (c.done) {
    j.boolean("passed", c.passed());
  } else {
    j.null("passed");
  }
  j.close('}');
  std::printf("%s\n", j.text().c_str());
}

}  // namespace flashattn_cli

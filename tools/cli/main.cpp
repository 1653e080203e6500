// `flashattn`: command-line front end of the library. Parses arguments (CLI11) and maps every
// failure to a one-line message and an exit status: 2 for usage errors (bad arguments), 1 for
// runtime errors (the library refused the call, memory ran out, ...), never a crash. A run whose
// results fail the accuracy check exits with 3 (cli.hpp lists the statuses).
#include <cctype>
#include <cstdio>
#include <exception>
#include <map>
#include <new>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli.hpp"

namespace {

using flashattn::DType;
using flashattn_cli::DeviceChoice;
using flashattn_cli::Impl;
using flashattn_cli::kExitRuntime;
using flashattn_cli::kExitUsage;
using flashattn_cli::RunOptions;

// "L,R", two integers, e.g. "256,0" or "-1,64" (-1 = unbounded side). Their range is the
// library's to check, so its message is the one the user sees.
bool parse_window(const std::string& text, int64_t& left, int64_t& right) {
  long long l = 0, r = 0;
  char tail = 0;
  if (std::sscanf(text.c_str(), "%lld,%lld%c", &l, &r, &tail) != 2) return false;
  left = l;
  right = r;
  return true;
}

// An integer option's value must parse and be >= `min`; CLI11's own checks print numbers as
// doubles ("not in range 0.000000 to 1.79e308"), this says what is expected.
CLI::Validator at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& text) {
        long long v = 0;
        char tail = 0;
        if (std::sscanf(text.c_str(), "%lld%c", &v, &tail) != 1 || v < min) {
          return "expected an integer >= " + std::to_string(min) + ", got '" + text + "'";
        }
        return std::string();
      },
      min == 0   ? "NONNEGATIVE"
      : min == 1 ? "POSITIVE"
                 : ">=" + std::to_string(min));
}

// Names of the enumerated options; main() converts the chosen name after parsing.
const std::map<std::string, DType> kDtypes{{"fp32", DType::kFloat32},       {"fp16", DType::kFloat16},
                                           {"bf16", DType::kBFloat16},      {"fp64", DType::kFloat64},
                                           {"fp8e4m3", DType::kFloat8E4M3}, {"fp8e5m2", DType::kFloat8E5M2}};
const std::map<std::string, DeviceChoice> kDevices{
    {"auto", DeviceChoice::kAuto}, {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}};
const std::map<std::string, Impl> kImpls{{"flash", Impl::kFlash}, {"reference", Impl::kReference}};

template <typename T>
CLI::IsMember member_of(const std::map<std::string, T>& names) {
  std::vector<std::string> keys;
  for (const auto& kv : names) keys.push_back(kv.first);
  return CLI::IsMember(keys, CLI::ignore_case);
}

struct RawOptions {
  int64_t seqlen = 1024;
  std::string window, dtype = "fp32", device = "auto", impl = "flash";
};

void add_run_options(CLI::App& run, RunOptions& o, RawOptions& raw) {
  flashattn_cli::Dims& d = o.dims;
  run.add_option("-b,--batch", d.batch, "Batch size")->check(at_least(1))->capture_default_str();
  run.add_option("--seqlen", raw.seqlen, "Sets both seqlen-q and seqlen-k")->check(at_least(1))->capture_default_str();
  run.add_option("--seqlen-q", d.seqlen_q, "Query length (default: --seqlen)")->check(at_least(1));
  run.add_option("--seqlen-k", d.seqlen_k, "Key/value length (default: seqlen-q)")->check(at_least(1));
  run.add_option("--heads", d.heads, "Query heads")->check(at_least(1))->capture_default_str();
  run.add_option("--heads-kv", d.heads_kv, "Key/value heads (default: --heads; fewer = GQA/MQA)")->check(at_least(1));
  run.add_option("-d,--head-dim", d.head_dim, "Head dimension (1..256)")->capture_default_str();
  run.add_option("--dtype", raw.dtype,
                 "Element type (fp32 is the CPU default; fp8e4m3 / fp8e5m2: FP8 q, k, v with descale 1 "
                 "and a bf16 out, forward only, on the CPU)")
      ->check(member_of(kDtypes))
      ->capture_default_str();
  run.add_flag("--causal", o.causal, "Causal mask (bottom-right aligned)");
  run.add_option("--window", raw.window, "Sliding window L,R (-1 = unbounded side)")->check([](const std::string& s) {
    int64_t l = 0, r = 0;
    if (!parse_window(s, l, r)) return "expected L,R (two integers), got '" + s + "'";
    return std::string();
  });
  run.add_option("--softcap", o.softcap, "Softcap on the scaled scores (0 = off)");
  run.add_flag("--alibi", o.alibi, "ALiBi with the standard geometric slopes 2^(-8(h+1)/H)");
  run.add_option("--dropout", o.dropout, "Dropout probability in [0, 1)");
  run.add_option("--seed", o.seed, "Seed of the inputs, of the checked slice and of dropout")->capture_default_str();
  run.add_flag("--backward", o.backward, "Also time (and check) the backward pass");
  run.add_flag("--precise", o.precise, "CPU precise mode (double accumulators, fp32 inputs)");
  run.add_option("--device", raw.device, "auto: cuda when this build can run there, else cpu")
      ->check(member_of(kDevices))
      ->capture_default_str();
  run.add_option("--repeats", o.repeats, "Timed runs per pass; the median is reported")
      ->check(at_least(1))
      ->capture_default_str();
  run.add_option("--check-rows", o.check_rows,
                 "Rows checked vs the fp64 reference when one head is too large to check whole "
                 "(0 = no check)")
      ->check(at_least(0))
      ->capture_default_str();
  run.add_flag("--reference", o.time_reference, "Also time the fp64 reference once, to compare");
  run.add_option("--impl", raw.impl, "Implementation timed and measured")
      ->check(member_of(kImpls))
      ->capture_default_str();
  run.add_flag("--json", o.json, "Machine-readable output (one JSON object on stdout)");
}

// Lower-case lookup: the IsMember checks above already accepted the name in any case.
template <typename T>
T lookup(const std::map<std::string, T>& names, std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return names.at(name);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flashattn: exact attention (FlashAttention) - inspect the build, time a call", "flashattn"};
  app.set_version_flag("--version", std::string(flashattn::version()));
  app.require_subcommand(1);
  CLI::App* info = app.add_subcommand("info", "Version, backends, devices, dtypes and features");
  bool info_json = false;
  info->add_flag("--json", info_json, "Machine-readable output (one JSON object on stdout)");
  CLI::App* run = app.add_subcommand("run",
                                     "Time one attention call, measure its memory, "
                                     "check it against the fp64 reference");
  RunOptions options;
  RawOptions raw;
  add_run_options(*run, options, raw);
  run->footer(
      "Exit status: 0 when the check passed or nothing was checked, 1 when the call "
      "could not run, 2 on a usage error, 3 when a result broke the tolerance rule.");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "flashattn: usage error: %s (see 'flashattn %s--help')\n", e.what(),
                 run->parsed()    ? "run "
                 : info->parsed() ? "info "
                                  : "");
    return kExitUsage;
  }

  try {
    if (info->parsed()) return flashattn_cli::info_command(info_json);
    // Defaults that depend on other options: --seqlen sets both lengths, --seqlen-q/-k override
    // it, seqlen-k follows seqlen-q when only that is given; heads-kv follows heads.
    flashattn_cli::Dims& d = options.dims;
    if (run->count("--seqlen-q") == 0) d.seqlen_q = raw.seqlen;
    if (run->count("--seqlen-k") == 0) {
      d.seqlen_k = run->count("--seqlen") != 0 ? raw.seqlen : d.seqlen_q;
    }
    if (run->count("--heads-kv") == 0) d.heads_kv = d.heads;
    if (!raw.window.empty()) parse_window(raw.window, options.window_left, options.window_right);
    d.dtype = lookup(kDtypes, raw.dtype);
    options.device = lookup(kDevices, raw.device);
    options.impl = lookup(kImpls, raw.impl);
    return flashattn_cli::run_command(options);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flashattn: error: out of host memory (try a smaller problem)\n");
  } catch (const std::exception& e) {
    // flashattn::Error (its message names the argument and the constraint) and CliError.
    std::fprintf(stderr, "flashattn: error: %s\n", e.what());
  }
  return kExitRuntime;
}

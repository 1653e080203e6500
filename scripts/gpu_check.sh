#!/usr/bin/env bash
# The GPU machine's check of the CUDA backend, in one call (10-11 minutes on an H100 machine of 16
# cores, 6 of them the full CUDA build; FLASHATTN_GPU_CHECK_SKIP and FLASHATTN_CUDA_HEAD_DIMS
# shorten it):
#   1. configure + build the library and tests/gpu (CUDA archs $FLASHATTN_CUDA_ARCHS, default
#      "90a;80"; warnings are errors; -lineinfo so sanitizer reports name source lines);
#   2. static kernel checks (tests/check_cuda_kernels.py: no spills, HMMA/LDSM/LDGSTS, sm_80 and sm_90a;
#      they need no GPU, so they may run on a CPU machine instead);
#   3. the host-only kernel tests (test_sm80_layouts: fragment layouts; test_sm80_emulated: the
#      kernel's code on CPU threads) and the GPU tests (test_gpu_forward, test_gpu_backward: the
#      reduced shape matrix against the fp64 reference; test_gpu_huge: 64-bit offsets;
#      test_gpu_varlen_checks: varlen lengths checked on the device; test_fa1_order: the FA1
#      loop-order teaching kernel of src/cuda/teaching; test_gpu_kvcache:
#      the KV-cache decode kernels of src/cuda/decode, built with FLASHATTN_CUDA_DECODE=ON, against
#      the CPU backend);
#   4. compute-sanitizer memcheck (--padding), racecheck, synccheck, initcheck on the small GPU
#      test filters (GpuSanitizerSmall, GpuBackwardSanitizerSmall: head dims 40, 64, 128, 256
#      only, so they stay fast; Fa1Order.MatchesReference; GpuKvCache.SanitizerSmall;
#      GpuVarlenChecks' bad and valid lengths);
#   5. the `flashattn` tool: build it, `flashattn info`, and `flashattn run --device cuda` on
#      small fp16 and bf16 (causal, GQA) forward problems, each checked against the fp64
#      reference (a gross-error bound; the exact tolerance rule is test_gpu_forward's).
# The benchmarks are scripts/bench.sh's (the Python package, built apart from this build).
# Nothing is fetched: the CUTLASS headers come in .deps/cutlass (scripts/fetch_cutlass.sh) and,
# when the machine has no GoogleTest, its sources in .deps/googletest (a copy of Debian's
# /usr/src/googletest) are built first; likewise the CLI11 headers in .deps/cli11. Carry .deps
# with the call.
# Logs go to $OUT when set, else to <build>/gpu_check_logs: summary.txt, build.log,
# static_checks.log, gpu_tests.log, test_gpu_forward*.xml, test_gpu_backward*.xml, sanitizers.log,
# cli.log. Into <out_dir>/check, the check's verdicts join scripts/bench.sh's report of <out_dir>.
# Every step runs even when an earlier one fails; the exit status is 1 when any step failed.
# Both regexes below match whole labels (anchored: ".*-sm90-bwd" selects the four sanitizers of
# the Hopper backward, "sm90-bwd" none).
# FLASHATTN_GPU_CHECK_SKIP=<regex> skips the steps whose label matches (e.g. "static-checks" when
# they ran on a CPU machine, to save GPU time); the summary says SKIPPED for each.
# FLASHATTN_GPU_CHECK_ONLY=<regex> runs only the steps whose label matches (list configure and
# build too: they cost nothing on a finished build).
# In parts, each under one 10-minute call of the project's GPU machine, into the same $OUT with
# the machine kept warm so the later parts reuse the first one's build:
#   scripts/gpu_check.sh <part>, part one of
#   build-tests  the build, then test_sm80_layouts, test_gpu_forward (as dispatched and with the
#                sm80 kernels forced) and test_fa1_order;
#   tests        test_gpu_backward, test_gpu_varlen_checks, test_gpu_huge, test_sm90_forward,
#                test_gpu_kvcache;
#   sanitizers   the compute-sanitizer subset and the `flashattn` tool's checks.
# The parts leave out static-checks and test_sm80_emulated: they need no GPU, and CI runs them on
# the CPU machine. FLASHATTN_CUDA_ARCHS=90a (sm_90a code only) cuts the build to about 4 minutes.
# FLASHATTN_TEST_SEED=<n> replays a run's random inputs. The long GPU test binaries run in
# $FLASHATTN_GPU_TEST_SHARDS GoogleTest shards at once (default 4; scripts/gtest_shards.sh): their
# time goes mostly to the CPU reference, which the shards spread over the cores; 1 runs each as
# one process. test_gpu_huge (large allocations) and the sanitizers run unsharded.
# FLASHATTN_GPU_CHECK_SM90=OFF leaves the sm90a family out of a 90a build (the sm80 kernels then
# run everywhere, and the build is shorter); FLASHATTN_GPU_CHECK_DECODE=OFF leaves out the decode
# kernels and their tests; FLASHATTN_EXTRA_CMAKE_ARGS (word-split) adds configure options, e.g.
# "-DFLASHATTN_CUDA_BACKWARD_HEAD_DIMS=64" for a forward check (the static checks want some
# backward kernels; skip test_gpu_backward and test_gpu_huge with FLASHATTN_GPU_CHECK_SKIP).
# With 90a in the archs (the default) the sm90a forward family is built (src/cuda/sm90): then
# test_sm90_forward runs (its kernels called directly, and the registry's choice) and
# test_sm90_backward (the backward kernel through the API, and on sm80 for comparison), the
# sanitizers run on their small filters, and test_gpu_forward runs twice: as dispatched (the sm90 kernels
# where they apply) and with FLASHATTN_DISABLE_SM90=1 (the sm80 kernels everywhere), both
# sanitized on the small filter. The check also builds the Hopper backward's d96, d192, d256 and
# dropout kernels (FLASHATTN_CUDA_SM90_BACKWARD_D96 / _D192 / _D256 / _DROPOUT, on by default).
set -uo pipefail
# part -> the steps it runs (GoogleTest's, configure and build are no-ops once the first part has
# built; each part has them, so that a part on a fresh machine builds what it runs)
declare -A part_steps=(
  [build-tests]="gtest-.*|configure|build|test_sm80_layouts|test_gpu_forward|test_gpu_forward_sm80|test_fa1_order"
  [tests]="gtest-.*|configure|build|test_gpu_backward|test_gpu_varlen_checks|test_gpu_huge|test_sm90_forward|test_sm90_backward|test_gpu_kvcache"
  [sanitizers]="gtest-.*|configure|build|(memcheck|racecheck|synccheck|initcheck).*|cli-.*")
if (($# > 1)) || { (($# == 1)) && [[ -z ${part_steps[$1]:-} ]]; }; then
  echo "usage: scripts/gpu_check.sh [build-tests|tests|sanitizers]" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
build=$(realpath -m "${FLASHATTN_GPU_BUILD_DIR:-build-gpu}")
archs=${FLASHATTN_CUDA_ARCHS:-90a;80}
head_dims=${FLASHATTN_CUDA_HEAD_DIMS:-32;64;96;128;160;192;224;256}  # fewer: faster dev runs
jobs=$(nproc)
shards=${FLASHATTN_GPU_TEST_SHARDS:-4}
sharded=(scripts/gtest_shards.sh "$shards")
logs=${OUT:-$repo/$build/gpu_check_logs}
mkdir -p "$logs" "$build"
summary=$logs/summary.txt
failed=0
export PATH="$PATH:/usr/local/cuda/bin"

# Appended, like every log: a check run in parts into one folder (FLASHATTN_GPU_CHECK_SKIP per
# part, the build reused) keeps each part's verdicts.
{ echo "=== gpu_check"; date; nvidia-smi -L; nvcc --version | tail -n 1; } >> "$summary" 2>&1
# Where this run's lines start in the logs whose results are copied into the summary at the end.
tests_from=$(($(cat "$logs/gpu_tests.log" 2>/dev/null | wc -l) + 1))
cli_from=$(($(cat "$logs/cli.log" 2>/dev/null | wc -l) + 1))

skip_steps=${FLASHATTN_GPU_CHECK_SKIP:-}
skip_variable=FLASHATTN_GPU_CHECK_SKIP
only_steps=${FLASHATTN_GPU_CHECK_ONLY:-}
only_variable=FLASHATTN_GPU_CHECK_ONLY
if (($# == 1)); then
  only_steps=${part_steps[$1]}
  only_variable="part $1"
fi
source scripts/steps.sh  # run, sanitize

if [[ ! -f .deps/cutlass/include/cute/tensor.hpp ]]; then
  echo "error: CUTLASS headers missing in .deps/cutlass/include (carry .deps)" | tee -a "$summary"
  exit 2
fi

# GoogleTest: the system's, else built from the carried sources.
prefix=()
have_gtest=0
for f in /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
         /usr/local/lib/cmake/GTest/GTestConfig.cmake /usr/local/lib64/cmake/GTest/GTestConfig.cmake; do
  [[ -f $f ]] && have_gtest=1
done
if ((!have_gtest)); then
  if [[ -f .deps/googletest/CMakeLists.txt ]]; then
    gtest=$build/_gtest
    run build.log gtest-configure 300 cmake -S .deps/googletest -B "$gtest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$gtest/install" -DBUILD_GMOCK=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON &&
      run build.log gtest-build 300 cmake --build "$gtest/build" -j "$jobs" &&
      run build.log gtest-install 60 cmake --install "$gtest/build"
    prefix=(-DCMAKE_PREFIX_PATH="$gtest/install")
  else
    echo "warning: no GoogleTest on this machine and none in .deps/googletest" | tee -a "$summary"
  fi
fi

# CLI11 (for the `flashattn` tool): the system's, else the carried headers (tools/cli/CMakeLists.txt).
cli=OFF
for f in .deps/cli11/include/CLI/CLI.hpp /usr/share/cmake/CLI11/CLI11Config.cmake \
         /usr/lib/cmake/CLI11/CLI11Config.cmake /usr/local/share/cmake/CLI11/CLI11Config.cmake \
         /usr/local/lib/cmake/CLI11/CLI11Config.cmake; do
  [[ -f $f ]] && cli=ON
done

sm90=OFF
[[ $archs == *90a* ]] && sm90=ON
sm90=${FLASHATTN_GPU_CHECK_SM90:-$sm90}  # OFF with 90a: the sm80 family alone on a Hopper GPU
decode=${FLASHATTN_GPU_CHECK_DECODE:-ON}
targets=(test_gpu_forward test_gpu_backward test_gpu_varlen_checks test_gpu_huge test_sm80_layouts test_sm80_emulated
         test_fa1_order)
[[ $decode == ON ]] && targets+=(test_gpu_kvcache test_decode_emulated)
[[ $sm90 == ON ]] && targets+=(test_sm90_forward test_sm90_backward)
run build.log configure 120 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" -DFLASHATTN_WERROR=ON -DFLASHATTN_BUILD_CLI="$cli" \
  -DFLASHATTN_CUDA_HEAD_DIMS="$head_dims" -DFLASHATTN_CUDA_SM90="$sm90" -DFLASHATTN_CUDA_DECODE="$decode" \
  -DFLASHATTN_CUDA_SM90_BACKWARD_D96=ON -DFLASHATTN_CUDA_SM90_BACKWARD_D192=ON -DFLASHATTN_CUDA_SM90_BACKWARD_D256=ON \
  -DFLASHATTN_CUDA_SM90_BACKWARD_DROPOUT=ON -DCMAKE_CUDA_FLAGS=-lineinfo ${FLASHATTN_EXTRA_CMAKE_ARGS:-} \
  "${prefix[@]}"
run build.log build 420 cmake --build "$build" -j "$jobs" --target "${targets[@]}"
test_bin=$build/tests/gpu/test_gpu_forward
if [[ ! -x $test_bin ]]; then
  echo "no test binary; stopping (see build.log)" | tee -a "$summary"
  tail -n 40 "$logs/build.log"
  exit 1
fi

run static_checks.log static-checks 240 env FLASHATTN_CHECK_ARCHS="${archs//;/ }" tests/check_cuda_kernels.py "$build" "$jobs"
run gpu_tests.log test_sm80_layouts 60 "$build/tests/gpu/test_sm80_layouts"
run gpu_tests.log test_sm80_emulated 120 "$build/tests/gpu/test_sm80_emulated"
run gpu_tests.log test_gpu_forward 300 "${sharded[@]}" "$test_bin" --gtest_output=xml:"$logs/test_gpu_forward.xml"
[[ $sm90 == ON ]] && run gpu_tests.log test_gpu_forward_sm80 300 "${sharded[@]}" env FLASHATTN_DISABLE_SM90=1 \
  "$test_bin" --gtest_output=xml:"$logs/test_gpu_forward_sm80.xml"
run gpu_tests.log test_gpu_backward 300 "${sharded[@]}" "$build/tests/gpu/test_gpu_backward" \
  --gtest_output=xml:"$logs/test_gpu_backward.xml"
run gpu_tests.log test_gpu_varlen_checks 120 "$build/tests/gpu/test_gpu_varlen_checks"
run gpu_tests.log test_gpu_huge 240 "$build/tests/gpu/test_gpu_huge"
run gpu_tests.log test_fa1_order 120 "$build/tests/gpu/test_fa1_order"
[[ $sm90 == ON ]] && run gpu_tests.log test_sm90_forward 240 "${sharded[@]}" "$build/tests/gpu/test_sm90_forward"
[[ $sm90 == ON ]] && run gpu_tests.log test_sm90_backward 300 "${sharded[@]}" "$build/tests/gpu/test_sm90_backward"
[[ $decode == ON ]] && run gpu_tests.log test_gpu_kvcache 300 "${sharded[@]}" "$build/tests/gpu/test_gpu_kvcache" \
  --gtest_output=xml:"$logs/test_gpu_kvcache.xml"

if command -v compute-sanitizer >/dev/null 2>&1; then
  sanitize "" "$test_bin" 'GpuSanitizerSmall.*:GpuUnsupported.*'
  [[ $sm90 == ON ]] && FLASHATTN_DISABLE_SM90=1 sanitize -sm80 "$test_bin" 'GpuSanitizerSmall.*'
  sanitize -bwd "$build/tests/gpu/test_gpu_backward" 'GpuBackwardSanitizerSmall.*:GpuBackwardErrors.*'
  sanitize -fa1 "$build/tests/gpu/test_fa1_order" 'Fa1Order.MatchesReference'
  sanitize -varlen "$build/tests/gpu/test_gpu_varlen_checks" 'GpuVarlenChecks.BadLengths*:GpuVarlenChecks.Valid*'
  [[ $sm90 == ON ]] && sanitize -sm90 "$build/tests/gpu/test_sm90_forward" '*Sm90Forward.Small*'
  [[ $sm90 == ON ]] && sanitize -sm90-bwd "$build/tests/gpu/test_sm90_backward" 'Sm90BackwardSanitizerSmall.*'
  [[ $decode == ON ]] && sanitize -kvcache "$build/tests/gpu/test_gpu_kvcache" 'GpuKvCache.SanitizerSmall:GpuKvCache.BadBlockTable*:GpuKvCache.BadIndices*'
else
  echo "compute-sanitizer not found: sanitizer steps skipped" | tee -a "$summary"
  failed=1
fi

# Runs `flashattn run ... --json` (argv[2:]) and prints its report; fails unless the call ran on
# CUDA and the checked slice is within argv[1] of the fp64 reference (out; lse within 1e-3).
cli_gate='
import json, subprocess, sys
bound = float(sys.argv[1])
r = json.loads(subprocess.run(sys.argv[2:], stdout=subprocess.PIPE, text=True, check=True).stdout)
print(json.dumps(r, indent=2))
e = r["check"].get("max_abs_error", {})
ok = r["device"].startswith("cuda") and r["check"]["done"] and all(
    isinstance(e.get(k), (int, float)) and e[k] <= b for k, b in (("out", bound), ("lse", 1e-3)))
print("cli check %s: %s, out %s, lse %s (bounds %g, 1e-3)" %
      ("ok" if ok else "FAILED", r["device_name"], e.get("out"), e.get("lse"), bound))
sys.exit(0 if ok else 1)
'
if [[ $cli == ON ]]; then
  flashattn=$build/tools/cli/flashattn
  cli_head_dim=${head_dims%%;*}  # a head dim whose kernels were built
  cli_problem=(--batch 2 --heads 4 --head-dim "$cli_head_dim" --device cuda --json)
  run cli.log cli-build 300 cmake --build "$build" -j "$jobs" --target flashattn_cli &&
    run cli.log cli-info 60 "$flashattn" info &&
    { run cli.log cli-run-fp16 120 python3 -c "$cli_gate" 1e-2 "$flashattn" run "${cli_problem[@]}" \
        --seqlen 512 --dtype fp16
      run cli.log cli-run-bf16-causal 120 python3 -c "$cli_gate" 5e-2 "$flashattn" run "${cli_problem[@]}" \
        --seqlen-q 300 --seqlen-k 512 --heads-kv 2 --dtype bf16 --causal; }
else
  echo "no CLI11 on this machine and none in .deps/cli11 (scripts/fetch_cutlass.sh copies it):" \
    "flashattn tool steps skipped" | tee -a "$summary"
  failed=1
fi

tail -n +"$tests_from" "$logs/gpu_tests.log" 2>/dev/null |
  grep -E "seed|^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ tests?|^\[  FAILED  \] [^ ]+$" >> "$summary"
tail -n +"$cli_from" "$logs/cli.log" 2>/dev/null | grep -E "^cli check|^flashattn: error" >> "$summary"
echo "=== summary (logs in $logs)"
cat "$summary"
echo "=== tail of static_checks.log"
tail -n 70 "$logs/static_checks.log" 2>/dev/null
# The device tool returns at most 8 files: the biggest, least read logs travel as one archive.
# FLASHATTN_GPU_CHECK_ARCHIVE=0 keeps them as they are (a check run in parts into one folder).
if [[ -n ${OUT:-} && ${FLASHATTN_GPU_CHECK_ARCHIVE:-1} == 1 ]]; then
  archived=()
  for f in "$logs"/build.log "$logs"/test_gpu_forward*.xml "$logs"/test_gpu_backward*.xml; do
    [[ -f $f ]] && archived+=("${f##*/}")
  done
  tar -czf "$logs/build_logs.tar.gz" -C "$logs" "${archived[@]}" 2>/dev/null &&
    (cd "$logs" && rm -f "${archived[@]}")
fi
exit $failed

#!/usr/bin/env bash
# The GPU machine's quick loop for the sm90a forward (src/cuda/sm90), in parts that each
# fit one 10-minute call. Each part first configures and builds what is not built yet (sm_90a
# only: the forward kernels of every head dim, no backward or decode kernels; ~5 min on 16
# cores), so on a machine kept warm between calls only the first pays for it (or none, with a
# build made here beforehand: FLASHATTN_SM90_PREBUILT below):
#   scripts/gpu_sm90.sh tests   test_sm90_forward and test_gpu_forward (the sm90 kernels where they
#                               apply, as dispatched, varlen too; FLASHATTN_SM90_TEST_FILTER
#                               narrows the first);
#   scripts/gpu_sm90.sh checks  compute-sanitizer memcheck, racecheck, synccheck, initcheck on
#                               test_sm90_forward's Small and Varlen tests (FLASHATTN_SM90_CHECK_FILTER:
#                               another gtest filter);
#   scripts/gpu_sm90.sh prebuild <folder>
#                               the build alone, into <folder>, on a machine without a GPU (99
#                               steps, ~75 minutes on two cores), and its library and test binaries
#                               copied to <folder>-slim (58 MiB); FLASHATTN_SM90_PREBUILT=
#                               <folder>-slim, that folder carried with the call (no .deps
#                               needed), runs the other parts on it, skipping the device's build. Nothing checks that it was built
#                               from the sources in the tree.
# The full check (backward, decode, the sm80 target, the CLI) stays scripts/gpu_check.sh's. The
# benchmarks of these kernels run on the Python package: the same configuration, forward kernels
# alone, is scripts/gpu_package.sh build-sm90-bench -DFLASHATTN_CUDA_BACKWARD_HEAD_DIMS=none
# -DFLASHATTN_CUDA_DECODE=OFF, then PYTHONPATH=build-sm90-bench/site python3 bench/gpu_forward.py
# --kernels grids (or gpu_varlen.py, gpu_dropout.py) --out DIR.
# FLASHATTN_EXTRA_CMAKE_ARGS adds configure options (e.g. -DFLASHATTN_CUDA_SM90_DROPOUT=OFF).
# FLASHATTN_SM90_SKIP=<regex> skips the steps whose label matches (e.g. "memcheck-sm90|initcheck-sm90":
# the four sanitizers on the default filter take up to 4 x 240 s, more than one call).
# Logs and results go to $OUT when set, else to <build>/gpu_sm90_logs; carry .deps.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
export PATH="$PATH:/usr/local/cuda/bin"
part=${1:-}
shift || true
if [[ ! $part =~ ^(tests|checks|prebuild)$ ]]; then
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the comment above
  exit 2
fi
if [[ $part == prebuild ]]; then
  # The build alone, into the folder given, for a later call to carry (FLASHATTN_SM90_PREBUILT).
  build=$(realpath -m "${1:?usage: scripts/gpu_sm90.sh prebuild <folder>}")
  logs=$build/gpu_sm90_logs
  build_limit=10800  # two cores: ~75 minutes
else
  build=$(realpath -m "${FLASHATTN_GPU_BUILD_DIR:-build-sm90-dev}")
  logs=${OUT:-$build/gpu_sm90_logs}
  build_limit=420
fi
mkdir -p "$logs" "$build"
summary=$logs/summary.txt
failed=0
skip_steps=${FLASHATTN_SM90_SKIP:-}
skip_variable=FLASHATTN_SM90_SKIP
source scripts/steps.sh  # run, sanitize
{ echo "=== gpu_sm90 $part"; date; nvidia-smi -L; git log -1 --format='commit %h %s' 2>/dev/null; } >> "$summary" 2>&1

# Configures and builds the library and both test binaries (ninja redoes nothing that is current):
# every part calls it, so a part run on a fresh machine (the last one went back) still works.
build_all() {
  run build.log configure 120 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DFLASHATTN_WERROR=ON -DFLASHATTN_BUILD_CLI=OFF -DFLASHATTN_CUDA_SM90=ON \
    -DFLASHATTN_CUDA_BACKWARD_HEAD_DIMS=none -DFLASHATTN_CUDA_DECODE=OFF -DCMAKE_CUDA_FLAGS=-lineinfo \
    ${FLASHATTN_EXTRA_CMAKE_ARGS:-} &&
    run build.log build "$build_limit" cmake --build "$build" -j "$(nproc)" --target flashattn test_sm90_forward test_gpu_forward
}
if [[ -n ${FLASHATTN_SM90_PREBUILT:-} ]]; then
  build=$(realpath -m "$FLASHATTN_SM90_PREBUILT")
  # A carried build keeps the run paths of the machine that made it.
  export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "prebuilt: $build" >> "$summary"
else
  build_all || { cat "$summary"; exit 1; }
fi

case $part in
  prebuild)
    # What the parts run, without the objects (over the carry's 64 MiB): carry <folder>-slim.
    slim=$build-slim
    rm -rf "$slim" && mkdir -p "$slim/tests/gpu" &&
      cp -a "$build"/libflashattn.so* "$slim/" &&
      cp "$build/tests/gpu/test_sm90_forward" "$build/tests/gpu/test_gpu_forward" "$slim/tests/gpu/" &&
      du -sh "$slim" | tee -a "$summary"
    ;;
  tests)
    run gpu_tests.log test_sm90_forward 300 "$build/tests/gpu/test_sm90_forward" \
      --gtest_filter="${FLASHATTN_SM90_TEST_FILTER:-*}"
    run gpu_tests.log test_gpu_forward 300 "$build/tests/gpu/test_gpu_forward"
    grep -E "^\[  (PASSED|FAILED) +\] [0-9]+ tests?|^\[  FAILED  \] [^ ]+$" "$logs/gpu_tests.log" >> "$summary"
    ;;
  checks)
    sanitize -sm90 "$build/tests/gpu/test_sm90_forward" \
      "${FLASHATTN_SM90_CHECK_FILTER:-*Sm90Forward.Small*:*Sm90Forward.Varlen*}"
    ;;
esac
cat "$summary"
exit $failed

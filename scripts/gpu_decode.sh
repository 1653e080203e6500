#!/usr/bin/env bash
# The GPU machine's check of the KV-cache decode kernels (src/cuda/decode) alone, in
# one call of a few minutes: what scripts/gpu_check.sh does for them, without its full build.
#   1. the library and test_gpu_kvcache: taken from $FLASHATTN_DECODE_PREBUILT (a build folder
#      made on a CPU machine with -DFLASHATTN_CUDA_DECODE=ON for this GPU's arch, carried with
#      the call), else built here (arch 90a, the decode kernels, prefill kernels of d128 only);
#   2. test_gpu_kvcache against the CPU backend (a gtest filter from $FLASHATTN_DECODE_TEST_FILTER,
#      e.g. '-*FourMillion*' for a quick call: that case alone takes ~130 s);
#   3. compute-sanitizer memcheck, racecheck, synccheck, initcheck on its small filter (2 and 3
#      are left out with FLASHATTN_DECODE_TESTS=0: a second call on the same warm machine that
#      only benchmarks, FLASHATTN_DECODE_PREBUILT naming the first call's build folder, e.g.
#      build-gpu-decode; the tests and the full grid take more than one 10-minute call together);
#   4. the benchmarks below run on the Python package built with the same kernels (arch 90a, the
#      decode kernels, prefill kernels of d128; scripts/gpu_package.sh into <build>/package), or on
#      a package installed beforehand and carried, $FLASHATTN_DECODE_SITE (its site folder); left
#      out when none of 5-7 runs;
#   5. the split sweep (bench/decode_splits.py: ours at fixed split counts against the heuristic
#      and cuDNN, on a few shapes) unless FLASHATTN_DECODE_SWEEP=0;
#   6. the short calls' kernels and launch gaps (bench/decode_profile.py, torch.profiler; more of
#      its arguments from $FLASHATTN_DECODE_PROFILE_ARGS; with $FLASHATTN_DECODE_BASE_SITE, the
#      site folder of another build's package, once more on that one, as "base") unless
#      FLASHATTN_DECODE_PROFILE=0;
#   7. the suite's decode part (bench/suite.py --parts decode; its arguments from
#      $FLASHATTN_DECODE_BENCH_ARGS, default the full grid against cuDNN, FA2 and EFFICIENT),
#      unless FLASHATTN_DECODE_BENCH=0.
# Logs and results go to $OUT when set, else to <build>/gpu_decode_logs. Every step runs even
# when an earlier one fails; the exit status is 1 when any step failed.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
export PATH="$PATH:/usr/local/cuda/bin"
build=$(realpath -m "${FLASHATTN_DECODE_PREBUILT:-build-gpu-decode}")
logs=${OUT:-$build/gpu_decode_logs}
mkdir -p "$logs" "$build"
summary=$logs/summary.txt
failed=0
{ date; nvidia-smi -L; nvcc --version | tail -n 1; git log -1 --format='commit %h %s' 2>/dev/null; } > "$summary" 2>&1
source scripts/steps.sh  # run, sanitize

if [[ -z ${FLASHATTN_DECODE_PREBUILT:-} ]]; then
  run build.log configure 120 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DFLASHATTN_WERROR=ON -DFLASHATTN_BUILD_CLI=OFF -DFLASHATTN_CUDA_HEAD_DIMS=128 \
    -DFLASHATTN_CUDA_SM90=OFF -DFLASHATTN_CUDA_DECODE=ON -DCMAKE_CUDA_FLAGS=-lineinfo
  run build.log build 420 cmake --build "$build" -j "$(nproc)" --target flashattn test_gpu_kvcache
fi
# A carried build keeps the run paths of the machine that made it.
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
test_bin=$build/tests/gpu/test_gpu_kvcache
if [[ ${FLASHATTN_DECODE_TESTS:-1} == 1 ]]; then
  run gpu_tests.log test_gpu_kvcache 300 "$test_bin" --gtest_output=xml:"$logs/test_gpu_kvcache.xml" \
    --gtest_filter="${FLASHATTN_DECODE_TEST_FILTER:-*}"
  sanitize -kvcache "$test_bin" 'GpuKvCache.SanitizerSmall:GpuKvCache.BadBlockTable*:GpuKvCache.BadIndices*'
fi
site=${FLASHATTN_DECODE_SITE:-$build/package/site}
benchmarks=${FLASHATTN_DECODE_SWEEP:-1}${FLASHATTN_DECODE_PROFILE:-1}${FLASHATTN_DECODE_BENCH:-1}
if [[ -z ${FLASHATTN_DECODE_SITE:-} && $benchmarks == *1* ]]; then
  run build.log package 600 env FLASHATTN_CUDA_ARCHS=90a FLASHATTN_CUDA_HEAD_DIMS=128 scripts/gpu_package.sh \
    "$build/package" -DFLASHATTN_CUDA_SM90=OFF -DFLASHATTN_CUDA_DECODE=ON
fi
export PYTHONPATH=$(realpath -m "$site")${PYTHONPATH:+:$PYTHONPATH}
if [[ ${FLASHATTN_DECODE_SWEEP:-1} == 1 ]]; then
  run bench.log decode-splits 180 python3 bench/decode_splits.py --out "$logs/decode_splits.json"
fi
if [[ ${FLASHATTN_DECODE_PROFILE:-1} == 1 ]]; then
  read -r -a profile_args <<< "${FLASHATTN_DECODE_PROFILE_ARGS:-}"
  run bench.log decode-profile 180 python3 bench/decode_profile.py "${profile_args[@]}" \
    --out "$logs/decode_profile.json"
  if [[ -n ${FLASHATTN_DECODE_BASE_SITE:-} ]]; then
    run bench.log decode-profile-base 180 env PYTHONPATH="$(realpath "$FLASHATTN_DECODE_BASE_SITE")" \
      python3 bench/decode_profile.py --name base "${profile_args[@]}" --out "$logs/decode_profile-base.json"
  fi
fi
if [[ ${FLASHATTN_DECODE_BENCH:-1} == 1 ]]; then
  read -r -a bench_args <<< "${FLASHATTN_DECODE_BENCH_ARGS:---peers cudnn,fa2,efficient}"
  run bench.log decode-suite 420 env FLASHATTN_COMMIT="${FLASHATTN_COMMIT:-unknown}" PYTHONUNBUFFERED=1 \
    python3 bench/suite.py --out "$logs/suite" --parts decode "${bench_args[@]}"
fi

grep -E "seed|^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ tests?|^\[  FAILED  \] [^ ]+$" "$logs/gpu_tests.log" >> "$summary" 2>/dev/null
echo "=== summary (logs in $logs)"
cat "$summary"
echo "=== bench"
# (The suite's lines share theirs with its progress bar: cut them out of it.)
grep -a -o -E "(splits TB/s|profile |decode TB/s|total:|NVIDIA).*" "$logs/bench.log" 2>/dev/null | cut -c1-300 | tail -n 100
exit $failed

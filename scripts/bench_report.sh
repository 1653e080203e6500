#!/usr/bin/env bash
# The benchmark report in one command, on the GPU machine: everything goes into the folder given
# on the command line.
#   scripts/bench_report.sh <out_dir>
#   1. scripts/gpu_check.sh into <out_dir>/check: builds the library, the GPU tests and the
#      kernels; runs the static checks, the GPU tests, the compute-sanitizer subset and the
#      `flashattn` tool's checks (its own quick forward benchmark is left to step 3);
#   2. builds the FA1 loop-order teaching library (flashattn_fa1_teaching) in the same build;
#   3. bench/suite.py: prefill (fwd, bwd, fwd+bwd) against every peer in the process, decode,
#      memory against seqlen, the GEMM and copy ceilings; its arguments come from
#      FLASHATTN_REPORT_SUITE_ARGS, default --quick (under 3 minutes; "" runs the full grids,
#      about an hour);
#   4. bench/io_bytes.py: HBM bytes per call under Nsight Compute (standard attention, FA1 order,
#      FA2 order);
#   5. bench/loop_order.py: FA1 against FA2 loop order, seqlen 1k..8k;
#   6. bench/cpu_vs_torch.py: our CPU backend against PyTorch's CPU SDPA on this machine's cores;
#   7. bench/report.py: <out_dir>/report.md and its charts.
# Every step runs even when an earlier one fails (a step that needs a missing library fails on
# its own); the exit status is 1 when any step failed. <out_dir>/summary.txt lists each step.
# FLASHATTN_REPORT_SKIP=<regex> skips steps by label (check, fa1-build, suite, io, loop-order,
# cpu, report).
#
# In parts: the whole run takes 15-20 minutes on an H100 (the check's full CUDA build alone about
# 6 on 16 cores), longer than one 10-minute call of this project's GPU machine. There it runs as
#   scripts/bench_report.sh <out_dir> <part>
# for each part in turn, into the same folder, each call made while the machine is still warm so
# the later parts reuse the first one's build (build-gpu). The parts (each under 10 minutes):
#   build-tests  the check's build, then test_sm80_layouts, test_gpu_forward (as dispatched and
#                with the sm80 kernels forced) and test_fa1_order; the FA1 teaching library;
#   tests        test_gpu_backward, test_gpu_huge, test_sm90_forward, test_gpu_kvcache;
#   sanitizers   the compute-sanitizer subset, the `flashattn` tool's checks; io; loop-order;
#   bench        the suite, cpu, the report.
# The parts leave out the check's static-checks and test_sm80_emulated: they need no GPU, and CI
# runs them on the CPU machine. FLASHATTN_CUDA_ARCHS=90a (sm_90a code only) cuts the build to
# about 4 minutes; CI's static check covers the sm_80 code.
#
# Needs .deps (CUTLASS, GoogleTest and CLI11 sources: scripts/fetch_cutlass.sh); set
# FLASHATTN_COMMIT to label the results (the GPU machine gets no .git).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# part -> (the report's steps, the check's steps) it runs; the check's configure and build are
# no-ops once the first part has built.
declare -A part_steps=(
  [build-tests]="check|fa1-build"
  [tests]="check"
  [sanitizers]="check|io|loop-order"
  [bench]="suite|cpu|report")
declare -A part_check_steps=(
  [build-tests]="configure|build|test_sm80_layouts|test_gpu_forward|test_gpu_forward_sm80|test_fa1_order"
  [tests]="configure|build|test_gpu_backward|test_gpu_huge|test_sm90_forward|test_gpu_kvcache"
  [sanitizers]="configure|build|(memcheck|racecheck|synccheck|initcheck).*|cli-.*")
if (($# < 1 || $# > 2)) || { (($# == 2)) && [[ -z ${part_steps[$2]:-} ]]; }; then
  echo "usage: scripts/bench_report.sh <out_dir> [build-tests|tests|sanitizers|bench]" >&2
  exit 2
fi
part=${2:-}
logs=$(realpath -m "$1")
build=$(realpath -m "${FLASHATTN_GPU_BUILD_DIR:-build-gpu}")
lib=$build/libflashattn.so
fa1_lib=$build/libflashattn_fa1_teaching.so
mkdir -p "$logs"
summary=$logs/summary.txt
failed=0
skip_steps=${FLASHATTN_REPORT_SKIP:-}
skip_variable=FLASHATTN_REPORT_SKIP
check_only=${FLASHATTN_GPU_CHECK_ONLY:-}
if [[ -n $part ]]; then
  only_steps=${part_steps[$part]}
  only_variable="part $part"
  check_only=${part_check_steps[$part]:-}
fi
source scripts/steps.sh  # run
export PATH="$PATH:/usr/local/cuda/bin" FLASHATTN_COMMIT=${FLASHATTN_COMMIT:-unknown}
{ echo "=== bench_report ${part:-(all parts)}"; date; nvidia-smi -L; echo "commit $FLASHATTN_COMMIT"; } >> "$summary" 2>&1

run check.log check 3600 env OUT="$logs/check" FLASHATTN_GPU_BUILD_DIR="$build" FLASHATTN_GPU_CHECK_BENCH=0 \
  FLASHATTN_GPU_CHECK_ARCHIVE=0 FLASHATTN_GPU_CHECK_ONLY="$check_only" scripts/gpu_check.sh
run build.log fa1-build 300 cmake --build "$build" -j "$(nproc)" --target flashattn flashattn_fa1_teaching
read -r -a suite_args <<< "${FLASHATTN_REPORT_SUITE_ARGS---quick}"
run suite.log suite 5400 python3 bench/suite.py --lib "$lib" --out "$logs" "${suite_args[@]}"
run io.log io 600 python3 bench/io_bytes.py --lib "$lib" --fa1-lib "$fa1_lib" --out "$logs"
run loop_order.log loop-order 600 python3 bench/loop_order.py --lib "$lib" --fa1-lib "$fa1_lib" --out "$logs"
run cpu.log cpu 600 python3 bench/cpu_vs_torch.py --lib "$lib" --out "$logs"
run report.log report 120 python3 bench/report.py "$logs"

echo "=== summary ($logs)"
cat "$summary"
exit $failed

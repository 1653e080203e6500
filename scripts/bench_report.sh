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
# cpu, report). The whole run takes 15-20 minutes on an H100 (the check's full CUDA build alone
# about 6 on 16 cores), longer than one 10-minute call of this project's GPU machine, so there it
# runs in parts into the same folder, e.g.
#   FLASHATTN_REPORT_SKIP="suite|io|loop-order|cpu|report" scripts/bench_report.sh out
#   FLASHATTN_REPORT_SKIP="check|io|loop-order|cpu|report" scripts/bench_report.sh out
#   FLASHATTN_REPORT_SKIP="check|fa1-build|suite" scripts/bench_report.sh out
# (later parts reuse the first's build, build-gpu, while the machine is the same).
# Needs .deps (CUTLASS, GoogleTest and CLI11 sources: scripts/fetch_cutlass.sh); set
# FLASHATTN_COMMIT to label the results (the GPU machine gets no .git).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if (($# != 1)); then
  echo "usage: scripts/bench_report.sh <out_dir>" >&2
  exit 2
fi
logs=$(realpath -m "$1")
build=$(realpath -m "${FLASHATTN_GPU_BUILD_DIR:-build-gpu}")
lib=$build/libflashattn.so
fa1_lib=$build/libflashattn_fa1_teaching.so
mkdir -p "$logs"
summary=$logs/summary.txt
failed=0
skip_steps=${FLASHATTN_REPORT_SKIP:-}
skip_variable=FLASHATTN_REPORT_SKIP
source scripts/steps.sh  # run
export PATH="$PATH:/usr/local/cuda/bin" FLASHATTN_COMMIT=${FLASHATTN_COMMIT:-unknown}
{ date; nvidia-smi -L; echo "commit $FLASHATTN_COMMIT"; } >> "$summary" 2>&1

run check.log check 3600 env OUT="$logs/check" FLASHATTN_GPU_BUILD_DIR="$build" FLASHATTN_GPU_CHECK_BENCH=0 \
  scripts/gpu_check.sh
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

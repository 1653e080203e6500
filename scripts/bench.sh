#!/usr/bin/env bash
# The benchmark suite and its report in one call, on the GPU machine, into the folder given:
#   scripts/bench.sh <out_dir> [bench/suite.py arguments, e.g. --quick or --parts decode]
#   1. install: the Python package with the CUDA backend into build-bench/site (scripts/gpu_package.sh,
#      as scripts/gpu_python.sh installs it; archs $FLASHATTN_CUDA_ARCHS, default 90a; head dims
#      $FLASHATTN_CUDA_HEAD_DIMS, default the benchmarked 64;128;256; a no-op rebuild when the
#      tree has not changed). The benchmarks import it from there;
#   2. suite: bench/suite.py --out <out_dir> and the arguments given (none: the full grids, about an
#      hour; --quick about 2 minutes): ours against every attention implementation in the process,
#      prefill, decode, memory, the GEMM and copy ceilings;
#   3. with FLASHATTN_BENCH_STEPS naming them (see below), the report's other sections:
#      io          bench/io_bytes.py: HBM bytes per call under Nsight Compute (standard attention,
#                  FA1 order, FA2 order, ours);
#      loop-order  bench/loop_order.py: FA1 against FA2 loop order, seqlen 1k..8k;
#      (both need the FA1 teaching library: built first, in build-bench/fa1, as step fa1-build;)
#      cpu         bench/cpu_vs_torch.py: our CPU backend against PyTorch's CPU SDPA;
#   4. report: bench/report.py <out_dir>: <out_dir>/report.md and its charts.
# FLASHATTN_BENCH_STEPS: the steps after install, comma-separated (default suite,report; "all":
# suite,io,loop-order,cpu,report). Every step runs even when an earlier one fails; the exit status
# is 1 when any step failed; <out_dir>/summary.txt lists each step's verdict and time, and the
# report closes with it. The GPU check's verdicts join the report when scripts/gpu_check.sh ran
# into <out_dir>/check first (OUT=<out_dir>/check FLASHATTN_GPU_CHECK_ARCHIVE=0 scripts/gpu_check.sh).
# In calls of at most 10 minutes (the project's GPU machine), --quick fits one call with the
# install; the full grids (about an hour) run as slices, one folder and report each (--parts decode;
# --parts prefill --dtypes bfloat16 --head-dims 128; ...): suite.json holds one run.
# After this, the other benchmarks run on the same install: PYTHONPATH=build-bench/site python3
# bench/gpu_forward.py ... ($FLASHATTN_BENCH_DIR: another folder than build-bench).
#
# Needs .deps (CUTLASS: scripts/fetch_cutlass.sh); set FLASHATTN_COMMIT to label the results (the
# GPU machine gets no .git).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if (($# < 1)) || [[ $1 == -* ]]; then
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the comment above
  exit 2
fi
logs=$(realpath -m "$1")
shift
folder=$(realpath -m "${FLASHATTN_BENCH_DIR:-build-bench}")
steps=${FLASHATTN_BENCH_STEPS:-suite,report}
[[ $steps == all ]] && steps=suite,io,loop-order,cpu,report
for step in ${steps//,/ }; do
  [[ $step =~ ^(suite|io|loop-order|cpu|report)$ ]] ||
    { echo "FLASHATTN_BENCH_STEPS: unknown step '$step' (suite, io, loop-order, cpu, report or all)" >&2; exit 2; }
done
[[ ,$steps, =~ ,(io|loop-order), ]] && steps=fa1-build,$steps
only_steps="install|${steps//,/|}"
only_variable=FLASHATTN_BENCH_STEPS
mkdir -p "$logs"
summary=$logs/summary.txt
failed=0
source scripts/steps.sh  # run
export PATH="$PATH:/usr/local/cuda/bin" FLASHATTN_COMMIT=${FLASHATTN_COMMIT:-unknown} PYTHONUNBUFFERED=1
{ echo "=== bench ($steps)"; date; nvidia-smi -L; echo "commit $FLASHATTN_COMMIT"; } >> "$summary" 2>&1

run install.log install 1800 scripts/gpu_package.sh "$folder"
export PYTHONPATH=$folder/site${PYTHONPATH:+:$PYTHONPATH}
run suite.log suite 5400 python3 bench/suite.py --out "$logs" "$@"
fa1=$folder/fa1
run install.log fa1-build 600 bash -c "cmake -S . -B '$fa1' -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES='${FLASHATTN_CUDA_ARCHS:-90a}' -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_CLI=OFF \
  && cmake --build '$fa1' -j $(nproc) --target flashattn_fa1_teaching"
run io.log io 600 python3 bench/io_bytes.py --fa1-lib "$fa1/libflashattn_fa1_teaching.so" --out "$logs"
run loop_order.log loop-order 600 python3 bench/loop_order.py --fa1-lib "$fa1/libflashattn_fa1_teaching.so" \
  --out "$logs"
run cpu.log cpu 600 python3 bench/cpu_vs_torch.py --out "$logs"
run report.log report 120 python3 bench/report.py "$logs"

echo "=== summary ($logs)"
cat "$summary"
echo "the package: PYTHONPATH=$folder/site"
exit $failed

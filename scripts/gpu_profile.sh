#!/usr/bin/env bash
# Nsight Compute profile of one forward config, ours next to PyTorch's FA2 and cuDNN kernels, on
# the GPU machine: what limits a kernel (shared-memory and tensor pipes, warp stalls, bank
# conflicts, occupancy), read from the same counters for every implementation.
#
#   scripts/gpu_profile.sh [bench/gpu_profile.py arguments]
#
# Ours is the Python package, installed first into build-bench as scripts/bench.sh installs it
# (scripts/gpu_package.sh: a no-op rebuild after bench.sh; head dims $FLASHATTN_CUDA_HEAD_DIMS,
# default 64;128;256; $FLASHATTN_PROFILE_DIR: another folder, e.g. one carried with its site/
# installed beforehand, FLASHATTN_PROFILE_PREBUILT=1 then skipping the install). Writes
# profile.ncu-rep (the full report: open it with ncu-ui), metrics.csv and metrics.txt (the table
# printed at the end) to $OUT, else bench/results/gpu/profile. ncu locks the SM clock to base:
# times are for comparing kernels within the report, not TFLOP/s claims.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-$repo/bench/results/gpu/profile}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"

source scripts/gpu_package.sh  # install_package
folder=$(realpath -m "${FLASHATTN_PROFILE_DIR:-build-bench}")
if [[ ${FLASHATTN_PROFILE_PREBUILT:-0} == 1 ]]; then
  export PYTHONPATH=$folder/site${PYTHONPATH:+:$PYTHONPATH}
else
  install_package "$folder"
fi

ncu --set full --nvtx --nvtx-include "profile/" --import-source no -f -o "$out/profile" \
  python3 bench/gpu_profile.py "$@"

# The counters that answer "what limits it" for an attention kernel: mma.sync (hmma) or WGMMA
# (gmma) tensor pipe, the MUFU (xu: the softmax's exponentials), FMA and ALU pipes, shared memory,
# stalls. (A name the report lacks is left out of the table.)
metrics=(
  gpu__time_duration.sum
  sm__cycles_elapsed.avg.per_second
  launch__registers_per_thread
  launch__occupancy_limit_registers
  launch__shared_mem_per_block_dynamic
  sm__warps_active.avg.pct_of_peak_sustained_active
  sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
  sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active
  sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
  sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
  smsp__inst_executed_op_mufu.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
  smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum
  smsp__inst_executed_op_ldsm.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
  smsp__issue_active.avg.pct_of_peak_sustained_active
  smsp__inst_executed.sum
  lts__t_bytes.sum
  dram__bytes.sum
  smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
  smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
  smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio
  smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
  smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
  smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
  smsp__inst_executed_op_global_red.sum
  smsp__inst_executed_op_global_atom.sum
  lts__t_sectors_op_red.sum
  lts__t_sectors_op_atom.sum
  smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio
  smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
)
ncu -i "$out/profile.ncu-rep" --page raw --csv --metrics "$(IFS=,; echo "${metrics[*]}")" > "$out/metrics.csv"
# One row per metric, one column per kernel (names shortened), for the terminal.
python3 - "$out/metrics.csv" "${metrics[@]}" > "$out/metrics.txt" <<'EOF'
import csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
header, units, data = rows[0], rows[1], rows[2:]
names = [re.sub(r"^(void )?([\w:]+::)?", "", r[header.index("Kernel Name")])[:24] for r in data]
print(f"{'metric':<72}" + "".join(f"{n:>26}" for n in names))
for m in sys.argv[2:]:
    if m in header:
        i = header.index(m)
        print(f"{m + ' (' + units[i] + ')':<72}" + "".join(f"{r[i]:>26}" for r in data))
EOF
cat "$out/metrics.txt"

# Per-instruction SASS with its warp-stall samples, one CSV per kernel-name regex in
# $FLASHATTN_PROFILE_SASS (space-separated; e.g. "backward_kernel flash_bwd"), for reading where a
# kernel waits: bench/sass_stalls.py summarizes one.
for regex in ${FLASHATTN_PROFILE_SASS:-}; do
  ncu -i "$out/profile.ncu-rep" --page source --print-source sass --csv -k "regex:$regex" > "$out/sass-$regex.csv"
done

# The step runner of the GPU machine's scripts (sourced by gpu_check.sh, gpu_decode.sh,
# gpu_sm90.sh, bench.sh): each step's output appended to a log under $logs, its verdict
# and time in $summary, $failed set to 1 when a step fails; steps whose label matches the regex
# $skip_steps are skipped ($skip_variable names the setting in the summary line), and so are
# those that do not match $only_steps when it is set ($only_variable).

# run <log> <label> <limit s> <command...>: appends to $logs/<log>, records ok / FAILED in the
# summary.
run() {
  local log=$logs/$1 label=$2 limit=$3
  shift 3
  if [[ -n ${skip_steps:-} && $label =~ ^(${skip_steps})$ ]]; then
    printf '%-22s SKIPPED (%s)\n' "$label" "${skip_variable:-skip}" | tee -a "$summary"
    return 0
  fi
  if [[ -n ${only_steps:-} && ! $label =~ ^(${only_steps})$ ]]; then
    printf '%-22s SKIPPED (not in %s)\n' "$label" "${only_variable:-only}" | tee -a "$summary"
    return 0
  fi
  local start=$SECONDS before
  before=$(cat "$log" 2>/dev/null | wc -l)
  echo "=== $*" >> "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  local verdict=ok
  if ((rc != 0)); then
    if tail -n +$((before + 1)) "$log" | grep -q "Device not supported"; then
      verdict="UNAVAILABLE (compute-sanitizer: device not supported on this runtime)"
    else
      verdict="FAILED (exit $rc)"
      failed=1
    fi
  fi
  printf '%-22s %-12s %4ds  [%s]\n' "$label" "${verdict%% *}" $((SECONDS - start)) "$(basename "$log")" |
    tee -a "$summary"
  [[ $verdict == ok ]] || echo "    $verdict" | tee -a "$summary"
  return $rc
}

# sanitize <label suffix> <binary> <gtest filter>: the four compute-sanitizer tools on a filter,
# into $logs/sanitizers.log.
sanitize() {
  local suffix=$1 bin=$2 filter=$3
  run sanitizers.log "memcheck$suffix" 240 compute-sanitizer --tool memcheck --padding 1024 --leak-check full \
    --error-exitcode 1 "$bin" --gtest_filter="$filter"
  for tool in racecheck synccheck initcheck; do
    run sanitizers.log "$tool$suffix" 240 compute-sanitizer --tool "$tool" --error-exitcode 1 "$bin" \
      --gtest_filter="$filter"
  done
}

#!/usr/bin/env bash
# A GoogleTest binary in several processes at once, through GoogleTest's own sharding
# (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX: each process runs every shards-th test of the filter):
#   scripts/gtest_shards.sh <shards> <binary> [arguments...]
# The GPU tests spend most of their time in the fp64 CPU reference, one core a process; the
# shards spread it over the machine's cores while they share the GPU. Each shard's output is
# printed after all have ended, shard by shard; the exit status is the first failing shard's
# (0 when all pass). A --gtest_output=xml:<name>.xml argument becomes <name>-<shard>.xml per
# shard. Shards of 1 runs the binary as it is.
set -uo pipefail
if (($# < 2)) || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/gtest_shards.sh <shards> <binary> [arguments...]" >&2
  exit 2
fi
shards=$1
shift
if ((shards == 1)); then
  exec "$@"
fi
work=$(mktemp -d)
pids=()
print_logs() {
  for ((i = 0; i < shards; ++i)); do
    echo "--- shard $i of $shards"
    cat "$work/$i.log" 2>/dev/null
  done
}
trap 'rm -rf "$work"' EXIT
# Stopped (a step's time limit): the shards stop too, and what they printed is kept.
trap 'kill "${pids[@]}" 2>/dev/null; wait; print_logs; exit 124' TERM INT
for ((i = 0; i < shards; ++i)); do
  args=()
  for a in "${@:2}"; do
    [[ $a == --gtest_output=xml:*.xml ]] && a="${a%.xml}-$i.xml"
    args+=("$a")
  done
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i "$1" "${args[@]}" > "$work/$i.log" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < shards; ++i)); do
  wait "${pids[$i]}"
  rc=$?
  ((status == 0 && rc != 0)) && status=$rc
done
print_logs
exit $status

#!/usr/bin/env bash
# The GPU machine's backward benchmark in one call: builds libflashattn with the CUDA backend as
# scripts/gpu_bench.sh does (same build directory, so one build serves both; archs
# $FLASHATTN_CUDA_ARCHS, default 90a; head dims $FLASHATTN_CUDA_HEAD_DIMS, default the benchmarked
# 64;128;256) and runs bench/gpu_backward.py: our backward, alone and as forward + backward,
# against PyTorch SDPA's FLASH and cuDNN backends, then each backward's extra device memory
# against seqlen. Results (backward.json, backward.md, build.log) go to $OUT, else
# bench/results/gpu. Extra arguments go to bench/gpu_backward.py: --quick takes under 3 minutes;
# the full grid about 9, too long for one 10-minute call after a build, so run it in two:
#   scripts/gpu_bench_backward.sh --dtypes bfloat16
#   scripts/gpu_bench_backward.sh --dtypes float16 --memory-seqlens ''
#
# Needs the CUTLASS headers in .deps/cutlass (scripts/fetch_cutlass.sh; carry .deps). Set
# FLASHATTN_COMMIT to the commit the working tree is at: the machine gets no .git.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-$repo/bench/results/gpu}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
source scripts/bench_build.sh  # build_bench_lib

start=$SECONDS
dir=$(realpath -m "${FLASHATTN_BENCH_BUILD_DIR:-build-bench-gpu}")
build_bench_lib "$dir" "${FLASHATTN_CUDA_HEAD_DIMS:-64;128;256}" "$(nproc)" > "$out/build.log" 2>&1 ||
  { tail -n 40 "$out/build.log"; exit 1; }
echo "build: $((SECONDS - start)) s"
exec python3 bench/gpu_backward.py --lib "$dir/libflashattn.so" --out "$out" "$@"

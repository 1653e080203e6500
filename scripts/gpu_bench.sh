#!/usr/bin/env bash
# The GPU machine's forward benchmark in one call: builds libflashattn with the CUDA backend
# (library only; archs $FLASHATTN_CUDA_ARCHS, default 90a; head dims $FLASHATTN_CUDA_HEAD_DIMS,
# default the benchmarked 64;128;256) and runs bench/gpu_forward.py against PyTorch SDPA's FLASH
# and cuDNN backends. Results (forward.json, forward.md, build.log) go to $OUT, else
# bench/results/gpu. Extra arguments go to bench/gpu_forward.py (e.g. --quick).
# Needs the CUTLASS headers in .deps/cutlass (scripts/fetch_cutlass.sh; carry .deps). Set
# FLASHATTN_COMMIT to the commit the working tree is at: the machine gets no .git.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
build=$(realpath -m "${FLASHATTN_BENCH_BUILD_DIR:-build-bench-gpu}")
out=${OUT:-$repo/bench/results/gpu}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
start=$SECONDS
{
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${FLASHATTN_CUDA_ARCHS:-90a}" \
    -DFLASHATTN_CUDA_HEAD_DIMS="${FLASHATTN_CUDA_HEAD_DIMS:-64;128;256}" \
    -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_CLI=OFF
  cmake --build "$build" -j "$(nproc)"
} > "$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
echo "build: $((SECONDS - start)) s"
python3 bench/gpu_forward.py --lib "$build/libflashattn.so" --out "$out" "$@"

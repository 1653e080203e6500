#!/usr/bin/env bash
# The GPU machine's forward benchmark in one call: builds libflashattn with the CUDA backend
# (library only; archs $FLASHATTN_CUDA_ARCHS, default 90a; head dims $FLASHATTN_CUDA_HEAD_DIMS,
# default the benchmarked 64;128;256) and runs bench/gpu_forward.py against PyTorch SDPA's FLASH
# and cuDNN backends. Results (forward.json, forward.md, build.log) go to $OUT, else
# bench/results/gpu. Extra arguments go to bench/gpu_forward.py (e.g. --quick).
#
# Tile tuning: FLASHATTN_BENCH_VARIANTS="128:64,64,4 90@128:128,64,4 ..." ([90@]head_dim:
# block_m,block_n,warps) instead builds one library per variant, in parallel, with that tile
# shape forced for every kernel (FLASHATTN_SM80_TILE_* in src/cuda/sm80/tile_shapes.hpp), or with
# "90@" for the sm90-tuned kernels only, and runs the quick bf16 grid of each variant's head dim;
# results in $OUT/variant_[sm90_]<d>_<m>x<n>x<w>/.
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
if [[ -z ${FLASHATTN_BENCH_VARIANTS:-} ]]; then
  dir=$(realpath -m "${FLASHATTN_BENCH_BUILD_DIR:-build-bench-gpu}")
  build_bench_lib "$dir" "${FLASHATTN_CUDA_HEAD_DIMS:-64;128;256}" "$(nproc)" > "$out/build.log" 2>&1 ||
    { tail -n 40 "$out/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s"
  exec python3 bench/gpu_forward.py --lib "$dir/libflashattn.so" --out "$out" "$@"
fi

read -r -a variants <<< "$FLASHATTN_BENCH_VARIANTS"
jobs=$(( ($(nproc) + ${#variants[@]} - 1) / ${#variants[@]} ))
pids=()
# variant <spec>: sets d, name and flags
variant() {
  local spec=$1 shape m n w target=""
  if [[ $spec == 90@* ]]; then
    target=90
    spec=${spec#90@}
  fi
  IFS=: read -r d shape <<< "$spec"
  IFS=, read -r m n w <<< "$shape"
  name=variant_${target:+sm90_}${d}_${m}x${n}x${w}
  flags="-DFLASHATTN_SM80_TILE_M=$m -DFLASHATTN_SM80_TILE_N=$n -DFLASHATTN_SM80_TILE_WARPS=$w"
  [[ -z $target ]] || flags+=" -DFLASHATTN_SM80_TILE_TARGET=$target"
}
for v in "${variants[@]}"; do
  variant "$v"
  mkdir -p "$out/$name"
  build_bench_lib "build-bench-$name" "$d" "$jobs" "$flags" > "$out/$name/build.log" 2>&1 &
  pids+=($!)
done
for i in "${!variants[@]}"; do
  wait "${pids[$i]}" || echo "build of ${variants[$i]} FAILED (see its build.log)"
done
echo "builds: $((SECONDS - start)) s"
status=0
for v in "${variants[@]}"; do
  variant "$v"
  [[ -f build-bench-$name/libflashattn.so ]] || { status=1; continue; }
  echo "=== $name"
  python3 bench/gpu_forward.py --lib "build-bench-$name/libflashattn.so" --out "$out/$name" --quick \
    --head-dims "$d" "$@" | grep -v "^ \|^{\|^}" || status=1
done
exit $status

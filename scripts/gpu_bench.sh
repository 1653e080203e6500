#!/usr/bin/env bash
# Tile tuning of the forward on the GPU machine: one package per tile shape, built in parallel,
# each timed by the forward benchmark's quick bf16 grid of its head dim (bench/gpu_forward.py
# --quick against PyTorch SDPA's FLASH and cuDNN backends).
#   FLASHATTN_BENCH_VARIANTS="128:64,64,4 90@128:128,64,4 ..." scripts/gpu_bench.sh [gpu_forward.py arguments]
# A variant is [90@]head_dim:block_m,block_n,warps: that tile shape forced for every kernel
# (FLASHATTN_SM80_TILE_* in src/cuda/sm80/tile_shapes.hpp), or with "90@" for the sm90-tuned
# kernels only. Each is installed into build-bench-<variant> (scripts/gpu_package.sh; archs
# $FLASHATTN_CUDA_ARCHS, default 90a; $FLASHATTN_EXTRA_CMAKE_ARGS adds configure options) and its
# results (forward.json, forward.md, pip.log) go to $OUT/variant_[sm90_]<d>_<m>x<n>x<w>/ ($OUT
# else bench/results/gpu). The forward benchmark of the tree as it is: scripts/bench.sh's install,
# then bench/gpu_forward.py (docs/PERFORMANCE.md).
#
# Needs the CUTLASS headers in .deps/cutlass (scripts/fetch_cutlass.sh; carry .deps). Set
# FLASHATTN_COMMIT to the commit the working tree is at: the machine gets no .git.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-$repo/bench/results/gpu}
export PATH="$PATH:/usr/local/cuda/bin"
source scripts/gpu_package.sh  # install_package

if [[ -z ${FLASHATTN_BENCH_VARIANTS:-} ]]; then
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the comment above
  exit 2
fi
start=$SECONDS
read -r -a variants <<< "$FLASHATTN_BENCH_VARIANTS"
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
# (The kernels and the registry must agree on the tile shapes: the flags go to both compilers.)
pids=()
for v in "${variants[@]}"; do
  variant "$v"
  mkdir -p "$out/$name"
  FLASHATTN_CUDA_HEAD_DIMS=$d CMAKE_BUILD_PARALLEL_LEVEL=$(( ($(nproc) + ${#variants[@]} - 1) / ${#variants[@]} )) \
    install_package "build-bench-$name" "-DCMAKE_CUDA_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" 2> /dev/null &
  pids+=($!)
done
declare -A built
for i in "${!variants[@]}"; do
  variant "${variants[$i]}"
  if wait "${pids[$i]}"; then
    built[$name]=1
  else
    echo "build of ${variants[$i]} FAILED (see its pip.log)"
  fi
  cp "build-bench-$name/pip.log" "$out/$name/" 2>/dev/null || true
done
echo "builds: $((SECONDS - start)) s"
status=0
for v in "${variants[@]}"; do
  variant "$v"
  [[ -n ${built[$name]:-} ]] || { status=1; continue; }
  echo "=== $name"
  PYTHONPATH=$repo/build-bench-$name/site${PYTHONPATH:+:$PYTHONPATH} python3 bench/gpu_forward.py \
    --out "$out/$name" --quick --head-dims "$d" "$@" | grep -v "^ \|^{\|^}" || status=1
done
exit $status

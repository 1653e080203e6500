#!/usr/bin/env bash
# The Python package with the CUDA backend, built and installed into a folder of its own, on the
# GPU machine: what the benchmarks (bench/*.py) and the package's GPU tests import.
#   scripts/gpu_package.sh <folder> [-DNAME=VALUE ...]
# builds in <folder>/build and installs into <folder>/site (pip, no build isolation and no
# downloads: scikit-build-core, nanobind and the peers are on the GPU machine), then prints the
# PYTHONPATH that imports it, e.g.
#   scripts/gpu_package.sh build-bench && PYTHONPATH=build-bench/site python3 bench/gpu_forward.py --out DIR
# Sourced (scripts/gpu_python.sh, gpu_bench.sh, gpu_ab.sh, gpu_profile.sh; bench.sh and
# gpu_decode.sh run it), it defines install_package <folder> [-DNAME=VALUE ...], which does the
# same and puts <folder>/site first on PYTHONPATH.
#
# Archs $FLASHATTN_CUDA_ARCHS (default 90a), head dims $FLASHATTN_CUDA_HEAD_DIMS (default the
# benchmarked 64;128;256), configure options from the arguments and $FLASHATTN_EXTRA_CMAKE_ARGS
# (word-split -DNAME=VALUE words, e.g. -DFLASHATTN_CUDA_SM90_TRACE=ON for bench/sm90_trace.py).
# They reach CMake on every call, so a folder's build follows them; an option dropped from one
# call to the next keeps its cached value: give each configuration its own folder.
# $FLASHATTN_PACKAGE_SOURCE: another source tree to build (e.g. a commit's `git archive` of
# CMakeLists.txt pyproject.toml python src include cmake; this tree's .deps/cutlass serves it).
# $CMAKE_BUILD_PARALLEL_LEVEL: the build's jobs (default all cores). A folder whose
# site/ was installed elsewhere (this script on a machine with nvcc and the GPU machine's Python)
# and carried needs no call at all: PYTHONPATH=<folder>/site.
# Needs the CUTLASS headers in .deps/cutlass (scripts/fetch_cutlass.sh; carry .deps).

# install_package <folder> [-DNAME=VALUE ...]: logs to <folder>/pip.log; returns pip's status.
install_package() {
  local folder arg defines=()
  folder=$(realpath -m "$1")
  shift
  local archs=${FLASHATTN_CUDA_ARCHS:-90a} dims=${FLASHATTN_CUDA_HEAD_DIMS:-64;128;256}
  # shellcheck disable=SC2086  # FLASHATTN_EXTRA_CMAKE_ARGS is a list of words
  for arg in -DFLASHATTN_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" "-DFLASHATTN_CUDA_HEAD_DIMS=$dims" \
             "$@" ${FLASHATTN_EXTRA_CMAKE_ARGS:-}; do
    if [[ $arg != -D?*=* ]]; then
      echo "install_package: '$arg' is not -DNAME=VALUE" >&2
      return 2
    fi
    defines+=(-C "cmake.define.${arg#-D}")
  done
  mkdir -p "$folder"
  local repo src
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  src=$(realpath -m "${FLASHATTN_PACKAGE_SOURCE:-$repo}")
  [[ $src == "$repo" ]] || defines+=(-C "cmake.define.FLASHATTN_CUTLASS_DIR=$repo/.deps/cutlass/include")
  (cd "$src" && PATH="$PATH:/usr/local/cuda/bin" python3 -m pip install -q --no-build-isolation --no-deps \
    --upgrade --target "$folder/site" -C build-dir="$folder/build" "${defines[@]}" .) > "$folder/pip.log" 2>&1 ||
    { tail -n 40 "$folder/pip.log" >&2; return 1; }
  export PYTHONPATH=$folder/site${PYTHONPATH:+:$PYTHONPATH}
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -euo pipefail
  if (($# < 1)); then
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the comment above
    exit 2
  fi
  start=$SECONDS
  install_package "$@"
  folder=$(realpath -m "$1")
  PYTHONPATH=$folder/site python3 -c "import flashattn; print('flashattn', flashattn.__version__, 'at', \
flashattn.__file__, '| cuda', flashattn.cuda_compiled(), len(flashattn.cuda_kernels()), 'kernels')"
  echo "build + install: $((SECONDS - start)) s; import it with PYTHONPATH=$folder/site"
fi

#!/usr/bin/env bash
# Puts the pinned CUTLASS/CuTe headers (PyPI nvidia-cutlass, header-only use) under
# .deps/cutlass/include, where CMake looks for them (FLASHATTN_CUTLASS_DIR overrides), and
# the GoogleTest sources the GPU machine lacks into .deps/googletest.
set -euo pipefail
version=4.2.0.0
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="$repo/.deps/cutlass"
if [[ ! -f "$dest/VERSION" || $(cat "$dest/VERSION") != "$version" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps -d "$tmp" "nvidia-cutlass==$version"
  python3 -m zipfile -e "$tmp"/nvidia_cutlass-*.whl "$tmp/wheel"
  rm -rf "$dest"
  mkdir -p "$dest"
  mv "$tmp/wheel/cutlass_library/source/include" "$dest/include"
  echo "$version" > "$dest/VERSION"
  echo "CUTLASS $version headers in $dest/include"
fi

# The GPU machine has no GoogleTest: scripts/gpu_check.sh builds it from this copy of the
# sources that Debian's googletest package installs here.
if [[ -d /usr/src/googletest && ! -f "$repo/.deps/googletest/CMakeLists.txt" ]]; then
  cp -r /usr/src/googletest "$repo/.deps/googletest"
  echo "GoogleTest sources in $repo/.deps/googletest"
fi

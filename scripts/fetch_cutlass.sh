#!/usr/bin/env bash
# Puts the pinned CUTLASS/CuTe headers (PyPI nvidia-cutlass, header-only use) under
# .deps/cutlass/include, where CMake looks for them (FLASHATTN_CUTLASS_DIR overrides), and
# what the GPU machine lacks: the GoogleTest sources into .deps/googletest, the CLI11 headers
# into .deps/cli11/include.
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

# Nor CLI11, which the `flashattn` tool needs: tools/cli/CMakeLists.txt falls back to this copy
# of the headers (header-only) that Debian's libcli11-dev installs here.
if [[ -f /usr/include/CLI/CLI.hpp && ! -f "$repo/.deps/cli11/include/CLI/CLI.hpp" ]]; then
  mkdir -p "$repo/.deps/cli11/include"
  cp -r /usr/include/CLI "$repo/.deps/cli11/include/CLI"
  echo "CLI11 headers in $repo/.deps/cli11/include"
fi

#!/usr/bin/env bash
# Puts the pinned CUTLASS/CuTe headers (PyPI nvidia-cutlass, header-only use) under
# .deps/cutlass/include, where CMake looks for them (FLASHATTN_CUTLASS_DIR overrides).
set -euo pipefail
version=4.2.0.0
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="$repo/.deps/cutlass"
if [[ -f "$dest/VERSION" && $(cat "$dest/VERSION") == "$version" ]]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" "nvidia-cutlass==$version"
python3 -m zipfile -e "$tmp"/nvidia_cutlass-*.whl "$tmp/wheel"
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/wheel/cutlass_library/source/include" "$dest/include"
echo "$version" > "$dest/VERSION"
echo "CUTLASS $version headers in $dest/include"

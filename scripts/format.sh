#!/usr/bin/env bash
# Formats the C++ / CUDA sources with the repository's .clang-format (clang-format 14, the
# version CI checks with; other versions format some constructs differently):
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   list the files that differ and exit 1 if any does (CI)
# The files: every tracked *.cpp, *.hpp, *.h, *.cu, *.cuh (the CMake-configured *.cu.in
# templates are left as written).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
tool=$(command -v clang-format-14 || command -v clang-format || true)
if [[ -z $tool ]] || ! "$tool" --version | grep -q "version 14\."; then
  echo "format.sh: clang-format 14 not found (apt install clang-format-14)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh')
if [[ ${1:-} == --check ]]; then
  bad=()
  for f in "${files[@]}"; do
    "$tool" --style=file "$f" | cmp -s - "$f" || bad+=("$f")
  done
  if ((${#bad[@]})); then
    printf 'not formatted (scripts/format.sh fixes them):\n'
    printf '  %s\n' "${bad[@]}"
    exit 1
  fi
  echo "format: ${#files[@]} files formatted as .clang-format says"
else
  "$tool" --style=file -i "${files[@]}"
fi

#!/usr/bin/env bash
# Proves the installed CMake package works: installs the build in $1 into a fresh prefix, runs
# the installed `flashattn` tool from there (it finds the installed shared library through its
# RPATH, no LD_LIBRARY_PATH), then configures, builds and runs the standalone consumers in
# examples/ (C++ API and C ABI) against it with warnings as errors, the way a user's project
# would. Last, a project that adds the sources with add_subdirectory (examples/subdirectory_consumer)
# configures, builds and runs with GoogleTest and CLI11 made unfindable: a subproject needs neither.
#   .ci/check_install.sh <build directory of the library>
set -euo pipefail

if [[ $# -ne 1 || ! -d "$1" ]]; then
  echo "usage: $0 <flashattn build directory>" >&2
  exit 2
fi
build_dir=$(cd "$1" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/flashattn-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

run() {
  echo "+ $*"
  "$@"
}

run cmake --install "$build_dir" --prefix "$prefix"

# The tool, where the build has it: run from the prefix with the loader's default search path only.
if [[ -x "$build_dir/tools/cli/flashattn" ]]; then
  bindir=$(sed -n 's/^CMAKE_INSTALL_BINDIR:[A-Z]*=//p' "$build_dir/CMakeCache.txt")
  tool="$prefix/${bindir:-bin}/flashattn"
  echo "--- installed tool"
  echo "+ $tool --help"
  env -u LD_LIBRARY_PATH "$tool" --help >/dev/null
  run env -u LD_LIBRARY_PATH "$tool" info
fi

# A shared libflashattn is found at run time through the prefix, as an installed one would be.
libdir=$(find "$prefix" -maxdepth 1 -name 'lib*' -type d | tr '\n' ':')
export LD_LIBRARY_PATH="${libdir}${LD_LIBRARY_PATH:-}"

warnings="-Wall -Wextra -Wpedantic -Werror"
for example in cpp_consumer c_consumer; do
  echo "--- $example"
  lang=$([[ $example == c_consumer ]] && echo C || echo CXX)
  run cmake -S "$repo/examples/$example" -B "$work/$example" -G Ninja \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_${lang}_FLAGS=$warnings"
  run cmake --build "$work/$example"
  run "$work/$example/$example"
done

echo "--- subdirectory_consumer"
run cmake -S "$repo/examples/subdirectory_consumer" -B "$work/subdirectory_consumer" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=OFF --no-warn-unused-cli \
  -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON
for option in FLASHATTN_BUILD_TESTS FLASHATTN_BUILD_CLI; do
  if ! grep -q "^$option:BOOL=OFF$" "$work/subdirectory_consumer/CMakeCache.txt"; then
    echo "error: $option is not OFF by default in a project that adds flashattn as a subdirectory" >&2
    exit 1
  fi
done
run cmake --build "$work/subdirectory_consumer"
run "$work/subdirectory_consumer/subdirectory_consumer"
echo "install check passed: the installed tool ran; three consumers built and ran against $prefix and the sources"

#!/usr/bin/env bash
# Proves the installed CMake package works: installs the build in $1 into a fresh prefix, then
# configures, builds and runs the standalone consumers in examples/ (C++ API and C ABI) against
# it with warnings as errors, the way a user's project would.
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
echo "install check passed: both consumers built and ran against $prefix"

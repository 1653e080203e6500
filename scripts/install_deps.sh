#!/usr/bin/env bash
# Installs what building and testing flashattn needs and is missing: CMake, Ninja, a C++20
# compiler, GoogleTest, CLI11, ccache, clang-format 14 (Debian packages). CUDA, when wanted,
# comes from the machine's CUDA toolkit (nvcc on PATH or in /usr/local/cuda).
set -euo pipefail

packages=(cmake ninja-build g++ libgtest-dev libcli11-dev ccache clang-format-14)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The Python package's tests (pytest, numpy, ml_dtypes for bfloat16 and FP8 arrays, PyTorch for the
# autograd / torch.compile layer, run on CPU tensors where there is no GPU); `pip install .`
# fetches its own build tools (scikit-build-core, nanobind) into an isolated build environment.
if ! python3 -c "import pytest, numpy, ml_dtypes" >/dev/null 2>&1; then
  echo "installing: pytest numpy ml_dtypes (pip)"
  python3 -m pip install -q --disable-pip-version-check pytest numpy ml_dtypes
fi
if ! python3 -c "import torch" >/dev/null 2>&1; then
  echo "installing: torch (pip)"
  python3 -m pip install -q --disable-pip-version-check torch
fi

#!/usr/bin/env bash
# One command from a fresh machine to a result: installs what is missing, builds (the CUDA
# backend when a GPU is present or FLASHATTN_CUDA=ON is set), then runs one attention call with
# the `flashattn` CLI -- on the GPU when present, otherwise the CPU backend -- checked against the
# fp64 reference. Extra arguments go to `flashattn run` (see `flashattn run --help`); without
# them: a causal bf16 forward on the GPU when the CUDA kernels are there (the CUDA backend runs
# the forward only, in fp16/bf16), else a causal fp32 forward and backward on the CPU.
#   scripts/run.sh [--seqlen 4096 --heads 16 --head-dim 128 --causal --backward ...]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

scripts/install_deps.sh

cuda=${FLASHATTN_CUDA:-}
if [[ -z $cuda ]]; then
  cuda=OFF
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=AUTO; fi
fi
build=${FLASHATTN_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA="$cuda" \
  -DFLASHATTN_BUILD_TESTS=OFF
cmake --build "$build" --target flashattn_cli

info=$("$build/tools/cli/flashattn" info)
echo "$info"
if (($# == 0)); then
  if grep -q "cuda: kernels available" <<<"$info"; then
    set -- --seqlen 2048 --heads 16 --head-dim 128 --causal --dtype bf16
  else
    set -- --seqlen 2048 --heads 16 --head-dim 128 --causal --backward
  fi
fi
"$build/tools/cli/flashattn" run --device auto "$@"

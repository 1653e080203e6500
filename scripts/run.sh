#!/usr/bin/env bash
# One command from a fresh machine to a result: installs what is missing, builds (the CUDA
# backend when a GPU is present or FLASHATTN_CUDA=ON is set), then runs one attention call with
# the `flashattn` CLI -- on the GPU when present, otherwise the CPU backend -- checked against the
# fp64 reference. Extra arguments go to `flashattn run` (see `flashattn run --help`); without
# them: a causal bf16 forward on the GPU when the CUDA kernels are there (the CUDA kernels take
# fp16/bf16 only), else a causal fp32 forward and backward on the CPU.
#   scripts/run.sh [--seqlen 4096 --heads 16 --head-dim 128 --causal --backward ...]
# With a GPU the CUDA backend is required (FLASHATTN_CUDA=ON: a missing nvcc or CUTLASS is an
# error, never a quiet CPU-only build); FLASHATTN_CUDA=OFF builds and runs on the CPU anyway. The
# kernels are compiled for that GPU only: FLASHATTN_CUDA_ARCHS, default from its compute
# capability (9.0 -> 90a, 8.x -> 80).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

fail() {
  echo "run.sh: error: $*" >&2
  exit 1
}

scripts/install_deps.sh

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
cuda=${FLASHATTN_CUDA:-}
if [[ -z $cuda ]]; then
  cuda=$([[ $gpu == 1 ]] && echo ON || echo OFF)
elif [[ $gpu == 1 && $cuda == OFF ]]; then
  echo "run.sh: WARNING: a GPU is present but FLASHATTN_CUDA=OFF: building without the CUDA" \
       "backend; the call below runs on the CPU" >&2
fi

cuda_args=()
if [[ $cuda == ON ]]; then
  nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  if [[ ! -x $nvcc ]]; then
    fail "the CUDA backend is needed$([[ $gpu == 1 ]] && echo " (a GPU is present)") but there is" \
         "no nvcc on PATH or in ${CUDA_HOME:-/usr/local/cuda}/bin. Install the CUDA toolkit (12.x)" \
         "and put its bin/ on PATH (or set CUDA_HOME), or set FLASHATTN_CUDA=OFF to run on the CPU."
  fi
  if ! scripts/fetch_cutlass.sh; then
    fail "the CUTLASS headers the CUDA kernels need are not in .deps/cutlass and could not be" \
         "downloaded (scripts/fetch_cutlass.sh: pip download nvidia-cutlass). Run" \
         "scripts/fetch_cutlass.sh on a machine with network access and copy its .deps/cutlass" \
         "here, then run this again; or set FLASHATTN_CUDA=OFF to run on the CPU."
  fi
  archs=${FLASHATTN_CUDA_ARCHS:-}
  if [[ -z $archs && $gpu == 1 ]]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')
    case $cap in
      9.0) archs=90a ;;  # H100 / H200: the Hopper kernels and the sm80 ones
      8.*) archs=80 ;;
      *) echo "run.sh: compute capability '$cap': building for the default architectures" \
              "(set FLASHATTN_CUDA_ARCHS to choose)" >&2 ;;
    esac
  fi
  cuda_args=(-DCMAKE_CUDA_COMPILER="$nvcc")
  [[ -n $archs ]] && cuda_args+=(-DCMAKE_CUDA_ARCHITECTURES="$archs")
  echo "run.sh: building the CUDA backend with $nvcc${archs:+ for CUDA architectures $archs}"
fi

build=${FLASHATTN_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA="$cuda" \
  -DFLASHATTN_BUILD_TESTS=OFF "${cuda_args[@]}"
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

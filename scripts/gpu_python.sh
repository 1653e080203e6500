#!/usr/bin/env bash
# The Python package on the GPU machine in one call: builds and installs it with the CUDA backend
# (scripts/gpu_package.sh's install_package, into build-python: archs $FLASHATTN_CUDA_ARCHS,
# default 90a; head dims $FLASHATTN_CUDA_HEAD_DIMS, default the tests' 64;128), runs the whole
# pytest suite (numpy, PyTorch CPU + CUDA, CuPy, JAX) and the per-call overhead benchmark. Logs and
# results go to $OUT, else build-python/gpu.
# Needs the CUTLASS headers in .deps/cutlass (scripts/fetch_cutlass.sh; carry .deps).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-$repo/build-python/gpu}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
export FLASHATTN_CUDA_HEAD_DIMS=${FLASHATTN_CUDA_HEAD_DIMS:-64;128}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would otherwise take 75% of the GPU's memory
source scripts/gpu_package.sh  # install_package

start=$SECONDS
install_package build-python || { cp build-python/pip.log "$out/pip.log"; exit 1; }
cp build-python/pip.log "$out/pip.log"
echo "build + install: $((SECONDS - start)) s"
python3 -c "import flashattn; print('flashattn', flashattn.__version__, 'cuda', flashattn.cuda_compiled(), len(flashattn.cuda_kernels()), 'kernels')"

status=0
(cd tests/python && python3 -m pytest -q -rs -p no:cacheprovider . 2>&1) | tee "$out/pytest.log" || status=1
python3 bench/python_overhead.py --out "$out/python_overhead.json" 2>&1 | tee "$out/python_overhead.txt" || status=1
exit $status

#!/usr/bin/env bash
# Builds and runs every test this machine can run, and prints the test runner's summary:
#   0. the sources formatted as .clang-format says (scripts/format.sh --check, clang-format 14);
#   1. release build (warnings are errors) of the CPU library, all C++ tests through CTest
#      (FLASHATTN_CUDA=ON builds every CUDA kernel into it too, slowly);
#   2. the installed CMake package used by the example consumers (C++ API and C ABI);
#   3. when nvcc is present: the CUDA kernels' representative compile set (every family, both
#      dtypes, two head dims, every mask kind; each kernel compiled once; warnings are errors;
#      the full set, sm_90a included, is scripts/gpu_check.sh's): the sm80 forward for bf16 d128
#      (the flagship, Q held in registers) and fp16 d256 (Q partly in registers), the sm80
#      backward for d128 in both dtypes (the largest the no-spill bar covers),
#      $FLASHATTN_CI_SM80_INSTANCES; the decode and FA1-order teaching kernels, all for sm_80
#      (the bf16 d128 forward for sm_90a too, where its sm90-tuned tiles are compiled);
#      the Hopper family for sm_90a, bf16 d128 masked, fp16 d64 unmasked (three consumer
#      warpgroups), bf16 d256 masked and bf16 d128 block-sparse forwards and the fp16 d64
#      unmasked (dense and varlen), bf16 d128 masked and bf16 d192 masked (the opt-in kernel
#      whose consumers run bodies of their own) backwards (their raw-score kernels: the softcap /
#      ALiBi ones keep 8 bytes of stack),
#      $FLASHATTN_CI_SM90_INSTANCES. Then their static checks
#      on the built objects (tests/check_cuda_kernels.py: no spills or stack; HMMA / LDSM /
#      LDGSTS, HGMMA / UTMALDG / UTMASTG / UBLKRED, 16-byte cp.async in the SASS), and the
#      host-only kernel tests, through CTest:
#      test_sm80_layouts (fragment layouts); test_sm80_emulated, test_sm80_backward_emulated,
#      test_fa1_order_emulated (the kernels' own code run on the CPU, one fiber per CUDA thread,
#      every tile shape, against the fp64 reference); test_decode_emulated (the decode kernels
#      against the CPU backend); test_varlen_checks_emulated (the device-side varlen length
#      check against the host's); test_sm90_forward's Sm90Dispatch and test_sm90_backward's
#      Sm90BackwardDispatch, test_value_head_dim's ValueHeadDimArguments (the CUDA backend's
#      refusal of a v with its own head_dim, by name) (no GPU needed). The full
#      CUDA build and the GPU tests run on the GPU machine (scripts/gpu_check.sh);
#   4. an AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU library and tests,
#      run with FLASHATTN_TEST_QUICK=1 (the largest shapes dropped) and without the bfloat16
#      twins of the float16 tests (the same code on elements of the same size);
#   5. the Python package: `pip install .` (CPU backend; FLASHATTN_CUDA=AUTO builds the CUDA one
#      where nvcc and the CUTLASS headers are) and its pytest suite (tests/python) with PyTorch on
#      CPU tensors: autograd, the custom ops and their fakes, torch.compile, the import orders;
#      the GPU tests are skipped, with the reason shown, where no GPU is present.
# Seeds are fresh each run and printed; FLASHATTN_TEST_SEED=<n> replays one.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

# section <name>: starts a section (its "=== name" line); the sections' wall times are printed
# before the last one (CI must finish within 40 minutes on a 2-core machine: where does it go).
timings=()
section() {
  [[ -n ${section_name:-} ]] && timings+=("$(printf '%5d s  %s' $((SECONDS - section_start)) "$section_name")")
  section_name=$1
  section_start=$SECONDS
  echo "=== $1"
}

section "dependencies"
scripts/install_deps.sh
jobs=$(nproc)

section "format"
scripts/format.sh --check

section "release build and tests"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_WERROR=ON \
  -DFLASHATTN_CUDA="${FLASHATTN_CUDA:-OFF}"
cmake --build build -j "$jobs"
ctest --test-dir build -j "$jobs" --output-on-failure

section "install and example consumers"
.ci/check_install.sh build

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [[ -x $nvcc ]]; then
  section "CUDA kernels: compile set and static checks"
  scripts/fetch_cutlass.sh
  # Each tool where check_cuda_kernels.py looks for it (PATH, the toolkit, pip's nvidia/*/bin),
  # else from PyPI: a toolkit may ship one without the other.
  for tool in cuobjdump nvdisasm; do
    command -v "$tool" >/dev/null || [[ -x /usr/local/cuda/bin/$tool ]] ||
      python3 -c "import glob, site, sys; sys.exit(not any(glob.glob(f'{p}/nvidia/**/bin/$tool', recursive=True)
                                                            for p in site.getsitepackages()))" ||
      python3 -m pip install -q --disable-pip-version-check "nvidia-cuda-$tool"
  done
  # The static checks read these objects: no kernel is compiled twice (the compile set is most
  # of CI's 40 minutes on 2 cores).
  cmake -S . -B build-cuda-ci -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_WERROR=ON -DFLASHATTN_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=80 -DFLASHATTN_CUDA_SM90=ON \
    -DFLASHATTN_CUDA_DECODE=ON -DFLASHATTN_CUDA_HEAD_DIMS="64;128;192;256" \
    -DFLASHATTN_CUDA_SM80_INSTANCES="${FLASHATTN_CI_SM80_INSTANCES-fwd_bf16_d128;fwd_fp16_d256;bwd_fp16_d128;bwd_bf16_d128}" \
    -DFLASHATTN_CUDA_SM90_INSTANCES="${FLASHATTN_CI_SM90_INSTANCES-bf16_d128_masked;fp16_d64_none;bf16_d256_masked;bf16_d128_blocksparse;bwd_fp16_d64_none;bwd_fp16_d64_none_varlen;bwd_bf16_d128_masked;bwd_bf16_d128_dropout;bwd_bf16_d192_masked;bwd_bf16_d256_none}" \
    -DFLASHATTN_CUDA_SM90_BLOCK_SPARSE=ON -DFLASHATTN_CUDA_SM90_BACKWARD_D192=ON -DFLASHATTN_CUDA_SM90_BACKWARD_D256=ON \
    -DFLASHATTN_CUDA_SM90_BACKWARD_DROPOUT=ON \
    -DFLASHATTN_CUDA_SM80_SM90A_CHECK=fwd_bf16_d128 -DFLASHATTN_BUILD_TESTS=ON -DFLASHATTN_BUILD_CLI=OFF
  # The library, the teaching kernels and the host-only kernel tests (the GPU tests are the GPU
  # machine's).
  cmake --build build-cuda-ci -j "$jobs" --target flashattn flashattn_fa1_teaching flashattn_sm80_sm90a_check test_sm80_layouts \
    test_sm80_emulated test_sm80_backward_emulated test_fa1_order_emulated test_sm90_forward test_sm90_backward test_decode_emulated test_varlen_checks_emulated \
    test_dropout_transposed_emulated \
    test_value_head_dim
  FLASHATTN_CHECK_ARCHS=80 FLASHATTN_CHECK_SM90=1 FLASHATTN_CHECK_DECODE=1 \
    tests/check_cuda_kernels.py build-cuda-ci "$jobs"
  section "CUDA kernels' own code on the CPU: fragment layouts, and every tile shape emulated"
  # Through CTest, one test case a process, two at a time (each emulation runs on one core); the
  # build's other test executables are not built here, hence the filter.
  ctest --test-dir build-cuda-ci -j "$jobs" --output-on-failure --no-tests=error \
    -R '^(Sm80Layouts|Sm80Emulated|Sm80BackwardEmulated|Fa1Schedule|Fa1OrderEmulated|DecodeEmulated|VarlenChecksEmulated|Sm90Dispatch|Sm90BackwardDispatch|ValueHeadDimArguments|DropoutTransposed)\.'
else
  echo "=== no nvcc: CUDA compile set and static checks skipped"
fi

section "ASan + UBSan build and tests"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHATTN_WERROR=ON \
  -DFLASHATTN_CUDA=OFF -DFLASHATTN_BUILD_CLI=OFF -DFLASHATTN_SANITIZE=address,undefined
cmake --build build-asan -j "$jobs"
FLASHATTN_TEST_QUICK=1 ctest --test-dir build-asan -j "$jobs" --output-on-failure -E '/bfloat16( |$)'

section "Python package and tests"
echo "=== wall time so far, by section (total $SECONDS s):"
printf '%s\n' "${timings[@]}"
FLASHATTN_CUDA="${FLASHATTN_CUDA:-OFF}" python3 -m pip install -q --disable-pip-version-check \
  -C cmake.define.FLASHATTN_WERROR=ON .
# From the tests' directory, so `import flashattn` is the installed package, not ./python.
(cd tests/python && python3 -m pytest -q -rs .)

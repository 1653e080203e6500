# Sourced by the GPU benchmark scripts (gpu_bench.sh, gpu_bench_backward.sh), from the repository
# root: builds libflashattn with the CUDA backend, library only, for archs $FLASHATTN_CUDA_ARCHS
# (default 90a); $FLASHATTN_EXTRA_CMAKE_ARGS (word-split) adds configure options, e.g.
# "-DFLASHATTN_CUDA_BACKWARD_HEAD_DIMS=none -DFLASHATTN_CUDA_DECODE=OFF" for a forward-only build.
#   build_bench_lib <dir> <head dims> <jobs> [extra flags: to the kernels and to the registry,
#                   which must agree on the tile shapes]
build_bench_lib() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${FLASHATTN_CUDA_ARCHS:-90a}" -DFLASHATTN_CUDA_HEAD_DIMS="$2" \
    -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_CLI=OFF -DCMAKE_CUDA_FLAGS="${4:-}" -DCMAKE_CXX_FLAGS="${4:-}" \
    ${FLASHATTN_EXTRA_CMAKE_ARGS:-} &&
    cmake --build "$1" -j "$3"
}

#!/usr/bin/env bash
# Same-run A/B timing of kernel variants on the GPU machine (tuning): builds one library per
# variant, in parallel, then runs the forward, varlen or backward benchmark over the same configs
# for each variant in alternating rounds (a b a b ...), and prints one table: per config, ours /
# FA2 for every variant and round (FA2 timed in the same process each time, so the ratios compare
# across variants; the spread between rounds says what is noise).
#
#   scripts/gpu_ab.sh <forward|varlen|backward> "<variants>" [benchmark arguments]
#   e.g. scripts/gpu_ab.sh backward "new= old=-DFLASHATTN_SM80_BWD_FOO base=@build-ab-base" \
#          --head-dims 128 --seqlens 1024,4096 --dtypes bfloat16
#
# A variant is name=flags (compile definitions for both the kernels and the registry, which must
# agree on tile shapes; empty for the tree as it is), name=@dir for another source tree, e.g.
# the committed baseline, written on the CPU machine with
#   mkdir -p build-ab-base && git archive HEAD CMakeLists.txt src include cmake | tar -x -C build-ab-base
# and carried (build-* is ignored), or name=lib:<path> for a library built beforehand (on the CPU
# machine, carried: no device time spent building; nothing checks what it was built from).
# $FLASHATTN_CUDA_HEAD_DIMS (default 128) limits the builds, $FLASHATTN_EXTRA_CMAKE_ARGS adds
# configure options to every build (bench_build.sh), $AB_ROUNDS (default 2) sets the rounds,
# $AB_OURS (default flashattn) which of our timings the table compares (e.g. flashattn_p256 with
# gpu_varlen.py --page-sizes 256); the JSON and Markdown of every round land in
# $OUT/<name>-<round>/. Builds need .deps (carry it); the benchmark's own defaults apply otherwise
# (add --memory-seqlens '' to a backward run to skip its memory sweep).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-$repo/build-ab/out}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
source scripts/bench_build.sh  # build_bench_lib

[[ $# -ge 2 && $1 =~ ^(forward|varlen|backward)$ ]] || { sed -n 2,24p "$0"; exit 2; }
direction=$1
read -r -a variants <<< "$2"
shift 2
dims=${FLASHATTN_CUDA_HEAD_DIMS:-128}
jobs=$(( ($(nproc) + ${#variants[@]} - 1) / ${#variants[@]} ))

start=$SECONDS
names=()
declare -A libs
for spec in "${variants[@]}"; do
  name=${spec%%=*}
  value=${spec#*=}
  [[ $name != "$spec" && -n $name ]] || { echo "variant '$spec' is not name=flags, name=@dir or name=lib:<path>" >&2; exit 2; }
  names+=("$name")
  dir=$repo/build-ab/$name
  libs[$name]=$dir/libflashattn.so
  if [[ $value == lib:* ]]; then
    libs[$name]=$(realpath "${value#lib:}")
    [[ -f ${libs[$name]} ]] || { echo "variant $name: no library ${libs[$name]}" >&2; exit 2; }
    continue
  elif [[ $value == @* ]]; then
    src=$(realpath "${value#@}")
    (cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
       -DFLASHATTN_CUTLASS_DIR="$repo/.deps/cutlass/include" \
       -DCMAKE_CUDA_ARCHITECTURES="${FLASHATTN_CUDA_ARCHS:-90a}" -DFLASHATTN_CUDA_HEAD_DIMS="$dims" \
       -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_CLI=OFF ${FLASHATTN_EXTRA_CMAKE_ARGS:-} &&
       cmake --build "$dir" -j "$jobs") \
      > "$out/build-$name.log" 2>&1 &
  else
    build_bench_lib "$dir" "$dims" "$jobs" "$value" > "$out/build-$name.log" 2>&1 &
  fi
done
for pid in $(jobs -pr); do
  wait "$pid" || { tail -n 30 "$out"/build-*.log; exit 1; }
done
echo "builds: $((SECONDS - start)) s"

for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    python3 "bench/gpu_$direction.py" --lib "${libs[$name]}" --out "$out/$name-$round" "$@" \
      > "$out/$name-$round.log" 2>&1 || { tail -n 30 "$out/$name-$round.log"; exit 1; }
    echo "round $round, $name: $((SECONDS - start)) s"
  done
done

# One row per config, one column per (variant, round): ours / FA2, and for the backward the
# backward alone after the forward + backward ratio.
python3 - "$direction" "$out" "${AB_ROUNDS:-2}" "${AB_OURS:-flashattn}" "${names[@]}" <<'EOF'
import json, sys
direction, out, rounds, ours, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
columns = [(n, r) for r in range(1, rounds + 1) for n in names]
tables = {c: json.load(open(f"{out}/{c[0]}-{c[1]}/{direction}.json"))["rows"] for c in columns}
def ratio(part):
    return part["tflops"][ours] / part["tflops"]["fa2"]
def cell(row):
    if direction != "backward":
        return f"{ratio(row):.3f}"
    return f"{ratio(row['fwd_bwd']):.3f}/{ratio(row['bwd']):.3f}"
key = lambda r: (r["dtype"], r["head_dim"], "causal" if r["causal"] else "none", r.get("seqlen", r.get("mix")))
print(f"{ours} / FA2" + (" (fwd+bwd/bwd)" if direction == "backward" else "") + " per variant-round")
print(f"{'config':<28}" + "".join(f"{n + '-' + str(r):>16}" for n, r in columns))
for i, row in enumerate(tables[columns[0]]):
    cells = [cell(tables[c][i]) for c in columns]
    print(f"{' '.join(map(str, key(row))):<28}" + "".join(f"{c:>16}" for c in cells))
EOF

#!/usr/bin/env bash
# Same-run A/B timing of kernel variants on the GPU machine (tuning): builds one Python package per
# variant, in parallel, then runs the forward, varlen or backward benchmark over the same configs
# for each variant in alternating rounds (a b a b ...), each round importing its variant's package,
# and prints one table: per config, ours / FA2 for every variant and round (FA2 timed in the same
# process each time, so the ratios compare across variants; the spread between rounds says what
# is noise).
#
#   scripts/gpu_ab.sh <forward|varlen|backward> "<variants>" [benchmark arguments]
#   e.g. scripts/gpu_ab.sh backward "new= old=-DFLASHATTN_SM80_BWD_FOO base=@build-ab-base" \
#          --head-dims 128 --seqlens 1024,4096 --dtypes bfloat16
#
# A variant is name=flags (compile definitions for both the kernels and the registry, which must
# agree on tile shapes; empty for the tree as it is), name=@dir for another source tree, e.g.
# the committed baseline, written on the CPU machine with
#   mkdir -p build-ab-base && git archive HEAD CMakeLists.txt pyproject.toml python src include cmake |
#     tar -x -C build-ab-base
# and carried (build-* is ignored), or name=site:<path> for a package installed beforehand into
# <path> (scripts/gpu_package.sh <folder> on a machine with nvcc, <path> = <folder>/site, carried:
# no device time spent building; nothing checks what it was built from). Builds go to
# build-ab/<name> (scripts/gpu_package.sh's install_package). $AB_ENV_<name> (e.g.
# AB_ENV_new="FLASHATTN_FOO=1 FLASHATTN_BAR=0") sets environment variables for that variant's
# runs only: two variants may share a package and differ in a runtime switch.
# $FLASHATTN_CUDA_HEAD_DIMS (default 128) limits the builds, $FLASHATTN_EXTRA_CMAKE_ARGS adds
# configure options to every build, $AB_ROUNDS (default 2) sets the rounds,
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
source scripts/gpu_package.sh  # install_package

if [[ $# -lt 2 || ! $1 =~ ^(forward|varlen|backward)$ ]]; then
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the comment above
  exit 2
fi
direction=$1
read -r -a variants <<< "$2"
shift 2
export FLASHATTN_CUDA_HEAD_DIMS=${FLASHATTN_CUDA_HEAD_DIMS:-128}
export CMAKE_BUILD_PARALLEL_LEVEL=$(( ($(nproc) + ${#variants[@]} - 1) / ${#variants[@]} ))

start=$SECONDS
names=()
declare -A sites
for spec in "${variants[@]}"; do
  name=${spec%%=*}
  value=${spec#*=}
  [[ $name != "$spec" && -n $name ]] || { echo "variant '$spec' is not name=flags, name=@dir or name=site:<path>" >&2; exit 2; }
  names+=("$name")
  folder=$repo/build-ab/$name
  sites[$name]=$folder/site
  if [[ $value == site:* ]]; then
    sites[$name]=$(realpath "${value#site:}")
    [[ -d ${sites[$name]}/flashattn ]] || { echo "variant $name: no package in ${sites[$name]}" >&2; exit 2; }
    continue
  elif [[ $value == @* ]]; then
    (FLASHATTN_PACKAGE_SOURCE=${value#@} install_package "$folder") 2> /dev/null &
  elif [[ -n $value ]]; then
    install_package "$folder" "-DCMAKE_CUDA_FLAGS=$value" "-DCMAKE_CXX_FLAGS=$value" 2> /dev/null &
  else
    install_package "$folder" 2> /dev/null &
  fi
done
for pid in $(jobs -pr); do
  wait "$pid" || { tail -n 30 "$repo"/build-ab/*/pip.log; exit 1; }
done
echo "builds: $((SECONDS - start)) s"

for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    variant_env=()
    env_name=AB_ENV_$name
    [[ $env_name =~ ^[A-Za-z0-9_]+$ ]] && read -r -a variant_env <<< "${!env_name:-}"
    env "${variant_env[@]}" PYTHONPATH=${sites[$name]}${PYTHONPATH:+:$PYTHONPATH} python3 "bench/gpu_$direction.py" \
      --out "$out/$name-$round" "$@" > "$out/$name-$round.log" 2>&1 || { tail -n 30 "$out/$name-$round.log"; exit 1; }
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

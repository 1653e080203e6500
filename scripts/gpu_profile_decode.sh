#!/usr/bin/env bash
# Nsight Compute on one decode call (GPU machine): where the decode kernel's warps stall, per
# SASS instruction, for a shape whose time is latency rather than bandwidth.
#
#   scripts/gpu_profile_decode.sh SITE B,CTX,HKV[,PAGE] [kernel-name regex, default decode_]
#
# SITE: the site folder of the Python package to profile (e.g. build-bench/site after
# scripts/bench.sh, or <build>/package/site after scripts/gpu_decode.sh; scripts/gpu_package.sh
# installs one). Writes to $OUT (else build-profile-decode): decode.ncu-rep, details.txt (the
# sections) and source.csv (SASS with its stall samples), and prints the sections' key lines and
# the 25 instructions with the most stall samples. ncu flushes the caches before the kernel (as the
# benchmarks' L2 flush does) and is told to leave the clocks alone.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-$repo/build-profile-decode}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
site=$(realpath "$1")
[[ -d $site/flashattn ]] || { echo "no flashattn package in $site" >&2; exit 2; }
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
ncu --set full --import-source no --clock-control none --cache-control all \
  --kernel-name "regex:${3:-decode_}" --launch-skip 3 --launch-count 1 -f -o "$out/decode" \
  python3 bench/decode_profile.py --calls-only "$2" > "$out/ncu.log" 2>&1 || { tail -n 30 "$out/ncu.log"; exit 1; }
ncu -i "$out/decode.ncu-rep" --page details > "$out/details.txt"
ncu -i "$out/decode.ncu-rep" --page source --csv --print-source sass > "$out/source.csv"
grep -E "Duration|Elapsed Cycles|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Ipc|DRAM Throughput|Memory Throughput" \
  "$out/details.txt" | head -n 40
python3 - "$out/source.csv" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
if lines and lines[0].startswith('"Kernel Name"'):  # (one line naming the kernel before the header)
    lines = lines[1:]
rows = list(csv.DictReader(lines))
key = next((k for k in rows[0] if k and k.startswith("Warp Stall Sampling (All")), None)
if key is None:
    sys.exit("no stall-sampling column in " + ", ".join(rows[0]))
def n(r):
    try:
        return float(r[key] or 0)
    except ValueError:
        return 0.0
total = sum(n(r) for r in rows)
executed = sum(float(r.get("Instructions Executed") or 0) for r in rows)
print(f"stall samples: {total:.0f}; warp instructions executed: {executed:.0f}")
for r in sorted(rows, key=n, reverse=True)[:25]:
    print(f"{n(r):6.0f} {100 * n(r) / max(total, 1):5.1f}%  {r.get('Address') or ''}  {(r.get('Source') or '')[:90]}")
PY

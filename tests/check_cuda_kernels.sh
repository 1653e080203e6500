#!/usr/bin/env bash
# Static checks of the CUDA forward kernels; needs no GPU.
#   tests/check_cuda_kernels.sh <build dir> [jobs]
# 1. Recompiles every generated kernel file of <build dir> (its compile_commands.json entry) for
#    sm_80 (and the other archs in $FLASHATTN_CHECK_ARCHS, e.g. "80 90a") with `ptxas -v` and
#    asserts 0 bytes of spill stores and of stack frame (no local memory) for every forward kernel.
# 2. Disassembles the built library's sm_80 code (cuobjdump --dump-sass) and asserts every forward
#    kernel contains the instructions it was written for: HMMA (mma.sync), LDSM (ldmatrix) and
#    LDGSTS (cp.async).
# Prints a per-kernel summary (registers, spills, stack, instruction counts).
# cuobjdump / nvdisasm: from the CUDA toolkit, or `pip install nvidia-cuda-cuobjdump
# nvidia-cuda-nvdisasm` (found in the active Python's site-packages).
set -euo pipefail
build=${1:?usage: tests/check_cuda_kernels.sh <build dir> [jobs]}
build=$(cd "$build" && pwd)
jobs=${2:-$(nproc)}
archs=${FLASHATTN_CHECK_ARCHS:-80}
commands=$build/compile_commands.json
[[ -f $commands ]] || { echo "error: $commands missing (configure with FLASHATTN_CUDA=ON)" >&2; exit 2; }

# --- tools ----------------------------------------------------------------------------------------
find_tool() {
  local name=$1 dir
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
  for dir in /usr/local/cuda/bin $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    for f in "$dir/$name" "$dir"/nvidia/*/bin/"$name" "$dir"/nvidia/*/*/bin/"$name"; do
      [[ -x $f ]] && { echo "$f"; return; }
    done
  done
  return 1
}
cuobjdump=$(find_tool cuobjdump) || { echo "error: cuobjdump not found (pip install nvidia-cuda-cuobjdump)" >&2; exit 2; }
nvdisasm=$(find_tool nvdisasm) || { echo "error: nvdisasm not found (pip install nvidia-cuda-nvdisasm)" >&2; exit 2; }
export PATH="$(dirname "$nvdisasm"):$PATH"  # cuobjdump runs nvdisasm for --dump-sass
library=$(find "$build" -maxdepth 2 \( -name 'libflashattn.so' -o -name 'libflashattn.a' \) | head -n 1)
[[ -n $library ]] || { echo "error: no libflashattn in $build (build it first)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- 1. ptxas -v for sm_80 ---------------------------------------------------------------------------
python3 - "$commands" "$work" $archs > "$work/jobs.txt" <<'EOF'
import json, shlex, sys, os
commands, work, archs = sys.argv[1], sys.argv[2], sys.argv[3:]
for entry in json.load(open(commands)):
    src = entry["file"]
    if "/generated/cuda/" not in src or not src.endswith(".cu"):
        continue
    args = shlex.split(entry["command"])
    if os.path.basename(args[0]) == "ccache":
        args = args[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a.startswith("--generate-code") or a.startswith("-gencode") or a == "-c":
            continue
        out.append(a)
    for arch in archs:
        cubin = os.path.join(work, "%s.sm_%s.cubin" % (os.path.basename(src), arch))
        flags = ["-gencode", "arch=compute_%s,code=sm_%s" % (arch, arch), "-cubin", "-Xptxas=-v", "-o", cubin]
        print(entry["directory"] + "\t" + shlex.join(out + flags))
EOF
count=$(wc -l < "$work/jobs.txt")
((count > 0)) || { echo "error: no generated kernel files in $commands" >&2; exit 2; }
echo "ptxas -v for sm_${archs// /, sm_}: $count compilations, $jobs jobs"
i=0
while IFS=$'\t' read -r dir cmd; do
  printf '%s\t%s\n' "$dir" "$cmd" > "$work/job$i.txt"
  i=$((i + 1))
done < "$work/jobs.txt"
ls "$work"/job*.txt | xargs -P "$jobs" -I{} bash -c \
  'IFS=$'"'"'\t'"'"' read -r dir cmd < "$1"; cd "$dir" && eval "$cmd" > "$1.log" 2>&1 || { cat "$1.log" >&2; exit 1; }' _ {}
cat "$work"/job*.txt.log > "$work/ptxas.log"

# --- 2. SASS of the built library, sm_80 ----------------------------------------------------------------
"$cuobjdump" --dump-sass --gpu-architecture sm_80 "$library" > "$work/sass80.txt" 2> "$work/sass80.err" || true

python3 - "$work/ptxas.log" "$work/sass80.txt" <<'EOF'
import re, subprocess, sys
ptxas_log, sass_file = sys.argv[1], sys.argv[2]

def short(mangled):
    """forward_kernel<ForwardTraits<(ElemType)0, 128>, (MaskKind)1> -> sm80_fwd_fp16_d128_masked"""
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    except OSError:
        return mangled
    m = re.search(r"ForwardTraits<\(flashattn::cuda::ElemType\)(\d), (\d+)(?:, \(flashattn::cuda::MaskKind\)\d)?>, \(flashattn::cuda::MaskKind\)(\d)", name)
    if not m:
        return name
    return "sm80_fwd_%s_d%s_%s" % ("fp16" if m.group(1) == "0" else "bf16", m.group(2),
                                   {"0": "nomask", "1": "masked", "2": "dropout"}[m.group(3)])

kernels = {}
current = None
for line in open(ptxas_log):
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'", line)
    if m:
        current = (m.group(1), m.group(2))
        kernels[current] = {}
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and current:
        kernels[current].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and current:
        kernels[current]["regs"] = int(m.group(1))

sass = {}
current = None
for line in open(sass_file):
    m = re.search(r"Function : (\S+)", line)
    if m:
        current = m.group(1)
        sass[current] = {"HMMA": 0, "LDSM": 0, "LDGSTS": 0}
        continue
    if current:
        for op in sass[current]:
            if re.search(r"\b%s\b" % op, line):
                sass[current][op] += 1

forward = [k for k in kernels if "forward_kernel" in k[0]]
failures = []
print("%-28s %-6s %5s %9s %9s %6s %6s %6s %7s" % ("kernel", "arch", "regs", "spill_st", "spill_ld", "stack",
                                                   "HMMA", "LDSM", "LDGSTS"))
for k in sorted(forward, key=lambda k: (k[1], short(k[0]))):
    name, arch = short(k[0]), k[1]
    p = kernels[k]
    s = sass.get(k[0]) if arch == "sm_80" else None
    counts = (s["HMMA"], s["LDSM"], s["LDGSTS"]) if s else ("-", "-", "-")
    print("%-28s %-6s %5s %9s %9s %6s %6s %6s %7s" % ((name, arch, p.get("regs"), p.get("spill_st"),
                                                       p.get("spill_ld"), p.get("stack")) + counts))
    if p.get("spill_st", 1) != 0:
        failures.append("%s (%s): %s bytes spill stores" % (name, arch, p.get("spill_st")))
    if p.get("stack", 1) != 0:  # fragments in local memory, e.g. behind a call NVVM did not inline
        failures.append("%s (%s): %s bytes stack frame" % (name, arch, p.get("stack")))
    if arch != "sm_80":
        continue
    if s is None:
        failures.append("%s: not in the library's sm_80 SASS" % name)
    else:
        for op in ("HMMA", "LDSM", "LDGSTS"):
            if s[op] == 0:
                failures.append("%s: no %s in sm_80 SASS" % (name, op))
if not forward:
    failures.append("no forward kernels in the ptxas report")
if failures:
    print("FAILED:")
    for f in failures:
        print("  " + f)
    sys.exit(1)
print("OK: %d forward kernel compilations, 0 bytes spill stores or stack, HMMA/LDSM/LDGSTS in every sm_80 kernel"
      % len(forward))
EOF

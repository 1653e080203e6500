#!/usr/bin/env bash
# Static checks of the CUDA forward and backward kernels (and the FA1-order teaching kernel of
# src/cuda/teaching, when the build has it); needs no GPU.
#   tests/check_cuda_kernels.sh <build dir> [jobs]
# 1. Recompiles every generated kernel file of <build dir> (its compile_commands.json entry) for
#    each arch in $FLASHATTN_CHECK_ARCHS (default "80"; e.g. "80 90a") with `ptxas -v` and
#    asserts 0 bytes of spill stores and of stack frame (no local memory) for every forward kernel
#    and every backward kernel of head_dim <= 128 (larger backward kernels are reported only: their
#    dK / dV accumulators alone take 128 registers a thread).
# 2. Disassembles those cubins (cuobjdump --dump-sass) and asserts every kernel contains the
#    instructions it was written for: HMMA (mma.sync), LDSM (ldmatrix) and LDGSTS (cp.async).
#    A kernel whose code for an arch is a stub (src/cuda/sm80/tile_shapes.hpp target_compiled_for:
#    sm90-tuned kernels outside sm_90, sm80-tuned ones in sm_90 where an sm90-tuned twin exists)
#    must have none of them there instead.
# 3. The sm90a forward kernels (src/cuda/sm90, compiled for sm_90a alone), on the objects the
#    build made: no stack or local memory (cuobjdump -res-usage), and HGMMA (WGMMA), UTMALDG and
#    UTMASTG (TMA load / store) in their SASS. FLASHATTN_CHECK_SM90=1 fails when there are none.
# 4. The KV-cache decode kernels (src/cuda/decode, FLASHATTN_CUDA_DECODE=ON), on the objects the
#    build made for its archs: no stack or local memory, 16-byte asynchronous copies (cp.async:
#    LDGSTS...128) of K / V in every decode kernel. FLASHATTN_CHECK_DECODE=1 fails when there are none.
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

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- 1. ptxas -v for sm_80 ---------------------------------------------------------------------------
python3 - "$commands" "$work" $archs > "$work/jobs.txt" <<'EOF'
import json, shlex, sys, os
commands, work, archs = sys.argv[1], sys.argv[2], sys.argv[3:]
for entry in json.load(open(commands)):
    src = entry["file"]
    if "/src/cuda/decode/" in src and src.endswith(".cu"):  # checked on the built object (section 4)
        args = shlex.split(entry["command"])
        with open(os.path.join(work, "decode_objects.txt"), "a") as f:
            f.write(os.path.join(entry["directory"], args[args.index("-o") + 1]) + "\n")
        continue
    if ("/generated/cuda/" not in src and "/generated/teaching/" not in src) or not src.endswith(".cu"):
        continue
    args = shlex.split(entry["command"])
    if "/generated/cuda/sm90/" in src:  # checked on the built object (section 3)
        with open(os.path.join(work, "sm90_objects.txt"), "a") as f:
            f.write(os.path.join(entry["directory"], args[args.index("-o") + 1]) + "\n")
        continue
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

# --- 2. SASS of the same cubins ---------------------------------------------------------------------
for cubin in "$work"/*.cubin; do
  "$cuobjdump" --dump-sass "$cubin" >> "$work/sass.txt" 2>> "$work/sass.err" || true
done

status=0
python3 - "$work/ptxas.log" "$work/sass.txt" <<'EOF' || status=1
import re, subprocess, sys
ptxas_log, sass_file = sys.argv[1], sys.argv[2]

def parse(mangled):
    """forward_kernel<ForwardTraits<(ElemType)0, 128, (MaskKind)1, (TileTarget)90>, (MaskKind)1>
    -> ("fp16", 128, "masked", 90, "fwd"); backward_kernel<BackwardTraits<(ElemType)1, 256,
    (MaskKind)1, (TileTarget)80>, (MaskKind)1> -> ("bf16", 256, "masked", 80, "bwd"); or None"""
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    m = re.search(r"teaching::Fa1Traits<\(flashattn::cuda::ElemType\)(\d), (\d+)>", name)
    if m:  # the FA1-order teaching kernel: a forward kernel of its own tile shapes
        return ("fp16" if m.group(1) == "0" else "bf16", int(m.group(2)), "fa1order", 80, "teaching")
    m = re.search(r"(Forward|Backward)Traits<\(flashattn::cuda::ElemType\)(\d), (\d+)(?:, \(flashattn::cuda::MaskKind\)\d)?"
                  r"(?:, \(flashattn::cuda::sm80::TileTarget\)(\d+))?>, \(flashattn::cuda::MaskKind\)(\d)", name)
    if not m:
        return None
    return ("fp16" if m.group(2) == "0" else "bf16", int(m.group(3)),
            {"0": "nomask", "1": "masked", "2": "dropout"}[m.group(5)], int(m.group(4) or 80),
            "fwd" if m.group(1) == "Forward" else "bwd")

def short(key):  # as src/cuda/kernel_registry.cpp names it
    if key[4] == "teaching":
        return "teaching_%s_d%d_%s" % (key[0], key[1], key[2])
    return "sm80_%s_%s_d%d_%s%s" % (key[4], key[0], key[1], key[2], "" if key[3] == 80 else "_sm%dtiles" % key[3])

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

# SASS per (function, arch): cuobjdump heads each cubin with "code for sm_90a".
sass = {}
current, arch = None, None
for line in open(sass_file):
    m = re.search(r"code for (sm_\d+a?)", line)
    if m:
        arch = m.group(1)
        continue
    m = re.search(r"Function : (\S+)", line)
    if m:
        current = (m.group(1), arch)
        sass[current] = {"HMMA": 0, "LDSM": 0, "LDGSTS": 0}
        continue
    if current:
        for op in sass[current]:
            if re.search(r"\b%s\b" % op, line):
                sass[current][op] += 1

forward = {k: parse(k[0]) for k in kernels if "forward_kernel" in k[0]}
backward = {k: parse(k[0]) for k in kernels if "backward_kernel" in k[0]}
teaching = {k: parse(k[0]) for k in kernels if "fa1_order_kernel" in k[0]}
sm90_tuned = {key[:3] + key[4:] for key in list(forward.values()) + list(backward.values()) if key and key[3] == 90}

def is_stub(key, arch):  # tile_shapes.hpp target_compiled_for
    sm90 = arch.startswith("sm_9")
    return not sm90 if key[3] == 90 else sm90 and key[:3] + key[4:] in sm90_tuned

SPILL_FREE_BACKWARD_HEAD_DIM = 128  # the issue's bar: no spills for backward kernels up to d128

failures = []
print("%-36s %-6s %5s %9s %9s %6s %6s %6s %7s" % ("kernel", "arch", "regs", "spill_st", "spill_ld", "stack",
                                                   "HMMA", "LDSM", "LDGSTS"))
checked = 0
every = {**forward, **backward, **teaching}
for k in sorted(every, key=lambda k: (k[1], short(every[k]) if every[k] else k[0])):
    key, arch = every[k], k[1]
    if key is None:
        failures.append("%s: not a kernel name this check can read" % k[0])
        continue
    must_not_spill = key[4] != "bwd" or key[1] <= SPILL_FREE_BACKWARD_HEAD_DIM
    name, p, s = short(key), kernels[k], sass.get(k)
    stub = is_stub(key, arch)
    counts = (s["HMMA"], s["LDSM"], s["LDGSTS"]) if s else ("-", "-", "-")
    print("%-36s %-6s %5s %9s %9s %6s %6s %6s %7s%s" % ((name, arch, p.get("regs"), p.get("spill_st"),
                                                         p.get("spill_ld"), p.get("stack")) + counts +
                                                        ("  (stub)" if stub else "",)))
    if must_not_spill and p.get("spill_st", 1) != 0:
        failures.append("%s (%s): %s bytes spill stores" % (name, arch, p.get("spill_st")))
    if must_not_spill and p.get("stack", 1) != 0:  # fragments in local memory, e.g. behind a call NVVM did not inline
        failures.append("%s (%s): %s bytes stack frame" % (name, arch, p.get("stack")))
    if s is None:
        failures.append("%s: not in the %s SASS" % (name, arch))
        continue
    for op in ("HMMA", "LDSM", "LDGSTS"):
        if stub and s[op] != 0:
            failures.append("%s: %s in the %s SASS of a stub" % (name, op, arch))
        if not stub and s[op] == 0:
            failures.append("%s: no %s in %s SASS" % (name, op, arch))
    checked += not stub
if not forward:
    failures.append("no forward kernels in the ptxas report")
if not backward:
    failures.append("no backward kernels in the ptxas report")
if failures:
    print("FAILED:")
    for f in failures:
        print("  " + f)
    sys.exit(1)
print("OK: %d forward, %d backward and %d teaching kernel compilations (%d real, %d stubs), 0 bytes spill "
      "stores or stack (backward: head_dim <= %d), HMMA/LDSM/LDGSTS in every real kernel's SASS"
      % (len(forward), len(backward), len(teaching), checked, len(every) - checked, SPILL_FREE_BACKWARD_HEAD_DIM))
EOF

# --- 3. the sm90a forward family, on the objects the build made (compiled for sm_90a alone) ---------
if [[ -f $work/sm90_objects.txt ]]; then
  while read -r object; do
    [[ -f $object ]] || { echo "error: $object missing: build the library before this check" >&2; exit 2; }
    "$cuobjdump" -res-usage "$object" >> "$work/sm90_res.txt"
    "$cuobjdump" --dump-sass "$object" >> "$work/sm90_sass.txt"
  done < "$work/sm90_objects.txt"
  python3 - "$work/sm90_res.txt" "$work/sm90_sass.txt" <<'EOF' || status=1
import re, subprocess, sys
res_file, sass_file = sys.argv[1], sys.argv[2]
OPS = ("HGMMA", "UTMALDG", "UTMASTG")  # WGMMA, TMA loads, the epilogue's TMA store
LAUNCH_REGS = 65536 // 384 // 8 * 8  # 3 warpgroups, 1 CTA an SM: the whole register file

def short(mangled):  # sm90::ForwardTraits<(ElemType)1, 128>, (MaskKind)1 -> sm90_fwd_bf16_d128_masked
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout
    m = re.search(r"sm90::ForwardTraits<\(flashattn::cuda::ElemType\)(\d), (\d+)>, \(flashattn::cuda::MaskKind\)(\d)", name)
    if not m:
        return None
    return "sm90_fwd_%s_d%s_%s" % ("fp16" if m.group(1) == "0" else "bf16", m.group(2),
                                   {"0": "nomask", "1": "masked"}.get(m.group(3), "?"))

usage, function = {}, None  # cuobjdump -res-usage: " Function <name>:" then "  REG:.. STACK:.. LOCAL:.."
for line in open(res_file):
    m = re.search(r"Function (\S+):", line)
    if m:
        function = m.group(1)
        continue
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
    if m and function and "forward_kernel" in function:
        usage[function] = {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))}
sass, current = {}, None
for line in open(sass_file):
    m = re.search(r"Function : (\S+)", line)
    if m:
        current = m.group(1)
        sass[current] = dict.fromkeys(OPS, 0)
        continue
    if current:
        for op in OPS:
            if re.search(r"\b%s\b" % op, line):
                sass[current][op] += 1

failures = []
print("%-28s %5s %6s %6s %6s %8s %8s" % (("sm90 kernel", "regs", "stack", "local") + OPS))
for mangled in sorted(usage, key=lambda k: short(k) or k):
    name, u, s = short(mangled), usage[mangled], sass.get(mangled)
    if name is None:
        failures.append("%s: not a kernel name this check can read" % mangled)
        continue
    counts = tuple(s[op] for op in OPS) if s else ("-",) * len(OPS)
    print("%-28s %5d %6d %6d %6s %8s %8s" % ((name, u["regs"], u["stack"], u["local"]) + counts))
    if u["regs"] != LAUNCH_REGS:  # setmaxnreg's budget (forward_traits.cuh kLaunchRegs) assumes it
        failures.append("%s: %d registers at launch, not %d" % (name, u["regs"], LAUNCH_REGS))
    if u["stack"] or u["local"]:  # spills land in local memory
        failures.append("%s: %d bytes stack, %d bytes local memory (spills)" % (name, u["stack"], u["local"]))
    if s is None:
        failures.append("%s: not in the SASS" % name)
        continue
    failures += ["%s: no %s in its SASS" % (name, op) for op in OPS if s[op] == 0]
if not usage:
    failures.append("no sm90 forward kernels in the objects")
if failures:
    print("FAILED:")
    for f in failures:
        print("  " + f)
    sys.exit(1)
print("OK: %d sm90a forward kernels, no stack or local memory, HGMMA/UTMALDG/UTMASTG in every one's SASS"
      % len(usage))
EOF
elif [[ ${FLASHATTN_CHECK_SM90:-0} == 1 ]]; then
  echo "FAILED: FLASHATTN_CHECK_SM90=1 but the build has no sm90a kernels (FLASHATTN_CUDA_SM90)"
  status=1
fi

# --- 4. the KV-cache decode kernels (src/cuda/decode), on the objects the build made ---------------
if [[ -f $work/decode_objects.txt ]]; then
  while read -r object; do
    [[ -f $object ]] || { echo "error: $object missing: build the library before this check" >&2; exit 2; }
    "$cuobjdump" -res-usage "$object" >> "$work/decode_res.txt"
    "$cuobjdump" --dump-sass "$object" >> "$work/decode_sass.txt"
  done < "$work/decode_objects.txt"
  python3 - "$work/decode_res.txt" "$work/decode_sass.txt" <<'EOF' || status=1
import re, subprocess, sys
res_file, sass_file = sys.argv[1], sys.argv[2]

def short(mangled):  # decode_kernel<cutlass::half_t, 128, 4, true> -> decode_fp16_d128_rows4_paged
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout
    m = re.search(r"decode::(decode|append|combine)_kernel<cutlass::(half_t|bfloat16_t)"
                  r"(?:, (\d+), (\d+), (true|false))?>", name)
    if not m:
        return None
    dtype = "fp16" if m.group(2) == "half_t" else "bf16"
    shape = "_d%s_rows%s%s" % (m.group(3), m.group(4), "_paged" if m.group(5) == "true" else "") if m.group(3) else ""
    return "%s_%s%s" % (m.group(1), dtype, shape)

usage, arch, function = {}, None, None
for line in open(res_file):
    m = re.search(r"arch = (sm_\d+a?)", line)
    if m:
        arch = m.group(1)
    m = re.search(r"Function (\S+):", line)
    if m:
        function = m.group(1)
        continue
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
    if m and function:
        usage[(function, arch)] = {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))}
sass, current, arch = {}, None, None
for line in open(sass_file):
    m = re.search(r"code for (sm_\d+a?)", line)
    if m:
        arch = m.group(1)
        continue
    m = re.search(r"Function : (\S+)", line)
    if m:
        current = (m.group(1), arch)
        sass[current] = 0
        continue
    if current and re.search(r"\bLDGSTS\.[A-Z0-9.]*\b128\b", line):  # cp.async of K / V rows
        sass[current] += 1

failures = []
print("%-36s %-6s %5s %6s %6s %8s" % ("decode kernel", "arch", "regs", "stack", "local", "LDGSTS"))
for key in sorted(usage, key=lambda k: (short(k[0]) or k[0], k[1] or "")):
    name, u = short(key[0]), usage[key]
    if name is None:
        failures.append("%s: not a kernel name this check can read" % key[0])
        continue
    loads = sass.get(key, "-")
    print("%-36s %-6s %5d %6d %6d %8s" % (name, key[1], u["regs"], u["stack"], u["local"], loads))
    if u["stack"] or u["local"]:
        failures.append("%s (%s): %d bytes stack, %d bytes local memory (spills)" % (name, key[1], u["stack"], u["local"]))
    if name.startswith("decode_") and not loads:
        failures.append("%s (%s): no 16-byte cp.async copies (LDGSTS...128) in its SASS" % (name, key[1]))
if not usage:
    failures.append("no decode kernels in the objects")
if failures:
    print("FAILED:")
    for f in failures:
        print("  " + f)
    sys.exit(1)
print("OK: %d decode kernel compilations, no stack or local memory, 16-byte K / V copies in every decode kernel"
      % len(usage))
EOF
elif [[ ${FLASHATTN_CHECK_DECODE:-0} == 1 ]]; then
  echo "FAILED: FLASHATTN_CHECK_DECODE=1 but the build has no decode kernels (FLASHATTN_CUDA_DECODE)"
  status=1
fi
exit $status

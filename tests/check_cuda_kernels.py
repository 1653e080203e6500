#!/usr/bin/env python3
"""Static checks of the CUDA kernels on the objects a build made; needs no GPU.

    tests/check_cuda_kernels.py <build dir> [jobs]

Finds the kernels' objects through the build's compile_commands.json and reads each with
cuobjdump (-res-usage: registers, stack, local memory; --dump-sass: the instructions), for every
arch the objects were built for. Per family:
  sm80       the forward and backward kernels (generated/cuda/sm80_*.cu) and the FA1-order teaching
             kernels (generated/teaching): no stack, local memory or local loads / stores (spills)
             for every forward kernel and every backward kernel of head_dim <= 128 (larger backward
             kernels are reported only: their dK / dV accumulators alone take 128 registers a
             thread); HMMA (mma.sync), LDSM (ldmatrix) and LDGSTS (cp.async) in the SASS. A kernel
             whose code for an arch is a stub (src/cuda/sm80/tile_shapes.hpp target_compiled_for:
             sm90-tuned kernels outside sm_90, sm80-tuned ones in sm_90 where an sm90-tuned twin
             exists) must have none of them there instead.
  sm90       the sm90a family (generated/cuda/sm90): the whole register file at launch
             (setmaxnreg's budget assumes it), no stack or local memory, HGMMA (WGMMA) and UTMALDG
             (TMA load) in the SASS, and O's store: UTMASTG (TMA) in the dense forward kernels,
             16-byte STG in the varlen ones; the backward's dK / dV stores (UTMASTG) and dQ sums
             (UBLKRED, bulk reduce-add).
  decode     the KV-cache decode kernels (src/cuda/decode): no stack or local memory, 16-byte
             cp.async copies (LDGSTS...128) of K / V in every decode kernel (not the sink-token
             pass, which reads a few keys a row), m16n8k16 MMAs (HMMA.16816) in the tensor-core
             one.
Environment: FLASHATTN_CHECK_ARCHS (default "80"): archs every sm80 kernel must have been built
for; FLASHATTN_CHECK_SM90=1 / FLASHATTN_CHECK_DECODE=1: fail when the build has no kernels of
that family. Prints a per-kernel table. cuobjdump / nvdisasm come from the CUDA toolkit or
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SPILL_FREE_BACKWARD_HEAD_DIM = 128  # spills cost the backward its speed: none allowed up to d128
# The block-sparse backward (the masked kernel with the block mask's walk and element bits) keeps
# a little stack at d128 (8 bytes on sm_90a, 48 on sm_80: values stored before the loop, reloaded once a
# step); allowed up to this much until it is reshaped, and reported in the table.
SPARSE_BACKWARD_STACK_BYTES = 64


def sm90_launch_regs(consumers: int) -> int:
    """The whole register file split over the CTA's threads (one CTA an SM; the producer warpgroup
    and the consumers, the traits' last template argument), in steps of 8: forward_traits.cuh
    WarpGroupRegisters::kLaunch."""
    return 65536 // ((1 + consumers) * 128) // 8 * 8


def find_tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for root in ["/usr/local/cuda/bin", *site.getsitepackages()]:
        for candidate in [Path(root) / name, *Path(root).glob(f"nvidia/*/bin/{name}"),
                          *Path(root).glob(f"nvidia/*/*/bin/{name}")]:
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    sys.exit(f"error: {name} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def family_of(source: str) -> str | None:
    if not source.endswith(".cu"):
        return None
    if "/generated/cuda/sm90/" in source:
        return "sm90"
    if "/generated/cuda/sm80_" in source or "/generated/teaching/" in source:
        return "sm80"
    if "/src/cuda/decode/" in source:
        return "decode"
    return None


def objects_by_family(build: Path) -> dict[str, list[Path]]:
    commands = build / "compile_commands.json"
    if not commands.is_file():
        sys.exit(f"error: {commands} missing (configure with FLASHATTN_CUDA=ON)")
    found: dict[str, list[Path]] = {"sm80": [], "sm90": [], "decode": []}
    for entry in json.loads(commands.read_text()):
        family = family_of(entry["file"])
        if family is None:
            continue
        args = shlex.split(entry["command"])
        obj = Path(entry["directory"]) / args[args.index("-o") + 1]
        if not obj.is_file():
            sys.exit(f"error: {obj} missing: build the library (and the teaching kernels) before this check")
        found[family].append(obj)
    return found


def dump(cuobjdump: str, obj: Path) -> tuple[str, str]:
    def run(flag: str) -> str:
        return subprocess.run([cuobjdump, flag, str(obj)], check=True, capture_output=True, text=True).stdout
    return run("-res-usage"), run("--dump-sass")


def parse_usage(text: str) -> dict[tuple[str, str], dict[str, int]]:
    """cuobjdump -res-usage: "arch = sm_80", " Function <name>:", "  REG:.. STACK:.. SHARED:.. LOCAL:.."."""
    usage, arch, function = {}, None, None
    for line in text.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1)
        elif m := re.search(r"Function (\S+):", line):
            function = m.group(1)
        elif (m := re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)) and function:
            usage[(function, arch)] = {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))}
    return usage


def parse_sass(text: str, ops: dict[str, str]) -> dict[tuple[str, str], dict[str, int]]:
    """cuobjdump --dump-sass: "code for sm_80", "Function : <name>", then instructions; counts the
    lines matching each of `ops` (name -> regex) per (function, arch)."""
    sass, arch, current = {}, None, None
    patterns = {name: re.compile(regex) for name, regex in ops.items()}
    for line in text.splitlines():
        if m := re.search(r"code for (sm_\d+a?)", line):
            arch = m.group(1)
        elif m := re.search(r"Function : (\S+)", line):
            current = (m.group(1), arch)
            sass[current] = dict.fromkeys(ops, 0)
        elif current:
            for name, pattern in patterns.items():
                if pattern.search(line):
                    sass[current][name] += 1
    return sass


def demangle(names) -> dict[str, str]:
    names = list(names)
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def print_table(header: tuple, rows: list[tuple], widths: tuple):
    """Name and arch left-aligned, numbers right-aligned."""
    fmt = " ".join(f"%-{w}s" if i < 2 else f"%{w}s" for i, w in enumerate(widths))
    for row in [header, *rows]:
        print(fmt % row)


DECODE_OPS = {"LDGSTS128": r"\bLDGSTS\.[A-Z0-9.]*\b128\b", "HMMA": r"\bHMMA\.16816\b"}
SM80_OPS = {"HMMA": r"\bHMMA\b", "LDSM": r"\bLDSM\b", "LDGSTS": r"\bLDGSTS\b", "local": r"\b(STL|LDL)\b"}


def sm80_key(name: str):
    """forward_kernel<ForwardTraits<(ElemType)0, 128, (MaskKind)1, (TileTarget)90, false>, (MaskKind)1, false, false>
    -> ("fp16", 128, "masked", 90, "fwd", False, False) (the last two: paged K / V, block-sparse; a
    backward_kernel's one flag: block-sparse);
    the FA1 teaching kernel -> (.., "fa1order", 80, "teaching", False, False)."""
    if m := re.search(r"teaching::Fa1Traits<\(flashattn::cuda::ElemType\)(\d), (\d+)>", name):
        return ("fp16" if m.group(1) == "0" else "bf16", int(m.group(2)), "fa1order", 80, "teaching", False, False)
    m = re.search(r"(Forward|Backward)Traits<\(flashattn::cuda::ElemType\)(\d), (\d+)(?:, \(flashattn::cuda::MaskKind\)\d)?"
                  r"(?:, \(flashattn::cuda::sm80::TileTarget\)(\d+))?(?:, (?:true|false))?>, \(flashattn::cuda::MaskKind\)(\d)"
                  r"(?:, (true|false))?(?:, (true|false))?", name)
    if not m:
        return None
    forward = m.group(1) == "Forward"
    # (the forward's flags: paged, block-sparse; the backward's one: block-sparse)
    paged, sparse = (m.group(6) == "true", m.group(7) == "true") if forward else (False, m.group(6) == "true")
    return ("fp16" if m.group(2) == "0" else "bf16", int(m.group(3)),
            {"0": "nomask", "1": "masked", "2": "dropout"}[m.group(5)], int(m.group(4) or 80),
            "fwd" if forward else "bwd", paged, sparse)


def sm80_short(key) -> str:  # as src/cuda/kernel_registry.cpp names it
    if key[4] == "teaching":
        return "teaching_%s_d%d_%s" % key[:3]
    return "sm80_%s_%s_d%d_%s%s%s%s" % (key[4], key[0], key[1], key[2], "" if key[3] == 80 else "_sm%dtiles" % key[3],
                                        "_paged" if key[5] else "", "_blocksparse" if key[6] else "")


def check_sm80(usage, sass, archs: list[str], failures: list[str]):
    kernels = {k: v for k, v in usage.items()
               if any(s in k[0] for s in ("forward_kernel", "backward_kernel", "fa1_order_kernel"))}
    names = demangle({k[0] for k in kernels})
    keys = {k: sm80_key(names[k[0]]) for k in kernels}
    sm90_tuned = {key[:3] + key[4:5] for key in keys.values() if key and key[3] == 90}

    def is_stub(key, arch):  # tile_shapes.hpp target_compiled_for (the paged and block-sparse kernels have no twin)
        sm90 = arch.startswith("sm_9")
        return not sm90 if key[3] == 90 else sm90 and not (key[5] or key[6]) and key[:3] + key[4:5] in sm90_tuned

    rows, real, before = [], 0, len(failures)
    for k in sorted(kernels, key=lambda k: (k[1], sm80_short(keys[k]) if keys[k] else k[0])):
        key, arch, u, s = keys[k], k[1], kernels[k], sass.get(k)
        if key is None:
            failures.append(f"{k[0]}: not a kernel name this check can read")
            continue
        name, stub = sm80_short(key), is_stub(key, arch)
        counts = tuple(s[op] for op in SM80_OPS) if s else ("-",) * len(SM80_OPS)
        rows.append((name, arch, u["regs"], u["stack"], u["local"]) + counts + ("(stub)" if stub else "",))
        if key[4] != "bwd" or key[1] <= SPILL_FREE_BACKWARD_HEAD_DIM:
            allowed = SPARSE_BACKWARD_STACK_BYTES if key[4] == "bwd" and key[6] else 0
            if u["stack"] > allowed or u["local"] or (s and s["local"] and not allowed):  # spills land in local memory
                failures.append(f"{name} ({arch}): {u['stack']} bytes stack, {u['local']} bytes local memory, "
                                       f"{s['local'] if s else '?'} local loads / stores (spills)")
        if s is None:
            failures.append(f"{name}: not in the {arch} SASS")
            continue
        for op in ("HMMA", "LDSM", "LDGSTS"):
            if stub and s[op]:
                failures.append(f"{name}: {op} in the {arch} SASS of a stub")
            if not stub and not s[op]:
                failures.append(f"{name}: no {op} in its {arch} SASS")
        real += not stub
    print_table(("kernel", "arch", "regs", "stack", "local", "HMMA", "LDSM", "LDGSTS", "STL/LDL", ""), rows,
                 (36, 6, 5, 6, 6, 6, 6, 7, 8, 0))
    directions = {key[4] for key in keys.values() if key}
    for direction, label in (("fwd", "forward"), ("bwd", "backward")):
        if direction not in directions:
            failures.append(f"no {label} kernels in the objects")
    for arch in archs:
        built = {k[0] for k in kernels if k[1] == f"sm_{arch}"}
        missing = {k[0] for k in kernels} - built
        if missing:
            failures.append(f"{len(missing)} sm80-family kernels not built for sm_{arch} "
                                   f"(FLASHATTN_CHECK_ARCHS; configure CMAKE_CUDA_ARCHITECTURES with it)")
    if len(failures) == before:
        count = Counter(key[4] for key in keys.values() if key)
        print(f"OK: {count['fwd']} forward, {count['bwd']} backward and {count['teaching']} teaching kernel "
              f"compilations ({real} real, {len(kernels) - real} stubs): no stack, local memory or spills "
              f"(backward: head_dim <= {SPILL_FREE_BACKWARD_HEAD_DIM}; the block-sparse backward <= "
              f"{SPARSE_BACKWARD_STACK_BYTES} bytes of stack); HMMA / LDSM / LDGSTS in every real kernel")


SM90_OPS = {"HGMMA": r"\bHGMMA\b", "UTMALDG": r"\bUTMALDG\b", "UTMASTG": r"\bUTMASTG\b",
            "STG.128": r"\bSTG\.E\.128\b", "UBLKRED": r"\bUBLKRED\b"}


def check_sm90(usage, sass, failures: list[str]):
    kernels = {k: v for k, v in usage.items() if "forward_kernel" in k[0] or "backward_kernel" in k[0]}
    names = demangle({k[0] for k in kernels})

    consumers = {}  # name -> consumer warpgroups

    # sm90::ForwardTraits<(ElemType)1, 128, (MaskKind)1, 2>, (MaskKind)1, true -> ..._masked_varlen;
    # three consumers where two are the default (d64 masked): ..._tall
    def short(mangled):
        # sm90::BackwardTraits<(ElemType)1, 128>, (MaskKind)1, false, true ->
        # sm90_bwd_bf16_d128_masked_varlen_scoremods (two consumers; raw scores true: no suffix)
        m = re.search(r"sm90::BackwardTraits<\(flashattn::cuda::ElemType\)(\d), (\d+)>, "
                      r"\(flashattn::cuda::MaskKind\)(\d), (true|false), (true|false)>", names[mangled])
        if m:
            name = "sm90_bwd_%s_d%s_%s%s%s" % ("fp16" if m.group(1) == "0" else "bf16", m.group(2),
                                               {"0": "nomask", "1": "masked", "2": "dropout"}.get(m.group(3), "?"),
                                               "_varlen" if m.group(5) == "true" else "",
                                               "" if m.group(4) == "true" else "_scoremods")
            consumers[name] = 2
            return name
        # (the traits' last argument: the block-sparse kernel, ..._masked_blocksparse)
        m = re.search(r"sm90::ForwardTraits<\(flashattn::cuda::ElemType\)(\d), (\d+), \(flashattn::cuda::MaskKind\)\d, "
                      r"(\d)(?:, (true|false))?>, \(flashattn::cuda::MaskKind\)(\d), (true|false)>",
                      names[mangled])
        if not m:
            return None
        name = "sm90_fwd_%s_d%s_%s%s%s%s" % ("fp16" if m.group(1) == "0" else "bf16", m.group(2),
                                             {"0": "nomask", "1": "masked", "2": "dropout"}.get(m.group(5), "?"),
                                             "_varlen" if m.group(6) == "true" else "",
                                             "_tall" if m.group(3) == "3" and m.group(5) != "0" else "",
                                             "_blocksparse" if m.group(4) == "true" else "")
        consumers[name] = int(m.group(3))
        return name

    rows, before = [], len(failures)
    for k in sorted(kernels, key=lambda k: short(k[0]) or k[0]):
        name, u, s = short(k[0]), kernels[k], sass.get(k)
        if name is None:
            failures.append(f"{k[0]}: not a kernel name this check can read")
            continue
        ops = tuple(s.values()) if s else ("-",) * len(SM90_OPS)
        rows.append((name, k[1], u["regs"], u["stack"], u["local"]) + ops)
        launch_regs = sm90_launch_regs(consumers[name])
        if u["regs"] != launch_regs:
            failures.append(f"{name}: {u['regs']} registers at launch, not {launch_regs}")
        if u["stack"] or u["local"]:
            failures.append(f"{name}: {u['stack']} bytes stack, {u['local']} bytes local memory (spills)")
        if s is None:
            failures.append(f"{name}: not in the SASS")
            continue
        # O's or dK / dV's stores (dense: TMA, varlen: 16-byte stores); the backward's dQ sums
        # (bulk reduce-adds)
        varlen = "_varlen" in name
        ops = ("STG.128" if varlen else "UTMASTG",) + (("UBLKRED",) if name.startswith("sm90_bwd") else ())
        failures += [f"{name}: no {op} in its SASS" for op in ("HGMMA", "UTMALDG") + ops if not s[op]]
    print_table(("sm90 kernel", "arch", "regs", "stack", "local") + tuple(SM90_OPS), rows,
                (42, 6, 5, 6, 6, 6, 8, 8, 8, 8))
    if not kernels:
        failures.append("no sm90 forward kernels in the objects")
    if len(failures) == before:
        print(f"OK: {len(kernels)} sm90a kernels, no stack or local memory, HGMMA / UTMALDG in every "
              "one's SASS, UTMASTG in the dense ones', 16-byte STG in the varlen ones', UBLKRED in the backward's")


def check_decode(usage, sass, failures: list[str]):
    names = demangle({k[0] for k in usage})

    def short(mangled):  # decode_kernel<cutlass::half_t, 128, 1, true> -> decode_fp16_d128_rows1_paged,
        # decode_mma_kernel<cutlass::bfloat16_t, 64, false, ...> -> decode_mma_bf16_d64, combine_kernel<.., 128> -> ..
        m = re.search(r"decode::(decode_sink_tokens|decode_mma|decode|append|combine)_kernel<cutlass::(half_t|bfloat16_t)"
                      r"(?:, (\d+)(?:, (\d+))?(?:, (true|false))?)?", names[mangled])
        if not m:
            return None
        dtype = "fp16" if m.group(2) == "half_t" else "bf16"
        # (the sink-token pass's second argument is its columns per lane, not a head dim)
        shape = f"_{'cols' if m.group(1) == 'decode_sink_tokens' else 'd'}{m.group(3)}" if m.group(3) else ""
        shape += f"_rows{m.group(4)}" if m.group(4) else ""
        shape += "_paged" if m.group(5) == "true" else ""
        return f"{m.group(1)}_{dtype}{shape}"

    rows, before = [], len(failures)
    for k in sorted(usage, key=lambda k: (short(k[0]) or k[0], k[1] or "")):
        name, u, loads = short(k[0]), usage[k], sass.get(k, {}).get("LDGSTS128", "-")
        if name is None:
            failures.append(f"{k[0]}: not a kernel name this check can read")
            continue
        mmas = sass.get(k, {}).get("HMMA", "-")
        rows.append((name, k[1], u["regs"], u["stack"], u["local"], loads, mmas))
        if u["stack"] or u["local"]:
            failures.append(f"{name} ({k[1]}): {u['stack']} bytes stack, {u['local']} bytes local memory (spills)")
        if name.startswith("decode_") and not name.startswith("decode_sink_tokens") and not loads:
            failures.append(f"{name} ({k[1]}): no 16-byte cp.async copies (LDGSTS...128) in its SASS")
        if name.startswith("decode_mma_") and not mmas:
            failures.append(f"{name} ({k[1]}): no tensor-core MMAs (HMMA) in its SASS")
    print_table(("decode kernel", "arch", "regs", "stack", "local", "LDGSTS", "HMMA"), rows, (36, 6, 5, 6, 6, 8, 6))
    if not usage:
        failures.append("no decode kernels in the objects")
    if len(failures) == before:
        print(f"OK: {len(usage)} decode kernel compilations, no stack or local memory, 16-byte K / V copies in every "
              "decode kernel, HMMA in every tensor-core one")


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit("usage: tests/check_cuda_kernels.py <build dir> [jobs]")
    build = Path(sys.argv[1]).resolve()
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count() or 1
    archs = os.environ.get("FLASHATTN_CHECK_ARCHS", "80").split()
    cuobjdump = find_tool("cuobjdump")
    nvdisasm = find_tool("nvdisasm")
    os.environ["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + os.environ["PATH"]  # cuobjdump runs it for SASS

    families = objects_by_family(build)
    if not families["sm80"]:
        sys.exit(f"error: no generated kernel files in {build}/compile_commands.json")
    failures: list[str] = []
    for family, ops in (("sm80", SM80_OPS), ("sm90", SM90_OPS), ("decode", DECODE_OPS)):
        objects = families[family]
        if not objects:
            if os.environ.get(f"FLASHATTN_CHECK_{family.upper()}", "0") == "1":
                failures.append(f"FLASHATTN_CHECK_{family.upper()}=1 but the build has no {family} kernels")
            continue
        with ThreadPoolExecutor(jobs) as pool:
            dumps = list(pool.map(lambda o: dump(cuobjdump, o), objects))
        usage, sass = {}, {}
        for res_text, sass_text in dumps:
            usage.update(parse_usage(res_text))
            sass.update(parse_sass(sass_text, ops))
        print(f"=== {family}: {len(objects)} objects")
        if family == "sm80":
            check_sm80(usage, sass, archs, failures)
        elif family == "sm90":
            check_sm90(usage, sass, failures)
        else:
            check_decode(usage, sass, failures)
    if failures:
        print("FAILED:")
        for failure in failures:
            print("  " + failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

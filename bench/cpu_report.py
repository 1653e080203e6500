#!/usr/bin/env python3
"""CPU backend report: throughput of the flash path vs the fp64 reference and the machine's
measured fp32 FMA peak, and peak extra memory vs sequence length (flash O(N), reference O(N^2)).

Runs the `flashattn` CLI (which measures time, GFLOP/s and real peak RSS growth) and writes
bench/results/cpu.json and bench/results/cpu.md.

    python3 bench/cpu_report.py --build build [--max-reference-seqlen 16384]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(cli, *args):
    out = subprocess.run([cli, "run", "--json", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def fma_peak():
    exe = os.path.join(REPO, "build-bench", "cpu_fma_peak")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    subprocess.run(["g++", "-O2", "-march=native", "-fopenmp",
                    os.path.join(REPO, "bench", "cpu_fma_peak.cpp"), "-o", exe], check=True)
    text = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    line = [l for l in text.splitlines() if l.startswith("fp32 FMA peak")][0]
    return float(line.split(":")[1].split()[0])


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="build directory with tools/cli/flashattn")
    ap.add_argument("--max-reference-seqlen", type=int, default=16384,
                    help="largest seqlen whose reference memory is measured (16k needs ~6 GiB)")
    args = ap.parse_args()
    cli = os.path.join(REPO, args.build, "tools", "cli", "flashattn")

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    info = subprocess.run([cli, "info"], capture_output=True, text=True).stdout
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit, "cpu": cpu_name(), "cores": os.cpu_count(),
              "compiler": subprocess.run(["g++", "--version"], capture_output=True,
                                         text=True).stdout.splitlines()[0],
              "flashattn_info": info}
    result["load_average_before"] = os.getloadavg()[0]
    print("measuring the fp32 FMA peak ...", file=sys.stderr)
    result["fma_peak_gflops"] = fma_peak()

    result["throughput"] = []
    for causal in (False, True):
        print(f"throughput, causal={causal} ...", file=sys.stderr)
        extra = ["--causal"] if causal else []
        r = run_cli(cli, "--batch", "1", "--heads", "16", "--seqlen", "2048", "--head-dim", "128",
                    "--dtype", "fp32", "--backward", "--reference", "--repeats", "5", *extra)
        result["throughput"].append(r)

    result["memory"] = []
    for seqlen in (1024, 4096, 16384):
        for impl in ("flash", "reference"):
            if impl == "reference" and seqlen > args.max_reference_seqlen:
                continue
            print(f"memory, {impl} seqlen={seqlen} ...", file=sys.stderr)
            r = run_cli(cli, "--batch", "1", "--heads", "1", "--seqlen", str(seqlen),
                        "--head-dim", "128", "--dtype", "fp32", "--backward", "--repeats", "1",
                        "--check-rows", "0", "--impl", impl)
            result["memory"].append(r)

    result["load_average_after"] = os.getloadavg()[0]
    out_dir = os.path.join(REPO, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "cpu.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))


def markdown(r):
    peak = r["fma_peak_gflops"]
    lines = [
        "# CPU backend: throughput and memory",
        "",
        f"Measured {r['date']} at commit `{r['commit']}` on {r['cpu']} ({r['cores']} cores), "
        f"{r['compiler']}. Made by `python3 bench/cpu_report.py`. 1-minute load average "
        f"{r['load_average_before']:.2f} before and {r['load_average_after']:.2f} after the run "
        "(anything well above 0 means other work shared the cores).",
        "",
        f"fp32 FMA peak of this machine, measured in the same run (`bench/cpu_fma_peak.cpp`, "
        f"AVX-512 FMA chains on every core): **{peak:.0f} GFLOP/s**.",
        "",
        "## Throughput: b=1, h=16, s=2048, d=128, fp32",
        "",
        "FLOPs as usual: forward 4·b·h·sq·sk·d (halved when causal), backward 2.5x forward. "
        "Median of 5 runs; the reference runs once.",
        "",
        "| mask | pass | flash time | flash GFLOP/s | % of FMA peak | reference time | reference GFLOP/s | flash speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in r["throughput"]:
        mask = "causal" if t["options"]["causal"] else "none"
        for p in ("forward", "backward"):
            s = t[p]
            ref_s = t[f"reference_{p}_s"]
            ref_gf = s["flops_guide"] / ref_s / 1e9
            lines.append(f"| {mask} | {p} | {s['median_s'] * 1e3:.1f} ms | {s['gflops_guide']:.1f} | "
                         f"{100 * s['gflops_guide'] / peak:.0f}% | {ref_s * 1e3:.0f} ms | "
                         f"{ref_gf:.2f} | {ref_s / s['median_s']:.0f}x |")
    lines += ["", "Max abs error of a checked (batch, head) slice vs the fp64 reference:", ""]
    for t in r["throughput"]:
        mask = "causal" if t["options"]["causal"] else "none"
        errs = ", ".join(f"{k} {v:.2e}" for k, v in t["check"]["max_abs_error"].items())
        lines.append(f"- {mask}: {t['check']['what']}: {errs}")
    lines += [
        "",
        "## Peak extra memory vs sequence length: b=1, h=1, d=128, fp32",
        "",
        "Growth of the process's peak resident memory during the call (`/proc/self/clear_refs` "
        "reset, VmHWM), inputs and outputs excluded.",
        "",
        "| seqlen | flash forward | flash backward | reference forward | reference backward |",
        "|---|---|---|---|---|",
    ]
    by = {(m["impl"], m["problem"]["seqlen_q"]): m for m in r["memory"]}

    def mem(m, p):
        if m is None:
            return "not run"
        b = m[p]["peak_extra_bytes"]
        return "n/a" if b is None else (f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB")

    for s in sorted({k[1] for k in by}):
        f, ref = by.get(("flash", s)), by.get(("reference", s))
        lines.append(f"| {s} | {mem(f, 'forward')} | {mem(f, 'backward')} | "
                     f"{mem(ref, 'forward')} | {mem(ref, 'backward')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""HBM bytes per attention call, measured with Nsight Compute's DRAM counters (GPU machine), next
to the analytic counts: standard attention (S and P through HBM), the FA1-order teaching kernel
(O, m and l through HBM once per K/V tile) and FA2's order (ours, production).

Each (implementation, seqlen) runs in its own process under
  ncu --profile-from-start off --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum
which warms the call up outside the profiled range, then profiles exactly one call between
cudaProfilerStart / Stop; the bytes of every kernel in that range are summed (standard attention
is several kernels: two GEMMs and a softmax).

Shape: the prefill grid's (16k tokens per call, heads = 2048 / d), d 64, bf16, non-causal: with
batch x heads >= 32 the working set of FA1's O accumulators outgrows the 50 MB L2, so the
counters see what the analysis counts. Analytic counts, in elements of 2 bytes per (batch, head)
(N = seqlen, d = head_dim, B_n = the teaching kernel's K/V tile width):
  standard   4Nd + 4N^2   (read Q, K, V, write O; write S, read S, write P, read P)
  FA2 order  4Nd          (each input read once, the output written once; + LSE)
  FA1 order  4Nd + (N / B_n) Nd [Q per K/V tile] + 2 (N / B_n - 1) 2N(d + 2) [O, m, l in fp32, read
             and written between K/V tiles]: Theta(N^2 d / B_n), and B_n ~ M / d for M bytes of
             shared memory, so Theta(N^2 d^2 / M) as the FA1 paper states.

Ours is flashattn.forward (the Python package that is importable, bench/_ours.py: the workers
inherit PYTHONPATH); the teaching kernels come from their own library (bench/fa1_teaching.py), built
by a CMake build of the repository (target flashattn_fa1_teaching; scripts/bench.sh builds it).

  python3 bench/io_bytes.py --fa1-lib build/libflashattn_fa1_teaching.so --out DIR

Writes DIR/io.json (rows, the Markdown section bench/report.py embeds) and DIR/io.png.
"""
import argparse
import csv
import io
import json
import os
import subprocess
import sys

IMPLS = ("standard", "fa1", "fa2_order", "ours")
LABELS = {"standard": "standard attention", "fa1": "FA1 order (teaching kernel)",
          "fa2_order": "FA2 order (teaching kernel's code)", "ours": "FA2 order (ours, production)"}
METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"
HEAD_DIM = 64


def shape(seqlen):
    return 16384 // seqlen, 2048 // HEAD_DIM  # batch, heads: the prefill grid's convention


def analytic_bytes(impl, seqlen, block_n):
    batch, heads = shape(seqlen)
    n, d = seqlen, HEAD_DIM
    elems = {"standard": 4 * n * d + 4 * n * n, "fa2_order": 4 * n * d, "ours": 4 * n * d}
    if impl in elems:
        extra = 2 * n if impl != "standard" else 0  # LSE, fp32
        return batch * heads * (2 * elems[impl] + 2 * extra)
    tiles = n // block_n
    # bytes: K and V once; Q (bf16) of every row once per K/V tile; the state of every row, O (fp32)
    # and m, l (fp32), read before and written after each K/V tile but the first (nothing to read)
    # and the last (O normalised and LSE written instead).
    fa1 = 4 * n * d + tiles * 2 * n * d + 2 * (tiles - 1) * 4 * n * (d + 2) + 2 * n * d + 4 * n
    return batch * heads * fa1


# ----------------------------------------------------------------------------- worker (under ncu)

def worker(args):
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _ours
    from fa1_teaching import Fa1Library
    batch, heads = shape(args.seqlen)
    q, k, v = (torch.randn(batch, args.seqlen, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, args.seqlen, device="cuda", dtype=torch.float32)
    if args.worker == "standard":
        def call():
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            s = torch.matmul(qt * HEAD_DIM ** -0.5, kt.transpose(-1, -2))  # written to HBM: N^2 per head
            p = torch.softmax(s, dim=-1)                                    # S read, P written
            return torch.matmul(p, vt)                                      # P read
        # Q's scaling (a Nd pass) is part of the call, as in any unfused implementation.
    elif args.worker == "ours":
        call = _ours.forward_call(q, k, v, out, lse)
    else:
        call = Fa1Library(args.fa1_lib).forward_call(args.worker, q, k, v, out, lse, False)
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


# ----------------------------------------------------------------------------- driver

def measure(args, impl, seqlen):
    """(bytes read, bytes written, kernels) of one call under ncu, or an error string."""
    cmd = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--metrics", METRICS, "--csv",
           "--target-processes", "all", sys.executable, os.path.abspath(__file__), "--worker", impl,
           "--seqlen", str(seqlen), "--fa1-lib", args.fa1_lib, "--out", args.out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith('"')]
    if proc.returncode != 0 or not lines:
        return f"ncu exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    totals = {"dram__bytes_read.sum": 0.0, "dram__bytes_write.sum": 0.0}
    kernels = set()
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        name = rec["Metric Name"]
        if name in totals:
            scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}[rec["Metric Unit"]]
            totals[name] += float(rec["Metric Value"].replace(",", "")) * scale
            kernels.add(rec["ID"])
    return totals["dram__bytes_read.sum"], totals["dram__bytes_write.sum"], len(kernels)


def markdown(rows, block_n):
    lines = [f"bf16, d {HEAD_DIM}, non-causal, 16k tokens per call (heads = 2048 / d); one call each; DRAM "
             f"bytes read + written (Nsight Compute) against the analytic count of the module docstring "
             f"(bench/io_bytes.py; the teaching kernel's K/V tile B_n = {block_n}). GB = 1e9 bytes.", "",
             "| seqlen | implementation | kernels | read GB | written GB | total GB | analytic GB | measured / analytic |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if isinstance(r["measured"], str):
            lines.append(f"| {r['seqlen']} | {LABELS[r['impl']]} | - | - | - | {r['measured']} | "
                         f"{r['analytic'] / 1e9:.3f} | - |")
            continue
        rd, wr, kernels = r["measured"]
        lines.append(f"| {r['seqlen']} | {LABELS[r['impl']]} | {kernels} | {rd / 1e9:.3f} | {wr / 1e9:.3f} | "
                     f"{(rd + wr) / 1e9:.3f} | {r['analytic'] / 1e9:.3f} | {(rd + wr) / r['analytic']:.2f} |")
    return "\n".join(lines) + "\n"


def chart(rows, path):
    from report import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, impl in enumerate(IMPLS):
        pts = [(r["seqlen"], sum(r["measured"][:2]) / 1e9) for r in rows if r["impl"] == impl
               and not isinstance(r["measured"], str)]
        ana = [(r["seqlen"], r["analytic"] / 1e9) for r in rows if r["impl"] == impl]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=f"{LABELS[impl]} (measured)")
        ax.plot(*zip(*ana), linestyle=":", color=f"C{i}", label=f"{LABELS[impl]} (analytic)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seqlen (16k tokens per call)")
    ax.set_ylabel("HBM bytes per call (GB)")
    ax.set_title(f"HBM traffic, bf16, d={HEAD_DIM}, non-causal")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fa1-lib", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="1024,2048,4096,8192")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--seqlen", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fa1_teaching import Fa1Library
    block_n = Fa1Library(args.fa1_lib).tile_sizes(HEAD_DIM)[1]
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        for impl in IMPLS:
            rows.append({"seqlen": seqlen, "impl": impl, "measured": measure(args, impl, seqlen),
                         "analytic": analytic_bytes(impl, seqlen, block_n)})
            m = rows[-1]["measured"]
            print(f"seqlen {seqlen:5} {impl:10}: " + (m if isinstance(m, str) else
                  f"read {m[0] / 1e9:.3f} GB, written {m[1] / 1e9:.3f} GB, {m[2]} kernels; "
                  f"analytic {rows[-1]['analytic'] / 1e9:.3f} GB"), flush=True)
    os.makedirs(args.out, exist_ok=True)
    chart(rows, os.path.join(args.out, "io.png"))
    result = {"head_dim": HEAD_DIM, "block_n": block_n, "rows": rows, "markdown": markdown(rows, block_n),
              "chart": "io.png"}
    with open(os.path.join(args.out, "io.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(result["markdown"])
    return 1 if any(isinstance(r["measured"], str) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

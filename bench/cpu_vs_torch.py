#!/usr/bin/env python3
"""Our CPU backend against PyTorch's CPU scaled_dot_product_attention, same process, same inputs,
all of the machine's cores for both (OpenMP threads for ours, PyTorch's intra-op threads for it).

fp32, [batch, seqlen, heads, head_dim] tensors (PyTorch sees transposed views), forward and
backward (ours: the Python package's flashattn.forward / backward on CPU tensors, into outputs
allocated once, the backward from our forward's out / LSE; PyTorch: autograd.grad from a saved
forward). Wall-clock medians of --reps calls after one warm-up call, which include each call's host
side (the package's tens of microseconds, PyTorch's autograd), small against calls of milliseconds;
FLOPs as in docs/PERFORMANCE.md (forward 4 * b * h * s^2 * d, halved for causal; backward 2.5x).

  python3 bench/cpu_vs_torch.py --out DIR [--seqlens 512,1024,2048]   (flashattn importable)

Writes DIR/cpu_vs_torch-<cores>cores.json (rows and a Markdown section bench/report.py embeds).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import forward_flops  # noqa: E402


def median_s(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def bench(batch, heads, d, seqlen, causal, reps):
    gen = torch.Generator().manual_seed(seqlen + d)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, d, generator=gen) for _ in range(4))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    ours_fwd = _ours.forward_call(q, k, v, out, lse, causal=causal)
    ours_fwd()
    ours_bwd = _ours.backward_call(dout, q, k, v, out, lse, *grads, causal=causal)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def torch_forward():
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal).transpose(1, 2)

    with torch.no_grad():
        reference = torch_forward()
    saved = torch_forward()

    def torch_fwd():
        with torch.no_grad():
            torch_forward()

    def torch_bwd():
        torch.autograd.grad(saved, leaves, dout, retain_graph=True)

    flops = forward_flops(batch, heads, seqlen, seqlen, d, causal)
    row = {"batch": batch, "heads": heads, "head_dim": d, "seqlen": seqlen, "causal": causal,
           "max_abs_diff_out": (out - reference).abs().max().item()}
    for name, fn, factor in (("ours_fwd", ours_fwd, 1.0), ("torch_fwd", torch_fwd, 1.0),
                             ("ours_bwd", ours_bwd, 2.5), ("torch_bwd", torch_bwd, 2.5)):
        seconds = median_s(fn, reps)
        row[name] = {"ms": seconds * 1e3, "gflops": factor * flops / seconds / 1e9}
    dq_ref = torch.autograd.grad(saved, leaves, dout, retain_graph=True)[0]
    ours_bwd()
    row["max_abs_diff_dq"] = (grads[0] - dq_ref).abs().max().item()
    return row


def markdown(meta, rows):
    lines = [f"### {meta['cpu']} ({meta['cores']} cores)", "",
             f"fp32, batch {rows[0]['batch']}, {rows[0]['heads']} heads; ours with {meta['omp_threads']} OpenMP "
             f"threads, PyTorch {meta['torch']} with {meta['torch_threads']} threads; wall-clock median of "
             f"{meta['reps']} calls; commit {meta['commit']}, {meta['date']}; 1-minute load average "
             f"{meta['load_before']:.2f} before, {meta['load_after']:.2f} after (well above 0 before: other "
             "work shared the cores).", "",
             "| d | mask | seqlen | ours fwd GFLOP/s | PyTorch fwd | ours / PyTorch | ours bwd GFLOP/s | PyTorch bwd "
             "| ours / PyTorch | max abs diff (out, dq) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        of, tf, ob, tb = (r[k]["gflops"] for k in ("ours_fwd", "torch_fwd", "ours_bwd", "torch_bwd"))
        lines.append(f"| {r['head_dim']} | {'causal' if r['causal'] else 'none'} | {r['seqlen']} | {of:.1f} | {tf:.1f} | "
                     f"{of / tf:.2f} | {ob:.1f} | {tb:.1f} | {ob / tb:.2f} | "
                     f"{r['max_abs_diff_out']:.1e}, {r['max_abs_diff_dq']:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="512,1024,2048,4096")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    version = _ours.package().__version__
    cores = os.cpu_count()
    meta = {"cpu": cpu_name(), "cores": cores, "omp_threads": os.environ.get("OMP_NUM_THREADS", f"{cores} (default)"),
            "flashattn": version, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "reps": args.reps,
            "commit": os.environ.get("FLASHATTN_COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": os.getloadavg()[0]}
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                rows.append(bench(args.batch, args.heads, d, seqlen, causal, args.reps))
                r = rows[-1]
                print(f"d{d} {'causal' if causal else 'none':6} s{seqlen:5}: fwd ours {r['ours_fwd']['gflops']:7.1f} "
                      f"torch {r['torch_fwd']['gflops']:7.1f} GFLOP/s; bwd ours {r['ours_bwd']['gflops']:7.1f} "
                      f"torch {r['torch_bwd']['gflops']:7.1f}; diff {r['max_abs_diff_out']:.1e}", flush=True)
    meta["load_after"] = os.getloadavg()[0]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cpu_vs_torch-{cores}cores.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, "markdown": markdown(meta, rows)}, f, indent=1)
    print(path)


if __name__ == "__main__":
    main()

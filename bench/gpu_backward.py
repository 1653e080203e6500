#!/usr/bin/env python3
"""Backward benchmark on the GPU machine: flashattn's CUDA backward, alone and as forward +
backward, against PyTorch SDPA's FLASH (FlashAttention-2) and cuDNN backends, in the same process
and run, over the prefill grid of docs/PERFORMANCE.md (16k tokens per call, heads = 2048 /
head_dim, seqlen 512..16k, causal and not, bf16 and fp16), with the bf16 GEMM and device-copy
ceilings of the same run; then each backward's extra device memory against seqlen (1k..64k,
batch 1, 16 heads, d 128), which must grow O(seqlen).

What is timed (bench/_timing.py: CUDA events, the L2 flushed before every call, warm-up, median
of the repeats, interleaved rounds in rotating order, each after 0.2 s of the same calls):
- bwd: the backward alone, from a forward's saved out and LSE. Ours: flashattn.backward (the
  Python package, bench/_ours.py) after our own forward, into gradients allocated once. Peers:
  torch.autograd.grad of SDPA's output with retain_graph=True, which runs exactly the backend's
  backward (its scratch allocation, dO.O preprocessing, kernels), and nothing else.
- fwd+bwd: ours flashattn.forward then flashattn.backward; peers SDPA with autograd, then
  autograd.grad.
Every implementation gets the same [batch, seqlen, heads, head_dim] q, k, v and dout (SDPA sees
transposed views, FlashAttention-2's native layout). Our outputs and gradients are allocated once
per config; our workspace and the peers' scratch memory come from PyTorch's allocator inside each
call, host work the GPU timing does not see. The host side of a call (autograd's; the package's
argument handling) can outlast the flush, so every timed call starts after a GPU spin
(Timer.lead_cycles) and only GPU time is measured, for every implementation alike.
FLOPs: forward 4 * b * h * sq * sk * d, halved for causal; backward 2.5x that, fwd+bwd 3.5x.

Extra memory: the peak of PyTorch's allocator during one backward call (after a warm-up call),
less what was allocated before it and less the returned gradients; ours allocates its workspace
inside that window, so its figure includes it (device memory the library allocated itself, past
PyTorch's allocator, would not show: the contract is that it allocates none).

  python3 bench/gpu_backward.py --out results_dir [--quick]   (flashattn importable: scripts/gpu_package.sh)
  python3 bench/gpu_backward.py --out results_dir --dropout 0.1   (every implementation with dropout_p 0.1)
  python3 bench/gpu_backward.py --list [--quick]    (the grid and its FLOPs only; no GPU)

Writes backward.json and backward.md to --out and prints the table.
"""
import argparse
import json
import math
import os
import sys
import time

try:
    import torch
except ImportError:  # a machine without PyTorch: --list only
    torch = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import (LEAD_CYCLES, ROUNDS, TOKENS, MODEL_WIDTH, Timer, batch_heads, ceilings,  # noqa: E402
                     config_name, environment, fmt, forward_flops, ratio, summarize, time_interleaved)
from suite import AutogradPeer, Ours, first_line, peak_extra_bytes, sdpa_attend  # noqa: E402

PEERS = ("fa2", "cudnn")
IMPLEMENTATIONS = ("flashattn",) + PEERS
LABELS = {"flashattn": "ours", "fa2": "FA2", "cudnn": "cuDNN"}
# Measurement -> its FLOPs as a multiple of the forward's (docs/PERFORMANCE.md).
MEASUREMENTS = {"fwd_bwd": 3.5, "bwd": 2.5}
MEMORY_SHAPE = {"batch": 1, "heads": 16, "head_dim": 128}
MiB = 1 << 20


# ----------------------------------------------------------------------------- grid

def grid(dtypes, head_dims, seqlens, masks=("none", "causal")):
    """(dtype name, head_dim, causal, seqlen) of every config, in table order."""
    return [(dt, d, m == "causal", s) for dt in dtypes for d in head_dims for m in masks for s in seqlens]


def measurement_flops(d, causal, seqlen):
    """FLOPs of each measurement of one grid config."""
    batch, heads = batch_heads(d, seqlen)
    fwd = forward_flops(batch, heads, seqlen, seqlen, d, causal)
    return {name: factor * fwd for name, factor in MEASUREMENTS.items()}


def growth_exponent(seqlens, sizes):
    """d log(size) / d log(seqlen) between the two longest sequences (where constant terms weigh
    least): 1 for O(N), 2 for O(N^2); None where a size is not positive."""
    (s1, m1), (s2, m2) = list(zip(seqlens, sizes))[-2:]
    return math.log(m2 / m1) / math.log(s2 / s1) if m1 > 0 and m2 > 0 else None


# ----------------------------------------------------------------------------- implementations

def peers(q, k, v, dout, causal, dropout_p=0.0):
    return {name: AutogradPeer(sdpa_attend(backend, causal, False, dropout_p), q, k, v, dout)
            for name, backend in (("fa2", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))}


def random_inputs(dtype, batch, seqlen, heads, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4)]


# ----------------------------------------------------------------------------- measurements

def checked_ours(q, k, v, dout, causal, deterministic, errors, dropout_p=0.0):
    """(ours after one forward + backward, its workspace bytes), or (None, None) with the reason in
    errors where this build cannot run the config: the benchmark goes on with the peers."""
    try:
        ours = Ours(q, k, v, dout, causal, True, deterministic, dropout_p)
        ours.fwd_bwd()
        torch.cuda.synchronize()
        return ours, ours.workspace_bytes()
    except RuntimeError as err:
        errors["flashattn"] = first_line(err)
        return None, None


def diffs_vs_fa2(grads, fa2):
    """max |ours - FA2| of dq, dk, dv (None where FA2 cannot run the config)."""
    try:
        reference = fa2.fwd_bwd()
    except RuntimeError:
        return None
    return {name: (a.float() - b.float()).abs().max().item()
            for name, a, b in zip(("dq", "dk", "dv"), grads, reference)}


def bench_config(timer, dtype_name, d, causal, seqlen, deterministic, dropout_p=0.0):
    batch, heads = batch_heads(d, seqlen)
    seed = hash((dtype_name, d, causal, seqlen)) & 0xFFFF
    q, k, v, dout = random_inputs(getattr(torch, dtype_name), batch, seqlen, heads, d, seed)
    row = {"dtype": dtype_name, "head_dim": d, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads,
           "errors": {}}
    ours, row["workspace_bytes"] = checked_ours(q, k, v, dout, causal, deterministic, row["errors"], dropout_p)
    others = peers(q, k, v, dout, causal, dropout_p)
    fns = {"fwd_bwd": {name: p.fwd_bwd for name, p in others.items()},
           "bwd": {name: p.bwd for name, p in others.items()}}
    row["all_written"] = None if ours is None else not any(torch.isnan(g).any().item() for g in ours.grads)
    # (With dropout the keep-masks differ: no comparison.)
    row["max_abs_diff_vs_fa2"] = None if ours is None or dropout_p > 0 else diffs_vs_fa2(ours.grads, others["fa2"])
    if ours is not None:
        fns["fwd_bwd"] = {"flashattn": ours.fwd_bwd, **fns["fwd_bwd"]}
        fns["bwd"] = {"flashattn": ours.bwd, **fns["bwd"]}

    flops = measurement_flops(d, causal, seqlen)
    for measurement, timed in fns.items():
        row[measurement] = {"tflops": {}, "ms": {}}
        time_interleaved(timer, timed, flops[measurement], row[measurement])
    return row


def extra_bytes(fn, output_bytes):
    """suite.peak_extra_bytes of fn() less the output_bytes of the gradients it returns; out of
    memory raises (a RuntimeError, as torch's own error is)."""
    peak = peak_extra_bytes(fn)
    if isinstance(peak, str):
        raise RuntimeError(peak)
    return peak - output_bytes


def memory_row(seqlen, deterministic):
    batch, heads, d = MEMORY_SHAPE["batch"], MEMORY_SHAPE["heads"], MEMORY_SHAPE["head_dim"]
    q, k, v, dout = random_inputs(torch.bfloat16, batch, seqlen, heads, d, seqlen)
    gradient_bytes = 3 * q.numel() * q.element_size()
    row = {"seqlen": seqlen, "workspace_bytes": None, "extra_bytes": {}, "errors": {}}
    ours, row["workspace_bytes"] = checked_ours(q, k, v, dout, False, deterministic, row["errors"])
    if ours is not None:
        row["extra_bytes"]["flashattn"] = extra_bytes(ours.fresh_bwd, gradient_bytes)
        del ours  # its buffers, before the peers are measured
    for name, peer in peers(q, k, v, dout, False).items():
        try:
            row["extra_bytes"][name] = extra_bytes(peer.bwd, gradient_bytes)
        except RuntimeError as err:
            row["errors"][name] = first_line(err)
        peer.saved = None  # frees its graph before the next peer runs
    return row


def memory_summary(rows):
    """Each implementation's growth exponent, and whether ours (workspace and measured extra
    memory) is O(N): None without two measured seqlens."""
    seqlens = [r["seqlen"] for r in rows]

    def exponent(sizes):
        return growth_exponent(seqlens, sizes) if len(rows) >= 2 and None not in sizes else None

    exponents = {name: exponent([r["extra_bytes"].get(name) for r in rows]) for name in IMPLEMENTATIONS}
    workspace = exponent([r["workspace_bytes"] for r in rows])
    measured = len(rows) >= 2 and all("flashattn" in r["extra_bytes"] for r in rows)
    # An exponent of None here: no growth at all (0 bytes), which is O(N) too.
    ours = [e for e in (exponents["flashattn"], workspace) if e is not None]
    return {"growth_exponent": exponents, "workspace_growth_exponent": workspace,
            "ours_linear": all(e <= 1.1 for e in ours) if measured else None}


# ----------------------------------------------------------------------------- report

def markdown(env, ceil, rows, summary, memory, settle_s, deterministic, dropout_p=0.0):
    lines = ["# Backward: flashattn CUDA backward vs PyTorch SDPA (FA2, cuDNN)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- bf16 GEMM ceiling (8192^3, same run): {ceil['bf16_gemm_tflops']:.0f} TFLOP/s",
              f"- device copy (512 MiB, read + write): {ceil['copy_tbps']:.2f} TB/s",
              f"- {TOKENS} tokens per call, heads = {MODEL_WIDTH} / head_dim; ours deterministic={deterministic} "
              "(the peers' dQ accumulation is not deterministic); dropout_p "
              f"{dropout_p} for every implementation (FLOPs without dropout)",
              "- bwd: the backward alone from the forward's saved out / LSE (ours: flashattn.backward; peers: "
              "torch.autograd.grad with retain_graph); fwd+bwd: forward then backward. FLOPs: 2.5x (bwd) and 3.5x "
              "(fwd+bwd) the forward's 4 * b * h * s^2 * d, halved for causal",
              f"- CUDA-event timings, L2 flushed and a {LEAD_CYCLES}-cycle GPU spin before each call; {ROUNDS} "
              f"interleaved rounds in rotating order, each timed after {settle_s} s of the same calls, median of the "
              "round medians; 'spread' = largest / smallest round median of ours and FA2, minus 1", ""]
    for measurement, title in (("fwd_bwd", "forward + backward"), ("bwd", "backward alone")):
        s = summary[measurement]
        lines += [f"## Summary, {title} (seqlen >= {s['min_seqlen']})", "",
                  f"- geometric mean vs FA2: {fmt(s['geomean_vs_fa2'], '.3f')}x",
                  f"- geometric mean vs cuDNN: {fmt(s['geomean_vs_cudnn'], '.3f')}x",
                  f"- lowest ratio vs FA2: {fmt(s['min_vs_fa2'], '.3f')}x",
                  f"- configs below FA2: {', '.join(s['configs_below_fa2']) or 'none'}", ""]
    lines += ["## TFLOP/s", "",
              "| dtype | d | mask | seqlen | fwd+bwd ours | FA2 | cuDNN | vs FA2 | vs cuDNN | bwd ours | FA2 | cuDNN "
              "| vs FA2 | vs cuDNN | bwd spread ours / FA2 | max abs diff vs FA2 (dq, dk, dv) | workspace MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for measurement in MEASUREMENTS:
            m = r[measurement]
            cells += [fmt(m["tflops"].get(name)) for name in IMPLEMENTATIONS]
            cells += [fmt(ratio(m, peer), ".2f") for peer in PEERS]
        spread = r["bwd"].get("round_spread", {})
        diff = r["max_abs_diff_vs_fa2"]
        diff = "-" if diff is None else ", ".join(f"{diff[g]:.2e}" for g in ("dq", "dk", "dv"))
        workspace = None if r["workspace_bytes"] is None else r["workspace_bytes"] / MiB
        lines.append(f"| {r['dtype']} | {r['head_dim']} | {'causal' if r['causal'] else 'none'} | {r['seqlen']} | "
                     + " | ".join(cells)
                     + f" | {fmt(spread.get('flashattn'), '.1%')} / {fmt(spread.get('fa2'), '.1%')} | {diff} | "
                     f"{fmt(workspace)} |" + ("" if r["all_written"] is not False else " UNWRITTEN GRADIENT |"))
    errors = [f"- {config_name(r)}: {name}: {e}" for r in rows for name, e in r["errors"].items()]
    errors += [f"- {config_name(r)} {m}: {name}: {e}" for r in rows for m in MEASUREMENTS
               for name, e in r[m].get("errors", {}).items()]
    lines += ["", "TFLOP/s; ratios are flashattn / peer in this run; '-': could not run"
              + (":" if errors else "."), *errors, ""]
    lines += markdown_memory(memory)
    return "\n".join(lines) + "\n"


def markdown_memory(memory):
    shape = memory["shape"]
    summary = memory["summary"]
    lines = [f"## Extra device memory of one backward (bf16, batch {shape['batch']}, {shape['heads']} heads, "
             f"d {shape['head_dim']}, no mask)", "",
             "Peak of PyTorch's allocator during the call beyond what it held before, less the returned "
             "gradients, in MiB (ours includes its workspace, allocated in the call).", "",
             "| seqlen | ours: workspace | ours | FA2 | cuDNN | ours bytes / token |", "|---|---|---|---|---|---|"]
    for r in memory["rows"]:
        extra = r["extra_bytes"]
        cells = [fmt(extra[name] / MiB if name in extra else None) for name in IMPLEMENTATIONS]
        workspace = None if r["workspace_bytes"] is None else r["workspace_bytes"] / MiB
        per_token = extra["flashattn"] / (shape["batch"] * r["seqlen"]) if "flashattn" in extra else None
        lines.append(f"| {r['seqlen']} | {fmt(workspace)} | " + " | ".join(cells) + f" | {fmt(per_token, '.0f')} |")
    exponents = summary["growth_exponent"]
    verdict = {True: "Ours is O(N).", False: "**Ours is not O(N).**", None: "Ours was not measured."}
    errors = [f"- seqlen {r['seqlen']}: {name}: {e}" for r in memory["rows"] for name, e in r["errors"].items()]
    lines += ["", "Growth exponent between the two longest sequences (1: O(N), 2: O(N^2)): "
              + ", ".join(f"{name} {fmt(exponents[name], '.2f')}" for name in IMPLEMENTATIONS)
              + f"; our workspace {fmt(summary['workspace_growth_exponent'], '.2f')}. "
              + verdict[summary["ours_linear"]], *errors, ""]
    return lines


def print_row(r, index, total):
    cells = []
    for measurement in MEASUREMENTS:
        m = r[measurement]
        cells += [f"{m['tflops'].get(name, 0):7.1f}" for name in IMPLEMENTATIONS]
        cells += [f"{ratio(m, peer) or 0:6.2f}" for peer in PEERS]
    diff = r["max_abs_diff_vs_fa2"]
    print(f"{r['dtype']:9} {r['head_dim']:4} {'causal' if r['causal'] else 'none':6} {r['seqlen']:6} "
          + " ".join(cells) + f" {fmt(diff and max(diff.values()), '8.1e')}  [{index}/{total}]"
          + ("  UNWRITTEN GRADIENT" if r["all_written"] is False else "")
          + "".join(f"  {name}: {e}" for name, e in r["errors"].items()), flush=True)


def print_grid(configs, memory_seqlens):
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'seqlen':>6} {'batch':>5} {'heads':>5} "
          + " ".join(f"{name + ' GFLOP':>14}" for name in MEASUREMENTS))
    for dt, d, causal, s in configs:
        batch, heads = batch_heads(d, s)
        flops = measurement_flops(d, causal, s)
        print(f"{dt:9} {d:4} {'causal' if causal else 'none':6} {s:6} {batch:5} {heads:5} "
              + " ".join(f"{flops[name] / 1e9:14.1f}" for name in MEASUREMENTS))
    print(f"memory: seqlen {', '.join(map(str, memory_seqlens))} at batch {MEMORY_SHAPE['batch']}, "
          f"{MEMORY_SHAPE['heads']} heads, d {MEMORY_SHAPE['head_dim']}")


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for backward.json and backward.md")
    parser.add_argument("--quick", action="store_true",
                        help="bf16 only, seqlen 1k / 16k; memory at seqlen 1k / 8k / 64k (under 3 minutes)")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--masks", default="none,causal", help="none and / or causal")
    parser.add_argument("--memory-seqlens", default="1024,2048,4096,8192,16384,32768,65536",
                        help="the memory sweep's seqlens (empty: none)")
    parser.add_argument("--deterministic", action="store_true", help="our backward with deterministic=True")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout_p for every implementation (the FLOPs stay those without dropout)")
    parser.add_argument("--list", action="store_true", help="print the grid and its FLOPs, run nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.seqlens, args.memory_seqlens = "bfloat16", "1024,16384", "1024,8192,65536"
    if not args.list and not args.out:
        parser.error("--out is required (or --list)")
    masks = args.masks.split(",")
    if not masks or any(m not in ("none", "causal") for m in masks):
        parser.error("--masks takes none and / or causal")
    args.configs = grid(args.dtypes.split(","), [int(d) for d in args.head_dims.split(",")],
                        [int(s) for s in args.seqlens.split(",")], masks)
    args.memory_seqlens = [int(s) for s in args.memory_seqlens.split(",") if s]
    return args


def main():
    args = parse_args()
    if args.list:
        print_grid(args.configs, args.memory_seqlens)
        return 0
    if torch is None:
        sys.exit("PyTorch is needed to run the benchmark (--list works without it)")
    started = time.monotonic()
    _ours.cuda_package()
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2, lead_cycles=LEAD_CYCLES)
    env = environment()
    ceil = ceilings(timer)
    print(f"{env['gpu']}: bf16 GEMM {ceil['bf16_gemm_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s",
          flush=True)

    names = [f"{LABELS[name]:>7}" for name in IMPLEMENTATIONS] + [f"{'/' + LABELS[peer]:>6}" for peer in PEERS]
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'seqlen':>6} fwd+bwd: {' '.join(names)}  bwd: {' '.join(names)} diff")
    rows = []
    for i, config in enumerate(args.configs):
        rows.append(bench_config(timer, *config, args.deterministic, args.dropout))
        print_row(rows[-1], i + 1, len(args.configs))
    summary = {m: summarize(rows, 1024, lambda r, m=m: r[m]) for m in MEASUREMENTS}

    memory_rows = []
    for seqlen in args.memory_seqlens:
        memory_rows.append(memory_row(seqlen, args.deterministic))
        extra = memory_rows[-1]["extra_bytes"]
        print(f"memory seqlen {seqlen:6}: workspace {memory_rows[-1]['workspace_bytes'] / MiB:8.1f} MiB, extra "
              + ", ".join(f"{name} {extra[name] / MiB:8.1f}" for name in extra) + " MiB", flush=True)
    memory = {"shape": MEMORY_SHAPE, "rows": memory_rows, "summary": memory_summary(memory_rows)}

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "backward.json"), "w") as f:
        json.dump({"environment": env, "ceilings": ceil, "deterministic": args.deterministic,
                   "dropout_p": args.dropout, "summary": summary,
                   "rows": rows, "memory": memory}, f, indent=1)
    with open(os.path.join(args.out, "backward.md"), "w") as f:
        f.write(markdown(env, ceil, rows, summary, memory, timer.settle_s, args.deterministic, args.dropout))
    print(json.dumps({"summary": summary, "memory": memory["summary"]}, indent=1))
    print(f"total: {time.monotonic() - started:.0f} s")
    ok = all(r["all_written"] for r in rows) and memory["summary"]["ours_linear"] is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

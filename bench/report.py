#!/usr/bin/env python3
"""Charts and a Markdown report from one results folder of the benchmark suite: suite.json
(bench/suite.py: prefill, decode, memory, ceilings), and where present io.json
(bench/io_bytes.py: HBM bytes per call), loop_order.json (bench/loop_order.py: FA1 vs FA2 loop
order), cpu*.json (bench/cpu_vs_torch.py: our CPU backend vs PyTorch's CPU SDPA), and the
hand-written findings.md (what the numbers show) and notes.md (how the run was made), copied in;
the step logs of scripts/bench.sh and scripts/gpu_check.sh (summary.txt, check/summary.txt: each
step's verdict and time, the GPU tests' counts) close the report.

  python3 bench/report.py DIR        (writes DIR/report.md and DIR/*.png)

The charts follow the FlashAttention papers' figures: TFLOP/s bars per seqlen for each
implementation, one panel per (head dim, causal) and one figure per (dtype, direction); decode
bandwidth against context length; peak memory and HBM bytes against seqlen. Runs anywhere with
matplotlib (no GPU, no PyTorch; the tables alone need no matplotlib either).
"""
import glob
import json
import math
import os
import sys

DIRECTION_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}
MiB = 1 << 20


def load(path):
    with open(path) as f:
        return json.load(f)


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def brief(error, limit=100):
    """An error line cut to its start (PyTorch's out-of-memory message runs to 600 characters)."""
    return error if len(error) <= limit else error[:limit].rstrip() + "..."


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def present(rows, key, labels):
    """Implementations with at least one measurement under rows[*][key], in the labels' order."""
    return [n for n in labels if any(n in r[key]["ms"] for r in rows if key in r)]


# ----------------------------------------------------------------------------- prefill

def pyplot():
    """matplotlib's pyplot on the file-only backend (imported here: the tables need no matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def impl_colors(plt, impls):
    """One color per implementation for every panel of a figure: tab10 without its gray (the
    ceilings' dashed lines are gray), then black."""
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7] + ["black"]
    return {name: palette[i % len(palette)] for i, name in enumerate(impls)}


def prefill_figure(rows, dtype, direction, labels, path):
    plt = pyplot()
    configs = [(d, causal) for d in sorted({r["head_dim"] for r in rows}) for causal in (False, True)]
    seqlens = sorted({r["seqlen"] for r in rows})
    impls = present([r for r in rows if r["dtype"] == dtype], direction, labels)
    fig, axes = plt.subplots(len(configs) // 2, 2, figsize=(12, 3.2 * (len(configs) // 2)), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    colors = impl_colors(plt, impls)
    for ax, (d, causal) in zip(axes.flat, configs):
        by_seqlen = {r["seqlen"]: r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dtype, d, causal)}
        for i, name in enumerate(impls):
            values = [by_seqlen[s][direction]["tflops"].get(name, 0) if s in by_seqlen else 0 for s in seqlens]
            ax.bar([x + i * width for x in range(len(seqlens))], values, width, label=labels[name],
                   color=colors[name])
        ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(seqlens))])
        ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{DIRECTION_TITLES[direction]}, {dtype}, 16k tokens per call, heads = 2048 / d")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def prefill_tables(rows, directions, labels):
    lines = []
    for direction in directions:
        impls = present(rows, direction, labels)
        peers = [n for n in impls if n != "flashattn"]
        long = [r for r in rows if r["seqlen"] >= 1024 and direction in r]
        lines += [f"### {DIRECTION_TITLES[direction]}", "",
                  "Geometric mean of ours / peer at seqlen >= 1k (configs where both ran), and the lowest ratio:", "",
                  "| peer | geomean | lowest | configs |", "|---|---|---|---|"]
        for peer in peers:
            ratios = [r[direction]["tflops"]["flashattn"] / r[direction]["tflops"][peer] for r in long
                      if "flashattn" in r[direction]["tflops"] and peer in r[direction]["tflops"]]
            lines.append(f"| {labels[peer]} | {fmt(geomean(ratios), '.3f')}x | "
                         f"{fmt(min(ratios, default=None), '.3f')}x | {len(ratios)} |")
        lines += ["", "| dtype | d | mask | seqlen | " + " | ".join(labels[n] for n in impls) + " |",
                  "|---|---|---|---|" + "---|" * len(impls)]
        for r in rows:
            if direction in r:
                t = r[direction]["tflops"]
                lines.append(f"| {r['dtype']} | {r['head_dim']} | {'causal' if r['causal'] else 'none'} | "
                             f"{r['seqlen']} | " + " | ".join(fmt(t.get(n)) for n in impls) + " |")
        lines.append("")
    return lines


# ----------------------------------------------------------------------------- decode

def decode_figure(rows, copy_tbps, labels, path):
    plt = pyplot()
    panels = sorted({(r["kv_heads"], r["batch"]) for r in rows}, key=lambda p: (-p[0], p[1]))
    impls = present(rows, "fwd", labels)
    colors = impl_colors(plt, impls)
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, (kv_heads, batch) in zip(axes.flat, panels):
        sel = sorted((r for r in rows if (r["kv_heads"], r["batch"]) == (kv_heads, batch)), key=lambda r: r["context"])
        for name in impls:
            points = [(r["context"], r["fwd"]["tbps"][name]) for r in sel if name in r["fwd"]["tbps"]]
            if points:
                ax.plot(*zip(*points), marker="o", label=labels[name], color=colors[name])
        ax.axhline(copy_tbps, color="gray", linestyle="--", linewidth=1, label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}, {'MHA' if kv_heads == rows[0]['heads'] else 'GQA'} "
                     f"({rows[0]['heads']}/{kv_heads} heads)")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TB/s of K/V read")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("decode: 1 query token, d=128, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def decode_table(rows, copy_tbps, labels, left_out):
    impls = present(rows, "fwd", labels)
    lines = [f"TB/s of K/V read (fraction of the {copy_tbps:.2f} TB/s device copy in parentheses: the copy "
             "counts the bytes it reads and writes, a decode reads, so a decode may pass 100%); ours / cuDNN in "
             "the last column.", "",
             "| batch | heads / kv heads | context | " + " | ".join(labels[n] for n in impls) + " | ours / cuDNN |",
             "|---|---|---|" + "---|" * (len(impls) + 1)]
    for r in rows:
        tb = r["fwd"]["tbps"]
        cells = [f"{tb[n]:.2f} ({tb[n] / copy_tbps:.0%})" if n in tb else "-" for n in impls]
        vs = tb["flashattn"] / tb["cudnn"] if "flashattn" in tb and "cudnn" in tb else None
        lines.append(f"| {r['batch']} | {r['heads']}/{r['kv_heads']} | {r['context']} | " + " | ".join(cells)
                     + f" | {fmt(vs, '.2f')} |")
    errors = sorted({f"{labels[n]}: {brief(e)}" for r in rows for n, e in r["errors"].items()}
                    | {f"{labels[n]} (b{r['batch']} ctx{r['context']} kv{r['kv_heads']}): {brief(e)}"
                       for r in rows for n, e in r["fwd"].get("errors", {}).items()})
    if errors:
        lines += ["", "Not measured:", *[f"- {e}" for e in errors]]
    if left_out:
        lines += ["", "Left out (K/V cache over the run's limit): "
                  + ", ".join(f"b{c['batch']} ctx{c['context']} kv{c['kv_heads']}" for c in left_out)]
    return lines + [""]


# ----------------------------------------------------------------------------- memory

def memory_figure(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"standard_fwd": ("standard, forward", "C3", "-"), "standard_fwd_bwd": ("standard, fwd+bwd", "C3", "--"),
              "flashattn_fwd": ("ours, forward", "C0", "-"), "flashattn_fwd_bwd": ("ours, fwd+bwd", "C0", "--")}
    top = max((v for r in rows for v in r["bytes"].values() if isinstance(v, int)), default=MiB) / MiB
    for key, (label, color, style) in styles.items():
        ok = [(r["seqlen"], r["bytes"][key] / MiB) for r in rows if isinstance(r["bytes"].get(key), int)]
        oom = [r["seqlen"] for r in rows if isinstance(r["bytes"].get(key), str)]
        if ok:
            ax.plot(*zip(*ok), style, marker="o", color=color, label=label)
        if oom:
            ax.plot(oom, [top * 2] * len(oom), "x", color=color, markersize=10,
                    label=f"{label}: out of memory")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seqlen")
    ax.set_ylabel("peak extra device memory (MiB)")
    ax.set_title("memory beyond the inputs: batch 1, 16 heads, d=128, bf16")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def memory_table(rows):
    keys = ["standard_fwd", "flashattn_fwd", "standard_fwd_bwd", "flashattn_fwd_bwd"]
    lines = ["| seqlen | standard fwd | ours fwd | standard fwd+bwd | ours fwd+bwd |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['bytes'][k] / MiB:.0f} MiB" if isinstance(r["bytes"].get(k), int) else "out of memory"
                 for k in keys]
        lines.append(f"| {r['seqlen']} | " + " | ".join(cells) + " |")
    exps = []
    for k in keys:
        pts = [(r["seqlen"], r["bytes"][k]) for r in rows if isinstance(r["bytes"].get(k), int) and r["bytes"][k] > 0]
        if len(pts) >= 2:
            (s1, m1), (s2, m2) = pts[-2:]
            exps.append(f"{k} {math.log(m2 / m1) / math.log(s2 / s1):.2f}")
    return lines + ["", "Growth exponent between the two longest measured seqlens (1: O(N), 2: O(N^2)): "
                    + ", ".join(exps) + ".", ""]


# ----------------------------------------------------------------------------- optional parts

def optional_section(folder, name, title, render):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return [f"## {title}", "", f"Not in this run ({name} missing).", ""]
    return [f"## {title}", "", *render(load(path), folder), ""]


def render_with_chart(data, folder):
    """A part's own Markdown section, then its chart."""
    return data.get("markdown", "").splitlines() + [""] + chart_line(folder, data.get("chart"))


def chart_line(folder, chart):
    return [f"![{chart}]({chart})", ""] if chart and os.path.exists(os.path.join(folder, chart)) else []


def render_cpu(folder):
    parts = []
    for path in sorted(glob.glob(os.path.join(folder, "cpu_vs_torch*.json"))):
        parts += load(path).get("markdown", "").splitlines() + [""]
    return parts or ["Not in this run (cpu_vs_torch*.json missing).", ""]


def step_logs(folder):
    """scripts/bench.sh's and scripts/gpu_check.sh's summaries: which steps ran, passed or failed, and how
    long."""
    parts = []
    for name, title in (("summary.txt", "scripts/bench.sh"), ("check/summary.txt", "scripts/gpu_check.sh")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                # A run lists every step it was not asked for; those lines say nothing.
                kept = [line for line in f.read().strip().splitlines() if "SKIPPED (not in" not in line]
            parts += [f"{title} ({name}):", "", "```", *kept, "```", ""]
    return ["## Steps of this run", "", *parts] if parts else []


# ----------------------------------------------------------------------------- main

def main(argv):
    if len(argv) == 2 and argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0
    if len(argv) != 2:
        sys.exit(__doc__)
    folder = argv[1]
    suite = load(os.path.join(folder, "suite.json"))
    env, ceil, labels = suite["environment"], suite["ceilings"], suite["labels"]
    settings = suite["settings"]
    lines = ["# flashattn benchmark report", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- bf16 GEMM ceiling (8192^3, same run): {ceil['bf16_gemm_tflops']:.0f} TFLOP/s",
              f"- device copy (512 MiB, read + write): {ceil['copy_tbps']:.2f} TB/s",
              f"- timing: CUDA events, L2 flushed and a {settings['lead_cycles']}-cycle GPU spin before each call, "
              f"{settings['settle_s']} s of the same calls before timing, median of the repeats; "
              f"{settings['rounds']} interleaved round(s) in rotating order, median of the round medians"
              + (" (quick grid)" if settings["quick"] else ""),
              "- made by bench/suite.py and bench/report.py; every number below is from this run, except in a "
              "CPU table that names another commit and date (a run on another machine)", ""]
    # Hand-written parts, where the folder has them: what the numbers below show, and how the run
    # was made where it departs from the defaults.
    for name, title in (("findings.md", "Findings"), ("notes.md", "How this run was made")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                lines += [f"## {title}", "", f.read().strip(), ""]

    prefill = suite.get("prefill", [])
    if prefill:
        lines += ["## Prefill", "", "TFLOP/s; FLOPs 4 * b * h * s^2 * d for the forward (halved for causal), "
                  "2.5x for the backward, 3.5x for forward + backward (docs/PERFORMANCE.md).", ""]
        for dtype in sorted({r["dtype"] for r in prefill}):
            for direction in settings["directions"]:
                name = f"prefill_{dtype}_{direction}.png"
                prefill_figure(prefill, dtype, direction, labels, os.path.join(folder, name))
                lines += [f"![{name}]({name})", ""]
        lines += prefill_tables(prefill, settings["directions"], labels)
        errors = sorted({f"{labels[n]}: {brief(e)}" for r in prefill for n, e in r["errors"].items()}
                        | {f"{labels[n]} ({r['dtype']} d{r['head_dim']} {'causal' if r['causal'] else 'full'} "
                           f"{r['seqlen']} {d}): {brief(e)}" for r in prefill for d in settings["directions"]
                           for n, e in r.get(d, {}).get("errors", {}).items()})
        if errors:
            lines += ["Not measured (first error line):", *[f"- {e}" for e in errors], ""]

    if suite.get("decode"):
        decode_figure(suite["decode"], ceil["copy_tbps"], labels, os.path.join(folder, "decode.png"))
        lines += ["## Decode", "", "![decode.png](decode.png)", "",
                  *decode_table(suite["decode"], ceil["copy_tbps"], labels, suite.get("decode_left_out", []))]

    if suite.get("memory"):
        memory_figure(suite["memory"], os.path.join(folder, "memory.png"))
        lines += ["## Memory: O(N) against O(N^2)", "",
                  "Peak of PyTorch's allocator during one call beyond what it held before (outputs, gradients, "
                  "intermediates, our workspace). Standard attention materialises S and P (bench/suite.py "
                  "standard_attention).", "", "![memory.png](memory.png)", "", *memory_table(suite["memory"])]

    lines += optional_section(folder, "io.json", "HBM traffic (Nsight Compute DRAM counters)", render_with_chart)
    lines += optional_section(folder, "loop_order.json", "Loop order: FA1 against FA2", render_with_chart)
    lines += ["## CPU backend against PyTorch's CPU SDPA", "", *render_cpu(folder)]
    lines += step_logs(folder)
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{folder}/report.md")


if __name__ == "__main__":
    main(sys.argv)

#!/usr/bin/env python3
"""FA1 against FA2 loop order (GPU machine): the FA1-order teaching kernel
(src/cuda/teaching, bench/fa1_teaching.py) in its three variants and our production sm80
forward, same process, seqlen 1k..8k at 16k tokens per call (heads = 2048 / d), d 64 and 128,
bf16, causal and not. Each variant's output is checked against SDPA's FLASH backend first.

The FA2 paper credits FA2's forward speedup over FA1 (1.7-2.1x reported) to three changes: fewer
non-matmul FLOPs, parallelism over the sequence (FA1 runs one CTA per (batch, head)) and the
loop order (FA1's outer loop over K/V tiles sends every query tile's O, m and l through HBM once
per K/V tile). The variants separate the last two: fa1 -> fa1_split adds the parallelism alone,
fa1_split -> fa2_order removes the HBM round trip alone (same kernel code and tiles), and
fa2_order -> ours is our production kernel's tuning on top.

Ours is flashattn.forward (the Python package that is importable, bench/_ours.py) into an out /
LSE allocated once, as the teaching kernels write theirs; the teaching kernels come from their own
library (bench/fa1_teaching.py: a CMake build's flashattn_fa1_teaching). Timing as
bench/gpu_forward.py's, no GPU spin: every call is 16k tokens of GPU work.

  python3 bench/loop_order.py --fa1-lib build/libflashattn_fa1_teaching.so --out DIR

Writes DIR/loop_order.json (rows and the Markdown section bench/report.py embeds) and
DIR/loop_order.png.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import Timer, batch_heads, environment, forward_flops, geomean, time_interleaved  # noqa: E402
from fa1_teaching import VARIANTS, Fa1Library  # noqa: E402

IMPLS = VARIANTS + ("ours",)
LABELS = {"fa1": "FA1 (1 CTA per head)", "fa1_split": "FA1 order, 1 query tile per CTA",
          "fa2_order": "FA2 order, same code", "ours": "ours (production FA2)"}


def bench(fa1, timer, d, causal, seqlen, rounds):
    batch, heads = batch_heads(d, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(seqlen + d + causal)
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        reference = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                   is_causal=causal).transpose(1, 2)
    row = {"head_dim": d, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads,
           "block_m_n": fa1.tile_sizes(d), "max_abs_diff_vs_fa2": {}, "tflops": {}, "ms": {}}
    fns = {}
    for name in IMPLS:
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
        if name == "ours":
            fns[name] = _ours.forward_call(q, k, v, out, lse, causal=causal)
        else:
            fns[name] = fa1.forward_call(name, q, k, v, out, lse, causal)
        fns[name]()
        torch.cuda.synchronize()
        row["max_abs_diff_vs_fa2"][name] = (out.float() - reference.float()).abs().nan_to_num(float("inf")).max().item()
    time_interleaved(timer, fns, forward_flops(batch, heads, seqlen, seqlen, d, causal), row, rounds)
    return row


def markdown(rows):
    lines = ["Forward TFLOP/s, bf16, 16k tokens per call (heads = 2048 / d); speedups are ratios of times in "
             "this run. FA2's order over FA1: fa2_order / fa1 (same kernel code: the loop swap together with "
             "the parallelism over the sequence it permits); split into parallelism (fa1_split / fa1) and the "
             "HBM round trip of O, m and l (fa2_order / fa1_split).", "",
             "| d | mask | seqlen | batch x heads | FA1 | FA1 order, split | FA2 order | ours | FA2 order / FA1 "
             "| parallelism | round trip | ours / FA1 | max abs diff vs SDPA FLASH |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tflops"]
        sp = lambda a, b: t[a] / t[b] if a in t and b in t else None  # noqa: E731
        cells = [f"{t[n]:.1f}" if n in t else "-" for n in IMPLS]
        row_ratios = [sp("fa2_order", "fa1"), sp("fa1_split", "fa1"), sp("fa2_order", "fa1_split"), sp("ours", "fa1")]
        diff = max(r["max_abs_diff_vs_fa2"].values())
        lines.append(f"| {r['head_dim']} | {'causal' if r['causal'] else 'none'} | {r['seqlen']} | "
                     f"{r['batch']} x {r['heads']} | " + " | ".join(cells) + " | "
                     + " | ".join("-" if x is None else f"{x:.2f}x" for x in row_ratios) + f" | {diff:.1e} |")

    def ratios(a, b):
        return [r["tflops"][a] / r["tflops"][b] for r in rows if a in r["tflops"] and b in r["tflops"]]

    summary = [(label, ratios(a, b)) for label, a, b in (("FA2 order over FA1", "fa2_order", "fa1"),
                                                          ("parallelism alone", "fa1_split", "fa1"),
                                                          ("HBM round trip alone", "fa2_order", "fa1_split"),
                                                          ("ours over FA1", "ours", "fa1"))]
    lines += ["", "Geometric means over the table (range in parentheses): "
              + "; ".join(f"{label} {geomean(v):.2f}x ({min(v):.2f}-{max(v):.2f}x)" for label, v in summary if v)
              + ".", ""]
    return "\n".join(lines)


def chart(rows, path):
    from report import pyplot
    plt = pyplot()
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (d, causal) in zip(axes.flat, panels):
        sel = sorted((r for r in rows if (r["head_dim"], r["causal"]) == (d, causal)), key=lambda r: r["seqlen"])
        for name in IMPLS:
            pts = [(r["seqlen"], r["tflops"][name]) for r in sel if name in r["tflops"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=LABELS[name])
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("forward: FA1 loop order against FA2 (bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fa1-lib", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="1024,2048,4096,8192")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    args = parser.parse_args()
    _ours.cuda_package()
    fa1 = Fa1Library(args.fa1_lib)
    timer = Timer(min_reps=5, max_reps=50, target_s=0.1, settle_s=0.2)
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                rows.append(bench(fa1, timer, d, causal, seqlen, args.rounds))
                r = rows[-1]
                print(f"d{d} {'causal' if causal else 'none':6} {seqlen:5}: "
                      + " ".join(f"{n} {r['tflops'].get(n, 0):6.1f}" for n in IMPLS)
                      + f"  diff {max(r['max_abs_diff_vs_fa2'].values()):.1e}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    chart(rows, os.path.join(args.out, "loop_order.png"))
    result = {"environment": environment(), "rows": rows, "labels": LABELS, "markdown": markdown(rows),
              "chart": "loop_order.png"}
    with open(os.path.join(args.out, "loop_order.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(result["markdown"])
    bad = [r for r in rows if max(r["max_abs_diff_vs_fa2"].values()) > 0.05]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

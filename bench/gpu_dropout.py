#!/usr/bin/env python3
"""Dropout forward benchmark on the GPU machine: what dropout costs flashattn's forward, on the
kernels as dispatched (on an H100 the sm90a dropout kernels of head dims 64-128, unless built
with -DFLASHATTN_CUDA_SM90_DROPOUT=OFF) and on the sm80 kernels forced, against PyTorch SDPA's FLASH (FA2) and cuDNN backends
with the same dropout_p, in the same process and run.

Implementations: "flashattn" (dropout_p, as dispatched), "flashattn_sm80" (dropout_p,
FLASHATTN_DISABLE_SM90=1), "flashattn_nodrop" (dropout_p = 0, as dispatched: the kernel without
dropout, so flashattn / flashattn_nodrop is dropout's cost), "fa2" and "cudnn" (SDPA with
dropout_p; a backend that refuses the config is recorded, not timed).
Ours is flashattn.forward (the Python package, bench/_ours.py) with dropout_p and a fixed seed,
into an out / LSE allocated once. Grid: 16k tokens per call, heads = 2048 / head_dim
(docs/PERFORMANCE.md), timing as bench/gpu_forward.py's (_timing.Timer; no GPU spin: prefill-sized
calls). FLOPs: those of the forward without dropout.

  python3 bench/gpu_dropout.py --out results_dir [--p 0.1]   (flashattn importable: scripts/gpu_package.sh)

Writes dropout.json and dropout.md to --out and prints the table.
"""
import argparse
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import (ROUNDS, TOKENS, MODEL_WIDTH, Timer, batch_heads, environment, fmt, forward_flops,  # noqa: E402
                     geomean, ratio, time_interleaved)
from gpu_forward import forced_sm80, sdpa  # noqa: E402


def bench_config(timer, p, dtype, d, causal, seqlen):
    batch, heads = batch_heads(d, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), d, causal, seqlen)) & 0xFFFF)
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
    ours = _ours.forward_call(q, k, v, out, lse, causal=causal, dropout_p=p, seed=1234)  # (offset 0)
    fns = {"flashattn": ours, "flashattn_sm80": forced_sm80(ours),
           "flashattn_nodrop": _ours.forward_call(q, k, v, out, lse, causal=causal),
           "fa2": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal, p),
           "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, p)}
    row = {"dtype": str(dtype).removeprefix("torch."), "head_dim": d, "causal": causal, "seqlen": seqlen,
           "batch": batch, "heads": heads, "dropout_p": p, "tflops": {}, "ms": {}, "all_written": True}
    for name in ("flashattn", "flashattn_sm80"):  # every element written, none NaN
        out.fill_(float("nan"))
        fns[name]()
        torch.cuda.synchronize()
        row["all_written"] &= not torch.isnan(out).any().item()
    time_interleaved(timer, fns, forward_flops(batch, heads, seqlen, seqlen, d, causal), row)
    return row


COLUMNS = [("flashattn", "ours"), ("flashattn_sm80", "ours sm80"), ("flashattn_nodrop", "ours p=0"), ("fa2", "FA2"),
           ("cudnn", "cuDNN")]
RATIOS = [("flashattn_nodrop", "vs p=0"), ("flashattn_sm80", "vs sm80"), ("fa2", "vs FA2"), ("cudnn", "vs cuDNN")]


def markdown(env, rows, summary, settle_s, p):
    lines = [f"# Forward with dropout (p = {p}): flashattn vs its sm80 kernels, its p = 0 kernel, PyTorch SDPA", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- {TOKENS} tokens per call, heads = {MODEL_WIDTH} / head_dim; CUDA-event timings, L2 flushed before "
              f"each call; {ROUNDS} interleaved rounds in rotating order, each timed after {settle_s} s of the same "
              "calls, median of the round medians; FLOPs of the forward without dropout", "",
              "## Summary (geometric means of ours / the column)", ""]
    lines += [f"- {label}: {fmt(summary[name], '.3f')}x" for name, label in RATIOS]
    lines += ["", "| dtype | d | mask | seqlen | " + " | ".join(label for _, label in COLUMNS) + " | "
              + " | ".join(label for _, label in RATIOS) + " | errors |",
              "|" + "---|" * (5 + len(COLUMNS) + len(RATIOS))]
    for r in rows:
        cells = [r["dtype"], r["head_dim"], "causal" if r["causal"] else "none", r["seqlen"]]
        cells += [fmt(r["tflops"].get(name)) for name, _ in COLUMNS]
        cells += [fmt(ratio(r, name), ".2f") for name, _ in RATIOS]
        cells.append("; ".join(f"{k}: {v}" for k, v in r.get("errors", {}).items()) or "")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "TFLOP/s; ratios are ours (dropout, as dispatched) / the column, in this run."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for dropout.json and dropout.md")
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()

    _ours.cuda_package()
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2)
    env = environment()
    configs = [(getattr(torch, dt), d, causal, s) for dt in args.dtypes.split(",")
               for d in map(int, args.head_dims.split(",")) for causal in (False, True)
               for s in map(int, args.seqlens.split(","))]
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'seqlen':>6} " + " ".join(f"{label:>9}" for _, label in COLUMNS) + " "
          + " ".join(f"{label:>8}" for _, label in RATIOS))
    rows = []
    for i, config in enumerate(configs):
        r = bench_config(timer, args.p, *config)
        rows.append(r)
        print(f"{r['dtype']:9} {r['head_dim']:4} {'causal' if r['causal'] else 'none':6} {r['seqlen']:6} "
              + " ".join(f"{r['tflops'].get(name, 0):9.1f}" for name, _ in COLUMNS) + " "
              + " ".join(f"{ratio(r, name) or 0:8.2f}" for name, _ in RATIOS)
              + f"  [{i + 1}/{len(configs)}]" + ("" if r["all_written"] else "  UNWRITTEN OUTPUT")
              + "".join(f"  {k}: {v}" for k, v in r.get("errors", {}).items()), flush=True)

    summary = {name: geomean([ratio(r, name) for r in rows]) for name, _ in RATIOS}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dropout.json"), "w") as f:
        json.dump({"environment": env, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "dropout.md"), "w") as f:
        f.write(markdown(env, rows, summary, timer.settle_s, args.p))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["all_written"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

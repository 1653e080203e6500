#!/usr/bin/env python3
"""What a learnable sink costs each kernel family, on the GPU machine: every family timed with a
sink (fp32 logits [heads]) and without one, interleaved in the same process and run.

Families (names in the results; "<family>" is timed with the sink, "<family>_nosink" without):
  fwd        flashattn.forward as dispatched (the sm90a kernels on Hopper)
  fwd_sm80   the same with FLASHATTN_DISABLE_SM90=1 (the sm80 kernels)
  bwd        flashattn.backward as dispatched (the sm90a backward where it applies), the sink's
             call also writing d_sink
  bwd_sm80   the same with FLASHATTN_DISABLE_SM90=1 (the sm80 backward)
  decode     flashattn.forward_kvcache, one query token per sequence against full caches (the
             split-KV decode kernels), --decode-batch sequences of each --decode-context keys
The prefill grid is the suite's (16k tokens per call, heads = 2048 / head_dim, bf16;
docs/PERFORMANCE.md) at --seqlens; timing is bench/_timing's (L2 flushed before each call, a GPU
spin ahead of each timed call, interleaved rounds in rotating order, median of round medians).
A family's cost is its time with the sink over its time without it, minus one.

  python3 bench/gpu_sink.py --out results_dir   (flashattn importable: scripts/gpu_package.sh)

Writes sink.json and sink.md to --out and prints the table.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import (LEAD_CYCLES, ROUNDS, TOKENS, MODEL_WIDTH, Timer, batch_heads, environment, fmt,  # noqa: E402
                     forward_flops, geomean, time_interleaved)
from gpu_forward import with_env  # noqa: E402

FAMILIES = ["fwd", "fwd_sm80", "bwd", "bwd_sm80"]


def prefill_fns(fa, dtype, d, causal, seqlen):
    """name -> call for the prefill families, with and without the sink."""
    batch, heads = batch_heads(d, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), d, causal, seqlen)) & 0xFFFF)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, generator=gen)
                     for _ in range(4))
    sink = torch.randn(heads, device="cuda", dtype=torch.float32, generator=gen)
    dsink = torch.empty_like(sink)
    fns, outputs = {}, {}
    for with_sink in (True, False):
        suffix = "" if with_sink else "_nosink"
        learnable_sink = sink if with_sink else None
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
        fwd = _ours.checked(lambda o=out, s=lse, ls=learnable_sink: fa.forward(
            q, k, v, causal=causal, out=o, lse=s, learnable_sink=ls))
        fwd()  # the backward's out / lse
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        extra = {"learnable_sink": sink, "dsink": dsink} if with_sink else {}
        bwd = _ours.checked(lambda o=out, s=lse, e=extra, g=(dq, dk, dv): fa.backward(
            dout, q, k, v, o, s, causal=causal, dq=g[0], dk=g[1], dv=g[2], **e))
        fns["fwd" + suffix] = fwd
        fns["fwd_sm80" + suffix] = with_env(fwd, "FLASHATTN_DISABLE_SM90", "1")
        fns["bwd" + suffix] = bwd
        fns["bwd_sm80" + suffix] = with_env(bwd, "FLASHATTN_DISABLE_SM90", "1")
        outputs[with_sink] = out
    torch.cuda.synchronize()
    fwd_flops = forward_flops(batch, heads, seqlen, seqlen, d, causal)
    flops = {name: fwd_flops * (2.5 if name.startswith("bwd") else 1) for name in fns}
    return fns, flops, {"batch": batch, "heads": heads}


def decode_fns(fa, dtype, d, batch, context):
    heads, heads_kv = MODEL_WIDTH // d, 8
    gen = torch.Generator(device="cuda").manual_seed(d * 7 + batch)
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype, generator=gen)
    k_cache, v_cache = (torch.randn(batch, context, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
                        for _ in range(2))
    sink = torch.randn(heads, device="cuda", dtype=torch.float32, generator=gen)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, 1, device="cuda", dtype=torch.float32)
    fns = {name: _ours.checked(lambda ls=ls: fa.forward_kvcache(q, k_cache, v_cache, out=out, lse=lse,
                                                                  index_check="host", learnable_sink=ls))
           for name, ls in (("decode", sink), ("decode_nosink", None))}
    bytes_read = 2 * k_cache.numel() * k_cache.element_size()
    return fns, bytes_read, {"batch": batch, "heads": heads, "heads_kv": heads_kv, "context": context}


def cost(row, family):
    ms = row["ms"]
    if family in ms and family + "_nosink" in ms:
        return ms[family] / ms[family + "_nosink"] - 1
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for sink.json and sink.md")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=16384)
    args = parser.parse_args()

    fa = _ours.cuda_package()
    dtype = getattr(torch, args.dtype)
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2, lead_cycles=LEAD_CYCLES)
    env = environment()
    head_dims = [int(x) for x in args.head_dims.split(",")]
    rows = []
    print(f"{'config':28} " + " ".join(f"{f:>9}" for f in FAMILIES + ["decode"]), flush=True)
    for d in head_dims:
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                fns, flops, shape = prefill_fns(fa, dtype, d, causal, seqlen)
                row = {"kind": "prefill", "dtype": args.dtype, "head_dim": d, "causal": causal, "seqlen": seqlen,
                       **shape, "ms": {}, "tflops": {}}
                time_interleaved(timer, fns, 1.0, row)
                row["tflops"] = {n: flops[n] / ms / 1e9 for n, ms in row["ms"].items()}
                row["cost"] = {f: cost(row, f) for f in FAMILIES}
                rows.append(row)
                name = f"d{d} {'causal' if causal else 'full'} {seqlen}"
                print(f"{name:28} " + " ".join(f"{fmt(None if c is None else 100 * c, '+.1f'):>8}%"
                                               for c in row["cost"].values())
                      + "".join(f"  {k}: {v}" for k, v in row.get("errors", {}).items()), flush=True)
        fns, bytes_read, shape = decode_fns(fa, dtype, d, args.decode_batch, args.decode_context)
        row = {"kind": "decode", "dtype": args.dtype, "head_dim": d, **shape, "ms": {}, "tflops": {}}
        time_interleaved(timer, fns, 1.0, row)
        row["tbps"] = {n: bytes_read / ms / 1e9 for n, ms in row["ms"].items()}
        row["cost"] = {"decode": cost(row, "decode")}
        rows.append(row)
        name = f"d{d} decode b{args.decode_batch} {args.decode_context}"
        print(f"{name:28} " + " " * 10 * len(FAMILIES)
              + f"{fmt(None if row['cost']['decode'] is None else 100 * row['cost']['decode'], '+.1f'):>8}%"
              + "".join(f"  {k}: {v}" for k, v in row.get("errors", {}).items()), flush=True)

    summary = {}
    for family in FAMILIES + ["decode"]:
        costs = [r["cost"][family] for r in rows if r["cost"].get(family) is not None]
        ratio = geomean([1 + c for c in costs])
        summary[family] = {"worst": max(costs) if costs else None, "geomean": None if ratio is None else ratio - 1}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sink.json"), "w") as f:
        json.dump({"environment": env, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "sink.md"), "w") as f:
        f.write(markdown(env, rows, summary, timer.settle_s, args))
    print(json.dumps(summary, indent=1))
    return 0


def pct(c):
    return fmt(None if c is None else 100 * c, "+.1f") + ("%" if c is not None else "")


def markdown(env, rows, summary, settle_s, args):
    lines = ["# The cost of a learnable sink, per kernel family", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- prefill: {TOKENS} tokens per call, heads = {MODEL_WIDTH} / head_dim, {args.dtype}; decode: "
              f"{args.decode_batch} sequences of {args.decode_context} cached keys, heads = {MODEL_WIDTH} / head_dim "
              "over 8 KV heads, one query token", f"- CUDA-event timings, L2 flushed before each call; {ROUNDS} "
              f"interleaved rounds in rotating order, each timed after {settle_s} s of the same calls, median of the "
              "round medians", "- cost = time with the sink / time without it - 1 (negative: noise)", "",
              "## Summary", "", "| family | worst | geomean |", "|---|---|---|"]
    lines += [f"| {f} | {pct(s['worst'])} | {pct(s['geomean'])} |" for f, s in summary.items()]
    lines += ["", "## Prefill (TFLOP/s with / without the sink, cost)", "",
              "| d | mask | seqlen | " + " | ".join(FAMILIES) + " |", "|" + "---|" * (3 + len(FAMILIES))]
    for r in rows:
        if r["kind"] != "prefill":
            continue
        cells = [r["head_dim"], "causal" if r["causal"] else "none", r["seqlen"]]
        cells += [f"{fmt(r['tflops'].get(f))} / {fmt(r['tflops'].get(f + '_nosink'))} ({pct(r['cost'][f])})"
                  for f in FAMILIES]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "## Decode (TB/s of K and V read, with / without the sink, cost)", "",
              "| d | batch | context | decode |", "|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "decode":
            lines.append(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {fmt(r['tbps'].get('decode'), '.2f')}"
                         f" / {fmt(r['tbps'].get('decode_nosink'), '.2f')} ({pct(r['cost']['decode'])}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

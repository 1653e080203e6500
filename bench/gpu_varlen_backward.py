#!/usr/bin/env python3
"""Varlen backward benchmark on the GPU machine: flashattn's CUDA backward on packed batches of
sequences of different lengths (bench/gpu_varlen.py's batches: 16k tokens, heads = 2048 /
head_dim, log-uniform lengths per mix) against PyTorch's varlen FlashAttention-2
(torch.nn.attention.varlen.varlen_attn), in the same process and run.

Ours: "flashattn" is the library as dispatched (on an H100 / H200 the sm90a backward where it
has the head dim), "flashattn_sm80" the same call with FLASHATTN_SM90_BACKWARD=0 (the sm80
backward). Both are flashattn.backward from our forward's out and LSE, into gradients allocated
once, the lengths checked on the device (the package's default: no host wait). FA2: the backward
alone, torch.autograd.grad of varlen_attn's output with retain_graph=True (its forward ran once,
untimed). Timing as bench/gpu_varlen.py's (_timing.Timer: CUDA events, the L2 flushed before
each call, interleaved rounds in rotating order). FLOPs: 2.5x the forward's, summed over the
sequences (4 * h * len^2 * d, halved for causal).

  python3 bench/gpu_varlen_backward.py --out results_dir   (flashattn importable)

Writes varlen_backward.json and varlen_backward.md to --out and prints the table.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import ROUNDS, TOKENS, MODEL_WIDTH, Timer, environment, fmt, geomean, ratio, time_interleaved  # noqa: E402
from gpu_forward import with_env  # noqa: E402
from gpu_varlen import MIXES, fa2_varlen, sequence_lengths  # noqa: E402


def bench_config(timer, dtype, d, causal, mix):
    heads = MODEL_WIDTH // d
    lengths = sequence_lengths(mix)
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), d, causal, mix)) & 0xFFFF)
    q, k, v, dout = (torch.randn(TOKENS, heads, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    max_len = max(lengths)
    out = torch.empty_like(q)
    lse = torch.empty(heads, TOKENS, device="cuda", dtype=torch.float32)
    _ours.forward_varlen_call(q, k, v, out, lse, cu, cu, max_len, max_len, causal=causal, index_check="device")()
    backward = _ours.package().backward
    dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(3))
    ours = _ours.checked(lambda: backward(dout, q, k, v, out, lse, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max_len, max_seqlen_k=max_len, causal=causal, dq=dq, dk=dk,
                                          dv=dv))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fa2_out = fa2_varlen(*leaves, cu, max_len, causal)()
    fa2 = lambda: torch.autograd.grad(fa2_out, leaves, dout, retain_graph=True)  # noqa: E731
    row = {"dtype": str(dtype).removeprefix("torch."), "head_dim": d, "causal": causal, "mix": mix,
           "sequences": len(lengths), "max_len": max_len, "heads": heads, "tflops": {}, "ms": {}}
    reference = fa2()
    fns = {"flashattn": ours, "flashattn_sm80": with_env(ours, "FLASHATTN_SM90_BACKWARD", "0")}
    row["all_finite"] = True
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        row["all_finite"] &= all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
        row["max_abs_diff_vs_fa2" + name.removeprefix("flashattn")] = max(
            (ours_g.float() - ref.float()).abs().max().item() for ours_g, ref in zip((dq, dk, dv), reference))
    flops = 2.5 * sum(4 * heads * n * n * d for n in lengths) / (2 if causal else 1)
    time_interleaved(timer, {**fns, "fa2": fa2}, flops, row)
    return row


def markdown(env, rows, summary, settle_s):
    lines = ["# Varlen backward: flashattn (as dispatched; its sm80 backward) vs PyTorch varlen FA2", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- {TOKENS} tokens per call in sequences of log-uniform lengths ("
              + ", ".join(f"{name}: {lo}..{hi}" for name, (lo, hi) in MIXES.items())
              + f"), heads = {MODEL_WIDTH} / head_dim; the backward alone; CUDA-event timings, L2 flushed "
              f"before each call; {ROUNDS} interleaved rounds in rotating order, each timed after {settle_s} s of "
              "the same calls, median of the round medians; FLOPs 2.5x the forward's, summed over the sequences",
              "", "## Summary", "",
              f"- geometric mean vs FA2 varlen: {fmt(summary['geomean_vs_fa2'], '.3f')}x "
              f"(sm80 backward: {fmt(summary['sm80_geomean_vs_fa2'], '.3f')}x)",
              f"- geometric mean vs our sm80 backward: {fmt(summary['geomean_vs_sm80'], '.3f')}x",
              "", "| dtype | d | mask | mix | seqs | max len | flashattn | sm80 backward | FA2 varlen | vs FA2 "
              "| vs sm80 | max abs diff vs FA2 (ours / sm80) |", "|" + "---|" * 12]
    for r in rows:
        t = r["tflops"]
        cells = [r["dtype"], r["head_dim"], "causal" if r["causal"] else "none", r["mix"], r["sequences"], r["max_len"],
                 fmt(t.get("flashattn")), fmt(t.get("flashattn_sm80")), fmt(t.get("fa2")),
                 fmt(ratio(r, "fa2"), ".2f"), fmt(ratio(r, "flashattn_sm80"), ".2f"),
                 f"{r['max_abs_diff_vs_fa2']:.2e} / {r['max_abs_diff_vs_fa2_sm80']:.2e}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "TFLOP/s; ratios are ours / peer in this run."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for varlen_backward.json and varlen_backward.md")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--mixes", default="short,medium,long")
    args = parser.parse_args()

    _ours.cuda_package()
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2)
    env = environment()
    configs = [(getattr(torch, dt), d, causal, mix) for dt in args.dtypes.split(",")
               for d in map(int, args.head_dims.split(",")) for causal in (False, True)
               for mix in args.mixes.split(",")]
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'mix':6} {'seqs':>4} {'ours':>7} {'sm80':>7} {'FA2':>7} "
          f"{'/FA2':>6} {'/sm80':>6} {'diff':>8}")
    rows = []
    for i, config in enumerate(configs):
        r = bench_config(timer, *config)
        rows.append(r)
        t = r["tflops"]
        print(f"{r['dtype']:9} {r['head_dim']:4} {'causal' if r['causal'] else 'none':6} {r['mix']:6} "
              f"{r['sequences']:4} {t.get('flashattn', 0):7.1f} {t.get('flashattn_sm80', 0):7.1f} "
              f"{t.get('fa2', 0):7.1f} {ratio(r, 'fa2') or 0:6.2f} {ratio(r, 'flashattn_sm80') or 0:6.2f} "
              f"{r['max_abs_diff_vs_fa2']:8.1e}  [{i + 1}/{len(configs)}]"
              + ("" if r["all_finite"] else "  NON-FINITE GRADIENT"), flush=True)
    summary = {
        "geomean_vs_fa2": geomean([ratio(r, "fa2") for r in rows]),
        "sm80_geomean_vs_fa2": geomean([ratio(r, "fa2", "flashattn_sm80") for r in rows]),
        "geomean_vs_sm80": geomean([ratio(r, "flashattn_sm80") for r in rows]),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "varlen_backward.json"), "w") as f:
        json.dump({"environment": env, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "varlen_backward.md"), "w") as f:
        f.write(markdown(env, rows, summary, timer.settle_s))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["all_finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Varlen forward benchmark on the GPU machine: flashattn's CUDA forward on packed batches of
sequences of different lengths against PyTorch's varlen FlashAttention-2
(torch.nn.attention.varlen.varlen_attn), in the same process and run.

Which of our kernels: "flashattn" is the library as dispatched (on an H100 the sm90a kernels,
but the sm80 ones for d64 batches of short sequences); "flashattn_sm90" the same call with
FLASHATTN_SM90_VARLEN=1 (the sm90a kernels wherever they run), "flashattn_sm80" with
FLASHATTN_SM90_VARLEN=0 (the sm80 kernels).

Batches: 16k tokens per call, heads = 2048 / head_dim; the sequence lengths drawn (seeded) from
a log-uniform distribution over a mix's range until the tokens are used up (the last one
trimmed): "short" 64..1024, "medium" 256..2048, "long" 512..8192. q, k, v [total, h, d];
cu_seqlens on the device.
--page-sizes P,... also times the same batch with K/V paged (flash_attn's block_table form): each
sequence's keys in pages of P tokens, the pages in shuffled order in one pool; "flashattn_pP" in
the results. Paged calls run our sm80 kernels on every GPU, so "pP / sm80" is the cost of paging.
Ours is flashattn.forward with cu_seqlens (the Python package, bench/_ours.py) into an out / LSE
allocated once, its lengths checked where --index-check says: "host" (the default, as the C ABI
checks them by default and as the committed varlen figures were measured: cu_seqlens copied to
the host and the stream waited for every call, so the host's queueing of the kernels after that
wait is inside the timed interval) or "device" (the package's default: a kernel checks them, the
call never waits). Timing as bench/gpu_forward.py's (_timing.Timer: CUDA events, the L2 flushed
before each call, settled clock, interleaved rounds in rotating order; no GPU spin: each call is
16k tokens of GPU work). FLOPs: the sum over the sequences of 4 * h * len^2 * d, halved for
causal; the same count for every implementation.

  python3 bench/gpu_varlen.py --out results_dir [--index-check host|device]   (flashattn importable)

Writes varlen.json and varlen.md to --out and prints the table.
"""
import argparse
import inspect
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import (ROUNDS, TOKENS, MODEL_WIDTH, Timer, ceilings, environment, fmt, geomean,  # noqa: E402
                     ratio, time_interleaved)
from gpu_forward import max_abs_diff_vs_fa2, with_env  # noqa: E402

MIXES = {"short": (64, 1024), "medium": (256, 2048), "long": (512, 8192)}


def sequence_lengths(mix):
    """Lengths log-uniform over the mix's range, summing to TOKENS (the same in every run)."""
    lo, hi = MIXES[mix]
    rng = random.Random(mix)
    lengths = []
    while sum(lengths) < TOKENS:
        lengths.append(min(int(math.exp(rng.uniform(math.log(lo), math.log(hi)))), TOKENS - sum(lengths)))
    return lengths


def fa2_varlen(q, k, v, cu, max_len, causal):
    """PyTorch's varlen FlashAttention-2; its causal flag moved into window_size in 2.10."""
    from torch.nn.attention.varlen import varlen_attn

    if "is_causal" in inspect.signature(varlen_attn).parameters:
        kwargs = {"is_causal": causal}
    else:
        kwargs = {"window_size": (-1, 0) if causal else (-1, -1)}
    return lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def paginate(k, v, lengths, page_size, gen):
    """k / v [total, hkv, d] packed -> (k_pages, v_pages [num_blocks, page_size, hkv, d], block_table
    int32 [batch, max_blocks]): sequence i's keys in the pages of its table row, the pages shuffled."""
    pages_of = [-(-n // page_size) for n in lengths]
    order = torch.randperm(sum(pages_of), generator=gen, device="cuda").tolist()
    table = torch.zeros(len(lengths), max(pages_of), dtype=torch.int32)
    page_of_token, row_of_token = [], []
    for i, n in enumerate(lengths):
        blocks, order = order[:pages_of[i]], order[pages_of[i]:]
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        page_of_token += [blocks[j // page_size] for j in range(n)]
        row_of_token += [j % page_size for j in range(n)]
    pages, rows = torch.tensor(page_of_token, device="cuda"), torch.tensor(row_of_token, device="cuda")
    k_pages = k.new_zeros(sum(pages_of), page_size, *k.shape[1:])
    v_pages = torch.zeros_like(k_pages)
    k_pages[pages, rows], v_pages[pages, rows] = k, v
    return k_pages, v_pages, table.cuda()


def bench_config(timer, dtype, d, causal, mix, page_sizes=(), index_check="host"):
    heads = MODEL_WIDTH // d
    lengths = sequence_lengths(mix)
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), d, causal, mix)) & 0xFFFF)
    q, k, v = (torch.randn(TOKENS, heads, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(heads, TOKENS, device="cuda", dtype=torch.float32)
    ours = _ours.forward_varlen_call(q, k, v, out, lse, cu, cu, max(lengths), max(lengths), causal=causal,
                                     index_check=index_check)
    flops = sum(4 * heads * n * n * d for n in lengths) / (2 if causal else 1)
    row = {"dtype": str(dtype).removeprefix("torch."), "head_dim": d, "causal": causal, "mix": mix,
           "sequences": len(lengths), "max_len": max(lengths), "heads": heads, "tflops": {}, "ms": {}}
    fa2 = fa2_varlen(q, k, v, cu, max(lengths), causal)
    ours_fns = {"flashattn": ours, "flashattn_sm90": with_env(ours, "FLASHATTN_SM90_VARLEN", "1"),
                "flashattn_sm80": with_env(ours, "FLASHATTN_SM90_VARLEN", "0")}
    for page_size in page_sizes:
        k_pages, v_pages, table = paginate(k, v, lengths, page_size, gen)
        ours_fns[f"flashattn_p{page_size}"] = _ours.forward_varlen_call(
            q, k_pages, v_pages, out, lse, cu, cu, max(lengths), max(lengths), causal=causal, block_table=table,
            index_check=index_check)
    reference = fa2()
    row["all_written"] = True
    for name, fn in ours_fns.items():
        diff, written = max_abs_diff_vs_fa2(fn, out, reference)
        row["max_abs_diff_vs_fa2" + name.removeprefix("flashattn")] = diff
        row["all_written"] &= written
    time_interleaved(timer, {**ours_fns, "fa2": fa2}, flops, row)
    return row


def markdown(env, ceil, rows, summary, settle_s, page_sizes):
    lines = ["# Varlen forward: flashattn (as dispatched; its sm90 and sm80 kernels) vs PyTorch varlen FA2", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- bf16 GEMM ceiling (8192^3, same run): {ceil['bf16_gemm_tflops']:.0f} TFLOP/s",
              f"- {TOKENS} tokens per call in sequences of log-uniform lengths ("
              + ", ".join(f"{name}: {lo}..{hi}" for name, (lo, hi) in MIXES.items())
              + f"), heads = {MODEL_WIDTH} / head_dim; CUDA-event timings, L2 flushed before each "
              f"call; {ROUNDS} interleaved rounds in rotating order, each timed after {settle_s} s of the same calls, "
              "median of the round medians; FLOPs summed over the sequences", "",
              "## Summary", "",
              f"- geometric mean vs FA2 varlen: {fmt(summary['geomean_vs_fa2'], '.3f')}x "
              f"(sm80 kernels: {fmt(summary['sm80_geomean_vs_fa2'], '.3f')}x)",
              f"- geometric mean vs our sm80 kernels: {fmt(summary['geomean_vs_sm80'], '.3f')}x",
              f"- geometric mean vs our sm90 kernels: {fmt(summary['geomean_vs_sm90'], '.3f')}x",
              f"- configs below FA2: {', '.join(summary['configs_below_fa2']) or 'none'}"]
    lines += [f"- pages of {p}: geometric mean {fmt(summary['paged_vs_sm80'][str(p)], '.3f')}x our packed sm80 "
              f"kernels (lowest {fmt(summary['paged_min_vs_sm80'][str(p)], '.3f')}x)" for p in page_sizes]
    paged_heads = "".join(f" pages of {p} | p{p} / sm80 |" for p in page_sizes)
    lines += ["", "| dtype | d | mask | mix | seqs | max len | flashattn | sm90 kernels | sm80 kernels | FA2 varlen "
              "| vs FA2 | vs sm90 | vs sm80 | spread ours / FA2 | max abs diff vs FA2 |" + paged_heads,
              "|" + "---|" * (15 + 2 * len(page_sizes))]
    for r in rows:
        t, spread = r["tflops"], r.get("round_spread", {})
        cells = [r["dtype"], r["head_dim"], "causal" if r["causal"] else "none", r["mix"], r["sequences"], r["max_len"],
                 fmt(t.get("flashattn")), fmt(t.get("flashattn_sm90")), fmt(t.get("flashattn_sm80")),
                 fmt(t.get("fa2")), fmt(ratio(r, "fa2"), ".2f"), fmt(ratio(r, "flashattn_sm90"), ".2f"),
                 fmt(ratio(r, "flashattn_sm80"), ".2f"),
                 f"{fmt(spread.get('flashattn'), '.1%')} / {fmt(spread.get('fa2'), '.1%')}",
                 f"{r['max_abs_diff_vs_fa2']:.2e}"]
        for p in page_sizes:
            cells += [fmt(t.get(f"flashattn_p{p}")), fmt(ratio(r, "flashattn_sm80", f"flashattn_p{p}"), ".3f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "TFLOP/s; ratios are ours / peer in this run."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for varlen.json and varlen.md")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--mixes", default="short,medium,long")
    parser.add_argument("--page-sizes", default="", help="also time K/V paged in pages of these sizes")
    parser.add_argument("--index-check", default="host", choices=("host", "device"),
                        help="where ours checks the lengths (host: the C ABI's default and the committed figures')")
    args = parser.parse_args()
    page_sizes = [int(p) for p in args.page_sizes.split(",") if p]

    _ours.cuda_package()
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2)
    env = dict(environment(), index_check=args.index_check)  # (ours' lengths check: in the Markdown too)
    ceil = ceilings(timer)
    configs = [(getattr(torch, dt), d, causal, mix) for dt in args.dtypes.split(",")
               for d in map(int, args.head_dims.split(",")) for causal in (False, True)
               for mix in args.mixes.split(",")]
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'mix':6} {'seqs':>4} {'ours':>7} {'sm90':>7} {'sm80':>7} {'FA2':>7} "
          f"{'/FA2':>6} {'/sm90':>6} {'/sm80':>6} {'diff':>8}")
    rows = []
    for i, config in enumerate(configs):
        r = bench_config(timer, *config, page_sizes=page_sizes, index_check=args.index_check)
        rows.append(r)
        t = r["tflops"]
        print(f"{r['dtype']:9} {r['head_dim']:4} {'causal' if r['causal'] else 'none':6} {r['mix']:6} "
              f"{r['sequences']:4} {t.get('flashattn', 0):7.1f} {t.get('flashattn_sm90', 0):7.1f} "
              f"{t.get('flashattn_sm80', 0):7.1f} {t.get('fa2', 0):7.1f} {ratio(r, 'fa2') or 0:6.2f} "
              f"{ratio(r, 'flashattn_sm90') or 0:6.2f} {ratio(r, 'flashattn_sm80') or 0:6.2f} "
              f"{r['max_abs_diff_vs_fa2']:8.1e}"
              + "".join(f" p{p} {ratio(r, 'flashattn_sm80', f'flashattn_p{p}') or 0:.3f}" for p in page_sizes)
              + f"  [{i + 1}/{len(configs)}]"
              + ("" if r["all_written"] else "  UNWRITTEN OUTPUT"), flush=True)
    summary = {
        "geomean_vs_fa2": geomean([ratio(r, "fa2") for r in rows]),
        "sm80_geomean_vs_fa2": geomean([ratio(r, "fa2", "flashattn_sm80") for r in rows]),
        "geomean_vs_sm80": geomean([ratio(r, "flashattn_sm80") for r in rows]),
        "geomean_vs_sm90": geomean([ratio(r, "flashattn_sm90") for r in rows]),
        "configs_below_fa2": [f"{r['dtype']} d{r['head_dim']} {'causal' if r['causal'] else 'full'} {r['mix']}"
                              for r in rows if (ratio(r, "fa2") or 0) < 1.0],
        "paged_vs_sm80": {str(p): geomean([ratio(r, "flashattn_sm80", f"flashattn_p{p}") for r in rows])
                          for p in page_sizes},
        "paged_min_vs_sm80": {str(p): min((ratio(r, "flashattn_sm80", f"flashattn_p{p}") or 0 for r in rows),
                                          default=None) for p in page_sizes},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "varlen.json"), "w") as f:
        json.dump({"environment": env, "ceilings": ceil, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "varlen.md"), "w") as f:
        f.write(markdown(env, ceil, rows, summary, timer.settle_s, page_sizes))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["all_written"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

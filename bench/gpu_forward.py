#!/usr/bin/env python3
"""Forward benchmark on the GPU machine: flashattn's CUDA forward against PyTorch SDPA's FLASH
(FlashAttention-2) and cuDNN backends, in the same process and run, over the prefill grid of
docs/PERFORMANCE.md (16k tokens per call, heads = 2048 / head_dim, seqlen 512..16k, causal and
not, bf16 and fp16), plus the bf16 GEMM and device-copy ceilings measured in the same run.

Which of our kernels (--kernels): "flashattn" is the library as dispatched (on an H100 the sm90a
kernels where they apply); with "both" (the default) the sm80 kernels also run, forced with
FLASHATTN_DISABLE_SM90=1, as "flashattn_sm80"; "sm80" times only those, as "flashattn"; "grids"
times the sm90 kernels' persistent grid (as dispatched) against one CTA per work tile
(FLASHATTN_SM90_PERSISTENT=0), as "flashattn_tile_grid"; "dynamic" times the library as dispatched
against the persistent grid whose CTAs take tiles from a counter (FLASHATTN_SM90_PERSISTENT=2),
as "flashattn_dynamic"; "tall" times masked d64 on two consumer warpgroups (FLASHATTN_SM90_D64_TALL=0)
as "flashattn" against the tall kernel (=1) as "flashattn_tall", to place the dispatch's threshold.

Every implementation gets the same [batch, seqlen, heads, head_dim] tensors (PyTorch's SDPA sees
them as transposed views, FlashAttention-2's native layout) and writes its LSE; ours is
flashattn.forward (the Python package, bench/_ours.py) into an out / LSE allocated once. Timing:
CUDA events around each call, the L2 flushed before every call, warm-up, median of the repeats, in
interleaved rounds whose order rotates (ours, FA2, cuDNN; FA2, cuDNN, ours; ...), each timing
after 0.2 s of the same calls so the power-capped clock has settled (see Timer). No GPU spin
before the calls (Timer.lead_cycles): every call here is a prefill of 16k tokens, whose GPU time
(0.1 ms and more) plus the flush's outlasts its host side (the package's or SDPA's, tens of
microseconds), and the timer queues the calls without waiting for them, so the host stays ahead.
FLOPs: 4 * b * h * sq * sk * d, halved for causal.

  python3 bench/gpu_forward.py --out results_dir [--quick]   (flashattn importable: scripts/gpu_package.sh)

Writes forward.json and forward.md to --out and prints the table.
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
from _timing import (ROUNDS, TOKENS, MODEL_WIDTH, Timer, batch_heads, ceilings, environment, fmt,  # noqa: E402
                     forward_flops, ratio, summarize, time_interleaved)


def sdpa(backend, q, k, v, causal, dropout_p=0.0):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d] views of [b, s, h, d]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, dropout_p=dropout_p, is_causal=causal)

    return run


def with_env(fn, name, value):
    """fn with the environment variable name set to value (the library reads FLASHATTN_DISABLE_SM90
    and FLASHATTN_SM90_PERSISTENT on every call; os.environ writes the process's environment, which
    the extension's getenv reads)."""
    def run():
        os.environ[name] = value
        try:
            return fn()
        finally:
            del os.environ[name]

    return run


def forced_sm80(fn):
    return with_env(fn, "FLASHATTN_DISABLE_SM90", "1")


# --kernels -> the second variant of ours timed beside the library as dispatched: its name in the
# results, and how the tables call it.
SECOND_VARIANTS = {"both": ("flashattn_sm80", "sm80 kernels forced"),
                   "grids": ("flashattn_tile_grid", "one CTA per tile"),
                   "dynamic": ("flashattn_dynamic", "persistent grid, tiles from a counter"),
                   "tall": ("flashattn_tall", "masked d64 on the tall kernel (three consumers)"),
                   "order": ("flashattn_pair_order", "masked tiles a (head, batch) pair at a time"),
                   "sm80order": ("flashattn_sm80_pair_order", "sm80, masked tiles a (head, batch) pair at a time")}


def max_abs_diff_vs_fa2(fn, out, reference):
    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    return (out.float() - reference.float()).abs().max().item(), not torch.isnan(out).any().item()


def bench_config(timer, kernels, dtype, d, causal, seqlen):
    batch, heads = batch_heads(d, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), d, causal, seqlen)) & 0xFFFF)
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
    ours = _ours.forward_call(q, k, v, out, lse, causal=causal)
    flops = forward_flops(batch, heads, seqlen, seqlen, d, causal)
    row = {"dtype": str(dtype).removeprefix("torch."), "head_dim": d, "causal": causal, "seqlen": seqlen,
           "batch": batch, "heads": heads, "tflops": {}, "ms": {}}

    ours_fns = {"flashattn": forced_sm80(ours) if kernels in ("sm80", "sm80order") else ours}
    if kernels == "tall":
        ours_fns = {"flashattn": with_env(ours, "FLASHATTN_SM90_D64_TALL", "0"),
                    "flashattn_tall": with_env(ours, "FLASHATTN_SM90_D64_TALL", "1")}
    if kernels == "both":
        ours_fns["flashattn_sm80"] = forced_sm80(ours)
    if kernels == "grids":
        ours_fns["flashattn_tile_grid"] = with_env(ours, "FLASHATTN_SM90_PERSISTENT", "0")
    if kernels == "dynamic":
        ours_fns["flashattn_dynamic"] = with_env(ours, "FLASHATTN_SM90_PERSISTENT", "2")
    if kernels in ("order", "sm80order"):  # FLASHATTN_TILE_ORDER=1,0: the order before tile groups
        name = SECOND_VARIANTS[kernels][0]
        ours_fns[name] = with_env(ours_fns["flashattn"], "FLASHATTN_TILE_ORDER", "1,0")
    reference = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)().transpose(1, 2)
    row["all_written"] = True
    for name, fn in ours_fns.items():
        diff, written = max_abs_diff_vs_fa2(fn, out, reference)
        row["max_abs_diff_vs_fa2" + name.removeprefix("flashattn")] = diff
        row["all_written"] &= written

    fns = {**ours_fns, "fa2": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal),
           "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)}
    time_interleaved(timer, fns, flops, row)
    return row


def markdown(env, ceil, rows, summary, settle_s, kernels):
    title = {"both": "flashattn (as dispatched; and its sm80 kernels forced)", "sm80": "flashattn sm80 kernels",
             "dispatch": "flashattn (as dispatched)",
             "grids": "flashattn (as dispatched: persistent grids; and one CTA per tile)",
             "tall": "flashattn (masked d64 on two consumers; and on the tall kernel)",
             "dynamic": "flashattn (as dispatched; and the persistent grid taking tiles from a counter)",
             "order": "flashattn (as dispatched; and masked tiles a (head, batch) pair at a time)",
             "sm80order": "flashattn sm80 kernels (as dispatched; and masked tiles a pair at a time)"}[kernels]
    lines = [f"# Forward: {title} vs PyTorch SDPA (FA2, cuDNN)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- bf16 GEMM ceiling (8192^3, same run): {ceil['bf16_gemm_tflops']:.0f} TFLOP/s",
              f"- device copy (512 MiB, read + write): {ceil['copy_tbps']:.2f} TB/s",
              f"- {TOKENS} tokens per call, heads = {MODEL_WIDTH} / head_dim; CUDA-event timings, L2 flushed "
              f"before each call; {ROUNDS} interleaved rounds in rotating order (ours, FA2, cuDNN; FA2, cuDNN, "
              f"ours; ...), each timed after {settle_s} s of the same calls (power-capped clock settled), "
              "median of the round medians; 'spread' = largest / smallest round median of ours and FA2, "
              "minus 1", ""]
    lines += ["## Summary (seqlen >= %d)" % summary["min_seqlen"], "",
              f"- geometric mean vs FA2: {fmt(summary['geomean_vs_fa2'], '.3f')}x",
              f"- geometric mean vs cuDNN: {fmt(summary['geomean_vs_cudnn'], '.3f')}x",
              f"- lowest ratio vs FA2: {fmt(summary['min_vs_fa2'], '.3f')}x",
              f"- configs below FA2: {', '.join(summary['configs_below_fa2']) or 'none'}", ""]
    second = SECOND_VARIANTS.get(kernels)
    if second:
        name, label = second
        s2 = summary["second"]
        lines += [f"{label} ({name}):", "",
                  f"- geometric mean vs FA2: {fmt(s2['geomean_vs_fa2'], '.3f')}x, vs cuDNN: "
                  f"{fmt(s2['geomean_vs_cudnn'], '.3f')}x, lowest vs FA2: {fmt(s2['min_vs_fa2'], '.3f')}x",
                  f"- configs below FA2: {', '.join(s2['configs_below_fa2']) or 'none'}", ""]
    header = "| dtype | d | mask | seqlen | flashattn | FA2 | cuDNN | vs FA2 | vs cuDNN |"
    if second:
        header += f" {second[0]} | its vs FA2 | flashattn / {second[0]} |"
    header += " spread ours / FA2 | max abs diff vs FA2 |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        t, spread = r["tflops"], r.get("round_spread", {})
        cells = [r["dtype"], r["head_dim"], "causal" if r["causal"] else "none", r["seqlen"], fmt(t.get("flashattn")),
                 fmt(t.get("fa2")), fmt(t.get("cudnn")), fmt(ratio(r, "fa2"), ".2f"), fmt(ratio(r, "cudnn"), ".2f")]
        if second:
            cells += [fmt(t.get(second[0])), fmt(ratio(r, "fa2", second[0]), ".2f"),
                      fmt(ratio(r, second[0]), ".3f")]
        cells += [f"{fmt(spread.get('flashattn'), '.1%')} / {fmt(spread.get('fa2'), '.1%')}",
                  f"{r['max_abs_diff_vs_fa2']:.2e}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    lines.append("TFLOP/s; ratios are ours / peer in this run.")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for forward.json and forward.md")
    parser.add_argument("--quick", action="store_true", help="bf16 only, seqlen 1k / 4k / 16k")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--kernels", default="both",
                        choices=("both", "dispatch", "sm80", "grids", "dynamic", "tall", "order", "sm80order"),
                        help="ours as dispatched and the sm80 kernels forced (both), or one of them; grids: "
                             "the persistent grid and one CTA per tile; dynamic: as dispatched and the "
                             "counter-fed persistent grid; tall: masked d64 on two consumers and on the tall "
                             "kernel; order / sm80order: as dispatched / the sm80 kernels, masked tiles dealt "
                             "over head groups and a pair at a time (FLASHATTN_TILE_ORDER=1,0)")
    parser.add_argument("--masks", default="none,causal", help="which masks: none, causal, or both as none,causal")
    args = parser.parse_args()

    _ours.cuda_package()
    seqlens = [1024, 4096, 16384] if args.quick else [int(s) for s in args.seqlens.split(",")]
    dtypes = ["bfloat16"] if args.quick else args.dtypes.split(",")
    masks = [{"none": False, "causal": True}[m] for m in args.masks.split(",")]
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2)
    env = environment()
    ceil = ceilings(timer)
    print(f"{env['gpu']}: bf16 GEMM {ceil['bf16_gemm_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s",
          flush=True)

    rows = []
    configs = [(getattr(torch, dt), d, causal, s) for dt in dtypes for d in map(int, args.head_dims.split(","))
               for causal in masks for s in seqlens]
    second = SECOND_VARIANTS.get(args.kernels, (None,))[0]
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'seqlen':>6} {'ours':>7} {'FA2':>7} {'cuDNN':>7} {'/FA2':>6} {'/cuDNN':>6}"
          + (f" {'second':>7} {'/FA2':>6} {'ours/2nd':>8}" if second else "") + f" {'diff':>8}")
    for i, config in enumerate(configs):
        r = bench_config(timer, args.kernels, *config)
        rows.append(r)
        t = r["tflops"]
        cols2 = (f" {t.get(second, 0):7.1f} {ratio(r, 'fa2', second) or 0:6.2f} {ratio(r, second) or 0:8.3f}"
                 if second else "")
        print(f"{r['dtype']:9} {r['head_dim']:4} {'causal' if r['causal'] else 'none':6} {r['seqlen']:6} "
              f"{t.get('flashattn', 0):7.1f} {t.get('fa2', 0):7.1f} {t.get('cudnn', 0):7.1f} "
              f"{ratio(r, 'fa2') or 0:6.2f} {ratio(r, 'cudnn') or 0:6.2f}{cols2} {r['max_abs_diff_vs_fa2']:8.1e}"
              f"  [{i + 1}/{len(configs)}]" + ("" if r["all_written"] else "  UNWRITTEN OUTPUT"), flush=True)

    summary = summarize(rows, min_seqlen=1024)
    if second:
        summary["second"] = summarize(rows, min_seqlen=1024, ours=second)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "forward.json"), "w") as f:
        json.dump({"environment": env, "ceilings": ceil, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "forward.md"), "w") as f:
        f.write(markdown(env, ceil, rows, summary, timer.settle_s, args.kernels))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["all_written"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

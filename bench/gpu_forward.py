#!/usr/bin/env python3
"""Forward benchmark on the GPU machine: flashattn's CUDA forward against PyTorch SDPA's FLASH
(FlashAttention-2) and cuDNN backends, in the same process and run, over the prefill grid of
GUIDE.md section 7 (16k tokens per call, heads = 2048 / head_dim, seqlen 512..16k, causal and
not, bf16 and fp16), plus the bf16 GEMM and device-copy ceilings measured in the same run.

Every implementation gets the same [batch, seqlen, heads, head_dim] tensors (PyTorch's SDPA sees
them as transposed views, FlashAttention-2's native layout) and writes its LSE. Timing: CUDA
events around each call, the L2 flushed before every call, warm-up, median of the repeats, in
interleaved rounds whose order rotates (ours, FA2, cuDNN; FA2, cuDNN, ours; ...), each timing
after 0.2 s of the same calls so the power-capped clock has settled (see Timer).
FLOPs: 4 * b * h * sq * sk * d, halved for causal.

  python3 bench/gpu_forward.py --lib build/libflashattn.so --out results_dir [--quick]

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
import flashattn_c  # noqa: E402
from _timing import (ROUNDS, TOKENS, MODEL_WIDTH, Timer, batch_heads, ceilings, environment, fmt,  # noqa: E402
                     forward_flops, ratio, summarize, time_interleaved)


def sdpa(backend, q, k, v, causal):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d] views of [b, s, h, d]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return run


def bench_config(lib, timer, dtype, d, causal, seqlen):
    batch, heads = batch_heads(d, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), d, causal, seqlen)) & 0xFFFF)
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
    ours = lib.forward_call(q, k, v, out, lse, lib.options(causal=causal), torch.cuda.current_stream().cuda_stream)
    flops = forward_flops(batch, heads, seqlen, seqlen, d, causal)
    row = {"dtype": str(dtype).removeprefix("torch."), "head_dim": d, "causal": causal, "seqlen": seqlen,
           "batch": batch, "heads": heads, "tflops": {}, "ms": {}}

    ours()
    torch.cuda.synchronize()
    reference = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)().transpose(1, 2)
    row["max_abs_diff_vs_fa2"] = (out.float() - reference.float()).abs().max().item()
    row["all_written"] = not torch.isnan(out).any().item()

    fns = {"flashattn": ours, "fa2": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal),
           "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)}
    time_interleaved(timer, fns, flops, row)
    return row


def markdown(env, ceil, rows, summary, settle_s):
    lines = ["# Forward: flashattn sm80 kernel vs PyTorch SDPA (FA2, cuDNN)", ""]
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
    lines += ["| dtype | d | mask | seqlen | flashattn | FA2 | cuDNN | vs FA2 | vs cuDNN | spread ours / FA2 "
              "| max abs diff vs FA2 |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, spread = r["tflops"], r.get("round_spread", {})
        lines.append(f"| {r['dtype']} | {r['head_dim']} | {'causal' if r['causal'] else 'none'} | {r['seqlen']} | "
                     f"{fmt(t.get('flashattn'))} | {fmt(t.get('fa2'))} | {fmt(t.get('cudnn'))} | "
                     f"{fmt(ratio(r, 'fa2'), '.2f')} | {fmt(ratio(r, 'cudnn'), '.2f')} | "
                     f"{fmt(spread.get('flashattn'), '.1%')} / {fmt(spread.get('fa2'), '.1%')} | "
                     f"{r['max_abs_diff_vs_fa2']:.2e} |")
    lines.append("")
    lines.append("TFLOP/s; ratios are flashattn / peer in this run.")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", required=True, help="path to libflashattn.so built with the CUDA backend")
    parser.add_argument("--out", required=True, help="directory for forward.json and forward.md")
    parser.add_argument("--quick", action="store_true", help="bf16 only, seqlen 1k / 4k / 16k")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()

    lib = flashattn_c.Library(args.lib)
    if not lib.lib.fa_cuda_compiled():
        sys.exit(f"{args.lib} was built without the CUDA backend")
    seqlens = [1024, 4096, 16384] if args.quick else [int(s) for s in args.seqlens.split(",")]
    dtypes = ["bfloat16"] if args.quick else args.dtypes.split(",")
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2)
    env = environment(lib)
    ceil = ceilings(timer)
    print(f"{env['gpu']}: bf16 GEMM {ceil['bf16_gemm_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s",
          flush=True)

    rows = []
    configs = [(getattr(torch, dt), d, causal, s) for dt in dtypes for d in map(int, args.head_dims.split(","))
               for causal in (False, True) for s in seqlens]
    print(f"{'dtype':9} {'d':>4} {'mask':6} {'seqlen':>6} {'ours':>7} {'FA2':>7} {'cuDNN':>7} {'/FA2':>6} {'/cuDNN':>6} {'diff':>8}")
    for i, config in enumerate(configs):
        r = bench_config(lib, timer, *config)
        rows.append(r)
        t = r["tflops"]
        print(f"{r['dtype']:9} {r['head_dim']:4} {'causal' if r['causal'] else 'none':6} {r['seqlen']:6} "
              f"{t.get('flashattn', 0):7.1f} {t.get('fa2', 0):7.1f} {t.get('cudnn', 0):7.1f} "
              f"{ratio(r, 'fa2') or 0:6.2f} {ratio(r, 'cudnn') or 0:6.2f} {r['max_abs_diff_vs_fa2']:8.1e}  [{i + 1}/{len(configs)}]"
              + ("" if r["all_written"] else "  UNWRITTEN OUTPUT"), flush=True)

    summary = summarize(rows, min_seqlen=1024)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "forward.json"), "w") as f:
        json.dump({"environment": env, "ceilings": ceil, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "forward.md"), "w") as f:
        f.write(markdown(env, ceil, rows, summary, timer.settle_s))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["all_written"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

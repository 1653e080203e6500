#!/usr/bin/env python3
"""flashattn.flex_attention against PyTorch's FlexAttention on the GPU machine: the same PyTorch
BlockMask (create_block_mask, 128 x 128 blocks, built on the GPU) and score_mod given to
flashattn.flex_attention and to torch.compile(flex_attention), interleaved in one process and run.

Masks: causal, document (causal within packed documents of random lengths, seeded), prefix-LM
(the first quarter of the keys visible to every row, causal after it), a causal sliding window of
1024 keys, the same window with 4 sink tokens (the first keys, always visible), and random
blocks (10% of the 128 x 128 blocks visible, seeded), and ALiBi as a score_mod
(flashattn.score_mods.alibi, FlashAttention's slopes) under the causal mask, each at --seqlens;
the prefill grid's batch and heads (16k tokens per call, heads = 2048 / head_dim;
docs/PERFORMANCE.md). Also timed: the converted flashattn.BlockMask, which runs as lists where
flex_attention would run a window mask ("flashattn_lists"); flashattn's dense kernels on the
causal and ALiBi rows ("flashattn_dense", causal=True and the slopes: the dispatched forward),
the bound a block mask should approach, and on the random-block rows the dense forward without
a mask, whose time the block-sparse call's is compared with ("of dense"). TFLOP/s count
the visible (query, key) pairs only: 4 * d per pair. Each row also records the largest difference
between our output and FlexAttention's (the two are independent implementations of the same
mask). Timing is bench/_timing's (L2 flushed before each call, a GPU spin ahead of each timed
call, interleaved rounds in rotating order, median of round medians).

With --backward, forward + backward instead: one autograd call (torch.autograd.grad of the output
against dout for q, k and v) of each, TFLOP/s of 14 d per visible pair (4 d forward, 10 d
backward); the dense rows are flashattn.flash_attn_func with autograd.

  python3 bench/gpu_flex.py --out results_dir   (flashattn importable: scripts/gpu_package.sh)

Writes flex.json and flex.md to --out and prints the table.
"""
import argparse
import importlib
import json
import os
import sys

import torch
from torch.nn.attention import flex_attention as flex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import LEAD_CYCLES, ROUNDS, TOKENS, MODEL_WIDTH, Timer, batch_heads, environment, fmt, geomean  # noqa: E402
from _timing import time_interleaved  # noqa: E402

MASKS = ["causal", "document", "prefix_lm", "window1024", "window_sinks", "random10", "alibi"]
WINDOW = 1024
SINK_TOKENS = 4


def mask_mod_of(kind, seqlen, seed):
    if kind in ("causal", "alibi"):
        return lambda b, h, q, kv: q >= kv
    if kind == "window1024":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)
    if kind == "window_sinks":
        return lambda b, h, q, kv: (q >= kv) & ((q - kv < WINDOW) | (kv < SINK_TOKENS))
    if kind == "random10":
        gen = torch.Generator().manual_seed(seed)
        blocks = (seqlen + 127) // 128
        table = (torch.rand(blocks, blocks, generator=gen) < 0.1).cuda()
        return lambda b, h, q, kv: table[q // 128, kv // 128]
    if kind == "prefix_lm":
        prefix = seqlen // 4
        return lambda b, h, q, kv: (kv < prefix) | (q >= kv)
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seqlen:  # documents of 1/16 to 1/2 of the sequence
        n = int(torch.randint(seqlen // 16, seqlen // 2 + 1, (1,), generator=gen))
        lengths.append(min(n, seqlen - total))
        total += lengths[-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
    return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)


def on_sm80(fn):
    """fn run with FLASHATTN_DISABLE_SM90=1 (read by the library on every call): the sm80 kernels
    on Hopper."""
    def run():
        os.environ["FLASHATTN_DISABLE_SM90"] = "1"
        try:
            return fn()
        finally:
            del os.environ["FLASHATTN_DISABLE_SM90"]
    return run


def forward_fns(fa, compiled_flex, q, k, v, block_mask, ours_mask, score_mod, kind):
    """The forward calls timed on one row ([b, h, s, d] q / k / v)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    mods = dict(block_mask=block_mask, score_mod=score_mod)
    fns = {"flashattn": _ours.checked(lambda: fa.flex_attention(q, k, v, **mods)),
           "flex_attention": lambda: compiled_flex(q, k, v, **mods),
           # The lists run as lists, where the library would have run a window mask instead.
           "flashattn_lists": _ours.checked(lambda: fa.flex_attention(q, k, v, **dict(mods, block_mask=ours_mask)))}
    if score_mod is None:  # the same lists checked on the host (a copy and a wait per call)
        fns["flashattn_host_check"] = _ours.checked(
            lambda: fa.forward(qt, kt, vt, block_mask=ours_mask, index_check="host"))
    dense = dense_options(kind, score_mod)
    if dense is not None:
        fns["flashattn_dense"] = _ours.checked(lambda: fa.forward(qt, kt, vt, **dense))
    return fns


def backward_fns(fa, compiled_flex, q, k, v, block_mask, ours_mask, score_mod, kind):
    """The forward + backward calls timed on one row: the gradients of q, k, v for a fixed dout."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    mods = dict(block_mask=block_mask, score_mod=score_mod)

    def grads(attention):
        return lambda: torch.autograd.grad(attention(), (q, k, v), dout)

    fns = {"flashattn": _ours.checked(grads(lambda: fa.flex_attention(q, k, v, **mods))),
           "flex_attention": grads(lambda: compiled_flex(q, k, v, **mods)),
           "flashattn_lists": _ours.checked(grads(lambda: fa.flex_attention(q, k, v,
                                                                            **dict(mods, block_mask=ours_mask))))}
    dense = dense_options(kind, score_mod)
    if dense is not None:
        fns["flashattn_dense"] = _ours.checked(grads(lambda: fa.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **dense).transpose(1, 2)))
    return fns


def dense_options(kind, score_mod):
    """The dense kernels' options for the rows timed with them, or None."""
    if kind == "causal":
        return dict(causal=True)
    if kind == "alibi":
        return dict(causal=True, alibi_slopes=score_mod.slopes)
    return {} if kind == "random10" else None


def visible_pairs(mask_mod, seqlen):
    """The (query, key) pairs the mask shows, counted on the GPU a slab of rows at a time."""
    total, rows = 0, max(1, (1 << 26) // seqlen)
    kv = torch.arange(seqlen, device="cuda")
    for start in range(0, seqlen, rows):
        q = torch.arange(start, min(seqlen, start + rows), device="cuda")
        total += int(mask_mod(0, 0, q[:, None], kv[None, :]).sum())
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for flex.json and flex.md")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    args = parser.parse_args()

    fa = _ours.cuda_package()
    dtype = getattr(torch, args.dtype)
    # Every (mask, shape) row recompiles flex_attention; past dynamo's default recompile limit (8) it
    # would fall back to eager, unfused, and the row would time that instead. Raise the limit, and
    # make a fallback an error rather than a silently slow peer.
    for name, value in (("recompile_limit", 256), ("cache_size_limit", 256), ("accumulated_recompile_limit", 4096),
                        ("accumulated_cache_size_limit", 4096), ("fail_on_recompile_limit_hit", True),
                        ("fail_on_cache_limit_hit", True)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    compiled_flex = torch.compile(flex.flex_attention, dynamic=False)
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2, lead_cycles=LEAD_CYCLES)
    env = environment()
    hopper = torch.cuda.get_device_capability() == (9, 0)
    rows = []
    print(f"{'config':26} {'ours':>8} {'lists':>8} {'sm80':>8} {'host-chk':>8} {'flex':>8} {'dense':>8} "
          f"{'ours/flex':>9} {'max |diff|':>10}", flush=True)
    for d in map(int, args.head_dims.split(",")):
        for seqlen in map(int, args.seqlens.split(",")):
            batch, heads = batch_heads(d, seqlen)
            gen = torch.Generator(device="cuda").manual_seed(d * 131 + seqlen)
            q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=dtype, generator=gen)
                       for _ in range(3))
            for kind in MASKS:
                mask_mod = mask_mod_of(kind, seqlen, seed=seqlen)
                block_mask = flex.create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
                score_mod = None
                if kind == "alibi":  # FlashAttention's slopes, 2^(-8 (h + 1) / heads)
                    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
                    score_mod = fa.score_mods.alibi(slopes.to(torch.float32))
                # (the first call converts the mask and caches it)
                ours_out = fa.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod)
                flex_out = compiled_flex(q, k, v, block_mask=block_mask, score_mod=score_mod)
                diff = (ours_out.float() - flex_out.float()).abs().max().item()
                # The converted mask, which runs as lists whatever its elements.
                ours_mask = importlib.import_module(fa.__name__ + ".flex").block_mask_from_torch(
                    block_mask, seqlen, seqlen)
                timed = backward_fns if args.backward else forward_fns
                fns = timed(fa, compiled_flex, q, k, v, block_mask, ours_mask, score_mod, kind)
                if hopper:
                    fns["flashattn_sm80"] = on_sm80(fns["flashattn_lists"])
                row = {"mask": kind, "dtype": args.dtype, "head_dim": d, "seqlen": seqlen, "batch": batch,
                       "heads": heads, "ms": {}, "tflops": {}, "max_abs_diff": diff}
                pairs = visible_pairs(mask_mod, seqlen)
                row["visible_fraction"] = pairs / seqlen**2
                time_interleaved(timer, fns, (14 if args.backward else 4) * d * pairs * batch * heads, row)
                t = row["tflops"]
                row["ours_over_flex"] = t["flashattn"] / t["flex_attention"] if "flex_attention" in t else None
                ms = row["ms"]
                if kind == "random10" and "flashattn" in ms and "flashattn_dense" in ms:
                    row["time_of_dense"] = ms["flashattn"] / ms["flashattn_dense"]
                rows.append(row)
                name = f"d{d} {kind} {seqlen}"
                print(f"{name:26} {fmt(t.get('flashattn')):>8} {fmt(t.get('flashattn_lists')):>8} "
                      f"{fmt(t.get('flashattn_sm80')):>8} "
                      f"{fmt(t.get('flashattn_host_check')):>8} "
                      f"{fmt(t.get('flex_attention')):>8} "
                      f"{fmt(t.get('flashattn_dense')):>8} {fmt(row['ours_over_flex'], '.3f'):>9} {diff:>10.3g}"
                      + (f"  of dense {row['time_of_dense']:.3f}" if "time_of_dense" in row else "")
                      + "".join(f"  {n}: {e}" for n, e in row.get("errors", {}).items()), flush=True)
                summary = write(args, env, rows, timer.settle_s)  # after every row: a run cut short keeps its rows
    print(json.dumps(summary, indent=1))
    return 0


def write(args, env, rows, settle_s):
    """flex.json and flex.md of the rows so far; returns the summary."""
    ratios = [r["ours_over_flex"] for r in rows if r["ours_over_flex"] is not None]
    summary = {"geomean_ours_over_flex": geomean(ratios), "min_ours_over_flex": min(ratios) if ratios else None,
               "random10_time_of_dense": [round(r["time_of_dense"], 4) for r in rows if "time_of_dense" in r]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flex.json"), "w") as f:
        json.dump({"environment": env, "summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "flex.md"), "w") as f:
        f.write(markdown(env, rows, summary, settle_s, args))
    return summary


def markdown(env, rows, summary, settle_s, args):
    what = "forward + backward" if args.backward else "forward"
    lines = [f"# Block-sparse {what}: flashattn.flex_attention against torch.compile(flex_attention)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- {TOKENS} tokens per call, heads = {MODEL_WIDTH} / head_dim, {args.dtype}, [b, h, s, d] tensors; "
              "one PyTorch BlockMask (128 x 128, built on the GPU) for both", "- TFLOP/s of the visible pairs "
              f"({14 if args.backward else 4} d per pair); CUDA-event timings, L2 flushed before each call; "
              f"{ROUNDS} interleaved rounds in rotating order, each timed after {settle_s} s of the same calls, "
              "median of the round medians",
              "- ours: flashattn.flex_attention, its lists checked by the kernel (index_check=\"device\", the "
              "default), or, where the mask is a causal / sliding-window one, that window; lists: the same call "
              "given the converted flashattn.BlockMask, which runs as lists always; host check: flashattn.forward "
              "on the same lists with index_check=\"host\" (a copy of the lists and a wait per call)",
              "- sm80 kernel: the lists' call with FLASHATTN_DISABLE_SM90=1 (on Hopper: the sm80 block-sparse "
              "kernel, against the Hopper one in `lists`)",
              "- dense: flashattn.forward on the same rows, causal=True on the causal rows and without a mask on "
              "the random-block rows (of dense: the block-sparse call's time over it)", "",
              f"Geomean ours / FlexAttention: {fmt(summary['geomean_ours_over_flex'], '.3f')}; lowest "
              f"{fmt(summary['min_ours_over_flex'], '.3f')}. Random 10% blocks, time of the dense forward: "
              f"{summary['random10_time_of_dense']}.", "",
              "| d | mask | seqlen | visible | ours | lists | sm80 kernel | ours, host check | FlexAttention | dense "
              "| ours / Flex | max abs diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tflops"]
        lines.append(f"| {r['head_dim']} | {r['mask']} | {r['seqlen']} | {r['visible_fraction']:.3f} | "
                     f"{fmt(t.get('flashattn'))} | {fmt(t.get('flashattn_lists'))} | {fmt(t.get('flashattn_sm80'))} | "
                     f"{fmt(t.get('flashattn_host_check'))} | "
                     f"{fmt(t.get('flex_attention'))} | {fmt(t.get('flashattn_dense'))} | "
                     f"{fmt(r['ours_over_flex'], '.3f')} | {r['max_abs_diff']:.3g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

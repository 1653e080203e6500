#!/usr/bin/env python3
"""Where a forward + backward's time goes, per implementation: the forward and the backward timed
separately inside one fwd+bwd call (events between them; one L2 flush before the pair), next to
each timed alone after its own flush, as bench/gpu_backward.py times them. A backward that runs
faster right after its forward than after a flush gains from what the forward left in L2 (or from
the clock state it left); the fwd+bwd column of gpu_backward.py includes that gain. Ours is the
Python package (bench/suite.py's Ours), timed after the GPU spin that hides every call's host side.

  python3 bench/fwd_bwd_split.py [--configs bfloat16:128:none:8192,...]   (flashattn importable)

Prints one line per (config, implementation): milliseconds (median of --reps) and TFLOP/s.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import FLUSH_BYTES, LEAD_CYCLES, batch_heads, forward_flops  # noqa: E402
from gpu_backward import peers, random_inputs  # noqa: E402
from suite import Ours  # noqa: E402


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def split_times(fwd, bwd, reps, flush):
    """Medians (ms) of: fwd and bwd inside one flushed pair, the pair, fwd alone, bwd alone."""
    def timed(calls):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        flush.zero_()
        torch.cuda._sleep(LEAD_CYCLES)
        events[0].record()
        for call, event in zip(calls, events[1:]):
            call()
            event.record()
        return events

    def run(calls):
        samples = []
        for _ in range(reps):
            events = timed(calls)
            samples.append(events)
        torch.cuda.synchronize()
        return [[a.elapsed_time(b) for a, b in zip(ev, ev[1:])] for ev in samples]

    saved = {}

    def forward():
        saved["out"] = fwd()

    def backward():
        bwd(saved.get("out"))

    run([forward, backward])  # warm-up and clock settling
    pair = run([forward, backward])
    alone_f = run([forward])
    alone_b = run([backward])
    return {"fwd_in_pair": median([p[0] for p in pair]), "bwd_in_pair": median([p[1] for p in pair]),
            "pair": median([p[0] + p[1] for p in pair]), "fwd_alone": median([a[0] for a in alone_f]),
            "bwd_alone": median([a[0] for a in alone_b])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="bfloat16:128:none:4096,bfloat16:128:none:8192,"
                        "bfloat16:128:causal:16384,float16:256:none:1024")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    _ours.cuda_package()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(f"{'config':28} {'impl':6} {'fwd|pair':>9} {'bwd|pair':>9} {'pair':>8} {'fwd':>8} {'bwd':>8}"
          f"  TF/s: {'pair':>6} {'sum':>6} {'bwd|pair':>8} {'bwd':>6}")
    for spec in args.configs.split(","):
        dtype_name, d, mask, seqlen = spec.split(":")
        d, seqlen, causal = int(d), int(seqlen), mask == "causal"
        batch, heads = batch_heads(d, seqlen)
        q, k, v, dout = random_inputs(getattr(torch, dtype_name), batch, seqlen, heads, d, 1)
        fwd_flops = forward_flops(batch, heads, seqlen, seqlen, d, causal)
        ours = Ours(q, k, v, dout, causal, True)
        impls = {"ours": (ours.fwd, lambda _out: ours.bwd())}
        for name, peer in peers(q, k, v, dout, causal).items():
            impls[name] = (lambda peer=peer: peer.attend(*peer.leaves),
                           lambda out, peer=peer: torch.autograd.grad(out, peer.leaves, peer.dout, retain_graph=True))
        for name, (fwd, bwd) in impls.items():
            t = split_times(fwd, bwd, args.reps, flush)
            tf = lambda factor, ms: factor * fwd_flops / ms / 1e9  # noqa: E731
            print(f"{spec:28} {name:6} {t['fwd_in_pair']:9.3f} {t['bwd_in_pair']:9.3f} {t['pair']:8.3f} "
                  f"{t['fwd_alone']:8.3f} {t['bwd_alone']:8.3f}  {tf(3.5, t['pair']):12.1f} "
                  f"{tf(3.5, t['fwd_alone'] + t['bwd_alone']):6.1f} {tf(2.5, t['bwd_in_pair']):8.1f} "
                  f"{tf(2.5, t['bwd_alone']):6.1f}", flush=True)


if __name__ == "__main__":
    main()

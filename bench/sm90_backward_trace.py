#!/usr/bin/env python3
"""Consumer and dQ-warp timelines of the sm90a backward (GPU machine, the package built with
-DFLASHATTN_CUDA_SM90_TRACE=ON: src/cuda/sm90/trace.cuh). Runs one backward config a few times,
reads the per-step clock stamps of CTA (0, 0, 0) that the library prints after each launch, and
reports the median cycles of each phase of a step over the steady steps (the first and last two
left out), per consumer (head dims split by keys: 64, 96, 128):

  issue       the S^T and dP^T GEMMs issued (includes waiting for the Q / dO stages to land)
  SdP wait    until both are done
  elements    the element pass: P^T, dS^T (mask, score modifiers, dropout)
  dS + dKV    P^T and dS^T converted, dS^T stored, dV's GEMM issued (by head dim dK's too)
  sync        waiting at the consumers' barrier (both halves of dS in)
  GEMMs       dQ's GEMM issued (by keys dK's after it), the others waited for
  stage       the dQ product staged (including the wait for its buffer to be free)
  gap         to the next step's start (by keys: dK's GEMM waited for)

and the dQ warp's: "full wait" (for the consumers' product), "turn" (deterministic mode: the query
tile's turn), "adds" (the reduce-adds issued until their reads of the buffer are done).

"tensor busy" is the five GEMMs' cycles at the SM's dense rate (4096 bf16 FLOP per clock) over
the measured step: how much of the step the tensor cores would need at full speed.

  scripts/gpu_package.sh build-trace -DFLASHATTN_CUDA_SM90_TRACE=ON
  PYTHONPATH=build-trace/site python3 bench/sm90_backward_trace.py [--head-dim 128] [--seqlen 8192]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from sm90_trace import FLOP_PER_CLOCK, MODEL_WIDTH, TOKENS, run_captured  # noqa: E402

PHASES = ("issue", "SdP wait", "elements", "dS + dKV", "sync", "GEMMs", "stage")
DQ_PHASES = ("full wait", "turn", "adds")


def last_call(text):
    """(consumer -> [stamps per step], [dQ warp stamps per step]) of the last launch printed."""
    calls, consumers, dq = [], {}, []
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("sm90bwd", "sm90dq"):
            continue
        if parts[0] == "sm90bwd":
            consumer, step = int(parts[1]), int(parts[2])
            if step == 0 and consumer in consumers:
                calls.append((consumers, dq))
                consumers, dq = {}, []
            consumers.setdefault(consumer, []).append([int(x) for x in parts[3:]])
        else:
            dq.append([int(x) for x in parts[2:]])
    if consumers:
        calls.append((consumers, dq))
    return calls[-1] if calls else ({}, [])


def median_phases(steps, names):
    """Median cycles between consecutive stamps over the steady steps whose stamps were all taken."""
    rows = [s for s in steps[2:-2] if min(s) > 0]
    out = {name: statistics.median(s[i + 1] - s[i] for s in rows) if rows else float("nan")
           for i, name in enumerate(names)}
    return out, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--block-m", type=int, default=64, help="the kernel's query tile (for 'tensor busy')")
    parser.add_argument("--block-n", type=int, default=128, help="the kernel's key tile")
    args = parser.parse_args()
    _ours.cuda_package()
    d = args.head_dim
    batch, heads = TOKENS // args.seqlen, MODEL_WIDTH // d
    q, k, v, dout = (torch.randn(batch, args.seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, args.seqlen, device="cuda", dtype=torch.float32)
    _ours.forward_call(q, k, v, out, lse, causal=args.causal)()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    call = _ours.backward_call(dout, q, k, v, out, lse, dq, dk, dv, causal=args.causal,
                               deterministic=args.deterministic)

    def calls():
        for _ in range(args.calls):
            call()

    consumers, dq_steps = last_call(run_captured(calls))
    if not consumers:
        print("no sm90bwd lines: is the package built with -DFLASHATTN_CUDA_SM90_TRACE=ON, and does the call "
              "run the sm90 backward?")
        return 1
    busy = 5 * 2 * args.block_m * args.block_n * d / FLOP_PER_CLOCK
    print(f"sm90 backward trace: bf16 d{d} {'causal' if args.causal else 'none'} seqlen {args.seqlen}"
          f"{' deterministic' if args.deterministic else ''}, CTA (0, 0, 0); cycles, median over steady steps")
    print(f"{'consumer':>9} {'steps':>6} " + " ".join(f"{p:>9}" for p in PHASES) +
          f" {'gap':>6} {'step':>6} {'tensor busy':>12}")
    for c in sorted(consumers):
        steps = consumers[c]
        m, rows = median_phases(steps, PHASES)
        nexts = [b[0] - a[0] for a, b in zip(steps[2:-3], steps[3:-2])]
        step = statistics.median(nexts) if nexts else float("nan")
        gap = step - sum(m.values())
        print(f"{c:>9} {len(rows):>6} " + " ".join(f"{m[p]:>9.0f}" for p in PHASES) +
              f" {gap:>6.0f} {step:>6.0f} {busy / step:>12.2f}")
    if len(consumers) == 2:
        a, b = consumers[0], consumers[1]
        pairs = [(x, y) for x, y in zip(a[2:-2], b[2:-2]) if min(x) > 0 and min(y) > 0]
        offsets = [statistics.median(y[i] - x[i] for x, y in pairs) for i in range(len(PHASES) + 1)] if pairs else []
        print("consumer 1's stamps after consumer 0's (median): " + ", ".join(f"{o:.0f}" for o in offsets))
    if dq_steps:
        m, rows = median_phases(dq_steps, DQ_PHASES)
        print("dQ warp: " + ", ".join(f"{p} {m[p]:.0f}" for p in DQ_PHASES) + f" ({len(rows)} steady steps)")
        if 0 in consumers:
            lags = [w[1] - s[7] for s, w in zip(consumers[0][2:-2], dq_steps[2:-2]) if min(s) > 0 and min(w) > 0]
            if lags:
                print(f"dQ warp's full barrier after consumer 0's staged stamp: {statistics.median(lags):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

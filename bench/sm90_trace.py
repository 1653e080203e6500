#!/usr/bin/env python3
"""Consumer timelines of the sm90a forward (GPU machine, the package built with
-DFLASHATTN_CUDA_SM90_TRACE=ON: src/cuda/sm90/trace.cuh). Runs one forward config a few times,
reads the per-step clock stamps of CTA 0's consumers on their second tile (the library prints them
after each launch), and reports,
per consumer, the median cycles of each phase of a key tile's step over the steady steps:

  turn wait   turn_begin: waiting for the previous consumer to pass the turn on
  issue       its S and PV GEMMs issued (includes waiting for the K / V stages to land)
  S wait      until the S GEMM is done
  scores      scaled / masked (score_tile)
  max         the row max settled (max, quad shuffles, vote, rescale factors)
  exp+sum     the exponentials and the row sums
              (steps on the stale max, RowSoftmax::update_stale / update_stale_in_place: "max" is
              the exponentials, the sums and their check (in place: and the consumer's vote);
              "exp+sum" what follows (the warp's vote; a fallback))
  PV wait     until the PV GEMM is done
  tail        O rescaled, P converted
  step        from one step's turn wait to the next's

Then each consumer's timeline: when each phase begins, in cycles after consumer 0's turn wait of
the same key tile (median over the steady steps; the consumers' clocks are the same SM's), to see
which phases of one consumer overlap which of another's.

Then the tile's boundary steps, per consumer: the first (its S GEMM alone: turn wait, issue, S
wait, scores, max, exp+sum, tail), the last (its PV GEMM alone: turn wait, issue, PV wait,
epilogue = the O stores, none where the kernel defers them to the next tile; with its points:
O normalised, LSE stored, O's buffer free, O written, the barrier after it, the end), and the
tile's overhead: its cycles from the first turn wait to the epilogue's end less key tiles x the steady
step (what the tile boundary costs this consumer).

With the tensor cores saturated a step takes (consumers x 2 GEMMs of 64 x kBlockN x d) at the
SM's dense rate; "tensor busy" is that over the measured step (4096 bf16 FLOP per clock per SM).

Ours is flashattn.forward (the Python package that is importable, bench/_ours.py): install a trace
build into a folder of its own, e.g.
  scripts/gpu_package.sh build-trace -DFLASHATTN_CUDA_SM90_TRACE=ON
  PYTHONPATH=build-trace/site python3 bench/sm90_trace.py [--head-dim 128] [--seqlen 16384] [--causal]
"""
import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402

TOKENS, MODEL_WIDTH = 16384, 2048
PHASES = ("turn wait", "issue", "S wait", "scores", "max", "exp+sum", "PV wait", "tail")
STEP_EVENTS = len(PHASES) + 1  # a step's stamps (trace.cuh's events up to kStepEnd); the epilogue's follow
# The epilogue's points in a tile's last step (trace.cuh's events after kStepEnd; none where the
# kernel defers its O stores to the next tile), and its end (kStepEnd).
EPILOGUE = (("normalised", 9), ("LSE stored", 10), ("O buffer free", 11), ("O written", 12), ("synced", 13),
            ("end", 8))
FLOP_PER_CLOCK = 4096  # dense bf16 / fp16 per SM (989 TFLOP/s over 132 SMs at 1.83 GHz)


def run_captured(fn):
    """Runs fn with the process's stdout (fd 1, where device printf goes) in a file; its text."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read()


def last_tile(text):
    """consumer -> list of stamp lists (one per step) of the last tile printed."""
    tiles, current = [], {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 + STEP_EVENTS or parts[0] != "sm90trace":
            continue
        consumer, step = int(parts[1]), int(parts[2])
        if step == 0 and consumer in current:
            tiles.append(current)
            current = {}
        current.setdefault(consumer, []).append([int(x) for x in parts[3:]])
    if current:
        tiles.append(current)
    return tiles[-1] if tiles else {}


def phases(steps):
    """Median cycles of each phase and of the whole step over the steady steps."""
    rows = [s for s in steps[2:-2] if min(s[:STEP_EVENTS]) >= 0]
    medians = {}
    for i, name in enumerate(PHASES):
        medians[name] = statistics.median(s[i + 1] - s[i] for s in rows) if rows else float("nan")
    nexts = [b[0] - a[0] for a, b in zip(steps[2:-3], steps[3:-2])]
    medians["step"] = statistics.median(nexts) if nexts else float("nan")
    return medians, len(rows)


def timeline(tile):
    """consumer -> median start of each phase, relative to consumer 0's turn wait of the same step."""
    base = tile[min(tile)]
    starts = {}
    for c, steps in tile.items():
        pairs = [(s, b) for s, b in zip(steps[2:-2], base[2:-2]) if min(s[:STEP_EVENTS]) >= 0 and min(b[:STEP_EVENTS]) >= 0]
        starts[c] = [statistics.median(s[i] - b[0] for s, b in pairs) if pairs else float("nan")
                     for i in range(len(PHASES))]
    return starts


def boundary(steps, steady_step):
    """The first and last steps' phases, the tile's cycles and its overhead over its key tiles at
    the steady step (stamp indices: trace.cuh's Event order)."""
    first, last = steps[0], steps[-1]
    if min(first[i] for i in range(STEP_EVENTS) if i != 7) < 0 or min(last[i] for i in (0, 1, 2, 7, 8)) < 0:
        return None
    tile = last[8] - first[0]
    return {"first": {"turn wait": first[1] - first[0], "issue": first[2] - first[1], "S wait": first[3] - first[2],
                      "scores": first[4] - first[3], "max": first[5] - first[4], "exp+sum": first[6] - first[5],
                      "tail": first[8] - first[6]},
            "last": {"turn wait": last[1] - last[0], "issue": last[2] - last[1], "PV wait": last[7] - last[2],
                     "epilogue": last[8] - last[7]},
            "epilogue": {name: last[i] - last[7] for name, i in EPILOGUE if i < len(last) and last[i] >= 0},
            "tile": tile, "key tiles": len(steps) - 1, "overhead": tile - (len(steps) - 1) * steady_step}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--block-n", type=int, default=128, help="the kernel's key tile (for 'tensor busy')")
    args = parser.parse_args()
    _ours.cuda_package()
    d = args.head_dim
    batch, heads = TOKENS // args.seqlen, MODEL_WIDTH // d
    q, k, v = (torch.randn(batch, args.seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, args.seqlen, device="cuda", dtype=torch.float32)
    call = _ours.forward_call(q, k, v, out, lse, causal=args.causal)

    def calls():
        for _ in range(args.calls):
            call()

    tile = last_tile(run_captured(calls))
    if not tile:
        print("no sm90trace lines: is the package built with -DFLASHATTN_CUDA_SM90_TRACE=ON, and does the call "
              "run the sm90 kernel?")
        return 1
    consumers = len(tile)
    busy_cycles = consumers * 2 * 2 * 64 * args.block_n * d / FLOP_PER_CLOCK
    print(f"sm90 trace: bf16 d{d} {'causal' if args.causal else 'none'} seqlen {args.seqlen}, CTA 0's second tile, "
          f"{consumers} consumers; cycles (median over steady steps)")
    print(f"{'consumer':>9} {'steps':>6} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'step':>8} {'tensor busy':>12}")
    for c in sorted(tile):
        m, n = phases(tile[c])
        print(f"{c:>9} {n:>6} " + " ".join(f"{m[p]:>10.0f}" for p in PHASES) +
              f" {m['step']:>8.0f} {busy_cycles / m['step']:>12.2f}")
    print("phase starts, cycles after consumer 0's turn wait of the same key tile")
    print(f"{'consumer':>9} {'':>6} " + " ".join(f"{p:>10}" for p in PHASES))
    for c, starts in sorted(timeline(tile).items()):
        print(f"{c:>9} {'':>6} " + " ".join(f"{x:>10.0f}" for x in starts))
    print("tile boundary: the first step (S GEMM alone), the last (PV GEMM alone, then the epilogue), cycles")
    for c in sorted(tile):
        b = boundary(tile[c], phases(tile[c])[0]["step"])
        if b is None:
            print(f"{c:>9} (no complete first / last step)")
            continue
        parts = [f"{k} {v}" for k, v in b["first"].items()] + ["|"] + [f"{k} {v}" for k, v in b["last"].items()]
        epilogue = b["epilogue"]
        if epilogue:
            print(f"{c:>9} epilogue, cycles after the PV GEMM's wait: " +
                  ", ".join(f"{k} {v}" for k, v in epilogue.items()))
        print(f"{c:>9} first: " + ", ".join(parts).replace(", |,", " | last:") +
              f"; tile {b['tile']} over {b['key tiles']} key tiles, overhead {b['overhead']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

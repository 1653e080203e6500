#!/usr/bin/env python3
"""A decode step as a Python user makes it (GPU machine): the package's flash_attn_with_kvcache with
its default arguments, against the same call with index_check="host", cuDNN's and FlashAttention-2's
SDPA, on the benchmark suite's decode grid (bench/suite.py: one query token, context 1k..128k,
batch 1..128, d 128, 32 query heads over 32 or 8 K/V heads, bf16).

The cache is contiguous and holds each sequence's context, with cache_seqlens given as an int32
tensor on the GPU, as a serving loop passes it: the host-checked call copies it to the host and
waits for the stream every call; the default checks it in the kernels and never waits. Reported
as TB/s of K/V read, as in the suite; the timer (bench/_timing.py) spins the GPU before each
timed call, so a call that keeps the host ahead of the GPU is timed by its GPU work alone, and
one that waits for the device pays its round trip.

  python3 bench/decode_default.py --out DIR [--contexts 1024,...] [--batches 1,...] [--rounds 3]

Writes DIR/decode_default.json and prints a line per config and the geometric means.
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashattn  # noqa: E402
from _timing import LEAD_CYCLES, ROUNDS, Timer, ceilings, environment, geomean, time_interleaved  # noqa: E402
from suite import decode_grid, kv_bytes, random_tensors, sdpa_attend  # noqa: E402

COLUMNS = ("default", "host", "cudnn", "fa2")


def bench(timer, c, rounds):
    b, h, hkv, d, ctx = c["batch"], c["heads"], c["kv_heads"], c["head_dim"], c["context"]
    q, k, v = random_tensors(torch.bfloat16, [(b, 1, h, d), (b, ctx, hkv, d), (b, ctx, hkv, d)], ctx + b + hkv)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    fns = {
        "default": lambda: flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens),
        "host": lambda: flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, index_check="host"),
    }
    for name, backend in (("cudnn", "CUDNN_ATTENTION"), ("fa2", "FLASH_ATTENTION")):
        attend = sdpa_attend(backend, False, hkv != h)
        fns[name] = lambda attend=attend: attend(q, k, v)
    result = {"tflops": {}, "ms": {}}
    time_interleaved(timer, fns, 1.0, result, rounds)
    del result["tflops"]  # (no FLOP count: decoding is a read of K / V)
    result["tbps"] = {name: kv_bytes(c) / ms / 1e9 for name, ms in result["ms"].items()}
    flashattn.check_device_errors()  # the default calls' indices were good: nothing recorded
    return dict(c, **result)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="1024,4096,16384,65536,131072")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--max-gib", type=float, default=24.0)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and flashattn.cuda_compiled()):
        sys.exit("needs a GPU and the package built with the CUDA backend")
    warnings.filterwarnings("ignore", category=UserWarning)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    grid, left_out = decode_grid(ints(args.contexts), ints(args.batches), args.max_gib)
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2, lead_cycles=LEAD_CYCLES)
    results = {"environment": environment(), "ceilings": ceilings(timer), "rounds": args.rounds,
               "left_out": left_out, "decode": []}
    started = time.monotonic()
    print(f"{results['environment']['gpu']}: copy {results['ceilings']['copy_tbps']:.2f} TB/s")
    print(f"{'config':24} " + " ".join(f"{n:>8}" for n in COLUMNS) + "  default/host  default/cudnn")
    os.makedirs(args.out, exist_ok=True)
    for c in grid:
        row = bench(timer, c, args.rounds)
        results["decode"].append(row)
        t = row["tbps"]
        r = lambda a, b: t[a] / t[b] if a in t and b in t else None  # noqa: E731
        cells = " ".join(f"{t[n]:8.2f}" if n in t else f"{'-':>8}" for n in COLUMNS)
        print(f"b{c['batch']} ctx{c['context']} h{c['heads']}/{c['kv_heads']}".ljust(24), cells,
              f"{r('default', 'host') or 0:12.3f}  {r('default', 'cudnn') or 0:13.3f}", flush=True)
        with open(os.path.join(args.out, "decode_default.json"), "w") as f:
            json.dump(results, f, indent=1)
    rows = results["decode"]
    results["geomean"] = {f"default/{p}": geomean([row["tbps"].get("default", 0) / row["tbps"][p]
                                                   for row in rows if p in row["tbps"]])
                          for p in ("host", "cudnn", "fa2")}
    results["elapsed_s"] = time.monotonic() - started
    with open(os.path.join(args.out, "decode_default.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("geomean " + ", ".join(f"{k} {v:.3f}" for k, v in results["geomean"].items() if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Context parallelism's overlap on GPUs: does a ring step cost no more than its attention alone?

Run under torchrun, one process per GPU (NCCL):

    torchrun --nproc-per-node 2 bench/gpu_context_parallel.py --out DIR

For per-rank blocks of 1k-16k tokens (batch 1, 16 heads, d128, bf16, causal and not, zigzag
shards), every rank times, with CUDA events, median of the repeats after a warm-up:
- attention: one flashattn forward (and forward + backward) of its queries against a K / V
  block of its own size, no communication: what one ring step computes;
- ring: flashattn.distributed.ring_attention over the group (forward, and forward + backward),
  divided by the number of ring steps (the group's size).
The ratio ring / attention is the cost of a step's communication not hidden under its
attention (1.0: fully hidden). With a causal mask, a zigzag step's blocks are half the size of
the own shard's causal one; the attention column then times those halves (the two half blocks a
step computes). Writes context_parallel.json (with the machine, versions, date) to --out on rank
0 and prints the table.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess

import torch
import torch.distributed as dist

import flashattn
import flashattn.distributed as cp


def timed(fn, repeats=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_attention(q, k, v, causal, backward):
    """What one ring step of this rank computes, without communication."""
    n = q.shape[1]

    def one(qs, ks, vs):
        if not backward:
            return flashattn.flash_attn_func(qs, ks, vs)
        qs, ks, vs = (x.detach().requires_grad_() for x in (qs, ks, vs))
        flashattn.flash_attn_func(qs, ks, vs).sum().backward()

    if not causal:
        return lambda: one(q, k, v)
    half = n // 2
    return lambda: one(q, k[:, :half], v[:, :half])  # an earlier rank's step: its first chunk


def ring(q, k, v, causal, backward):
    def run():
        if not backward:
            return cp.ring_attention(q, k, v, causal=causal)
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        cp.ring_attention(qs, ks, vs, causal=causal).sum().backward()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="1024,2048,4096,8192,16384", help="per-rank block sizes")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    heads, d = 16, 128
    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v = (torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        for causal in (False, True):
            for backward in (False, True):
                alone = timed(step_attention(q, k, v, causal, backward))
                whole = timed(ring(q, k, v, causal, backward)) / world
                t = torch.tensor([alone, whole], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                rows.append({"tokens_per_rank": n, "causal": causal, "pass": "fwd+bwd" if backward else "fwd",
                             "attention_ms": t[0].item(), "ring_step_ms": t[1].item(),
                             "ratio": t[1].item() / t[0].item()})
    if rank == 0:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"gpu": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())), "flashattn": flashattn.__version__,
                "commit": commit or "unknown", "date": datetime.date.today().isoformat()}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "context_parallel.json"), "w") as f:
            json.dump({"environment": meta, "rows": rows}, f, indent=1)
        print(f"{meta['gpu']} x{world}, torch {meta['torch']}, NCCL {meta['nccl']}")
        print("tokens/rank  causal  pass     attention ms  ring step ms  ratio")
        for r in rows:
            print(f"{r['tokens_per_rank']:>11}  {str(r['causal']):>6}  {r['pass']:<7}  {r['attention_ms']:>12.3f}"
                  f"  {r['ring_step_ms']:>12.3f}  {r['ratio']:>5.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

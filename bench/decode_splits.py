#!/usr/bin/env python3
"""The decode kernels' split counts (GPU machine): ours at fixed num_splits against its heuristic
(num_splits 0) and cuDNN, on shapes that span the heuristic's cases (few CTAs: batch 1, GQA; many:
batch 32+, MHA), as TB/s of K/V read. It shows where the heuristic (decode_setup.cpp) leaves
bandwidth behind; bench/suite.py's decode part is the benchmark of record.

Ours is flashattn.forward_kvcache with num_splits (the Python package, bench/_ours.py) into an
out / LSE allocated once. A decode call's GPU work (10-20 us at the short contexts) can be shorter
than its host side through the package, so every timed call starts after the suite's GPU spin
(LEAD_CYCLES), which keeps the host ahead and leaves only GPU time in the timings.

  python3 bench/decode_splits.py [--page N] [--out FILE.json]   (flashattn importable: scripts/gpu_package.sh)

With --page N ours reads the cache through a block table of shuffled pages of N tokens (cuDNN
still reads it contiguous: the column is the contiguous peer the paged call is held to).
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
from _timing import LEAD_CYCLES, Timer, environment  # noqa: E402
from suite import paged  # noqa: E402

SHAPES = [  # (batch, context, kv heads); 32 query heads, d 128, bf16, one query token
    (1, 1024, 8), (1, 1024, 32), (1, 4096, 8), (1, 65536, 8), (1, 65536, 32), (8, 1024, 8), (8, 1024, 32),
    (8, 16384, 8), (32, 4096, 32), (32, 16384, 8), (128, 1024, 8), (128, 4096, 8)]
SPLITS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=int, default=0, help="ours in shuffled pages of this many tokens")
    parser.add_argument("--out")
    args = parser.parse_args()
    _ours.cuda_package()
    timer = Timer(min_reps=10, max_reps=100, target_s=0.05, settle_s=0.05, lead_cycles=LEAD_CYCLES)
    results = []
    label = f"p{args.page} " if args.page else ""
    print(f"splits TB/s:  {label}{'shape':22} {'cuDNN':>6} " + " ".join(f"{s if s else 'auto':>6}" for s in SPLITS))
    for batch, ctx, hkv in SHAPES:
        torch.manual_seed(batch + ctx + hkv)
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, ctx, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = 2 * k.numel() * k.element_size()
        out = torch.empty_like(q)
        lse = torch.empty(batch, 32, 1, device="cuda", dtype=torch.float32)
        tbps = {}
        kc, vc, table = paged(k, v, args.page, ctx) if args.page else (k, v, None)
        for splits in SPLITS:
            run = _ours.kvcache_call(q, kc, vc, out, lse, block_table=table, num_splits=splits, index_check="device")
            tbps[splits] = nbytes / timer.median_ms(run) / 1e9

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      enable_gqa=hkv != 32)
        try:
            tbps["cudnn"] = nbytes / timer.median_ms(cudnn) / 1e9
        except RuntimeError:
            tbps["cudnn"] = float("nan")
        results.append({"batch": batch, "context": ctx, "kv_heads": hkv, "tbps": {str(s): t for s, t in tbps.items()}})
        shape = f"b{batch} ctx{ctx} h32/{hkv}"
        print(f"splits TB/s:  {label}{shape:22} {tbps['cudnn']:6.2f} " + " ".join(f"{tbps[s]:6.2f}" for s in SPLITS),
              flush=True)
        del q, k, v, kc, vc, table
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "page": args.page, "shapes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One forward config of ours and of PyTorch's FLASH (FA2) and cuDNN backends, for Nsight Compute.

Run under ncu by scripts/gpu_profile.sh: each implementation runs once unprofiled (warm-up,
cuDNN's plan build) and once inside the NVTX range "profile", which the script tells ncu to
capture (the kernel names tell the implementations apart). The inputs are the benchmark's (bench/gpu_forward.py: 16k tokens, heads = 2048 / d).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn_c import Library

TOKENS, MODEL_WIDTH = 16384, 2048


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lib", required=True, help="path to libflashattn.so built with the CUDA backend")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--peers", default="fa2,cudnn", help="comma-separated subset of fa2,cudnn (or empty)")
    args = parser.parse_args()

    lib = Library(args.lib)
    dtype = getattr(torch, args.dtype)
    batch, heads, d = TOKENS // args.seqlen, MODEL_WIDTH // args.head_dim, args.head_dim
    q, k, v = (torch.randn(batch, args.seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, args.seqlen, device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    fns = {"flashattn": lib.forward_call(q, k, v, out, lse, lib.options(causal=args.causal), stream)}
    backends = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name in filter(None, args.peers.split(",")):
        def run(backend=backends[name]):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
        fns[name] = run

    for name, fn in fns.items():
        fn()  # warm-up, outside the captured range
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"profiled {', '.join(fns)}: {args.dtype} d{d} {'causal' if args.causal else 'none'} "
          f"seqlen {args.seqlen} batch {batch} heads {heads}")


if __name__ == "__main__":
    main()

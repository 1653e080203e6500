"""One forward (or backward) config of ours and of PyTorch's FLASH (FA2) and cuDNN backends, for Nsight Compute.

Run under ncu by scripts/gpu_profile.sh: each implementation runs once unprofiled (warm-up,
cuDNN's plan build) and once inside the NVTX range "profile", which the script tells ncu to
capture (the kernel names tell the implementations apart). The inputs are the benchmark's (bench/gpu_forward.py: 16k tokens, heads = 2048 / d).
Ours is the Python package that is importable (bench/_ours.py; scripts/gpu_profile.sh installs it).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402

TOKENS, MODEL_WIDTH = 16384, 2048


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--peers", default="fa2,cudnn", help="comma-separated subset of fa2,cudnn (or empty)")
    parser.add_argument("--backward", action="store_true",
                        help="profile the backward from the forward's saved out / LSE (the peers' autograd backward)")
    args = parser.parse_args()

    _ours.cuda_package()
    dtype = getattr(torch, args.dtype)
    batch, heads, d = TOKENS // args.seqlen, MODEL_WIDTH // args.head_dim, args.head_dim
    q, k, v = (torch.randn(batch, args.seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, args.seqlen, device="cuda", dtype=torch.float32)
    fns = {"flashattn": _ours.forward_call(q, k, v, out, lse, causal=args.causal)}
    if args.backward:
        fns["flashattn"]()  # out / LSE for the backward
        dout = torch.randn_like(q)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        fns["flashattn"] = _ours.backward_call(dout, q, k, v, out, lse, dq, dk, dv, causal=args.causal)
    backends = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    leaves = [t.detach().transpose(1, 2).requires_grad_(args.backward) for t in (q, k, v)]
    for name in filter(None, args.peers.split(",")):
        if args.backward:  # the forward once, its backward in the captured range
            with sdpa_kernel(backends[name]):
                peer_out = F.scaled_dot_product_attention(*leaves, is_causal=args.causal)
            def run(peer_out=peer_out, dout_t=dout.transpose(1, 2)):
                torch.autograd.grad(peer_out, leaves, dout_t, retain_graph=True)
        else:
            def run(backend=backends[name]):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(*leaves, is_causal=args.causal)
        fns[name] = run

    # Autograd runs a backward on its own device thread, outside the NVTX range of this one;
    # single-threaded autograd keeps the peers' backward kernels inside it.
    torch.autograd.set_multithreading_enabled(False)
    for name, fn in fns.items():
        fn()  # warm-up, outside the captured range
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"profiled {', '.join(fns)} {'backward' if args.backward else 'forward'}: {args.dtype} d{d} {'causal' if args.causal else 'none'} "
          f"seqlen {args.seqlen} batch {batch} heads {heads}")


if __name__ == "__main__":
    main()

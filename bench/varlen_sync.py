#!/usr/bin/env python3
"""What checking cu_seqlens costs a small variable-length batch (GPU machine): with
index_check="host" the varlen forward (and backward) copies cu_seqlens to the host and waits for
the stream once per call, so the host cannot run ahead of the GPU; the default, "device", checks
them in a kernel of its own and never waits.

Measured per call, bf16, d 64, 16 heads, 8 sequences of 64-512 tokens, for the default call
(flash_attn_varlen_func, with autograd for forward + backward), the same work with the host check
(flashattn.forward / backward with index_check="host", and with "device" beside them), and the
dense call of the padded batch (no lengths to check):
- kernel: CUDA-event time of one call on an idle stream (the GPU work);
- loop: wall time per call of 200 calls back to back (host and GPU overlapped where they can);
- blocked: host time of one call issued behind 2 ms of queued GPU work (about 2 ms when the call
  waits for the stream, tens of microseconds when it does not);
and the same for the dense call of the padded batch (no host check) for comparison.

  python3 bench/varlen_sync.py [--out FILE.json]
"""
import argparse
import json
import sys
import time

import torch

import flashattn


def per_call(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def kernel_time(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def blocked(fn, sleep_cycles=4_000_000, reps=10):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)  # ~2 ms of queued GPU work
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 513, (8,), generator=gen)
    total, longest, h, d = int(lens.sum()), int(lens.max()), 16, 64
    cu = torch.zeros(9, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    cu = cu.cuda()
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qd, kd, vd = (torch.randn(8, longest, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3))

    def varlen_fwd():
        with torch.no_grad():
            return flashattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)

    def varlen_fwd_bwd():
        flashattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).sum().backward()

    lengths = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True)
    qn, kn, vn = (x.detach() for x in (q, k, v))
    dout = torch.ones_like(qn)

    def ops_fwd(check):
        return lambda: flashattn.forward(qn, kn, vn, index_check=check, **lengths)

    def ops_fwd_bwd(check):
        def run():
            out, lse = flashattn.forward(qn, kn, vn, index_check=check, **lengths)
            flashattn.backward(dout, qn, kn, vn, out, lse, index_check=check, **lengths)
        return run

    def dense_fwd():
        with torch.no_grad():
            return flashattn.flash_attn_func(qd, kd, vd, causal=True)

    def dense_fwd_bwd():
        flashattn.flash_attn_func(qd, kd, vd, causal=True).sum().backward()

    rows = {}
    for name, fn in (("varlen fwd", varlen_fwd), ("ops fwd, host check", ops_fwd("host")),
                     ("ops fwd, device check", ops_fwd("device")), ("dense fwd", dense_fwd),
                     ("varlen fwd+bwd", varlen_fwd_bwd), ("ops fwd+bwd, host check", ops_fwd_bwd("host")),
                     ("ops fwd+bwd, device check", ops_fwd_bwd("device")), ("dense fwd+bwd", dense_fwd_bwd)):
        rows[name] = {"kernel_us": kernel_time(fn) * 1e6, "loop_us": per_call(fn) * 1e6,
                      "blocked_us": blocked(fn) * 1e6}
        r = rows[name]
        print(f"{name:26} kernel {r['kernel_us']:8.1f} us  loop {r['loop_us']:8.1f} us/call  "
              f"blocked behind 2 ms of GPU work {r['blocked_us']:8.1f} us", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "lengths": lens.tolist(),
              "heads": h, "head_dim": d, "dtype": "bfloat16", "causal": True, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

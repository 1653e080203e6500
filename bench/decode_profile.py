#!/usr/bin/env python3
"""Where a short decode call's time goes (GPU machine): each implementation's kernels, one call
at a time after an L2 flush, under torch.profiler (CUPTI kernel timestamps). Per call: the span
from its first kernel's start to its last kernel's end, each kernel's duration, and the gaps
between them (launch latency the GPU sits idle). It explains the small-batch rows of the suite's
decode table, where the time is latency, not bandwidth; bench/suite.py stays the benchmark of
record.

Ours is flashattn.forward_kvcache (the Python package that is importable, bench/_ours.py) into an
out / LSE allocated once; the profile reads kernel timestamps, so the package's host side is not
in the figures. Another build of ours (e.g. the commit before a change) is profiled by running this
again with that build's package first on PYTHONPATH and --name naming it ("base": its rows are
"base", "base_p16", ...; scripts/gpu_decode.sh does so with FLASHATTN_DECODE_BASE_SITE).

  python3 bench/decode_profile.py [--name ours] [--out FILE.json]   (flashattn importable: scripts/gpu_package.sh)
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import FLUSH_BYTES  # noqa: E402
from suite import paged  # noqa: E402

SHAPES = [  # (batch, context, kv heads); 32 query heads, d 128, bf16, one query token
    (1, 64, 8), (1, 64, 32), (1, 1024, 8), (1, 4096, 8), (1, 16384, 8), (8, 1024, 8), (1, 1024, 32),
    (1, 65536, 8), (8, 1024, 32), (8, 16384, 32)]
CALLS = 30


def profile_calls(fn, flush):
    """Per call: (span_us, [(kernel, duration_us)], gaps_us) of CALLS calls, each after a flush."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    calls, current = [], None
    for e in kernels:
        if "fill" in e.name.lower() or "memset" in e.name.lower():  # the flush starts a call
            current = []
            calls.append(current)
        elif current is not None:
            current.append(e)
    out = []
    for call in calls:
        if not call:
            continue
        span = call[-1].time_range.end - call[0].time_range.start
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(call, call[1:])]
        out.append((span, [(e.name, e.time_range.end - e.time_range.start) for e in call], gaps))
    return out


def summary(calls):
    spans = [c[0] for c in calls]
    names = [n for n, _ in calls[0][1]]
    per_kernel = [statistics.median(c[1][i][1] for c in calls if len(c[1]) == len(names)) for i in range(len(names))]
    gaps = [statistics.median(c[2][i] for c in calls if len(c[2]) == len(names) - 1) for i in range(len(names) - 1)]
    return {"span_us": statistics.median(spans), "kernels": [[n[:60], d] for n, d in zip(names, per_kernel)],
            "gaps_us": gaps}


FLOOR_SOURCE = r"""
extern "C" __global__ void touch(const float* src, float* dst, int loads) {
  extern __shared__ float smem[];
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  float x = 0.0f;
  for (int i = 0; i < loads; ++i) x += src[(t + i * gridDim.x * blockDim.x) * 64];  // dependent DRAM reads
  smem[threadIdx.x] = x;
  dst[t] = smem[threadIdx.x];
}
"""


def floor_fns():
    """The latency floor a short call meets under this protocol: 64 CTAs of 128 threads that do
    nothing but 0 / 1 / 2 dependent DRAM reads, with 0 or 100 KiB of dynamic shared memory (the
    tensor-core decode kernel's; raw CUDA through CuPy), or {} without CuPy."""
    try:
        import cupy
    except ImportError:
        return {}
    kernel = cupy.RawKernel(FLOOR_SOURCE, "touch")
    kernel.max_dynamic_shared_size_bytes = 100 << 10
    src = cupy.zeros(64 * 128 * 64 * 3, dtype=cupy.float32)
    dst = cupy.zeros(64 * 128, dtype=cupy.float32)
    fns = {}
    for loads in (0, 1, 2):
        for smem in (1 << 10, 100 << 10):
            def run(loads=loads, smem=smem):
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    kernel((64,), (128,), (src, dst, cupy.int32(loads)), shared_mem=smem)
            fns[f"loads{loads}_smem{smem >> 10}k"] = run
    return fns


def calls_only(batch, ctx, hkv, page=0):
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, ctx, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    lse = torch.empty(batch, 32, 1, device="cuda", dtype=torch.float32)
    if page:  # pages in order: the contiguous cache's addresses through the paged kernel
        kp, vp, table = paged(k, v, page, ctx, shuffle=False)
        run = _ours.kvcache_call(q, kp, vp, out, lse, table, index_check="device")
    else:
        run = _ours.kvcache_call(q, k, v, out, lse, index_check="host")
    for _ in range(5):
        run()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="ours", help="ours' name in the output (e.g. base for another build)")
    parser.add_argument("--out")
    parser.add_argument("--calls-only", metavar="B,CTX,HKV[,PAGE]",
                        help="no profiler: only 5 calls of ours on this shape, with PAGE: in pages of "
                             "that size, in order (for Nsight Compute, scripts/gpu_profile_decode.sh)")
    args = parser.parse_args()
    _ours.cuda_package()
    if args.calls_only:
        calls_only(*(int(x) for x in args.calls_only.split(",")))
        return
    ours = args.name
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = []
    for name, fn in floor_fns().items():
        s = summary(profile_calls(fn, flush))
        print(f"profile floor {name:27} span {s['span_us']:6.1f} us", flush=True)
        results.append({"floor": name, "span_us": s["span_us"]})
    for batch, ctx, hkv in SHAPES:
        torch.manual_seed(batch + ctx + hkv)
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, ctx, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        lse = torch.empty(batch, 32, 1, device="cuda", dtype=torch.float32)
        fns = {ours: _ours.kvcache_call(q, k, v, out, lse, index_check="host")}
        kp, vp, table = paged(k, v, 16, ctx)
        fns[f"{ours}_p16"] = _ours.kvcache_call(q, kp, vp, out, lse, table, index_check="device")
        # (Pages of 16 in order: the paged kernel's instructions on the contiguous cache's memory,
        # so p16 - p16_inorder is what the scattered pages cost the memory system.)
        kpo, vpo, table_inorder = paged(k, v, 16, ctx, shuffle=False)
        fns[f"{ours}_p16_inorder"] = _ours.kvcache_call(q, kpo, vpo, out, lse, table_inorder, index_check="device")
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            def peer(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          enable_gqa=hkv != 32)
            fns[name] = peer
        shape = f"b{batch} ctx{ctx} h32/{hkv}"
        row = {"batch": batch, "context": ctx, "kv_heads": hkv, "impls": {}}
        for name, fn in fns.items():
            try:
                s = summary(profile_calls(fn, flush))
            except (RuntimeError, IndexError, statistics.StatisticsError) as err:
                print(f"profile {shape:20} {name:9} failed: {str(err).splitlines()[0][:100]}", flush=True)
                continue
            row["impls"][name] = s
            kernels = "  ".join(f"{n[:38]} {d:.1f}" for n, d in s["kernels"])
            gaps = " ".join(f"{g:.1f}" for g in s["gaps_us"])
            print(f"profile {shape:20} {name:9} span {s['span_us']:6.1f} us | {kernels} | gaps {gaps}", flush=True)
        results.append(row)
        del q, k, v, kp, vp, kpo, vpo
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "name": ours,
                       "flashattn": _ours.package().__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

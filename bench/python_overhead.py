"""Per-call host overhead of flash_attn_func on CUDA for a tiny shape, next to PyTorch SDPA's, in
the same process (the target: within 1.3x of SDPA). The shape (b=1, s=128, h=8, d=64) makes the GPU
time negligible: what is timed is the host time per call, CUDA graphs off, measured as the wall
time of many back-to-back calls (the GPU keeps up) after a warm-up.

    python3 bench/python_overhead.py [--out results.json]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn


def per_call_us(fn, calls=2000, rounds=7):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples), samples


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    args = parser.parse_args()
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return run

    # The floor under the Python layers: the extension call alone, its arguments prepared once.
    from flashattn import _ext
    from flashattn._arrays import framework_of

    fw = framework_of(q)
    out, lse = torch.empty_like(q), torch.empty(1, 8, 128, device="cuda")
    ext_args = [fw.to_ext(t) for t in (q, k, v, out, lse)] + [None, None, None, 0, 0, 0.0, True, -1, -1, 0.0, None,
                                                              0.0, 0, 0, None,
                                                              fw.workspace_to_ext(fw.workspace(q, 16)), fw.stream(q)]
    fns = {
        "flashattn.flash_attn_func": lambda: flashattn.flash_attn_func(q, k, v, causal=True),
        "flashattn.forward (array-agnostic)": lambda: flashattn.forward(q, k, v, causal=True),
        "extension call only (arguments ready)": lambda: _ext.forward(*ext_args),
        "two torch.empty (output allocation)": lambda: (torch.empty_like(q), torch.empty(1, 8, 128, device="cuda")),
        "torch SDPA (FLASH backend)": sdpa(SDPBackend.FLASH_ATTENTION),
        "torch SDPA (default dispatch)": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
    }
    results = {name: per_call_us(fn) for name, fn in fns.items()}
    base = results["torch SDPA (default dispatch)"][0]
    print(f"{'call':<42}{'us / call':>12}{'vs SDPA':>10}")
    for name, (us, _) in results.items():
        print(f"{name:<42}{us:>12.1f}{us / base:>9.2f}x")
    if args.out:
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flashattn": flashattn.__version__}
        with open(args.out, "w") as f:
            json.dump({"environment": env, "us_per_call": {n: r[0] for n, r in results.items()},
                       "rounds_us": {n: r[1] for n, r in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()

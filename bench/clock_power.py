"""SM clock and board power while a forward runs back to back: ours, cuDNN and the bf16 GEMM.

Why: at Nsight Compute's locked clock ours runs 1.12-1.16x cuDNN's speed at the non-causal
configs where the benchmark (boost clocks, power-managed) measures 1.03-1.11x. If the difference
is the clock each kernel is allowed under the board's power limit, it shows here: each
implementation runs for --seconds back to back (no L2 flush: a sustained load), twice a config in
the order ours, cuDNN, cuDNN, ours, while nvidia-smi samples the SM clock, the power draw, the
temperature and the active clock-event reasons every 20 ms; the first quarter of each window
(the ramp) is left out of the averages. nvidia-smi's power.draw is a one-second average: it lags
a window's start, so short windows read low (the clock is read as it is). TFLOP/s over GHz is the
work an implementation does per clock cycle, comparable with ncu's times.

    python3 bench/clock_power.py [--configs 128:2048:none,256:16384:none] [--seconds 3] [--out clock_power.json]

Shapes are the benchmark's (16k tokens a call, heads = 2048 / d, bf16). Ours is flashattn.forward
(the Python package that is importable, bench/_ours.py) into an out / LSE allocated once; the call
rate is wall-clock, which the package's host side (tens of microseconds) does not bound: each call
is 0.4 ms or more of GPU work, queued 50 at a time.
"""
import argparse
import json
import subprocess
import time

from _timing import batch_heads, forward_flops


def smi_query():
    """The fields to sample: the clock-event reasons under their newer name, else the older one."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        query = f"clocks.sm,power.draw,temperature.gpu,{reasons}"
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return query
    raise SystemExit("nvidia-smi cannot report clocks.sm / power.draw here")


def parse_samples(lines):
    """nvidia-smi's csv lines (clock MHz, watts, deg C, reasons) -> tuples; other lines dropped."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
        except (ValueError, IndexError):
            continue  # a header, an error line or "[N/A]"
    return samples


def sample_while(fn, seconds, query):
    """Runs fn back to back for `seconds`; returns (calls a second, [(sm MHz, watts, deg C, reasons)])."""
    import torch

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)
    torch.cuda.synchronize()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(50):
            fn()
        calls += 50
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    smi.terminate()
    return calls / elapsed, parse_samples(smi.communicate()[0].strip().splitlines())


def summarize(name, flops, rate, samples):
    """One window: TFLOP/s from the call rate; clock, power and temperature past its first quarter."""
    if not samples:
        raise SystemExit(f"{name}: nvidia-smi returned no samples")
    steady = samples[len(samples) // 4:]
    mhz = sum(s[0] for s in steady) / len(steady)
    watts = sum(s[1] for s in steady) / len(steady)
    celsius = sum(s[2] for s in steady) / len(steady)
    reasons = sorted({s[3] for s in steady})
    tflops = flops * rate / 1e12
    return {"impl": name, "tflops": tflops, "sm_mhz": mhz, "watts": watts, "celsius": celsius,
            "tflops_per_ghz": tflops / (mhz / 1e3), "reasons": reasons, "samples": len(steady)}


def ratios(results):
    """Per config: ours / cuDNN in TFLOP/s, TFLOP/s per GHz and SM clock, each the mean of its windows."""
    def mean(config, impl, key):
        values = [r[key] for r in results if r["config"] == config and r["impl"] == impl]
        return sum(values) / len(values)

    configs = dict.fromkeys(r["config"] for r in results if r["impl"] != "cublas")
    keys = ("tflops", "tflops_per_ghz", "sm_mhz")
    return {c: {key: mean(c, "flashattn", key) / mean(c, "cudnn", key) for key in keys} for c in configs}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="128:2048:none,128:4096:none,256:4096:none,256:16384:none",
                        help="comma-separated head_dim:seqlen:mask (mask none or causal)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import _ours

    query = smi_query()
    _ours.cuda_package()
    results = []
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate, samples = sample_while(lambda: a @ b, args.seconds, query)
    results.append({"config": "gemm 8192^3", **summarize("cublas", 2 * 8192 ** 3, rate, samples)})
    del a, b
    for spec in args.configs.split(","):
        d, seqlen, mask = spec.split(":")
        d, seqlen, causal = int(d), int(seqlen), mask == "causal"
        batch, heads = batch_heads(d, seqlen)
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
        ours = _ours.forward_call(q, k, v, out, lse, causal=causal)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        flops = forward_flops(batch, heads, seqlen, seqlen, d, causal)
        fns = {"flashattn": ours, "cudnn": cudnn}
        for fn in fns.values():
            fn()  # warm-up (cuDNN builds its plan)
        # Windows in the order A B B A, so that the board's warming over a config favours neither.
        for name in ("flashattn", "cudnn", "cudnn", "flashattn"):
            time.sleep(1.0)  # the same pause before every window
            rate, samples = sample_while(fns[name], args.seconds, query)
            results.append({"config": f"d{d} {mask} {seqlen}", **summarize(name, flops, rate, samples)})
    print(f"{'config':<18}{'impl':<11}{'TFLOP/s':>9}{'SM MHz':>8}{'W':>6}{'C':>4}{'TF/GHz':>8}  reasons")
    for r in results:
        print(f"{r['config']:<18}{r['impl']:<11}{r['tflops']:>9.1f}{r['sm_mhz']:>8.0f}{r['watts']:>6.0f}"
              f"{r['celsius']:>4.0f}{r['tflops_per_ghz']:>8.1f}  {' '.join(r['reasons'])}")
    print(f"\n{'config':<18}{'ours/cuDNN':>11}{'per GHz':>9}{'clock ours/cuDNN':>18}")
    for config, ratio in ratios(results).items():
        print(f"{config:<18}{ratio['tflops']:>11.3f}{ratio['tflops_per_ghz']:>9.3f}{ratio['sm_mhz']:>18.3f}")
    if args.out:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version(), "results": results}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

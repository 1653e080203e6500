"""What the GPU benchmarks (suite.py, gpu_forward.py, gpu_backward.py, ...) share: the prefill grid
of docs/PERFORMANCE.md and its FLOP count, the machine's description, the timer (CUDA events, L2
flush, warm-up, settled clock, median), the ceilings measured in the same run, the interleaved
timing of ours and the peers, and the ratios' summary.

The CPU-side pieces (grid, FLOPs, summary) run without PyTorch too.
"""
import datetime
import math
import os
import statistics
import subprocess

try:
    import torch
except ImportError:  # a machine without PyTorch: the CPU-side pieces only
    torch = None

TOKENS = 16384
MODEL_WIDTH = 2048  # heads * head_dim
FLUSH_BYTES = 256 << 20  # > the 50-60 MB L2 of H100 / H200
# GPU spin before each timed call (Timer.lead_cycles), ~0.25-0.3 ms at the H100 / H200 clocks: longer
# than the host side of any call timed with it (PyTorch's autograd engine; flashattn's Python
# package, tens of microseconds), so the GPU never waits for the host inside a timed interval.
LEAD_CYCLES = 500_000
ROUNDS = 3  # interleaved timing rounds per config: each implementation at each place once


def batch_heads(head_dim, seqlen):
    """The grid's shape: TOKENS tokens per call, heads = MODEL_WIDTH / head_dim."""
    return TOKENS // seqlen, MODEL_WIDTH // head_dim


def forward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal):
    """4 * b * h * sq * sk * d (two GEMMs), halved for causal (docs/PERFORMANCE.md)."""
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)


def environment():
    """The machine, the software and the flashattn package under test (its version and where it
    was imported from: which build ran)."""
    from _ours import package

    fa = package()

    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {
        "gpu": torch.cuda.get_device_name(),
        "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[0],
        "cuda_runtime_torch": torch.version.cuda,
        "nvcc": run(["nvcc", "--version"]).splitlines()[-1],
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "flashattn": fa.__version__,
        "flashattn_package": os.path.dirname(os.path.abspath(fa.__file__)),
        "commit": os.environ.get("FLASHATTN_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class Timer:
    """Median time of fn, each call after an L2 flush. Before timing, fn runs (with its flushes)
    for settle_s, so every implementation is timed in its own steady state whatever ran before:
    the GPU runs at its power cap here, and with short bursts in a fixed order the round spread of
    whichever implementation followed cuDNN was 3-21% against 1-3% for the others (rotating the
    order spread that noise over all of them).

    The flush also gives the host time to queue fn before the GPU reaches the start event; where
    fn's host side is slower than that (PyTorch's autograd engine), lead_cycles > 0 adds a GPU
    spin of that many clock cycles before the start event, so host time is never timed."""

    def __init__(self, min_reps, max_reps, target_s, settle_s, lead_cycles=0):
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.min_reps, self.max_reps, self.target_s, self.settle_s = min_reps, max_reps, target_s, settle_s
        self.lead_cycles = lead_cycles

    def median_ms(self, fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        probe = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        probe[0].record()
        self.flush.zero_()
        probe[1].record()
        fn()
        probe[2].record()
        torch.cuda.synchronize()
        call_s = max(probe[1].elapsed_time(probe[2]) / 1e3, 1e-6)
        flushed_call_s = max(probe[0].elapsed_time(probe[2]) / 1e3, 1e-6)
        for _ in range(int(self.settle_s / flushed_call_s)):
            self.flush.zero_()
            fn()
        reps = int(min(self.max_reps, max(self.min_reps, self.target_s / call_s)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self.flush.zero_()  # also gives the host time to queue the call before the GPU reaches it
            if self.lead_cycles:
                torch.cuda._sleep(self.lead_cycles)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def ceilings(timer):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = timer.median_ms(lambda: torch.matmul(a, b))
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float16)  # 512 MiB
    dst = torch.empty_like(src)
    copy_ms = timer.median_ms(lambda: dst.copy_(src))
    return {
        "bf16_gemm_tflops": 2 * n**3 / gemm_ms / 1e9,
        "copy_tbps": 2 * src.numel() * src.element_size() / copy_ms / 1e9,
    }


def time_interleaved(timer, fns, flops, result, rounds=ROUNDS):
    """Times fns (name -> no-argument call) into result's ms, tflops and round_spread; a peer that
    cannot run the config gets its first error line in result["errors"] instead.

    Interleaved rounds in rotating order: clock and thermal drift during a config reach every
    implementation alike, and each one follows each other equally often (the GPU runs at its
    power cap here, and the clock it gets depends on what ran just before: in a fixed order,
    ours always followed cuDNN, the most power-hungry). Each one's time is the median of its
    round medians, and the rounds' spread is kept to show the noise."""
    times_of = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            if name in result.get("errors", {}):
                continue
            try:
                times_of[name].append(timer.median_ms(fn))
            except RuntimeError as err:  # a peer that cannot run this config
                result.setdefault("errors", {})[name] = str(err).splitlines()[0]
    for name, times in times_of.items():
        if name in result.get("errors", {}) or not times:
            continue
        ms = statistics.median(times)
        result["ms"][name] = ms
        result["tflops"][name] = flops / ms / 1e9
        result.setdefault("round_spread", {})[name] = max(times) / min(times) - 1


def ratio(result, peer, ours="flashattn"):
    """ours' TFLOP/s over peer's in result (a row, or a row's measurement), or None."""
    t = result["tflops"]
    return t[ours] / t[peer] if ours in t and peer in t else None


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def config_name(row):
    return f"{row['dtype']} d{row['head_dim']} {'causal' if row['causal'] else 'full'} {row['seqlen']}"


def summarize(rows, min_seqlen, measurement=lambda row: row, ours="flashattn"):
    """Geometric means of ours' ratios over the rows with seqlen >= min_seqlen; measurement picks
    the timed result out of a row (the row itself where a row holds one)."""
    eligible = [r for r in rows if r["seqlen"] >= min_seqlen]
    vs_fa2 = [ratio(measurement(r), "fa2", ours) for r in eligible]
    return {
        "min_seqlen": min_seqlen,
        "geomean_vs_fa2": geomean(vs_fa2),
        "geomean_vs_cudnn": geomean([ratio(measurement(r), "cudnn", ours) for r in eligible]),
        "min_vs_fa2": min((v for v in vs_fa2 if v), default=None),
        "configs_below_fa2": [config_name(r) for r in eligible if (ratio(measurement(r), "fa2", ours) or 0) < 1.0],
    }


def fmt(x, spec=".1f"):
    """A table cell: '-' for a missing value."""
    return "-" if x is None else format(x, spec)

"""bench/clock_power.py's CPU-side logic: nvidia-smi's lines parsed, a window summarized past its
ramp, the per-config ratios, on synthetic samples (the tool itself needs a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import clock_power as cp  # noqa: E402


def test_parse_keeps_sample_lines_only():
    lines = ["clocks.sm [MHz], power.draw [W]", "1980, 650.5, 61, 0x0000000000000004", "", "[N/A], [N/A], 60, 0x0",
             "1800, 640.0, 62, 0x0000000000000000"]
    assert cp.parse_samples(lines) == [(1980.0, 650.5, 61.0, "0x0000000000000004"),
                                       (1800.0, 640.0, 62.0, "0x0000000000000000")]


def test_summary_leaves_the_ramp_out():
    ramp = [(1980.0, 300.0, 40.0, "0x0")]
    steady = [(1600.0, 640.0, 60.0, "0x4"), (1700.0, 660.0, 62.0, "0x4"), (1650.0, 650.0, 61.0, "0x4")]
    r = cp.summarize("flashattn", 2e12, 300.0, ramp + steady)
    assert r["tflops"] == pytest.approx(600.0)
    assert (r["sm_mhz"], r["watts"], r["celsius"]) == pytest.approx((1650.0, 650.0, 61.0))
    assert r["tflops_per_ghz"] == pytest.approx(600.0 / 1.65)
    assert r["reasons"] == ["0x4"] and r["samples"] == 3
    with pytest.raises(SystemExit):
        cp.summarize("cudnn", 1.0, 1.0, [])


def test_ratios_average_each_implementations_windows():
    def window(config, impl, tflops, mhz):
        return {"config": config, "impl": impl, "tflops": tflops, "sm_mhz": mhz, "tflops_per_ghz": tflops / (mhz / 1e3)}

    results = [window("gemm 8192^3", "cublas", 600.0, 1500.0),
               window("d128 none 2048", "flashattn", 630.0, 1600.0), window("d128 none 2048", "cudnn", 560.0, 1650.0),
               window("d128 none 2048", "cudnn", 570.0, 1650.0), window("d128 none 2048", "flashattn", 640.0, 1600.0)]
    ratio = cp.ratios(results)
    assert list(ratio) == ["d128 none 2048"]
    assert ratio["d128 none 2048"]["tflops"] == pytest.approx(635.0 / 565.0)
    assert ratio["d128 none 2048"]["sm_mhz"] == pytest.approx(1600.0 / 1650.0)



def test_flops_are_the_benchmarks():
    # clock_power takes the benchmark's shapes and FLOP count from _timing.
    batch, heads = cp.batch_heads(128, 16384)
    assert cp.forward_flops(batch, heads, 16384, 16384, 128, False) == 4 * 1 * 16 * 16384 * 16384 * 128
    batch, heads = cp.batch_heads(64, 2048)
    assert cp.forward_flops(batch, heads, 2048, 2048, 64, True) == 4 * 8 * 32 * 2048 * 2048 * 64 / 2

"""The GPU backward benchmark's CPU-side logic (bench/gpu_backward.py, bench/_timing.py): the grid,
its FLOP counts, the memory growth exponent, and the report rendered from synthetic results, so a
mistake there shows in CI rather than after a run on the GPU machine."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_backward as gb  # noqa: E402
from _timing import MODEL_WIDTH, TOKENS, summarize  # noqa: E402


def test_grid_has_16k_tokens_and_2048_wide_heads():
    configs = gb.parse_args(["--list"]).configs
    assert len(configs) == 2 * 3 * 2 * 6
    for _, d, _, seqlen in configs:
        batch, heads = gb.batch_heads(d, seqlen)
        assert batch * seqlen == TOKENS and heads * d == MODEL_WIDTH
    quick = gb.parse_args(["--list", "--quick"])
    assert {c[0] for c in quick.configs} == {"bfloat16"} and len(quick.configs) == 3 * 2 * 2
    assert quick.memory_seqlens == [1024, 8192, 65536]


def test_flops_are_2_5x_and_3_5x_the_forward_halved_for_causal():
    fwd = 4 * 1 * 16 * 16384 * 16384 * 128  # d128, seqlen 16k: batch 1, 16 heads
    assert gb.measurement_flops(128, False, 16384) == {"fwd_bwd": 3.5 * fwd, "bwd": 2.5 * fwd}
    assert gb.measurement_flops(128, True, 16384) == {"fwd_bwd": 1.75 * fwd, "bwd": 1.25 * fwd}


def test_growth_exponent():
    seqlens = [1024, 2048, 4096]
    assert gb.growth_exponent(seqlens, [5 + 3 * s for s in seqlens]) == pytest.approx(1.0, abs=0.01)
    assert gb.growth_exponent(seqlens, [s * s for s in seqlens]) == pytest.approx(2.0)
    assert gb.growth_exponent(seqlens, [0, 0, 0]) is None


def synthetic_row(d, causal, seqlen, ours_tflops, cudnn_runs=True):
    row = {"dtype": "bfloat16", "head_dim": d, "causal": causal, "seqlen": seqlen, "batch": TOKENS // seqlen,
           "heads": MODEL_WIDTH // d, "errors": {}, "workspace_bytes": 3 << 20, "all_written": True,
           "max_abs_diff_vs_fa2": {"dq": 1e-3, "dk": 2e-3, "dv": 1e-3}}
    for m in gb.MEASUREMENTS:
        row[m] = {"tflops": {"flashattn": ours_tflops, "fa2": 200.0}, "ms": {"flashattn": 1.0, "fa2": 1.5},
                  "round_spread": {"flashattn": 0.01, "fa2": 0.02}}
        if cudnn_runs:
            row[m]["tflops"]["cudnn"] = 400.0
        else:
            row[m]["errors"] = {"cudnn": "no kernel"}
    return row


def test_report_from_synthetic_results():
    rows = [synthetic_row(64, False, 512, 100.0), synthetic_row(128, True, 1024, 300.0),
            synthetic_row(256, False, 4096, 150.0, cudnn_runs=False)]
    failed = synthetic_row(256, True, 4096, 0.0)
    failed.update(errors={"flashattn": "head dim not compiled"}, workspace_bytes=None, all_written=None,
                  max_abs_diff_vs_fa2=None)
    for m in gb.MEASUREMENTS:
        del failed[m]["tflops"]["flashattn"]
    rows.append(failed)
    summary = {m: summarize(rows, 1024, lambda r, m=m: r[m]) for m in gb.MEASUREMENTS}
    assert summary["bwd"]["geomean_vs_fa2"] == pytest.approx((1.5 * 0.75) ** 0.5)
    # a config ours cannot run counts as below FA2
    assert summary["bwd"]["configs_below_fa2"] == ["bfloat16 d256 full 4096", "bfloat16 d256 causal 4096"]

    memory_rows = [{"seqlen": s, "workspace_bytes": 8 * s, "errors": {},
                    "extra_bytes": {"flashattn": 8 * s, "fa2": 10 * s, "cudnn": s * s}} for s in (1024, 2048)]
    memory_rows[1]["errors"]["cudnn"] = "out of memory"
    del memory_rows[1]["extra_bytes"]["cudnn"]
    memory = {"shape": gb.MEMORY_SHAPE, "rows": memory_rows, "summary": gb.memory_summary(memory_rows)}
    assert memory["summary"]["ours_linear"] is True
    assert memory["summary"]["growth_exponent"]["cudnn"] is None

    env = {"gpu": "test", "commit": "abc"}
    text = gb.markdown(env, {"bf16_gemm_tflops": 700.0, "copy_tbps": 3.0}, rows, summary, memory, 0.2, False)
    assert "| bfloat16 | 128 | causal | 1024 | 300.0 | 200.0 | 400.0 | 1.50 | 0.75 |" in text
    assert "- bfloat16 d256 causal 4096: flashattn: head dim not compiled" in text
    assert "- bfloat16 d256 full 4096 bwd: cudnn: no kernel" in text
    assert "Ours is O(N)." in text and "- seqlen 2048: cudnn: out of memory" in text
    for i, row in enumerate(rows):
        gb.print_row(row, i + 1, len(rows))


def test_varlen_backward_report_from_synthetic_results():
    """bench/gpu_varlen_backward.py's table and summary from synthetic rows (the ratios are ours
    over each peer, their geometric means in the summary)."""
    gvb = pytest.importorskip("gpu_varlen_backward")  # imports PyTorch
    rows = [{"dtype": "bfloat16", "head_dim": d, "causal": causal, "mix": "short", "sequences": 48, "max_len": 1020,
             "heads": MODEL_WIDTH // d, "tflops": {"flashattn": ours, "flashattn_sm80": 200.0, "fa2": 100.0},
             "ms": {}, "max_abs_diff_vs_fa2": 1e-2, "max_abs_diff_vs_fa2_sm80": 2e-2, "all_finite": True}
            for d, causal, ours in ((64, False, 400.0), (128, True, 100.0))]
    summary = {"geomean_vs_fa2": 2.0, "sm80_geomean_vs_fa2": 2.0, "geomean_vs_sm80": 1.0}
    text = gvb.markdown({"gpu": "synthetic"}, rows, summary, 0.2)
    assert "| bfloat16 | 64 | none | short | 48 | 1020 | 400.0 | 200.0 | 100.0 | 4.00 | 2.00 |" in text
    assert "| bfloat16 | 128 | causal | short | 48 | 1020 | 100.0 | 200.0 | 100.0 | 1.00 | 0.50 |" in text
    assert "geometric mean vs FA2 varlen: 2.000x (sm80 backward: 2.000x)" in text

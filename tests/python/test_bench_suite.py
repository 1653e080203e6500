"""The benchmark suite's CPU-side logic (bench/suite.py grids and CSV, bench/io_bytes.py analytic
HBM counts, bench/report.py tables, bench/forward_chart.py's reading of a forward run), checked on synthetic results so a mistake shows in CI rather
than after a run on the GPU machine."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import forward_chart  # noqa: E402
import io_bytes  # noqa: E402
import report  # noqa: E402
import suite  # noqa: E402


def test_prefill_grid_full_and_quick():
    full = suite.parse_args(["--list"])
    assert len(full.prefill) == 2 * 3 * 2 * 6
    assert full.directions == ["fwd", "bwd", "fwd_bwd"]
    quick = suite.parse_args(["--list", "--quick"])
    assert [(c["head_dim"], c["seqlen"]) for c in quick.prefill] == [(128, 2048), (128, 8192)] * 2
    assert quick.rounds == 1 and full.rounds == suite.ROUNDS
    with pytest.raises(SystemExit):
        suite.parse_args(["--list", "--directions", "fwd,sideways"])


def test_decode_grid_leaves_out_caches_over_the_budget():
    configs, skipped = suite.decode_grid([1024, 131072], [1, 128], max_gib=24)
    assert len(configs) + len(skipped) == 2 * 2 * 2
    # 128 x 128k tokens x 32 kv heads x d128 x 2 bytes x (K, V) = 256 GiB; with 8 kv heads 64 GiB.
    assert {(c["batch"], c["context"], c["kv_heads"]) for c in skipped} == {(128, 131072, 32), (128, 131072, 8)}
    assert all(suite.kv_bytes(c) <= 24 << 30 for c in configs)
    assert suite.kv_bytes({"batch": 1, "context": 1024, "kv_heads": 8, "head_dim": 128}) == 2 * 1024 * 8 * 128 * 2


def synthetic_results():
    prefill = []
    for c in suite.prefill_grid(["bfloat16"], [128], [512, 2048]):
        c = dict(c, batch=16384 // c["seqlen"], heads=16, errors={"flash_attn": "not installed (flash_attn)"})
        for d in suite.FLOP_FACTORS:
            c[d] = {"tflops": {"flashattn": 300.0, "fa2": 250.0, "cudnn": 500.0}, "ms": {"flashattn": 1.0, "fa2": 1.2,
                                                                                        "cudnn": 0.6}}
        c["bwd"]["errors"] = {"cudnn": "out of memory"}
        del c["bwd"]["tflops"]["cudnn"], c["bwd"]["ms"]["cudnn"]
        prefill.append(c)
    decode, left_out = suite.decode_grid([4096], [1, 256], max_gib=24)
    for c in decode:
        c.update(errors={"math": "left out"},
                 fwd={"tflops": {}, "ms": {"flashattn": 0.1, "cudnn": 0.05}, "tbps": {"flashattn": 1.0, "cudnn": 2.0}})
    memory = [{"seqlen": 1024, "bytes": {"flashattn_fwd": 1 << 20, "flashattn_fwd_bwd": 4 << 20,
                                         "standard_fwd": 64 << 20, "standard_fwd_bwd": 128 << 20}},
              {"seqlen": 4096, "bytes": {"flashattn_fwd": 4 << 20, "flashattn_fwd_bwd": 16 << 20,
                                         "standard_fwd": 1024 << 20, "standard_fwd_bwd": "out of memory: x"}}]
    return {"environment": {"gpu": "synthetic"}, "labels": suite.LABELS, "ceilings": {"bf16_gemm_tflops": 700.0,
            "copy_tbps": 3.0}, "settings": {"rounds": 1, "settle_s": 0.2, "lead_cycles": 1, "quick": True,
            "directions": list(suite.FLOP_FACTORS)}, "prefill": prefill, "decode": decode, "decode_left_out": left_out,
            "memory": memory}


def test_csv_has_one_line_per_timed_or_failed_implementation():
    rows = list(suite.csv_rows(synthetic_results()))
    prefill = [r for r in rows if r["part"] == "prefill"]
    assert len(prefill) == 4 * 3 * len(suite.IMPLEMENTATIONS)
    bwd_cudnn = [r for r in prefill if r["direction"] == "bwd" and r["impl"] == "cudnn"]
    assert all(r["error"] == "out of memory" and r["tflops"] is None for r in bwd_cudnn)
    decode = [r for r in rows if r["part"] == "decode" and r["impl"] == "cudnn"]
    assert all(r["tbps"] == 2.0 and r["seqlen"] == 1 for r in decode)


def test_report_tables_from_synthetic_results(tmp_path, monkeypatch):
    for figure in ("prefill_figure", "decode_figure", "memory_figure"):
        monkeypatch.setattr(report, figure, lambda *args: None)
    (tmp_path / "suite.json").write_text(json.dumps(synthetic_results()))
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "summary.txt").write_text("test_gpu_forward       ok  104s  [gpu_tests.log]\n")
    report.main(["report.py", str(tmp_path)])
    text = (tmp_path / "report.md").read_text()
    steps = text.split("## Steps of this run")[1]
    assert "scripts/gpu_check.sh (check/summary.txt)" in steps and "test_gpu_forward       ok  104s" in steps
    assert "(summary.txt)" not in steps  # no scripts/bench.sh summary in this folder
    assert "| FA2 (SDPA) | 1.200x | 1.200x | 2 |" in text  # seqlen >= 1k only: the 2048 rows
    assert "cuDNN (bfloat16 d128 full 2048 bwd): out of memory" in text
    assert "| 1 | 32/32 | 4096 | 1.00 (33%) |" in text and "| 0.50 |" in text
    assert "out of memory" in text.split("## Memory")[1]
    assert "Not in this run (io.json missing)" in text


def test_analytic_hbm_bytes():
    n, d, bh = 2048, io_bytes.HEAD_DIM, (16384 // 2048) * (2048 // io_bytes.HEAD_DIM)
    assert io_bytes.analytic_bytes("standard", n, 128) == bh * 2 * (4 * n * d + 4 * n * n)
    assert io_bytes.analytic_bytes("ours", n, 128) == bh * (8 * n * d + 4 * n)
    # FA1's traffic grows as N^2 d / B_n: twice the K/V tile width, about half the extra traffic.
    extra = lambda bn: io_bytes.analytic_bytes("fa1", n, bn) - io_bytes.analytic_bytes("ours", n, bn)  # noqa: E731
    assert extra(64) / extra(128) == pytest.approx(2.0, rel=0.1)


def test_forward_chart_draws_one_figure_per_dtype(tmp_path, monkeypatch):
    row = {"head_dim": 128, "causal": True, "seqlen": 2048, "batch": 8, "heads": 16,
           "tflops": {"fa2": 300.0, "flashattn": 600.0, "cudnn": 550.0},
           "ms": {"fa2": 2.0, "flashattn": 1.0, "cudnn": 1.1}}
    run = tmp_path / "forward-x.json"
    run.write_text(json.dumps({"rows": [{**row, "dtype": "bfloat16"}, {**row, "dtype": "float16"}]}))
    drawn = []
    monkeypatch.setattr(report, "prefill_figure", lambda *args: drawn.append(args))
    forward_chart.main(["forward_chart.py", str(run), str(tmp_path / "charts")])
    assert [(a[1], a[2], Path(a[4]).name) for a in drawn] == [
        ("bfloat16", "fwd", "forward-x-bfloat16.png"), ("float16", "fwd", "forward-x-float16.png")]
    rows, labels = drawn[0][0], drawn[0][3]
    assert rows == [{"dtype": "bfloat16", "head_dim": 128, "causal": True, "seqlen": 2048,
                     "fwd": {"tflops": row["tflops"], "ms": row["ms"]}}]
    assert list(labels) == ["flashattn", "cudnn", "fa2"]  # ours first
    assert labels["fa2"] == suite.LABELS["fa2"]

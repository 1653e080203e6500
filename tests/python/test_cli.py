"""`python -m flashattn`: info and run in a subprocess (the installed package), their JSON output and
exit status, and a usage error. CPU only: runs are pinned to --device cpu."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def flashattn_cli(*args):
    return subprocess.run([sys.executable, "-m", "flashattn", *args], capture_output=True, text=True, timeout=300)


def test_info_json():
    import flashattn

    r = flashattn_cli("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["version"] == flashattn.__version__
    assert info["cuda_compiled"] == flashattn.cuda_compiled()
    assert info["cuda_kernels"] == flashattn.cuda_kernels()
    assert isinstance(info["cuda_device_count"], int) and info["cuda_device_count"] >= 0


def test_info_text():
    r = flashattn_cli("info")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("flashattn ") and "CUDA backend" in r.stdout


@pytest.mark.parametrize("extra", [[], ["--backward"]], ids=["forward", "backward"])
def test_run_gqa_causal_json(extra):
    r = flashattn_cli("run", "--seqlen-q", "64", "--seqlen-k", "80", "--head-dim", "32", "--heads", "4",
                      "--heads-kv", "2", "--causal", "--device", "cpu", "--json", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["device"] == "cpu"
    assert report["problem"] == {"batch": 1, "seqlen_q": 64, "seqlen_k": 80, "heads": 4, "heads_kv": 2,
                                 "head_dim": 32, "dtype": "float32", "causal": True}
    assert report["passed"] is True
    assert report["forward"]["median_s"] > 0 and report["forward"]["tflops"] > 0
    assert ("backward" in report) == bool(extra)
    names = ["out", "lse"] + (["dq", "dk", "dv"] if extra else [])
    assert list(report["check"]) == names
    for name in names:
        c = report["check"][name]
        assert c["passed"] and 0 <= c["max_abs_error"] <= c["tolerance"], (name, c)


def test_run_device_auto():
    """Without --device: CUDA where this build, a GPU and PyTorch are there (bfloat16), else the CPU.
    Head dim 64: the one dev builds of the CUDA backend (FLASHATTN_CUDA_HEAD_DIMS) keep."""
    r = flashattn_cli("run", "--seqlen-q", "64", "--seqlen-k", "80", "--head-dim", "64", "--heads", "4",
                      "--heads-kv", "2", "--causal", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] is True and report["device"] in ("cpu", "cuda:0")


def test_run_bfloat16_text():
    pytest.importorskip("ml_dtypes")
    r = flashattn_cli("run", "--seqlen-q", "48", "--heads", "2", "--head-dim", "16", "--dtype", "bfloat16",
                      "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bfloat16" in r.stdout and "max abs error" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("PASS")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_run_float8_json(dtype):
    """FP8 inputs (descale 1): a bfloat16 out judged against the naive FP8 attention; the forward alone."""
    pytest.importorskip("ml_dtypes")
    r = flashattn_cli("run", "--seqlen-q", "40", "--seqlen-k", "72", "--heads", "4", "--heads-kv", "2",
                      "--head-dim", "32", "--dtype", dtype, "--causal", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["problem"]["dtype"] == dtype and report["problem"]["out_dtype"] == "bfloat16"
    assert report["passed"] is True and list(report["check"]) == ["out", "lse"]
    # The naive FP8 attention rounds P to FP8: its error, the rule's baseline, is far above zero.
    assert report["check"]["out"]["naive_max_abs_error"] > 1e-3
    r = flashattn_cli("run", "--seqlen-q", "16", "--dtype", dtype, "--backward", "--device", "cpu")
    assert r.returncode == 1 and "FP8 inputs run the forward pass only" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["run", "--heads", "many"], "argument --heads: expected an integer >= 1, got 'many'"),
    (["run", "--dtype", "float64"], "argument --dtype: invalid choice"),
    (["run", "--heads", "4", "--heads-kv", "3"], "argument --heads-kv: 3 does not divide --heads 4"),
    (["run", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_usage_error(args, message):
    r = flashattn_cli(*args)
    assert r.returncode == 2
    assert message in r.stderr, r.stderr


def test_library_refusal_is_an_error():
    r = flashattn_cli("run", "--head-dim", "600", "--seqlen-q", "8", "--device", "cpu")
    assert r.returncode == 1
    assert "head_dim" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_wrong_result_fails(monkeypatch, capsys):
    """The verdict is the check's: an output off by 1e-3 is a FAIL and exit status 3."""
    import flashattn
    from flashattn import cli

    forward = flashattn.forward

    def off_forward(*args, **kwargs):
        out, lse = forward(*args, **kwargs)
        return out + 1e-3, lse

    monkeypatch.setattr(flashattn, "forward", off_forward)
    assert cli.main(["run", "--seqlen-q", "32", "--heads", "2", "--head-dim", "16", "--device", "cpu"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert any(line.strip().startswith("out ") and line.endswith("FAIL") for line in lines), lines
    assert lines[-1].startswith("FAIL")

"""The package's command line: `python -m flashattn` and the `flashattn` console script.

- `info`: version, whether the CUDA backend is compiled in, its kernels, the CUDA devices visible;
- `run`: one checked attention call on random inputs, numpy arrays on the CPU or PyTorch tensors
  on a CUDA device, timed (median of --repeats after one warm-up call), and compared with a float64
  numpy reference: PASS when the error is within 2x (3x for gradients) the error of plain
  attention computed in the input dtype with float32 accumulation, plus a small atol (the test
  suites' rule, tests/python/tolerance.py). Exit status 3 on FAIL, 1 when the library refuses the
  call, 2 on a usage error (as the C++ tool's).

PyTorch is needed only for CUDA runs; the reference and the CPU runs use numpy alone (bfloat16
and FP8 CPU inputs: ml_dtypes). FP8 inputs (descale 1) give a bfloat16 out; their naive attention
rounds P to the FP8 type, as an FP8 GEMM's operand would be.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time

import numpy as np

from . import _ext

EXIT_CHECK_FAILED = 3  # a result outside the tolerance (1: the call cannot run, 2: a usage error)

_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_CUDA_DTYPES = ("float16", "bfloat16")  # the CUDA backend's
_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # FP8 inputs: descale 1, a bfloat16 out
_BACKWARD_FLOPS_FACTOR = 2.5  # a backward does 2.5x the forward's matmul work


def _out_dtype(dtype: str) -> str:
    return "bfloat16" if dtype in _FP8_MAX else dtype


def _ml_dtype(dtype: str):
    """numpy's type for a bfloat16 or FP8 dtype (ml_dtypes)."""
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError(f"--dtype {dtype}: numpy {dtype} arrays need ml_dtypes (pip install ml_dtypes)") from None
    return getattr(ml_dtypes, dtype)


# --- info -----------------------------------------------------------------------------------------

def _torch_version():
    """PyTorch's version when it is installed (without importing it: that takes seconds), else None."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def info_facts() -> dict:
    compiled = bool(_ext.cuda_compiled())
    return {
        "version": _ext.version(),
        "cuda_compiled": compiled,
        # Without the backend the library cannot ask the driver: 0 then says nothing about the machine.
        "cuda_device_count": int(_ext.cuda_device_count()),
        "cuda_devices_queried": compiled,
        "cuda_kernels": list(_ext.cuda_kernels()),
        "torch": _torch_version(),
    }


def _print_info(facts: dict) -> None:
    kernels = facts["cuda_kernels"]
    print(f"flashattn {facts['version']} (Python package)")
    compiled = "compiled into this build" if facts["cuda_compiled"] else "not compiled into this build"
    print(f"  {'CUDA backend':<14} {compiled}")
    devices = f"{facts['cuda_device_count']} visible"
    if not facts["cuda_devices_queried"]:
        devices += " (not queried: no CUDA backend)"
    print(f"  {'CUDA devices':<14} {devices}")
    print(f"  {'CUDA kernels':<14} {len(kernels)} compiled{':' if kernels else ''}")
    for i in range(0, len(kernels), 3):
        print(f"  {'':<14} {'  '.join(kernels[i:i + 3])}")
    print(f"  {'PyTorch':<14} {facts['torch'] or 'not installed (needed for CUDA runs only)'}")


# --- reference ------------------------------------------------------------------------------------

def _round(x, dtype: str):
    """float32 values rounded to `dtype` (round to nearest even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # the top 16 bits, rounded to nearest even (no ml_dtypes needed)
        bits = x.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    if dtype in _FP8_MAX:  # to nearest even, saturating (the library's quantisation)
        return np.clip(x, -_FP8_MAX[dtype], _FP8_MAX[dtype]).astype(_ml_dtype(dtype)).astype(np.float32)
    return x


def visible(sq: int, sk: int, causal: bool):
    """bool [sq, sk]: query i sees key j iff j <= i + sk - sq (bottom-right causal mask)."""
    if not causal:
        return np.ones((sq, sk), dtype=bool)
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)


def attention(q, k, v, causal: bool, dout=None, dtype: str | None = None):
    """Attention from its definition, [b, s, h, d] in. dtype None: the float64 oracle. dtype set:
    the naive attention of a framework in that dtype (float32 arithmetic; P and dS rounded to the
    dtype for the products that consume them, the results rounded to it, lse float32; FP8: P
    rounded to FP8, out to bfloat16). GQA: query head h reads kv head h // (hq // hkv). Returns
    (out, lse) and, with dout, (dq, dk, dv)."""
    ct = np.float64 if dtype is None else np.float32
    rnd = (lambda x: x) if dtype is None else (lambda x: _round(x, dtype))
    rnd_out = (lambda x: x) if dtype is None else (lambda x: _round(x, _out_dtype(dtype)))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qh = np.asarray(q, ct).transpose(0, 2, 1, 3)
    kh = np.repeat(np.asarray(k, ct).transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(np.asarray(v, ct).transpose(0, 2, 1, 3), group, axis=1)
    scale = ct(1.0 / np.sqrt(d))
    s = (qh @ kh.swapaxes(-1, -2)) * scale
    vis = visible(sq, sk, causal)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)  # a row that sees no key: P = 0, out = 0, lse = -inf
    e = np.where(vis, np.exp(s - m), 0)
    l_sum = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, l_sum, out=np.zeros_like(e), where=l_sum > 0)
    p = rnd(p)
    out = rnd_out(p @ vh)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l_sum))[..., 0]  # [b, hq, sq]
    result = (out.transpose(0, 2, 1, 3), lse)
    if dout is None:
        return result
    doh = np.asarray(dout, ct).transpose(0, 2, 1, 3)
    dp = doh @ vh.swapaxes(-1, -2)
    delta = (doh * out).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    dq = rnd(scale * (ds @ kh))
    dk = rnd((scale * (ds.swapaxes(-1, -2) @ qh)).reshape(b, hkv, group, sk, d).sum(axis=2))
    dv = rnd((p.swapaxes(-1, -2) @ doh).reshape(b, hkv, group, sk, d).sum(axis=2))
    return result + tuple(g.transpose(0, 2, 1, 3) for g in (dq, dk, dv))


def _atol(dtype: str, scale: float) -> float:
    """Accumulator rounding noise at the result's scale, plus one ulp of a 16-bit result (where the
    naive result is exact, e.g. one visible key, any other rounding may cross a rounding boundary)."""
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7}.get(dtype, 0.0)
    return (64 * 2.0**-23 + ulp) * max(scale, 1e-3)


def _max_err(a, exact) -> float:
    a, exact = np.asarray(a, np.float64), np.asarray(exact, np.float64)
    finite = np.isfinite(exact)
    if not np.array_equal(np.isfinite(a), finite) or not np.array_equal(a[~finite], exact[~finite]):
        return float("inf")  # NaN, or -inf (an empty row's lse) where the reference has none
    return float(np.abs(a[finite] - exact[finite]).max(initial=0.0))


# --- run ------------------------------------------------------------------------------------------

def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got '{text}'")
    return value


def _choose_device(choice: str, dtype: str):
    """('cpu' | 'cuda', why, torch module or None); raises ValueError when --device cuda cannot run."""
    if choice == "cpu":
        return "cpu", "--device cpu", None
    missing = None
    if not _ext.cuda_compiled():
        missing = "the CUDA backend is not compiled into this build (pip install . with nvcc and CUTLASS)"
    elif _ext.cuda_device_count() == 0:
        missing = "no CUDA device is visible"
    elif dtype not in _CUDA_DTYPES:
        missing = f"--dtype {dtype}: the CUDA backend runs float16 and bfloat16"
    elif _torch_version() is None:
        missing = "CUDA runs use PyTorch tensors, and PyTorch is not installed"
    torch = None
    if missing is None:
        import torch

        if not torch.cuda.is_available():
            missing = "PyTorch sees no CUDA device (a CPU-only PyTorch build?)"
    if missing is None:
        return "cuda", f"--device {choice}", torch
    if choice == "cuda":
        raise ValueError(f"--device cuda: {missing}")
    return "cpu", f"auto: {missing}", None


def _timed(call, repeats: int, sync) -> list:
    call()  # warm-up: first-touch of the outputs, CUDA module loading
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _pass_result(times: list, flops: float) -> dict:
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "max_s": max(times), "flops": flops,
            "tflops": flops / median * 1e-12}


def run(args) -> dict:
    """Runs, times and checks one call; returns the report (its "passed" is the verdict)."""
    import flashattn

    if args.dtype is None:  # bfloat16 where the call runs on CUDA, else float32
        device, why, torch = _choose_device(args.device, "bfloat16")
        dtype = "bfloat16" if device == "cuda" else "float32"
    else:
        dtype = args.dtype
        device, why, torch = _choose_device(args.device, dtype)
    if dtype in _FP8_MAX and args.backward:
        raise ValueError(f"--dtype {dtype}: FP8 inputs run the forward pass only (no --backward)")
    b, sq, sk, hq, hkv, d = args.batch, args.seqlen_q, args.seqlen_k or args.seqlen_q, args.heads, \
        args.heads_kv or args.heads, args.head_dim
    rng = np.random.default_rng(args.seed)
    # Inputs as float32 values already rounded to the dtype: the reference sees exactly what the library does.
    q, k, v, dout = (_round(rng.standard_normal(shape, dtype=np.float32), dtype)
                     for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))

    if device == "cuda":
        tdtype = getattr(torch, dtype)
        # Exact: the float32 values are already rounded to the dtype.
        to_dev = lambda a: torch.from_numpy(a).to(device="cuda", dtype=tdtype)  # noqa: E731
        to_np = lambda t: t.float().cpu().numpy()  # noqa: E731
        sync = torch.cuda.synchronize
    else:
        np_dtype = _ml_dtype(dtype) if dtype == "bfloat16" or dtype in _FP8_MAX else np.dtype(dtype)
        to_dev = lambda a: a.astype(np_dtype)  # noqa: E731
        to_np = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
        sync = lambda: None  # noqa: E731
    tq, tk, tv, tdout = (to_dev(a) for a in (q, k, v, dout))

    results = {}

    def fwd():
        results["fwd"] = flashattn.forward(tq, tk, tv, causal=args.causal)

    flops = 4.0 * b * hq * d * float(visible(sq, sk, args.causal).sum())
    passes = {"forward": _pass_result(_timed(fwd, args.repeats, sync), flops)}
    out, lse = results["fwd"]
    outputs = {"out": to_np(out), "lse": to_np(lse)}
    if args.backward:

        def bwd():
            results["bwd"] = flashattn.backward(tdout, tq, tk, tv, out, lse, causal=args.causal)
        passes["backward"] = _pass_result(_timed(bwd, args.repeats, sync), _BACKWARD_FLOPS_FACTOR * flops)
        outputs.update(zip(("dq", "dk", "dv"), (to_np(g) for g in results["bwd"])))

    grad = dout if args.backward else None
    exact = dict(zip(("out", "lse", "dq", "dk", "dv"), attention(q, k, v, args.causal, grad)))
    naive = dict(zip(("out", "lse", "dq", "dk", "dv"), attention(q, k, v, args.causal, grad, dtype)))
    check = {}
    for name, value in outputs.items():
        # lse is float32 whatever the dtype (the naive's too): its atol is float32's.
        naive_err = _max_err(naive[name], exact[name])
        scale = float(np.abs(np.where(np.isfinite(exact[name]), exact[name], 0)).max(initial=0.0))
        atol_dtype = "float32" if name == "lse" else _out_dtype(dtype) if name == "out" else dtype
        bound = (2 if name in ("out", "lse") else 3) * naive_err + _atol(atol_dtype, scale)
        err = _max_err(value, exact[name])
        check[name] = {"max_abs_error": err, "naive_max_abs_error": naive_err, "tolerance": bound,
                       "passed": err <= bound}
    return {
        "version": flashattn.__version__,
        "device": device if device == "cpu" else "cuda:0",
        "device_reason": why,
        "problem": {"batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads": hq, "heads_kv": hkv, "head_dim": d,
                    "dtype": dtype, **({"out_dtype": _out_dtype(dtype)} if dtype in _FP8_MAX else {}),
                    "causal": args.causal},
        "repeats": args.repeats,
        "seed": args.seed,
        **passes,
        "check": check,
        "passed": all(c["passed"] for c in check.values()),
    }


def _print_run(r: dict) -> None:
    p = r["problem"]
    print(f"flashattn {r['version']} run (Python package)")
    print(f"  problem   batch {p['batch']}, seqlen_q {p['seqlen_q']}, seqlen_k {p['seqlen_k']}, heads {p['heads']} "
          f"(kv {p['heads_kv']}), head_dim {p['head_dim']}, {p['dtype']}"
          f"{' (out ' + p['out_dtype'] + ')' if 'out_dtype' in p else ''}{', causal' if p['causal'] else ''}")
    print(f"  device    {r['device']} ({r['device_reason']})")
    for name in ("forward", "backward"):
        if name in r:
            t = r[name]
            print(f"  {name:<9} {t['median_s'] * 1e3:.3f} ms median of {r['repeats']} "
                  f"(min {t['min_s'] * 1e3:.3f}, max {t['max_s'] * 1e3:.3f}), {t['tflops']:.4g} TFLOP/s")
    for name, c in r["check"].items():
        print(f"  {name:<9} max abs error {c['max_abs_error']:.3g} (tolerance {c['tolerance']:.3g}: 2-3x the "
              f"naive's {c['naive_max_abs_error']:.3g} + atol){'' if c['passed'] else '  FAIL'}")
    print("PASS: every result within tolerance of the float64 reference" if r["passed"] else
          "FAIL: results outside the tolerance of the float64 reference")


def _json_safe(x):
    """NaN and infinities (an error where the result had NaN) as null: JSON has no such numbers."""
    if isinstance(x, dict):
        return {key: _json_safe(value) for key, value in x.items()}
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashattn", description="flashattn (Python package): inspect the build, "
                                     "run one checked attention call")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,run}")
    info = sub.add_parser("info", help="version, CUDA backend, kernels, devices")
    info.add_argument("--json", action="store_true", help="one JSON object on stdout")
    r = sub.add_parser("run", help="time one attention call and check it against a float64 reference",
                       description="Times one attention call on random inputs and checks it against a float64 "
                                   "numpy reference (the whole problem: memory O(batch*heads*seqlen_q*seqlen_k)).")
    r.add_argument("--batch", type=_positive, default=1)
    r.add_argument("--seqlen-q", type=_positive, default=512)
    r.add_argument("--seqlen-k", type=_positive, default=None, help="default: --seqlen-q")
    r.add_argument("--heads", type=_positive, default=8)
    r.add_argument("--heads-kv", type=_positive, default=None, help="default: --heads; fewer = GQA / MQA")
    r.add_argument("--head-dim", type=_positive, default=64)
    r.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="default: float32 on the CPU, bfloat16 on CUDA; float8_*: FP8 q, k, v (descale 1) with a "
                        "bfloat16 out, the forward on the CPU")
    r.add_argument("--causal", action="store_true", help="causal mask, bottom-right aligned")
    r.add_argument("--backward", action="store_true", help="also time and check dq, dk, dv")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when this build, a GPU and PyTorch are there (and the dtype is 16-bit)")
    r.add_argument("--repeats", type=_positive, default=3, help="timed calls after one warm-up; the median is reported")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    r.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # usage errors: a message naming the argument, exit status 2
    if args.command == "info":
        facts = info_facts()
        print(json.dumps(facts, indent=2)) if args.json else _print_info(facts)
        return 0
    if args.heads_kv is not None and args.heads % args.heads_kv:
        parser.error(f"argument --heads-kv: {args.heads_kv} does not divide --heads {args.heads}")
    try:
        report = run(args)
    except (ValueError, TypeError, NotImplementedError, MemoryError) as e:
        print(f"flashattn: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(_json_safe(report), indent=2)) if args.json else _print_run(report)
    return 0 if report["passed"] else EXIT_CHECK_FAILED

"""The tolerance rule of docs/CONVENTIONS.md, shared by the numpy and PyTorch suites:
max|ours - ref| <= factor * max|naive - ref| + atol (factor 2 for outputs, 3 for gradients), the
same for the mean error, NaN never passes."""
from __future__ import annotations

import numpy as np


def f64(a):
    return np.asarray(a).astype(np.float64)


def atol_for(dtype, scale):
    """Accumulator rounding noise at the result's scale (float32's), plus for 16-bit results one
    ulp of the result: where the naive result is exact (one visible key, P = 1), any other
    rounding of P may land on the other side of a rounding boundary. tests/cpp's rule."""
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7}.get(np.dtype(dtype).name, 0.0)
    return (64 * 2.0**-23 + ulp) * max(scale, 1e-3)


def check_close(name, ours, exact, naive, factor, atol):
    """ours vs the float64 reference, within `factor` times the naive's error (+ atol);
    naive None (float64 inputs): within atol. -inf entries (lse of empty rows) must match."""
    ours, exact = f64(ours), f64(exact)
    assert ours.shape == exact.shape, f"{name}: shape {ours.shape} != {exact.shape}"
    assert not np.isnan(ours).any(), f"{name}: NaN"
    finite = np.isfinite(exact)
    assert np.array_equal(np.isfinite(ours), finite), f"{name}: non-finite entries differ from the reference"
    assert np.array_equal(ours[~finite], exact[~finite]), f"{name}: -inf entries differ"
    err = np.abs(ours[finite] - exact[finite])
    if err.size == 0:
        return
    if naive is None:
        assert err.max() <= atol, f"{name}: max error {err.max():.3g} > {atol:.3g}"
        return
    naive_err = np.abs(f64(naive)[finite] - exact[finite])
    bound = factor * naive_err.max() + atol
    assert err.max() <= bound, (f"{name}: max error {err.max():.4g} > {factor} * naive {naive_err.max():.4g}"
                                f" + {atol:.3g}")
    mean_bound = factor * naive_err.mean() + atol
    assert err.mean() <= mean_bound, (f"{name}: mean error {err.mean():.4g} > {factor} * naive "
                                      f"{naive_err.mean():.4g} + {atol:.3g}")


def max_abs(*arrays):
    return max([float(np.max(np.abs(a), initial=0.0)) for a in arrays] + [1e-30])



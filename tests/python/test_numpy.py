"""flashattn on numpy arrays (the CPU backend) against the float64 reference in reference.py.

Error budget (docs/CONVENTIONS.md): max|ours - ref| <= 2 * max|naive - ref| + atol for outputs
(3x for gradients), where `naive` is plain attention in the input dtype with float32 arithmetic;
the mean error obeys the same bound; NaN never passes; float64 inputs are compared at ~1e-10.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashattn
import reference as ref
from tolerance import atol_for, check_close, f64, max_abs

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float16, BF16, np.float32, np.float64]
DTYPE_IDS = ["fp16", "bf16", "fp32", "fp64"]
OUT_FACTOR, GRAD_FACTOR = 2.0, 3.0


# ----------------------------------------------------------------------------- helpers

def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def random_window(rng, sk):
    """A random (left, right) window; either side may be -1 (unbounded)."""
    left, right = rng.integers(-1, max(sk, 2), size=2)
    return int(left), int(right)


def mask_options(rng, mask, sk):
    if mask == "causal":
        return dict(causal=True)
    if mask == "local":
        return dict(window_size=random_window(rng, sk))
    return {}


def alibi(rng, shape):
    return (rng.random(shape) * 0.3).astype(np.float32)


def result_atol(dtype, scale):
    """The rule's atol at a result's scale: float64's rounding noise, else the float32
    accumulator's plus, for 16-bit results, one ulp (tolerance.atol_for). Without the ulp, a
    16-bit gradient whose naive twin happens to round close to the exact value fails on the final
    rounding alone (seen at head dim 1, where one ulp of out moves D = rowsum(dout * out))."""
    return 1e-10 * scale if np.dtype(dtype) == np.float64 else atol_for(dtype, scale)


def run_and_check(q, k, v, dout, *, grads=True, **opts):
    """Runs flashattn.forward (and backward) and checks out, lse (and dq, dk, dv) against the
    reference. Returns ours: (out, lse) or (out, lse, dq, dk, dv)."""
    out, lse = flashattn.forward(q, k, v, **opts)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[1], q.shape[0]) if opts.get("cu_seqlens_q") is not None else (
        q.shape[0], q.shape[2], q.shape[1])
    assert lse.dtype == np.float32 and lse.shape == lse_shape

    ref_out, ref_lse = ref.forward(q, k, v, **opts)
    fp64 = q.dtype == np.float64
    naive_out, naive_lse = (None, None) if fp64 else ref.naive_forward(q, k, v, **opts)
    check_close("out", out, ref_out, naive_out, OUT_FACTOR, result_atol(q.dtype, max_abs(ref_out)))
    # lse is float32 whatever the inputs: for float64 ones, float32's rounding is the budget.
    lse_rel = 2.0**-22 if fp64 else 1e-5
    finite_lse = ref_lse[np.isfinite(ref_lse)]
    check_close("lse", lse, ref_lse, naive_lse, OUT_FACTOR, lse_rel * max(1.0, max_abs(finite_lse)))
    if not grads:
        return out, lse

    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, **opts)
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert isinstance(g, np.ndarray) and g.dtype == q.dtype and g.shape == like.shape, name
    ref_grads = ref.backward(dout, q, k, v, **opts)
    naive_grads = (None,) * 3 if fp64 else ref.naive_backward(dout, q, k, v, **opts)
    # One scale for the three gradients: a gradient that is ~0 (dq with a single key) must not
    # get an atol of ~0 that float32 noise from the other terms could never meet.
    atol = result_atol(q.dtype, max_abs(*ref_grads))
    for name, g, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, naive_grads):
        check_close(name, g, r, n, GRAD_FACTOR, atol)
    return out, lse, dq, dk, dv


def dense_inputs(rng, b, sq, sk, hq, hkv, d, dtype):
    return (randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hkv, d), dtype),
            randn(rng, (b, sk, hkv, d), dtype), randn(rng, (b, sq, hq, d), dtype))


def cu_seqlens(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def varlen_problem(rng, dtype, hq=6, hkv=6, d=64, batch=5, pad=3):
    """Random lengths including a zero-length query sequence and a zero-length key sequence
    (whose query rows see no key), plus `pad` trailing rows that belong to no sequence."""
    lens_q = rng.integers(1, 150, size=batch)
    lens_k = rng.integers(1, 200, size=batch)
    lens_q[1] = 0
    lens_k[3] = 0
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    total_q, total_k = int(cu_q[-1]) + pad, int(cu_k[-1]) + pad
    q = randn(rng, (total_q, hq, d), dtype)
    k = randn(rng, (total_k, hkv, d), dtype)
    v = randn(rng, (total_k, hkv, d), dtype)
    dout = randn(rng, (total_q, hq, d), dtype)
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(lens_q.max()),
                max_seqlen_k=int(lens_k.max()))
    return q, k, v, dout, opts, lens_q, lens_k


# ----------------------------------------------------------------------------- the reference itself

def test_reference_gradients_match_finite_differences(rng):
    # The oracle's backward is hand-written: check it against central differences of
    # sum(dout * out) in float64, with every score option and GQA at once.
    b, sq, sk, hq, hkv, d = 1, 5, 7, 4, 2, 8
    q, k, v, dout = dense_inputs(rng, b, sq, sk, hq, hkv, d, np.float64)
    opts = dict(softcap=3.0, alibi_slopes=alibi(rng, (b, hq)), window_size=(3, 1), softmax_scale=0.7)
    grads = ref.backward(dout, q, k, v, **opts)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            plus = np.sum(dout * ref.forward(q, k, v, **opts)[0])
            x[idx] = old - eps
            minus = np.sum(dout * ref.forward(q, k, v, **opts)[0])
            x[idx] = old
            fd[idx] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


def test_reference_empty_rows():
    # Rows that see no key: out 0, lse -inf, no NaN, in both flavours.
    q, k, v = (np.ones((1, 4, 1, 8), np.float32), np.ones((1, 2, 1, 8), np.float32),
               np.ones((1, 2, 1, 8), np.float32))
    for fwd in (ref.forward, ref.naive_forward):
        out, lse = fwd(q, k, v, causal=True)
        assert np.all(out[0, :2] == 0) and np.all(np.isneginf(lse[0, 0, :2]))
        assert np.all(np.isfinite(lse[0, 0, 2:]))


# ----------------------------------------------------------------------------- dense matrix

# (seqlen_q, seqlen_k, head_dim): the test matrix's shapes (without 4224), a spread of head dims.
SHAPES = [(1, 1, 32), (1, 3, 40), (2, 1, 64), (1, 147, 59), (1, 239, 96), (239, 1, 128), (3, 799, 111),
          (113, 203, 40), (127, 513, 59), (128, 217, 96), (512, 256, 64)]


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sq,sk,d", SHAPES, ids=[f"{sq}x{sk}-d{d}" for sq, sk, d in SHAPES])
def test_dense(rng, sq, sk, d, dtype, mask):
    b = 4 if sq * sk < 20_000 else 1  # the test matrix's batch sizes 1 and 4
    q, k, v, dout = dense_inputs(rng, b, sq, sk, 6, 6, d, dtype)
    run_and_check(q, k, v, dout, **mask_options(rng, mask, sk))


@pytest.mark.parametrize("sq,sk", [(1023, 1024), (1024, 1023), (2048, 2048)])
def test_dense_long(rng, sq, sk):
    # The long shapes, causal (the bottom-right alignment matters when sq != sk), in bf16.
    q, k, v, dout = dense_inputs(rng, 1, sq, sk, 2, 1, 64, BF16)
    run_and_check(q, k, v, dout, causal=True)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [1, 8, 32, 40, 59, 64, 96, 111, 112, 128, 160, 192, 224, 256])
def test_head_dims(rng, d, dtype):
    q, k, v, dout = dense_inputs(rng, 1, 113, 203, 2, 2, d, dtype)
    run_and_check(q, k, v, dout, causal=True)


FEATURES = {
    "softcap": lambda rng, b, h: dict(softcap=50.0),
    "alibi": lambda rng, b, h: dict(alibi_slopes=alibi(rng, (h,))),
    "alibi-batch": lambda rng, b, h: dict(alibi_slopes=alibi(rng, (b, h))),
    "softcap-alibi-causal": lambda rng, b, h: dict(softcap=50.0, alibi_slopes=alibi(rng, (h,)), causal=True),
    # A small softcap so that tanh saturates and its derivative matters.
    "softcap2-local-alibi": lambda rng, b, h: dict(softcap=2.0, window_size=(40, 7),
                                                   alibi_slopes=alibi(rng, (b, h))),
    "scale": lambda rng, b, h: dict(softmax_scale=0.3, causal=True),
}


@pytest.mark.parametrize("sq,sk", [(113, 203), (239, 1), (1, 147)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_score_options(rng, feature, dtype, sq, sk):
    b, h = 2, 6
    q, k, v, dout = dense_inputs(rng, b, sq, sk, h, h, 64, dtype)
    run_and_check(q, k, v, dout, **FEATURES[feature](rng, b, h))


def test_strided_alibi_slopes(rng):
    # Slopes may be a strided view too ([batch, heads] with a head stride of 2).
    q, k, v, dout = dense_inputs(rng, 2, 60, 90, 6, 6, 32, np.float32)
    slopes = alibi(rng, (2, 6, 2))[..., 0]
    assert not slopes.flags.c_contiguous
    run_and_check(q, k, v, dout, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=DTYPE_IDS[:3])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (6, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (3, 799)])
def test_gqa(rng, sq, sk, hq, hkv, dtype, mask):
    q, k, v, dout = dense_inputs(rng, 2, sq, sk, hq, hkv, 96, dtype)
    run_and_check(q, k, v, dout, **mask_options(rng, mask, sk))


def test_gqa_equals_mha_with_repeated_kv(rng):
    # GQA must be MHA over repeated K/V, with dK/dV summed over each group.
    hq, hkv = 6, 2
    q, k, v, dout = dense_inputs(rng, 2, 77, 130, hq, hkv, 64, np.float32)
    opts = dict(causal=True, softcap=50.0)
    out, lse = flashattn.forward(q, k, v, **opts)
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, **opts)
    k_rep, v_rep = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)
    out_m, lse_m = flashattn.forward(q, k_rep, v_rep, **opts)
    dq_m, dk_m, dv_m = flashattn.backward(dout, q, k_rep, v_rep, out_m, lse_m, **opts)
    np.testing.assert_allclose(out, out_m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse_m, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dq, dq_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk, dk_m.reshape(dk.shape[:2] + (hkv, -1, 64)).sum(3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dv, dv_m.reshape(dv.shape[:2] + (hkv, -1, 64)).sum(3), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- varlen

VARLEN_EXTRAS = {
    "plain": lambda rng, batch, h, lens_k: {},
    "seqused_k": lambda rng, batch, h, lens_k: dict(
        seqused_k=rng.integers(0, lens_k + 1).astype(np.int32)),
    "softcap-alibi-batch": lambda rng, batch, h, lens_k: dict(softcap=50.0, alibi_slopes=alibi(rng, (batch, h))),
    "alibi-seqused-k": lambda rng, batch, h, lens_k: dict(
        alibi_slopes=alibi(rng, (h,)), seqused_k=rng.integers(0, lens_k + 1).astype(np.int32)),
}


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("extra", list(VARLEN_EXTRAS))
def test_varlen(rng, extra, dtype, mask):
    q, k, v, dout, opts, lens_q, lens_k = varlen_problem(rng, dtype, hq=6, hkv=2, d=59)
    opts.update(mask_options(rng, mask, int(lens_k.max())))
    opts.update(VARLEN_EXTRAS[extra](rng, len(lens_q), q.shape[1], lens_k))
    run_and_check(q, k, v, dout, **opts)


def test_varlen_without_max_seqlen(rng):
    # max_seqlen_q / max_seqlen_k are optional.
    q, k, v, dout, opts, _, _ = varlen_problem(rng, np.float16)
    del opts["max_seqlen_q"], opts["max_seqlen_k"]
    run_and_check(q, k, v, dout, causal=True, **opts)


@pytest.mark.parametrize("b,sq,sk", [(2, 0, 5), (2, 5, 0), (0, 5, 5), (1, 0, 0)])
def test_dense_zero_length(rng, b, sq, sk):
    # Zero-length sequences are valid no-ops (docs/CONVENTIONS.md): rows that see no key give
    # out 0, lse -inf, dq 0; keys that no query sees give dk = dv = 0. (numpy gives empty
    # arrays all-zero strides: a stride check must not reject them.)
    q, k, v, dout = dense_inputs(rng, b, sq, sk, 4, 2, 32, np.float16)
    out, lse, dq, dk, dv = run_and_check(q, k, v, dout, causal=True)
    assert np.all(f64(out) == 0) and np.all(np.isneginf(lse)) and np.all(f64(dq) == 0)
    assert np.all(f64(dk) == 0) and np.all(f64(dv) == 0)


def test_varlen_all_sequences_empty(rng):
    # total_q = 0: every query sequence has length 0 (q is an empty array).
    q = randn(rng, (0, 4, 32), np.float16)
    k, v = randn(rng, (9, 4, 32), np.float16), randn(rng, (9, 4, 32), np.float16)
    opts = dict(cu_seqlens_q=np.array([0, 0, 0], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32),
                max_seqlen_q=0, max_seqlen_k=5)
    out, lse, dq, dk, dv = run_and_check(q, k, v, q.copy(), **opts)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)
    assert np.all(f64(dk) == 0) and np.all(f64(dv) == 0)


def test_varlen_equals_dense_per_sequence(rng):
    # Varlen is a batch of independent problems: each sequence equals its own dense call.
    q, k, v, dout, opts, lens_q, lens_k = varlen_problem(rng, np.float32, hq=6, hkv=3, d=64, pad=0)
    attn = dict(causal=True, alibi_slopes=alibi(rng, (6,)))
    out, lse = flashattn.forward(q, k, v, **opts, **attn)
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, **opts, **attn)
    cu_q, cu_k = opts["cu_seqlens_q"], opts["cu_seqlens_k"]
    for i in range(len(lens_q)):
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue  # zero-length dense problems have their own test
        sq_, sk_ = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qi, ki, vi, doi = q[None, sq_], k[None, sk_], v[None, sk_], dout[None, sq_]
        o_i, l_i = flashattn.forward(qi, ki, vi, **attn)
        dq_i, dk_i, dv_i = flashattn.backward(doi, qi, ki, vi, o_i, l_i, **attn)
        np.testing.assert_allclose(out[sq_], o_i[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, sq_], l_i[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dq[sq_], dq_i[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dk[sk_], dk_i[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dv[sk_], dv_i[0], rtol=1e-4, atol=1e-5)


def test_varlen_rows_outside_sequences(rng):
    # Zero-length key sequences, keys past seqused_k and trailing padding rows: defined zeros
    # (and lse -inf), never uninitialised memory.
    q, k, v, dout, opts, lens_q, lens_k = varlen_problem(rng, np.float32, pad=5)
    used = rng.integers(0, lens_k + 1).astype(np.int32)
    used[0] = 0
    opts["seqused_k"] = used
    out, lse, dq, dk, dv = run_and_check(q, k, v, dout, **opts)
    cu_q, cu_k = opts["cu_seqlens_q"], opts["cu_seqlens_k"]
    assert np.all(out[cu_q[-1]:] == 0) and np.all(np.isneginf(lse[:, cu_q[-1]:]))
    assert np.all(dq[cu_q[-1]:] == 0) and np.all(dk[cu_k[-1]:] == 0) and np.all(dv[cu_k[-1]:] == 0)
    for i in (0, 3):  # no key seen: seqused_k 0, and the zero-length key sequence
        rows = slice(cu_q[i], cu_q[i + 1])
        assert np.all(out[rows] == 0) and np.all(np.isneginf(lse[:, rows])) and np.all(dq[rows] == 0)
    for i in range(len(lens_k)):
        unused = slice(cu_k[i] + used[i], cu_k[i + 1])
        assert np.all(dk[unused] == 0) and np.all(dv[unused] == 0)


# ----------------------------------------------------------------------------- strides

def test_packed_qkv_and_strided_dout(rng):
    # q, k, v as slices of one packed [b, s, 3, h, d] array, dout as dout[:, ::2], lse transposed.
    b, s, h, d = 2, 97, 6, 40
    qkv = randn(rng, (b, s, 3, h, d), np.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = randn(rng, (b, 2 * s, h, d), np.float16)[:, ::2]
    assert not q.flags.c_contiguous and not dout.flags.c_contiguous
    out, lse, *_ = run_and_check(q, k, v, dout, causal=True)
    # The backward with strided out / lse views gives the contiguous result.
    out_view = np.zeros((b, s, h, 2 * d), out.dtype)[..., :d]
    out_view[...] = out
    lse_view = np.ascontiguousarray(lse.transpose(0, 2, 1)).transpose(0, 2, 1)
    grads = flashattn.backward(dout, q, k, v, out, lse, causal=True)
    grads_strided = flashattn.backward(dout, q, k, v, out_view, lse_view, causal=True)
    for g, gs in zip(grads, grads_strided):
        np.testing.assert_array_equal(g, gs)


@pytest.mark.parametrize("dtype", [BF16, np.float64], ids=["bf16", "fp64"])
def test_bhsd_transposed_views(rng, dtype):
    # Arrays stored [b, h, s, d] and viewed as [b, s, h, d] (the SDPA layout).
    def view(shape):
        b, s, h, d = shape
        return randn(rng, (b, h, s, d), dtype).transpose(0, 2, 1, 3)

    q, k, v, dout = view((2, 113, 6, 64)), view((2, 203, 2, 64)), view((2, 203, 2, 64)), view((2, 113, 6, 64))
    run_and_check(q, k, v, dout, window_size=(50, 20), softcap=50.0)


def test_varlen_packed_views(rng):
    # Varlen q, k, v sliced from one packed [total, 3, h, d] array, dout with a row stride of 2.
    lens = np.array([33, 0, 71, 5], np.int64)
    cu = cu_seqlens(lens)
    total, h, d = int(cu[-1]), 4, 96
    qkv = randn(rng, (total, 3, h, d), np.float32)
    dout = randn(rng, (2 * total, h, d), np.float32)[::2]
    opts = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=71, max_seqlen_k=71, causal=True)
    run_and_check(qkv[:, 0], qkv[:, 1], qkv[:, 2], dout, **opts)


def test_negative_strides(rng):
    # Reversed views: computed correctly, or refused with an error that names the argument;
    # never read out of bounds.
    q, k, v, dout = dense_inputs(rng, 2, 50, 70, 4, 2, 64, np.float32)
    try:
        flashattn.forward(q[:, ::-1], k[:, ::-1], v[::-1, ::-1], causal=True)
    except ValueError as e:
        assert str(e).startswith(("q:", "k:", "v:")), e
        return
    run_and_check(q[:, ::-1], k[:, ::-1], v[::-1, ::-1], dout[:, ::-1, ::-1], causal=True)


# ----------------------------------------------------------------------------- properties

def test_key_permutation_invariance(rng):
    # Without position-dependent terms the keys are a set: permuting k and v together leaves
    # out and lse unchanged and permutes dk, dv the same way.
    q, k, v, dout = dense_inputs(rng, 2, 70, 300, 6, 2, 64, np.float32)
    perm = rng.permutation(300)
    res = run_and_check(q, k, v, dout, softcap=50.0)
    res_p = run_and_check(q, k[:, perm], v[:, perm], dout, softcap=50.0)
    scale_o, scale_g = max_abs(res[0]), max_abs(*res[2:])
    np.testing.assert_allclose(res_p[0], res[0], atol=1e-5 * scale_o, rtol=0)
    np.testing.assert_allclose(res_p[1], res[1], atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(res_p[2], res[2], atol=1e-5 * scale_g, rtol=0)
    np.testing.assert_allclose(res_p[3], res[3][:, perm], atol=1e-5 * scale_g, rtol=0)
    np.testing.assert_allclose(res_p[4], res[4][:, perm], atol=1e-5 * scale_g, rtol=0)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=DTYPE_IDS[:3])
def test_lse_normalises_probabilities(rng, dtype):
    # Our lse must normalise the exact scores: every visible row of exp(S - lse) sums to 1.
    q, k, v, _ = dense_inputs(rng, 2, 100, 180, 6, 3, 64, dtype)
    opts = dict(window_size=(30, 10), alibi_slopes=alibi(rng, (6,)), softcap=50.0)
    _, lse = flashattn.forward(q, k, v, **opts)
    s = ref.scores(q, k, **opts)
    finite = np.isfinite(lse)
    assert np.array_equal(finite, np.isfinite(s).any(-1))
    row_sums = np.exp(s - f64(lse)[..., None]).sum(-1)[finite]
    np.testing.assert_allclose(row_sums, 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(5, 10)),
                                  dict(window_size=(-1, 0), softcap=50.0, alibi_slopes=np.full(6, 0.2, np.float32))],
                         ids=["causal", "window", "softcap-alibi"])
def test_empty_rows(rng, dtype, opts):
    # sq > sk with bottom-right alignment: the first rows see no key (0 / -inf / zero dq),
    # the others match the reference, and nothing is NaN.
    sq, sk = 150, 40
    q, k, v, dout = dense_inputs(rng, 2, sq, sk, 6, 6, 64, dtype)
    out, lse, dq, dk, dv = run_and_check(q, k, v, dout, **opts)
    right = 0 if opts.get("causal") else opts["window_size"][1]
    empty = sq - sk - right  # rows i with i + sk - sq + right < 0
    assert np.all(f64(out[:, :empty]) == 0) and np.all(np.isneginf(lse[:, :, :empty]))
    assert np.all(f64(dq[:, :empty]) == 0)
    assert np.all(np.isfinite(lse[:, :, empty:]))


@pytest.mark.parametrize("deterministic", [False, True])
def test_bitwise_reproducible(rng, deterministic):
    # Forward always, and the CPU backward as well, are bitwise reproducible.
    q, k, v, dout = dense_inputs(rng, 2, 129, 257, 6, 2, 64, np.float16)
    opts = dict(causal=True, alibi_slopes=alibi(rng, (6,)))
    first = flashattn.forward(q, k, v, **opts)
    first_g = flashattn.backward(dout, q, k, v, *first, deterministic=deterministic, **opts)
    for _ in range(3):
        again = flashattn.forward(q, k, v, **opts)
        again_g = flashattn.backward(dout, q, k, v, *again, deterministic=deterministic, **opts)
        for a, b in zip(first + first_g, again + again_g):
            np.testing.assert_array_equal(a, b)


def test_inputs_untouched(rng):
    # The library writes only its outputs.
    q, k, v, dout = dense_inputs(rng, 1, 64, 64, 2, 2, 32, np.float32)
    copies = [a.copy() for a in (q, k, v, dout)]
    out, lse = flashattn.forward(q, k, v, causal=True)
    out_c, lse_c = out.copy(), lse.copy()
    flashattn.backward(dout, q, k, v, out, lse, causal=True)
    for a, c in zip((q, k, v, dout, out, lse), copies + [out_c, lse_c]):
        np.testing.assert_array_equal(a, c)


# ----------------------------------------------------------------------------- dropout

P_DROP = 0.17


def test_dropout_seeds(rng):
    # Same seed: bitwise identical; another seed: a different mask; p = 0: no dropout at all.
    q, k, v, _ = dense_inputs(rng, 2, 64, 96, 6, 2, 64, np.float16)
    a, lse_a = flashattn.forward(q, k, v, dropout_p=P_DROP, seed=1234)
    b, lse_b = flashattn.forward(q, k, v, dropout_p=P_DROP, seed=1234)
    c, _ = flashattn.forward(q, k, v, dropout_p=P_DROP, seed=1235)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(lse_a, lse_b)
    assert not np.array_equal(a, c)
    plain, plain_lse = flashattn.forward(q, k, v)
    zero, zero_lse = flashattn.forward(q, k, v, dropout_p=0.0, seed=1234)
    np.testing.assert_array_equal(zero, plain)
    np.testing.assert_array_equal(zero_lse, plain_lse)
    # The lse is the softmax's, dropout or not.
    np.testing.assert_array_equal(lse_a, plain_lse)


def test_dropout_unbiased_over_seeds(rng):
    # Kept probabilities are scaled by 1 / (1 - p): the mean over many seeds tends to the
    # output without dropout (error ~ 1/sqrt(n) of one draw's).
    q, k, v, _ = dense_inputs(rng, 1, 16, 32, 2, 2, 32, np.float32)
    plain, _ = flashattn.forward(q, k, v)
    draws = np.stack([flashattn.forward(q, k, v, dropout_p=P_DROP, seed=s)[0] for s in range(300)])
    one_draw_err = np.abs(draws - plain).mean()
    mean_err = np.abs(draws.mean(0) - plain).mean()
    assert mean_err < 0.2 * one_draw_err, (mean_err, one_draw_err)


def keep_mask(q, k, seed, causal):
    """The keep-mask flashattn draws for (q, k, seed), read back through v = identity: then
    out[b, i, h, j] = P[b, h, i, j] * keep / (1 - p) > 0 exactly where key j is kept."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    assert d == sk, "the identity trick needs head_dim == seqlen_k"
    eye = np.broadcast_to(np.eye(sk, dtype=q.dtype)[None, :, None, :], (b, sk, hkv, d)).copy()
    out, _ = flashattn.forward(q, k, eye, dropout_p=P_DROP, seed=seed, causal=causal)
    keep = f64(out).transpose(0, 2, 1, 3) > 0  # [b, hq, sq, sk]
    return keep | ~ref.visible(sq, sk, causal)  # hidden keys: P = 0 either way


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["fp16", "fp64"])
def test_dropout_matches_reference_with_its_mask(rng, dtype, causal):
    # Read the keep-mask back, then check forward and backward with that seed against the
    # reference applying the same mask: the backward must use the forward's mask.
    b, sq, sk, hq, hkv = 2, 40, 64, 4, 2
    q, k, v, dout = dense_inputs(rng, b, sq, sk, hq, hkv, sk, dtype)
    seed = int(rng.integers(0, 2**62))
    keep = keep_mask(q, k, seed, causal)
    visible = np.broadcast_to(ref.visible(sq, sk, causal), keep.shape)
    kept = keep[visible].mean()
    assert abs(kept - (1 - P_DROP)) < 0.05, kept

    opts = dict(dropout_p=P_DROP, seed=seed, causal=causal)
    # The library holds dropout_p as a float32: its kept values are scaled by 1 / (1 - float32(p)).
    ref_opts = dict(dropout_p=float(np.float32(P_DROP)), dropout_mask=keep, causal=causal)
    out, lse = flashattn.forward(q, k, v, **opts)
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, **opts)
    ref_out, _ = ref.forward(q, k, v, **ref_opts)
    ref_grads = ref.backward(dout, q, k, v, **ref_opts)
    if dtype == np.float64:
        naive_out, naive_grads = None, (None,) * 3
    else:
        naive_out, _ = ref.naive_forward(q, k, v, **ref_opts)
        naive_grads = ref.naive_backward(dout, q, k, v, **ref_opts)
    check_close("out", out, ref_out, naive_out, OUT_FACTOR, result_atol(dtype, max_abs(ref_out)))
    atol = result_atol(dtype, max_abs(*ref_grads))
    for name, g, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, naive_grads):
        check_close(name, g, r, n, GRAD_FACTOR, atol)


def test_dropout_backward_seed(rng):
    # out = P_drop @ v is linear in v and dv = P_drop^T @ dout, so dout^T out = dv^T v (per batch
    # and kv head, summed over its query heads) exactly when the backward drops what the forward
    # dropped; another seed breaks it. The same seed is bitwise repeatable.
    b, sq, sk, hq, hkv, d = 2, 50, 70, 6, 3, 32
    q, k, v, dout = dense_inputs(rng, b, sq, sk, hq, hkv, d, np.float64)
    out, lse = flashattn.forward(q, k, v, dropout_p=P_DROP, seed=7)
    g7 = flashattn.backward(dout, q, k, v, out, lse, dropout_p=P_DROP, seed=7)
    g7b = flashattn.backward(dout, q, k, v, out, lse, dropout_p=P_DROP, seed=7, deterministic=True)
    g8 = flashattn.backward(dout, q, k, v, out, lse, dropout_p=P_DROP, seed=8)
    for a, b_ in zip(g7, g7b):
        np.testing.assert_array_equal(a, b_)
    assert not np.array_equal(g7[2], g8[2])

    grouped = lambda x: x.reshape(b, sq, hkv, hq // hkv, d)  # noqa: E731
    forward_side = np.einsum("bikgc,bikge->bkce", grouped(dout), grouped(out))
    scale = np.abs(forward_side).max()
    for dv, consistent in ((g7[2], True), (g8[2], False)):
        mismatch = np.abs(np.einsum("bjkc,bjke->bkce", dv, v) - forward_side).max()
        assert (mismatch <= 1e-10 * scale) if consistent else (mismatch > 1e-3 * scale), mismatch / scale


# ----------------------------------------------------------------------------- errors

def _dense_args(rng, dtype=np.float16, b=1, sq=8, sk=8, hq=4, hkv=4, d=64):
    return dense_inputs(rng, b, sq, sk, hq, hkv, d, dtype)[:3]


def _forward_with(rng, **changes):
    """forward on a small valid problem with some arguments replaced."""
    q, k, v = _dense_args(rng)
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return flashattn.forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _backward_with(rng, **changes):
    q, k, v, dout = dense_inputs(rng, 1, 8, 8, 4, 4, 64, np.float16)
    out, lse = flashattn.forward(q, k, v)
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    args.update(changes)
    arrays = [args.pop(n) for n in ("dout", "q", "k", "v", "out", "lse")]
    return flashattn.backward(*arrays, **args)


def _varlen_with(rng, **changes):
    q = randn(rng, (10, 4, 32), np.float16)
    k = randn(rng, (12, 4, 32), np.float16)
    args = dict(cu_seqlens_q=np.array([0, 4, 10], np.int32), cu_seqlens_k=np.array([0, 5, 12], np.int32),
                max_seqlen_q=10, max_seqlen_k=12)
    args.update(changes)
    return flashattn.forward(q, k, k.copy(), **args)


h16 = np.float16
ERRORS = {
    # name: (call(rng), exception, regex the message must match: the argument's name)
    "k-head_dim": (lambda r: _forward_with(r, k=randn(r, (1, 8, 4, 72), h16), v=randn(r, (1, 8, 4, 72), h16)),
                   ValueError, r"k: head_dim 72 != q head_dim 64"),
    "v-shape": (lambda r: _forward_with(r, v=randn(r, (1, 9, 4, 64), h16)), ValueError, r"\bv\b"),
    "k-batch": (lambda r: _forward_with(r, k=randn(r, (2, 8, 4, 64), h16), v=randn(r, (2, 8, 4, 64), h16)),
                ValueError, r"\bk\b.*batch"),
    "k-dtype": (lambda r: _forward_with(r, k=randn(r, (1, 8, 4, 64), np.float32)), TypeError, r"\bk\b.*dtype"),
    "v-bf16-vs-fp16": (lambda r: _forward_with(r, v=randn(r, (1, 8, 4, 64), BF16)), TypeError, r"\bv\b.*dtype"),
    "q-int32": (lambda r: _forward_with(r, q=np.ones((1, 8, 4, 64), np.int32)), TypeError, r"\bq\b"),
    # uint16 is no float type, even though bfloat16 crosses into the extension as uint16 views.
    "uint16": (lambda r: _forward_with(r, q=np.ones((1, 8, 4, 64), np.uint16), k=np.ones((1, 8, 4, 64), np.uint16),
                                       v=np.ones((1, 8, 4, 64), np.uint16)), TypeError, r"\bq\b"),
    "q-none": (lambda r: _forward_with(r, q=None), TypeError, r"\bq\b"),
    "q-complex": (lambda r: _forward_with(r, q=np.ones((1, 8, 4, 64), np.complex64)), TypeError, r"\bq\b"),
    "heads-not-divisible": (lambda r: _forward_with(r, q=randn(r, (1, 8, 6, 64), h16)), ValueError, r"heads"),
    "q-ndim": (lambda r: _forward_with(r, q=randn(r, (8, 4, 64), h16)), ValueError, r"\bq\b"),
    "head_dim-577": (lambda r: _forward_with(r, q=randn(r, (1, 8, 4, 577), h16), k=randn(r, (1, 8, 4, 577), h16),
                                             v=randn(r, (1, 8, 4, 577), h16)), ValueError, r"head_dim"),
    # Strided inputs are copied (test_compat.py); outputs are the caller's memory.
    "head_dim-stride": (lambda r: _forward_with(r, out=randn(r, (1, 8, 4, 128), h16)[..., ::2]),
                        ValueError, r"out: head_dim stride"),
    "window-left": (lambda r: _forward_with(r, window_size=(-2, 0)), ValueError, r"window_left"),
    "window-right": (lambda r: _forward_with(r, window_size=(0, -7)), ValueError, r"window_right"),
    "window-not-a-pair": (lambda r: _forward_with(r, window_size=(1, 2, 3)), ValueError, r"window_size"),
    "window-junk": (lambda r: _forward_with(r, window_size="left"), ValueError, r"window_size"),
    "causal-with-right-window": (lambda r: _forward_with(r, causal=True, window_size=(-1, 4)),
                                 ValueError, r"window_right"),
    "softcap-negative": (lambda r: _forward_with(r, softcap=-1.0), ValueError, r"softcap"),
    "softmax_scale-nan": (lambda r: _forward_with(r, softmax_scale=float("nan")), ValueError, r"softmax_scale"),
    "dropout-1": (lambda r: _forward_with(r, dropout_p=1.0, seed=1), ValueError, r"dropout_p"),
    "dropout-negative": (lambda r: _forward_with(r, dropout_p=-0.1, seed=1), ValueError, r"dropout_p"),
    "alibi-heads": (lambda r: _forward_with(r, alibi_slopes=np.ones(5, np.float32)), ValueError, r"alibi_slopes"),
    "alibi-batch": (lambda r: _forward_with(r, alibi_slopes=np.ones((3, 4), np.float32)),
                    ValueError, r"alibi_slopes"),
    "alibi-float64": (lambda r: _forward_with(r, alibi_slopes=np.ones(4, np.float64)), TypeError, r"alibi_slopes"),
    "cu_seqlens-decreasing": (lambda r: _varlen_with(r, cu_seqlens_q=np.array([0, 6, 4], np.int32)),
                              ValueError, r"cu_seqlens_q"),
    "cu_seqlens-past-end": (lambda r: _varlen_with(r, cu_seqlens_k=np.array([0, 5, 13], np.int32)),
                            ValueError, r"cu_seqlens_k"),
    "cu_seqlens-int64": (lambda r: _varlen_with(r, cu_seqlens_q=np.array([0, 4, 10], np.int64)),
                         TypeError, r"cu_seqlens_q"),
    "cu_seqlens-lengths-differ": (lambda r: _varlen_with(r, cu_seqlens_k=np.array([0, 12], np.int32)),
                                  ValueError, r"cu_seqlens"),
    "cu_seqlens_k-missing": (lambda r: _varlen_with(r, cu_seqlens_k=None), ValueError, r"cu_seqlens_k"),
    "seqused_k-too-long": (lambda r: _varlen_with(r, seqused_k=np.array([6, 1], np.int32)),
                           ValueError, r"seqused_k"),
    "max_seqlen_q-too-small": (lambda r: _varlen_with(r, max_seqlen_q=3), ValueError, r"max_seqlen_q"),
    "lse-shape": (lambda r: _backward_with(r, lse=np.zeros((1, 4, 9), np.float32)), ValueError, r"\blse\b"),
    "lse-dtype": (lambda r: _backward_with(r, lse=np.zeros((1, 4, 8), np.float16)), TypeError, r"\blse\b"),
    "dout-shape": (lambda r: _backward_with(r, dout=randn(r, (1, 7, 4, 64), h16)), ValueError, r"\bdout\b"),
    "out-dtype": (lambda r: _backward_with(r, out=randn(r, (1, 8, 4, 64), np.float32)), TypeError, r"\bout\b"),
    "dropout-backward-without-seed": (lambda r: _backward_with(r, dropout_p=0.1), ValueError, r"seed"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_invalid_arguments(rng, case):
    call, exc, pattern = ERRORS[case]
    with pytest.raises(exc, match=pattern):
        call(rng)


def test_still_works_after_errors(rng):
    # A failed call leaves no state behind (and did not crash the interpreter). Which error each
    # call raises is test_invalid_arguments' business.
    for call, _, _ in ERRORS.values():
        try:
            call(rng)
        except (ValueError, TypeError):
            pass
    q, k, v, dout = dense_inputs(rng, 1, 33, 65, 4, 2, 64, np.float16)
    run_and_check(q, k, v, dout, causal=True)


# ----------------------------------------------------------------------------- flash_attn-compatible API

@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_flash_attn_func(rng, dtype):
    q, k, v, _ = dense_inputs(rng, 2, 113, 203, 6, 2, 64, dtype)
    opts = dict(softmax_scale=0.2, causal=True, window_size=(60, -1), softcap=50.0,
                alibi_slopes=alibi(rng, (2, 6)))
    out = flashattn.flash_attn_func(q, k, v, **opts)
    expect, expect_lse = flashattn.forward(q, k, v, **opts)
    np.testing.assert_array_equal(out, expect)
    out2, lse, probs = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    np.testing.assert_array_equal(out2, expect)
    np.testing.assert_array_equal(lse, expect_lse)
    assert probs is None
    # Positional arguments in flash_attn's order, with its defaults, against the reference.
    out3 = flashattn.flash_attn_func(q, k, v, 0.0, None, False)
    run_and_check(q, k, v, None, grads=False)
    np.testing.assert_array_equal(out3, flashattn.forward(q, k, v)[0])


def test_flash_attn_qkvpacked_func(rng):
    qkv = randn(rng, (2, 97, 3, 6, 64), np.float16)
    out = flashattn.flash_attn_qkvpacked_func(qkv, causal=True, softcap=50.0)
    expect, _ = flashattn.forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, softcap=50.0)
    np.testing.assert_array_equal(out, expect)
    check_close("out", out, ref.forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, softcap=50.0)[0],
                ref.naive_forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, softcap=50.0)[0],
                OUT_FACTOR, 1e-5 * max_abs(out))


def test_flash_attn_kvpacked_func(rng):
    q = randn(rng, (2, 113, 6, 64), BF16)
    kv = randn(rng, (2, 203, 2, 2, 64), BF16)
    out, lse, probs = flashattn.flash_attn_kvpacked_func(q, kv, window_size=(30, 30), return_attn_probs=True)
    expect, expect_lse = flashattn.forward(q, kv[:, :, 0], kv[:, :, 1], window_size=(30, 30))
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(lse, expect_lse)
    assert probs is None


def test_flash_attn_varlen_func(rng):
    q, k, v, _, opts, _, _ = varlen_problem(rng, np.float16, hq=6, hkv=2, d=64)
    slopes = alibi(rng, (len(opts["cu_seqlens_q"]) - 1, 6))
    out = flashattn.flash_attn_varlen_func(q, k, v, opts["cu_seqlens_q"], opts["cu_seqlens_k"],
                                           opts["max_seqlen_q"], opts["max_seqlen_k"], causal=True,
                                           alibi_slopes=slopes)
    expect, _ = flashattn.forward(q, k, v, causal=True, alibi_slopes=slopes, **opts)
    np.testing.assert_array_equal(out, expect)
    run_and_check(q, k, v, None, grads=False, causal=True, alibi_slopes=slopes, **opts)


def test_flash_attn_varlen_packed_funcs(rng):
    # The packed varlen layouts read q / k / v in place, as views of one buffer.
    lengths = [5, 0, 17, 9]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    qkv = randn(rng, (int(cu[-1]), 3, 4, 32), np.float16)
    out = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    expect, _ = flashattn.forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    np.testing.assert_array_equal(out, expect)
    out_kv, lse, probs = flashattn.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, max(lengths),
                                                                   max(lengths), causal=True, return_attn_probs=True)
    np.testing.assert_array_equal(out_kv, expect)
    assert lse.shape == (4, int(cu[-1])) and probs is None
    with pytest.raises(ValueError, match="qkv: expected shape"):
        flashattn.flash_attn_varlen_qkvpacked_func(qkv[:, :2], cu, max(lengths))

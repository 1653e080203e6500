"""Attention written from the math, for the numpy tests: explicit scores S and probabilities P.

Two flavours of the same code:
- `forward` / `backward`: the float64 oracle (docs/CONVENTIONS.md, "Testing"). Inputs arrive already
  rounded to the tested dtype; everything after that is float64.
- `naive_forward` / `naive_backward`: plain attention "in the input dtype", as a framework would
  compute it on a GPU: float32 arithmetic (float32 GEMM accumulation), P and dS rounded to the
  input dtype before the GEMMs that consume them (as tensor cores see them), results rounded to
  the input dtype. Its distance to the oracle sets the error budget of the library under test
  (the same naive as the C++ suites', tools/oracle/naive_attention.hpp).

Both take the keyword options of `flashattn.forward` (cu_seqlens_*, seqused_k, softmax_scale,
causal, window_size, softcap, alibi_slopes; max_seqlen_* are accepted and ignored). Dropout is
Philox-based and not reproducible here; a known keep-mask can be passed as `dropout_mask`
(bool [b, hq, sq, sk], dense only) together with `dropout_p`.
"""
from __future__ import annotations

import numpy as np

F64 = np.float64
F32 = np.float32


def visible(sq, sk, causal=False, window_size=(-1, -1)):
    """bool [sq, sk]: query row i sees key j (masks align bottom-right; -1 = unbounded side)."""
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq  # the key on query row i's diagonal
    vis = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        vis &= j <= diag + right
    if left >= 0:
        vis &= j >= diag - left
    return vis


def _slopes(alibi_slopes, batch, heads):
    """ALiBi slopes broadcast to [batch, heads] (None stays None)."""
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, dtype=F64)
    return np.broadcast_to(a.reshape((1, heads) if a.ndim == 1 else (batch, heads)), (batch, heads))


def _scores(qh, kh, ct, scale, causal, window_size, softcap, slopes):
    """Masked scores S [b, hq, sq, sk] (-inf where hidden) and tanh(S_scaled / softcap) (or None)
    for the softcap derivative. qh [b, hq, sq, d], kh [b, hq, sk, d]."""
    sq, sk = qh.shape[2], kh.shape[2]
    s = ct(scale) * (qh @ kh.swapaxes(-1, -2))
    tanh = None
    if softcap > 0:  # on the scaled score, before ALiBi and masking
        tanh = np.tanh(s / ct(softcap))
        s = ct(softcap) * tanh
    if slopes is not None:
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        dist = np.abs(i + sk - sq - j).astype(ct)
        s = s - slopes.astype(ct)[:, :, None, None] * dist
    vis = visible(sq, sk, causal, window_size)
    return np.where(vis, s, ct(-np.inf)), tanh


def _dense(q, k, v, dout, *, ct, softmax_scale, causal, window_size, softcap, slopes, dropout_p,
           dropout_mask, out_for_delta=None, operand=None):
    """One dense problem in compute type ct. q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv]
    (v's head_dim dv may differ from d).

    Returns (out [b, sq, hq, dv], lse [b, hq, sq]) and, with dout, also (dq, dk, dv).
    out_for_delta: the output used for D = rowsum(dout * out) in the backward (the naive flavour
    passes its own output rounded to the input dtype, as a real backward only sees that).
    operand: the dtype P and dS are rounded to before the GEMMs that consume them (naive flavour).
    """
    def as_operand(x):
        return x if operand is None else x.astype(operand).astype(ct)

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    # [b, h, s, d]; query head h reads kv head h // group (np.repeat keeps that order).
    qh = q.astype(ct).transpose(0, 2, 1, 3)
    kh = np.repeat(k.astype(ct), group, axis=2).transpose(0, 2, 1, 3)
    vh = np.repeat(v.astype(ct), group, axis=2).transpose(0, 2, 1, 3)

    s, tanh = _scores(qh, kh, ct, scale, causal, window_size, softcap, slopes)

    # Softmax with empty rows (no visible key) giving P = 0 and lse = -inf, never NaN.
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, ct(0))
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l > 0, m_safe + np.log(l), ct(-np.inf))
        p = np.where(l > 0, e / l, ct(0))
    if dropout_mask is not None:
        pd = p * dropout_mask.astype(ct) / ct(1.0 - dropout_p)
    else:
        pd = p
    pd = as_operand(pd)
    oh = pd @ vh  # [b, hq, sq, dv]
    out = oh.transpose(0, 2, 1, 3)
    lse = lse[..., 0]
    if dout is None:
        return out, lse

    doh = dout.astype(ct).transpose(0, 2, 1, 3)
    dvh = pd.swapaxes(-1, -2) @ doh
    dp = doh @ vh.swapaxes(-1, -2)
    if dropout_mask is not None:
        dp = dp * dropout_mask.astype(ct) / ct(1.0 - dropout_p)
    o_delta = oh if out_for_delta is None else out_for_delta.astype(ct).transpose(0, 2, 1, 3)
    delta = (doh * o_delta).sum(axis=-1, keepdims=True)  # D = rowsum(dO * O)
    ds = p * (dp - delta)
    if tanh is not None:  # d/dx softcap * tanh(x / softcap) = 1 - tanh^2
        ds = ds * (ct(1) - tanh * tanh)
    ds = as_operand(ds)
    dqh = ct(scale) * (ds @ kh)
    dkh = ct(scale) * (ds.swapaxes(-1, -2) @ qh)
    # Sum the query heads of each GQA group back onto their kv head.
    dq = dqh.transpose(0, 2, 1, 3)
    dk = dkh.transpose(0, 2, 1, 3).reshape(b, sk, hkv, group, d).sum(axis=3)
    dv = dvh.transpose(0, 2, 1, 3).reshape(b, sk, hkv, group, v.shape[-1]).sum(axis=3)
    return out, lse, dq, dk, dv


def _run(q, k, v, dout, *, ct, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None,
         max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
         alibi_slopes=None, dropout_p=0.0, dropout_mask=None, out_for_delta=None, operand=None):
    opts = dict(ct=ct, softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                softcap=softcap, dropout_p=dropout_p, operand=operand)
    want_grad = dout is not None
    if cu_seqlens_q is None:
        slopes = _slopes(alibi_slopes, q.shape[0], q.shape[2])
        return _dense(q, k, v, dout, slopes=slopes, dropout_mask=dropout_mask, out_for_delta=out_for_delta,
                      **opts)

    # Varlen: a loop over the sequences of dense problems of batch 1. Rows outside every
    # sequence (past cu_seqlens[-1], keys past seqused_k) get out/dq/dk/dv = 0 and lse = -inf.
    assert dropout_mask is None, "the reference takes a dropout mask for dense problems only"
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    cu_k = np.asarray(cu_seqlens_k, dtype=np.int64)
    batch = len(cu_q) - 1
    hq = q.shape[1]
    slopes = _slopes(alibi_slopes, batch, hq)
    out = np.zeros((q.shape[0], hq, v.shape[-1]), dtype=ct)  # q's rows, v's head_dim
    lse = np.full((hq, q.shape[0]), -np.inf, dtype=ct)
    dq, dk, dv = np.zeros(q.shape, ct), np.zeros(k.shape, ct), np.zeros(v.shape, ct)
    for bi in range(batch):
        q0, q1 = cu_q[bi], cu_q[bi + 1]
        k0 = cu_k[bi]
        k1 = k0 + int(seqused_k[bi]) if seqused_k is not None else cu_k[bi + 1]
        if q1 == q0:
            continue  # a zero-length query sequence is a no-op
        res = _dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                     None if dout is None else dout[None, q0:q1],
                     slopes=None if slopes is None else slopes[bi:bi + 1],
                     dropout_mask=None,
                     out_for_delta=None if out_for_delta is None else out_for_delta[None, q0:q1], **opts)
        out[q0:q1] = res[0][0]
        lse[:, q0:q1] = res[1][0]
        if want_grad:
            dq[q0:q1] = res[2][0]
            dk[k0:k1] = res[3][0]
            dv[k0:k1] = res[4][0]
    return (out, lse, dq, dk, dv) if want_grad else (out, lse)


def _as_float(a, ct):
    return np.asarray(a).astype(ct)


def forward(q, k, v, **opts):
    """float64 oracle: (out, lse) in float64."""
    return _run(_as_float(q, F64), _as_float(k, F64), _as_float(v, F64), None, ct=F64, **opts)


def backward(dout, q, k, v, **opts):
    """float64 oracle: (dq, dk, dv) of sum(dout * out) in float64."""
    res = _run(_as_float(q, F64), _as_float(k, F64), _as_float(v, F64), _as_float(dout, F64), ct=F64, **opts)
    return res[2:]


def naive_forward(q, k, v, **opts):
    """Attention in q's dtype: float32 arithmetic, P rounded to q.dtype for P V, out rounded to
    q.dtype, lse float32."""
    out, lse = _run(_as_float(q, F32), _as_float(k, F32), _as_float(v, F32), None, ct=F32, operand=q.dtype,
                    **opts)
    return out.astype(q.dtype), lse.astype(F32)


def naive_forward_float8(q, k, v, float8, out_dtype, **opts):
    """The naive attention of FP8 inputs (the FP8 tolerance rule, docs/CONVENTIONS.md): q, k, v
    hold the dequantised values (exact in float32), float32 arithmetic, P rounded to the FP8
    dtype `float8` for P V (an FP8 GEMM's operand), out rounded to out_dtype, lse float32."""
    out, lse = _run(_as_float(q, F32), _as_float(k, F32), _as_float(v, F32), None, ct=F32, operand=float8, **opts)
    return out.astype(out_dtype), lse.astype(F32)


def naive_backward(dout, q, k, v, **opts):
    """Gradients in q's dtype (float32 arithmetic, P and dS rounded to q.dtype for their GEMMs,
    results rounded to q.dtype). D = rowsum(dout * out)
    uses the output rounded to q.dtype, the only one a real backward pass gets to see."""
    out, _ = naive_forward(q, k, v, **opts)
    res = _run(_as_float(q, F32), _as_float(k, F32), _as_float(v, F32), _as_float(dout, F32), ct=F32,
               out_for_delta=out, operand=q.dtype, **opts)
    return tuple(g.astype(q.dtype) for g in res[2:])


def scores(q, k, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """float64 masked scores S [b, hq, sq, sk] of a dense problem (-inf where a key is hidden)."""
    b, _, hq, d = q.shape
    group = hq // k.shape[2]
    qh = _as_float(q, F64).transpose(0, 2, 1, 3)
    kh = np.repeat(_as_float(k, F64), group, axis=2).transpose(0, 2, 1, 3)
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    return _scores(qh, kh, F64, scale, causal, tuple(window_size), softcap, _slopes(alibi_slopes, b, hq))[0]

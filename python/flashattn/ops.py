"""Array-agnostic forward and backward: numpy (ml_dtypes bfloat16 too), PyTorch, CuPy and JAX arrays
in, the same framework's arrays out, on the inputs' device and (CUDA) the caller's current stream.

Layouts (docs/ARCHITECTURE.md): dense q [batch, seqlen_q, heads, head_dim], k / v
[batch, seqlen_k, heads_kv, head_dim], lse float32 [batch, heads, seqlen_q]; with cu_seqlens_*
(int32 prefix sums, [batch + 1]) q / k / v are [total, heads, head_dim] and lse is
[heads, total_q]. Every argument is checked by the library before any memory is touched.
"""
from __future__ import annotations

import secrets

from . import _ext
from ._arrays import framework_of


def _window(window_size):
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}") from None


def _options(softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, seed, fw, *, needs_seed):
    left, right = _window(window_size)
    if dropout_p and seed is None:
        if needs_seed:
            raise ValueError("seed: the backward pass with dropout_p > 0 needs the forward's seed")
        seed = secrets.randbits(63)
    return dict(softmax_scale=0.0 if softmax_scale is None else float(softmax_scale), causal=bool(causal),
                window_left=left, window_right=right, softcap=float(softcap),
                alibi_slopes=None if alibi_slopes is None else fw.to_ext(alibi_slopes),
                dropout_p=float(dropout_p), seed=0 if seed is None else int(seed), offset=0)


def _varlen(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, fw):
    conv = lambda a: None if a is None else fw.to_ext(a)  # noqa: E731
    return dict(cu_seqlens_q=conv(cu_seqlens_q), cu_seqlens_k=conv(cu_seqlens_k), seqused_k=conv(seqused_k),
                max_seqlen_q=int(max_seqlen_q or 0), max_seqlen_k=int(max_seqlen_k or 0))


def forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, seed=None, out=None, lse=None):
    """Attention forward: returns (out, lse).

    softmax_scale defaults to 1 / sqrt(head_dim). Masks align bottom-right: query row i sees key
    j iff i + sk - sq - window_left <= j <= i + sk - sq + window_right (-1: unbounded side);
    causal sets window_right = 0. softcap > 0 applies softcap * tanh(s / softcap) to the scaled
    scores; alibi_slopes (float32 [heads] or [batch, heads]) subtracts slope * |i + sk - sq - j|.
    Dropout (dropout_p in [0, 1)) draws its keep-mask from `seed` (a fresh one when None): pass
    the same seed to backward. `out` / `lse` may be given to write into (arrays of q's framework).
    """
    fw = framework_of(q)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if out is None:
        out = fw.empty(q, q.shape)
    if lse is None:
        lse_shape = (q.shape[1], q.shape[0]) if varlen and q.ndim == 3 else (q.shape[0], q.shape[2], q.shape[1])
        lse = fw.empty(q, lse_shape if q.ndim in (3, 4) else (0,), fw.float32(q))
    _ext.forward(fw.to_ext(q), fw.to_ext(k), fw.to_ext(v), fw.to_ext(out), fw.to_ext(lse),
                 **_varlen(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, fw),
                 **_options(softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, seed, fw,
                            needs_seed=False),
                 stream=fw.stream(q), uint16_is_bf16=fw.uint16_is_bf16)
    fw.finish(q)
    return fw.from_ext(out), fw.from_ext(lse)


def backward(dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, deterministic=False, dq=None, dk=None,
             dv=None):
    """Attention backward from the forward's out and lse: returns (dq, dk, dv).

    The options must be the forward's (with dropout, its seed). deterministic=True fixes the
    accumulation order of dQ (bitwise-reproducible gradients; the CPU backend always is).
    """
    fw = framework_of(q)
    dq = fw.empty(q, q.shape) if dq is None else dq
    dk = fw.empty(k, k.shape) if dk is None else dk
    dv = fw.empty(v, v.shape) if dv is None else dv
    _ext.backward(fw.to_ext(dout), fw.to_ext(q), fw.to_ext(k), fw.to_ext(v), fw.to_ext(out), fw.to_ext(lse),
                  fw.to_ext(dq), fw.to_ext(dk), fw.to_ext(dv),
                  **_varlen(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, fw),
                  **_options(softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, seed, fw,
                             needs_seed=True),
                  deterministic=bool(deterministic), stream=fw.stream(q), uint16_is_bf16=fw.uint16_is_bf16)
    fw.finish(q)
    return fw.from_ext(dq), fw.from_ext(dk), fw.from_ext(dv)

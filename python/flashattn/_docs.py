"""Docstring text that several public functions share (the arguments flashattn.forward, the
flash_attn_* functions and flashattn.torch have in common), so that each is written once.
`documented(template)` sets a function's __doc__ to the template with these fragments filled in.
"""
from __future__ import annotations

from typing import Any

Array = Any  # a numpy (ml_dtypes bfloat16 included), PyTorch, CuPy or JAX array

FRAGMENTS = dict(
    layout_notes="""\
    Masks align bottom-right: with sequence lengths sq, sk, query row i sees key j iff
    i + sk - sq - window_left <= j <= i + sk - sq + window_right (-1: that side unbounded);
    causal=True is window_right = 0. A query row that sees no key gets out = 0 and lse = -inf.
    GQA / MQA: heads % heads_kv == 0, and query head h reads kv head h // (heads // heads_kv).
    head_dim: 1..576 (CUDA arrays: up to 256), the same for q and k; v (v_cache and v_new in
    the KV-cache call) may have its own (multi-head latent attention's 192 / 128, or 576 / 512
    with v_cache a view of k_cache's first 512 columns), which out, dout and dv then have: on CPU
    arrays (the CUDA kernels raise NotImplementedError for it so far). CUDA arrays take fp16 / bf16; the
    CUDA kernels read head_dim in multiples of 8, so other head dims run zero-padded (a copy of
    q, k, v) and the results are cut back. Inputs whose last dimension is strided are copied
    first.""",
    softmax_scale="""\
        softmax_scale: float. Scale of QK^T before the softmax; None: 1 / sqrt(head_dim) of q
            and k.""",
    mask_args="""\
        causal: bool. Causal mask (window_right = 0), bottom-right aligned.
        window_size: (window_left, window_right). Sliding-window attention; -1 leaves a side
            unbounded. window_right must be -1 or 0 with causal=True.
        sink_tokens: int >= 0. The first sink_tokens keys of each sequence stay visible
            whatever window_left says (StreamingLLM's attention sinks); causal still applies to
            them.""",
    score_args="""\
        softcap: float. > 0: scores become softcap * tanh(scaled score / softcap); 0: off.
        alibi_slopes: float32 [heads] or [batch, heads]. Adds -slope * |i + sk - sq - j| to the
            score of query i and key j (after softcap).
        learnable_sink: float32 [heads], or None. A learnable attention sink: one logit per
            query head that joins every row's softmax without a value vector (the row's LSE
            includes exp(sink[h]); a row that sees no key gets out 0 and lse sink[h]; -inf is no
            sink). Differentiable.""",
    fp8_descale="""\
        q_descale: float32 [batch, heads_kv], or None (factor 1). FP8 inputs (q, k, v all
            torch.float8_e4m3fn / ml_dtypes.float8_e4m3fn, or all e5m2; CPU arrays): an element
            of query head h stands for its value times q_descale[b, h // (heads // heads_kv)]
            (FlashAttention-3's semantics). out is then bfloat16 (flashattn.forward takes a
            float16 out= too); the forward alone (no autograd). Only for FP8 inputs.
        k_descale: float32 [batch, heads_kv], or None: k's factors, element of KV head h in
            batch entry b standing for its value times k_descale[b, h].
        v_descale: float32 [batch, heads_kv], or None: v's factors, as k_descale.""",
    fp8_cache_descale="""\
        k_descale: float32 [batch, heads_kv], or None (factor 1). An FP8 cache (k_cache /
            v_cache float8_e4m3fn or float8_e5m2, q and k / v bfloat16 or float16; CPU arrays):
            cache element x of sequence b, KV head h stands for x * k_descale[b, h]; new rows
            are stored as float8(float32(x) / factor), rounded to nearest even and saturating
            (to +-448 for e4m3, +-57344 for e5m2).
        v_descale: float32 [batch, heads_kv], or None: v_cache's factors, as k_descale.""",
    dropout_p="""\
        dropout_p: float in [0, 1). Dropout of the attention probabilities (0 in evaluation).""",
    deterministic="""\
        deterministic: bool. A backward pass with a fixed accumulation order (bitwise
            reproducible gradients, slightly slower on CUDA); the CPU backend always is.""",
    return_attn_probs="""\
        return_attn_probs: bool. Also return the LSE; the probabilities themselves are never
            materialised (the third value is None).""",
    lse="""\
        The LSE is float32: the natural log of each query row's softmax denominator (the
        logsumexp over its visible keys of the scaled, softcapped, ALiBi-biased scores).""",
    raises="""\
    Raises:
        ValueError: an invalid argument (shapes, lengths, window, scale, an output with a
            strided last dimension ...), the message naming it.
        TypeError: an unsupported dtype or dtypes that differ (index arrays: "int32 expected,
            got int64"), or arrays that are not numpy / PyTorch / CuPy / JAX.
        NotImplementedError: not supported by the arrays' backend (e.g. fp32 on CUDA, or no
            CUDA backend in this build).
        MemoryError: the device is out of memory.""",
)


def documented(template: str):
    """Decorator: __doc__ = template with FRAGMENTS' {names} filled in."""
    def decorate(fn):
        fn.__doc__ = template.format(**FRAGMENTS)
        return fn
    return decorate

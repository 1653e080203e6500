"""The flash_attn package's functions (names, arguments, defaults and return values of flash_attn
2.8), so `from flashattn import flash_attn_func` replaces `from flash_attn import flash_attn_func`.

PyTorch tensors go through flashattn.torch (autograd, torch.compile); other arrays (numpy, CuPy,
JAX) run the forward only. With return_attn_probs=True the functions return
(out, softmax_lse, None): flashattn never materialises the attention probabilities, so the third
value, which flash_attn documents as a testing aid, is None.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

from . import ops
from ._docs import Array, documented

Output = Union[Array, Tuple[Array, Array, None]]  # out, or (out, softmax_lse, None)

# The options every function below shares, documented once.
_OPTIONS = """{dropout_p}
{softmax_scale}
{mask_args}
{score_args}
{deterministic}
{return_attn_probs}"""
_DENSE_RETURNS = """    Returns:
        out [batch, seqlen_q, heads, head_dim_v] (v's head_dim; q's dtype and device), or
        (out, softmax_lse [batch, heads, seqlen_q], None) with return_attn_probs.
{lse}"""
_VARLEN_RETURNS = """    Returns:
        out [total_q, heads, head_dim_v] (v's head_dim; q's dtype and device), or
        (out, softmax_lse [heads, total_q], None) with return_attn_probs.
{lse}"""
_VARLEN_ARGS = """        cu_seqlens_q: int32 [batch + 1]. Prefix sums of the query lengths: sequence b is rows
            cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (rows past cu_seqlens_q[-1] get out = 0).
        cu_seqlens_k: int32 [batch + 1]. The same for k / v.
        max_seqlen_q: int. The longest query sequence (at least max(diff(cu_seqlens_q))).
        max_seqlen_k: int. The longest key sequence. On a GPU the lengths are checked there,
            without waiting for it (flashattn.forward's index_check="device"): lengths that
            break a rule give NaN outputs, and the next such call or
            flashattn.check_device_errors() raises a ValueError naming the entry.
            flashattn.forward / backward with index_check="host" check them before the call."""
_DIFFERENTIABLE = """PyTorch tensors are differentiable (autograd, torch.compile); numpy, CuPy
    and JAX arrays run the forward only. With dropout, torch draws the seed from its generator
    (torch.manual_seed reproduces it), other arrays a fresh one per call."""


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               learnable_sink=None, sink_tokens=0, descale=(None, None, None)):
    if type(q).__module__.startswith("torch"):
        from . import torch as fa_torch  # imports PyTorch: only when given its tensors

        # (FP8 inputs too: the forward alone, which the library has for them; under torch.compile
        # the custom op.)
        out, lse = fa_torch.run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, softmax_scale,
                                causal, window_size, softcap, alibi_slopes, dropout_p, None, deterministic,
                                learnable_sink, sink_tokens, descale)
    else:
        out, lse = ops.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               dropout_p=dropout_p, learnable_sink=learnable_sink, sink_tokens=sink_tokens,
                               q_descale=descale[0], k_descale=descale[1], v_descale=descale[2])
    return (out, lse, None) if return_attn_probs else out


@documented("""Attention of q against k, v (flash_attn 2.8's flash_attn_func).

    """ + _DIFFERENTIABLE + """

{layout_notes}

    Args:
        q: [batch, seqlen_q, heads, head_dim]; fp16 or bf16 (the CPU also takes fp32, fp64).
        k: [batch, seqlen_k, heads_kv, head_dim], q's dtype and device.
        v: [batch, seqlen_k, heads_kv, head_dim_v], q's dtype and device; head_dim_v may differ
            from q's and k's head_dim (CPU arrays).
""" + _OPTIONS + """
{fp8_descale}

""" + _DENSE_RETURNS + """

{raises}
    """)
def flash_attn_func(q: Array, k: Array, v: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, learnable_sink: Optional[Array] = None,
                    sink_tokens: int = 0, q_descale: Optional[Array] = None, k_descale: Optional[Array] = None,
                    v_descale: Optional[Array] = None) -> Output:
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, learnable_sink=learnable_sink, sink_tokens=sink_tokens,
                      descale=(q_descale, k_descale, v_descale))


@documented("""Attention with q, k, v packed in one array (flash_attn 2.8's
    flash_attn_qkvpacked_func), read in place (no copy); its gradient is one array too.

    """ + _DIFFERENTIABLE + """

{layout_notes}

    Args:
        qkv: [batch, seqlen, 3, heads, head_dim]: q, k, v along dimension 2 (heads_kv = heads).
""" + _OPTIONS + """
{fp8_descale}

""" + _DENSE_RETURNS + """

{raises}
    """)
def flash_attn_qkvpacked_func(qkv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, learnable_sink: Optional[Array] = None,
                              sink_tokens: int = 0, q_descale: Optional[Array] = None,
                              k_descale: Optional[Array] = None, v_descale: Optional[Array] = None) -> Output:
    _check_packed("qkv", qkv, 5, 2, 3)
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink,
                      sink_tokens=sink_tokens, descale=(q_descale, k_descale, v_descale))


@documented("""Attention with k, v packed in one array (flash_attn 2.8's
    flash_attn_kvpacked_func), read in place (no copy).

    """ + _DIFFERENTIABLE + """

{layout_notes}

    Args:
        q: [batch, seqlen_q, heads, head_dim]; fp16 or bf16 (the CPU also takes fp32, fp64).
        kv: [batch, seqlen_k, 2, heads_kv, head_dim]: k, v along dimension 2; q's dtype, device.
""" + _OPTIONS + """
{fp8_descale}

""" + _DENSE_RETURNS + """

{raises}
    """)
def flash_attn_kvpacked_func(q: Array, kv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, learnable_sink: Optional[Array] = None,
                             sink_tokens: int = 0, q_descale: Optional[Array] = None,
                             k_descale: Optional[Array] = None, v_descale: Optional[Array] = None) -> Output:
    _check_packed("kv", kv, 5, 2, 2)
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink,
                      sink_tokens=sink_tokens, descale=(q_descale, k_descale, v_descale))


@documented("""Attention over a batch of sequences of different lengths, packed without
    padding (flash_attn 2.8's flash_attn_varlen_func). Masks align per sequence.

    """ + _DIFFERENTIABLE + """

{layout_notes}

    Args:
        q: [total_q, heads, head_dim]; fp16 or bf16 (the CPU also takes fp32, fp64).
        k: [total_k, heads_kv, head_dim], q's dtype and device; with block_table a paged cache
            [num_blocks, page_size, heads_kv, head_dim].
        v: like k, with a head_dim of its own allowed (CPU arrays).
""" + _VARLEN_ARGS + """
""" + _OPTIONS + """
        block_table: int32 [batch, max_blocks_per_sequence], or None. Paged K/V: key j of
            sequence b is row j % page_size of block block_table[b, j // page_size], and
            cu_seqlens_k only gives the lengths. The forward only (no autograd; on CUDA no
            dropout), as in flash_attn, whose pages must hold a multiple of 256 keys: any
            page_size here.
{fp8_descale}

""" + _VARLEN_RETURNS + """

{raises}
    """)
def flash_attn_varlen_func(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int,
                           max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Array] = None, *,
                           learnable_sink: Optional[Array] = None, sink_tokens: int = 0,
                           q_descale: Optional[Array] = None, k_descale: Optional[Array] = None,
                           v_descale: Optional[Array] = None) -> Output:
    if block_table is not None:
        out, lse = ops.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               dropout_p=dropout_p, block_table=block_table, learnable_sink=learnable_sink,
                               sink_tokens=sink_tokens, q_descale=q_descale, k_descale=k_descale,
                               v_descale=v_descale)
        return (out, lse, None) if return_attn_probs else out
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink,
                      sink_tokens=sink_tokens, descale=(q_descale, k_descale, v_descale))


@documented("""Variable-length attention with q, k, v packed in one array (flash_attn 2.8's
    flash_attn_varlen_qkvpacked_func), read in place.

    """ + _DIFFERENTIABLE + """

{layout_notes}

    Args:
        qkv: [total, 3, heads, head_dim]: q, k, v along dimension 1 (heads_kv = heads).
        cu_seqlens: int32 [batch + 1]. Prefix sums of the sequence lengths (queries and keys).
        max_seqlen: int. The longest sequence.
""" + _OPTIONS + """
{fp8_descale}

""" + _VARLEN_RETURNS + """

{raises}
    """)
def flash_attn_varlen_qkvpacked_func(qkv: Array, cu_seqlens: Array, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *,
                                     learnable_sink: Optional[Array] = None, sink_tokens: int = 0,
                                     q_descale: Optional[Array] = None, k_descale: Optional[Array] = None,
                                     v_descale: Optional[Array] = None) -> Output:
    _check_packed("qkv", qkv, 4, 1, 3)
    return _attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                      max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, learnable_sink=learnable_sink,
                      sink_tokens=sink_tokens, descale=(q_descale, k_descale, v_descale))


@documented("""Variable-length attention with k, v packed in one array (flash_attn 2.8's
    flash_attn_varlen_kvpacked_func), read in place.

    """ + _DIFFERENTIABLE + """

{layout_notes}

    Args:
        q: [total_q, heads, head_dim]; fp16 or bf16 (the CPU also takes fp32, fp64).
        kv: [total_k, 2, heads_kv, head_dim]: k, v along dimension 1; q's dtype and device.
""" + _VARLEN_ARGS + """
""" + _OPTIONS + """
{fp8_descale}

""" + _VARLEN_RETURNS + """

{raises}
    """)
def flash_attn_varlen_kvpacked_func(q: Array, kv: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int,
                                    max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                    causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0, alibi_slopes: Optional[Array] = None,
                                    deterministic: bool = False, return_attn_probs: bool = False, *,
                                    learnable_sink: Optional[Array] = None, sink_tokens: int = 0,
                                    q_descale: Optional[Array] = None, k_descale: Optional[Array] = None,
                                    v_descale: Optional[Array] = None) -> Output:
    _check_packed("kv", kv, 4, 1, 2)
    return _attention(q, kv[:, 0], kv[:, 1], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink,
                      sink_tokens=sink_tokens, descale=(q_descale, k_descale, v_descale))


@documented("""Attention of new queries against a KV cache, optionally appending new keys and
    values to it first (flash_attn 2.8's flash_attn_with_kvcache; flashattn.forward_kvcache is
    its keyword form). Inference only: no autograd.

    For sequence b, the new keys k[b] / v[b] (when given) are written into k_cache / v_cache in
    place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (rotated first with
    rotary_cos / rotary_sin), then q[b] attends to positions [cache_leftpad[b],
    cache_seqlens[b] + seqlen_new) of cache row cache_batch_idx[b] (sk = that many keys, masks
    bottom-right aligned as below). Unlike flash_attn, pages may hold any number of tokens,
    cache_leftpad works with block_table, and an int cache_seqlens is broadcast over the batch.
    CUDA caches whose head_dim is not a multiple of 8 run on zero-padded copies of both caches,
    copied back after an append: O(cache size) extra memory traffic per call.

{layout_notes}

    Args:
        q: [batch, seqlen_q, heads, head_dim]; fp16 or bf16 (the CPU also takes fp32, fp64).
        k_cache: [batch_cache, seqlen_cache, heads_kv, head_dim], or with block_table a paged
            cache [num_blocks, page_size, heads_kv, head_dim]; q's dtype and device. Written in
            place when k / v are given (so its last dimension must be contiguous).
        v_cache: like k_cache.
        k: [batch, seqlen_new, heads_kv, head_dim], or None. New keys to append.
        v: like k; given with k.
        rotary_cos: [seqlen_ro, rotary_dim / 2] (float32 or q's dtype), or None. Rotary embedding
            of the new keys at their positions and of q (at cache_seqlens + its row when causal
            or windowed, at cache_seqlens otherwise); needs k / v. rotary_dim <= head_dim.
        rotary_sin: like rotary_cos.
        cache_seqlens: int, or int32 [batch]. Tokens already in each sequence's cache.
        cache_batch_idx: int32 [batch], or None. The cache row of each sequence (default b).
        cache_leftpad: int32 [batch], or None. The first valid position of each sequence (0).
        block_table: int32 [batch, max_blocks_per_sequence], or None. Paged caches: position j
            of sequence b is row j % page_size of block block_table[b, j // page_size].
{softmax_scale}
{mask_args}
{score_args}
        rotary_interleaved: bool. True: rotary pairs dimensions (0, 1), (2, 3), ...; False:
            (i, i + rotary_dim / 2) (GPT-NeoX).
        num_splits: int. Splits of the keys for the GPU's split-KV decode (0: a heuristic;
            1: none); >= 0.
        return_softmax_lse: bool. Also return softmax_lse.
{fp8_cache_descale}
        index_check: "device" (default) or "host": where the index values of GPU arrays are
            checked (see flashattn.forward_kvcache). With "device" the call never waits for the
            GPU, and a bad index is raised by a later call or flashattn.check_device_errors().

    Returns:
        out [batch, seqlen_q, heads, head_dim] (q's dtype and device), or
        (out, softmax_lse [batch, heads, seqlen_q]) with return_softmax_lse.
{lse}

{raises}
    """)
def flash_attn_with_kvcache(q: Array, k_cache: Array, v_cache: Array, k: Optional[Array] = None,
                            v: Optional[Array] = None, rotary_cos: Optional[Array] = None,
                            rotary_sin: Optional[Array] = None, cache_seqlens: Union[int, Array, None] = None,
                            cache_batch_idx: Optional[Array] = None, cache_leftpad: Optional[Array] = None,
                            block_table: Optional[Array] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Array] = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, index_check: str = "device", *,
                            learnable_sink: Optional[Array] = None, sink_tokens: int = 0,
                            k_descale: Optional[Array] = None,
                            v_descale: Optional[Array] = None) -> Union[Array, Tuple[Array, Array]]:
    out, lse = ops.forward_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                   block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                   rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                   num_splits=num_splits, index_check=index_check, learnable_sink=learnable_sink,
                                   sink_tokens=sink_tokens, k_descale=k_descale, v_descale=v_descale)
    return (out, lse) if return_softmax_lse else out


def _check_packed(name, a, ndim, axis, count):
    shape = tuple(a.shape)
    if len(shape) != ndim or shape[axis] != count:
        layout = "[batch, seqlen, " if ndim == 5 else "[total, "
        raise ValueError(f"{name}: expected shape {layout}{count}, heads, head_dim], got {list(shape)}")

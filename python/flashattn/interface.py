"""The flash_attn package's functions (names, arguments, defaults and return values of flash_attn
2.8), so `from flashattn import flash_attn_func` replaces `from flash_attn import flash_attn_func`.

PyTorch tensors go through flashattn.torch (autograd, torch.compile); other arrays (numpy, CuPy,
JAX) run the forward only. With return_attn_probs=True the functions return
(out, softmax_lse, None): flashattn never materialises the attention probabilities, so the third
value, which flash_attn documents as a testing aid, is None.
"""
from __future__ import annotations

from . import ops


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    if type(q).__module__.startswith("torch"):
        from . import torch as fa_torch  # imports PyTorch: only when given its tensors

        out, lse = fa_torch.run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, softmax_scale,
                                causal, window_size, softcap, alibi_slopes, dropout_p, None, deterministic)
    else:
        out, lse = ops.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               dropout_p=dropout_p)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [batch, seqlen_q, heads, d], k / v [batch, seqlen_k, heads_kv, d] -> out like q."""
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv [batch, seqlen, 3, heads, d] -> out [batch, seqlen, heads, d] (q, k, v read in place)."""
    _check_packed("qkv", qkv, 5, 2, 3)
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [batch, seqlen_q, heads, d], kv [batch, seqlen_k, 2, heads_kv, d] -> out like q."""
    _check_packed("kv", kv, 5, 2, 2)
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [total_q, heads, d], k / v [total_k, heads_kv, d], cu_seqlens_* int32 [batch + 1] -> out like q.
    With block_table (int32 [batch, max_blocks]) k / v are paged caches [num_blocks, page_size,
    heads_kv, d] and cu_seqlens_k gives the lengths alone: the forward only (no autograd), as in
    flash_attn (which asks pages of a multiple of 256 keys; any size here); on CUDA no dropout."""
    if block_table is not None:
        out, lse = ops.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               dropout_p=dropout_p, block_table=block_table)
        return (out, lse, None) if return_attn_probs else out
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv [total, 3, heads, d], cu_seqlens int32 [batch + 1] -> out [total, heads, d]."""
    _check_packed("qkv", qkv, 4, 1, 3)
    return _attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                      max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [total_q, heads, d], kv [total_k, 2, heads_kv, d] -> out like q."""
    _check_packed("kv", kv, 4, 1, 2)
    return _attention(q, kv[:, 0], kv[:, 1], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            index_check="host"):
    """Decoding against a KV cache, flash_attn 2.8's arguments and return values: out, or
    (out, softmax_lse) with return_softmax_lse. k / v, when given, are appended to k_cache / v_cache
    in place at cache_seqlens. Inference only (no autograd). Unlike flash_attn, pages may hold any
    number of tokens, cache_leftpad works with block_table, and an int cache_seqlens is
    broadcast over q's batch. index_check="device" keeps GPU calls asynchronous (indices checked
    by the kernels; see flashattn.forward_kvcache)."""
    out, lse = ops.forward_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                   block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                   rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                   num_splits=num_splits, index_check=index_check)
    return (out, lse) if return_softmax_lse else out


def _check_packed(name, a, ndim, axis, count):
    shape = tuple(a.shape)
    if len(shape) != ndim or shape[axis] != count:
        layout = "[batch, seqlen, " if ndim == 5 else "[total, "
        raise ValueError(f"{name}: expected shape {layout}{count}, heads, head_dim], got {list(shape)}")

"""PyTorch integration: flashattn's forward and backward as custom ops (torch.library), with fake
implementations so torch.compile(fullgraph=True) traces them, autograd that saves the LSE, the
current CUDA stream, and outputs from PyTorch's allocator.

Eager calls skip the dispatcher (a custom op costs tens of microseconds a call): with gradients
they go through a torch.autograd.Function, without them straight to the library; under
torch.compile they are the custom ops, whose autograd is registered too.

    flashattn.torch.attention(q, k, v, ...)          -> out       (autograd; [b, s, h, d] or varlen)
    flashattn.torch.attention_with_lse(q, k, v, ...) -> out, lse
    flashattn.torch.scaled_dot_product_attention(query, key, value, ...)   ([b, h, s, d], like SDPA)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops
from ._arrays import TorchFramework
from ._docs import documented

_TORCH = TorchFramework(torch)

_SEED_LIMIT = 2**62


def check_bhsd(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
    """The [batch, heads, seq, dim] layout of SDPA and FlexAttention: 4-D tensors, and as many
    key heads as query heads unless enable_gqa (a ValueError otherwise)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query / key / value: expected [batch, heads, seq, dim] tensors, got "
                         f"{query.dim()} / {key.dim()} / {value.dim()} dimensions")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"key: {key.shape[1]} heads != query's {query.shape[1]}; pass enable_gqa=True for "
                         "grouped-query attention")


def _lse_shape(q: Tensor, varlen: bool):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                  window_left, window_right, sink_tokens, softcap, alibi_slopes, learnable_sink, dropout_p, seed,
                  deterministic, q_descale=None, k_descale=None, v_descale=None):
    return ops.run_forward(_TORCH, q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q or None,
                           max_seqlen_k or None, softmax_scale or None, causal, (window_left, window_right), softcap,
                           alibi_slopes, dropout_p, None if seed is None else int(seed), None, True, learnable_sink,
                           sink_tokens, None, ops._descale(q_descale, k_descale, v_descale))


def _backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                   softmax_scale, causal, window_left, window_right, sink_tokens, softcap, alibi_slopes, learnable_sink,
                   dropout_p, seed, deterministic, q_descale=None, k_descale=None, v_descale=None):
    """(dq, dk, dv, dsink); dsink is an empty tensor without a learnable sink (a custom op's
    outputs are tensors)."""
    # dout may be strided along head_dim (e.g. the expanded gradient of a sum over it, stride 0):
    # ops.backward copies such inputs. (FP8 inputs have no backward: the library refuses them.) The ops' int / float arguments use 0 for "not given"
    # (max_seqlen_*: derived; scale: default).
    grads = ops.backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q or None, max_seqlen_k=max_seqlen_k or None, seqused_k=seqused_k,
                         softmax_scale=softmax_scale or None, causal=causal, window_size=(window_left, window_right),
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         seed=None if seed is None else int(seed), deterministic=deterministic,
                         learnable_sink=learnable_sink, sink_tokens=sink_tokens)
    return grads if learnable_sink is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


@torch.library.custom_op("flashattn::forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[Tensor], softmax_scale: float,
                causal: bool, window_left: int, window_right: int, sink_tokens: int, softcap: float,
                alibi_slopes: Optional[Tensor], learnable_sink: Optional[Tensor], dropout_p: float,
                seed: Optional[Tensor], deterministic: bool, q_descale: Optional[Tensor],
                k_descale: Optional[Tensor], v_descale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    # deterministic is the backward's: an argument here so autograd's context sees it.
    return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale,
                         causal, window_left, window_right, sink_tokens, softcap, alibi_slopes, learnable_sink,
                         dropout_p, seed, deterministic, q_descale, k_descale, v_descale)


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale,
                  causal, window_left, window_right, sink_tokens, softcap, alibi_slopes, learnable_sink, dropout_p,
                  seed, deterministic, q_descale, k_descale, v_descale):
    varlen = cu_seqlens_q is not None
    out_dtype = _TORCH.float8_out_dtype(q) if _TORCH.is_float8(q) else q.dtype  # FP8 inputs: a bfloat16 out
    return (q.new_empty(ops._out_shape(q, v), dtype=out_dtype),
            q.new_empty(_lse_shape(q, varlen), dtype=torch.float32))


@torch.library.custom_op("flashattn::backward", mutates_args=())
def _backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                 max_seqlen_k: int, seqused_k: Optional[Tensor], softmax_scale: float, causal: bool,
                 window_left: int, window_right: int, sink_tokens: int, softcap: float,
                 alibi_slopes: Optional[Tensor], learnable_sink: Optional[Tensor], dropout_p: float,
                 seed: Optional[Tensor], deterministic: bool, q_descale: Optional[Tensor],
                 k_descale: Optional[Tensor], v_descale: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          seqused_k, softmax_scale, causal, window_left, window_right, sink_tokens, softcap,
                          alibi_slopes, learnable_sink, dropout_p, seed, deterministic, q_descale, k_descale,
                          v_descale)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, *args):
    sink = args[_SINK_ARG]
    dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


_OPTION_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_k", "softmax_scale",
                 "causal", "window_left", "window_right", "sink_tokens", "softcap", "alibi_slopes", "learnable_sink",
                 "dropout_p", "seed", "deterministic", "q_descale", "k_descale", "v_descale")
_SINK_ARG = _OPTION_NAMES.index("learnable_sink")  # among the options (the arguments after q, k, v)


def _option_grads(options, dsink):
    """The gradients of the options: dsink for a learnable sink, None for the rest."""
    return tuple(dsink if i == _SINK_ARG and options[i] is not None else None for i in range(len(options)))


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = inputs[3:]


def _autograd_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv, dsink = _backward_op(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + _option_grads(ctx.options, dsink)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """Eager autograd without the dispatcher; saves q, k, v, out and the LSE."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse = _forward_impl(q, k, v, *options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dsink = _backward_impl(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + _option_grads(ctx.options, dsink)


@documented("""Differentiable attention on torch tensors: returns (out, lse). Eager calls run the
    library directly (with gradients through a torch.autograd.Function that saves the LSE);
    under torch.compile(fullgraph=True) they are the custom ops flashattn::forward / backward.

{layout_notes}
    With dropout and no seed, the seed is drawn from PyTorch's default generator
    (torch.manual_seed reproduces it); the backward redraws the forward's mask.

    Args:
        q: [batch, seqlen_q, heads, head_dim] (varlen: [total_q, heads, head_dim]); fp16 or bf16
            (CPU tensors also fp32, fp64).
        k: [batch, seqlen_k, heads_kv, head_dim] (varlen: [total_k, heads_kv, head_dim]).
        v: like k, or with a head_dim of its own (CPU tensors), which out then has.
        cu_seqlens_q: int32 [batch + 1], or None. Varlen: prefix sums of the query lengths.
        cu_seqlens_k: int32 [batch + 1], or None. The same for k / v.
        max_seqlen_q: int, or None. The longest query sequence (None: computed).
        max_seqlen_k: int, or None. The longest key sequence.
        seqused_k: int32 [batch], or None. Varlen: keys used per sequence.
{softmax_scale}
{mask_args}
{score_args}
{dropout_p}
        seed: int, or None. The dropout seed (None: from PyTorch's generator).
{deterministic}
{fp8_descale}

    Returns:
        (out, lse): out shaped like q with v's head_dim (differentiable; FP8 inputs: bfloat16, and
        no backward); lse float32
        [batch, heads, seqlen_q] (varlen: [heads, total_q]), not differentiable.
{lse}

{raises}
    """)
def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Optional[Tensor] = None,
                       cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                       max_seqlen_k: Optional[int] = None, seqused_k: Optional[Tensor] = None,
                       softmax_scale: Optional[float] = None, causal: bool = False,
                       window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, seed: Optional[int] = None,
                       deterministic: bool = False, learnable_sink: Optional[Tensor] = None,
                       sink_tokens: int = 0, q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                       v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
               window_size, softcap, alibi_slopes, dropout_p, seed, deterministic, learnable_sink, sink_tokens,
               (q_descale, k_descale, v_descale))


def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal, window_size,
        softcap, alibi_slopes, dropout_p, seed, deterministic, learnable_sink=None, sink_tokens=0,
        descale=(None, None, None)):
    """attention_with_lse with positional arguments (the flash_attn-compatible functions' path)."""
    pad, pad_v = ops.head_dim_paddings(_TORCH, q, k, v)  # v's head_dim may be its own
    if pad or pad_v:
        # The CUDA kernels need head_dim % 8 == 0: attention of zero-padded q, k, v (the default
        # scale kept at the caller's head_dim), cut back. Differentiable ops outside the custom op,
        # so autograd slices the gradients back and torch.compile traces it.
        out, lse = run(ops._padded(_TORCH, q, pad), ops._padded(_TORCH, k, pad), ops._padded(_TORCH, v, pad_v),
                       cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                       ops._scale(softmax_scale, q.shape[-1]), causal, window_size, softcap, alibi_slopes, dropout_p,
                       seed, deterministic, learnable_sink, sink_tokens, descale)
        return out[..., :v.shape[-1]], lse
    left, right = ops._window(window_size)
    compiling = torch.compiler.is_compiling()
    if dropout_p > 0 and seed is None:  # from PyTorch's generator: a tensor, so compiled graphs draw it too
        seed = torch.randint(0, _SEED_LIMIT, (1,), dtype=torch.int64)
        seed = seed if compiling else int(seed)
    elif dropout_p > 0 and compiling:
        seed = torch.tensor([int(seed)], dtype=torch.int64)
    elif dropout_p <= 0:
        seed = None
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q or 0), int(max_seqlen_k or 0), seqused_k,
            float(softmax_scale or 0.0), bool(causal), left, right, int(sink_tokens), float(softcap), alibi_slopes,
            learnable_sink, float(dropout_p), seed, bool(deterministic), *descale)
    # Tensor subclasses (fake tensors of tracing, DTensor, ...) take the custom op, whose
    # dispatcher knows them; plain tensors skip it.
    if compiling or type(q) is not torch.Tensor:
        return _forward_op(*args)
    sink_grad = learnable_sink is not None and learnable_sink.requires_grad
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or sink_grad):
        return _Attention.apply(*args)
    return _forward_impl(*args)


def attention(q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
    """attention_with_lse(q, k, v, **options)'s out alone (differentiable).

    Args:
        q: [batch, seqlen_q, heads, head_dim] (varlen: [total_q, heads, head_dim]).
        k: [batch, seqlen_k, heads_kv, head_dim] (varlen: [total_k, heads_kv, head_dim]).
        v: like k, or with a head_dim of its own (CPU tensors).
        **options: attention_with_lse's keyword arguments (cu_seqlens_*, max_seqlen_*,
            seqused_k, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
            seed, deterministic, learnable_sink, sink_tokens, q_descale, k_descale, v_descale).

    Returns:
        out, shaped like q with v's head_dim.

    Raises:
        ValueError, TypeError, NotImplementedError, MemoryError: as attention_with_lse.
    """
    return attention_with_lse(q, k, v, **options)[0]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention's layout and arguments, for those
    flashattn can honour; differentiable.

    Args:
        query: [batch, heads, seqlen_q, head_dim]; fp16 or bf16 (CPU tensors also fp32, fp64).
        key: [batch, heads_kv, seqlen_k, head_dim].
        value: [batch, heads_kv, seqlen_k, head_dim_v]: like key, or with a head_dim of its own
            (CPU tensors), as SDPA allows.
        attn_mask: must be None: arbitrary masks are not supported (use is_causal, or
            flashattn.torch.attention's window_size / alibi_slopes).
        dropout_p: float in [0, 1). Dropout of the attention probabilities.
        is_causal: bool. SDPA's top-left aligned causal mask: query i sees keys j <= i, also
            when seqlen_q != seqlen_k (unlike flash_attn's bottom-right causal).
        scale: float, or None (1 / sqrt(head_dim)). Scale of QK^T.
        enable_gqa: bool. Allows heads_kv < heads (heads % heads_kv == 0); query head h reads
            kv head h // (heads // heads_kv).

    Returns:
        out [batch, heads, seqlen_q, head_dim_v], query's dtype.

    Raises:
        NotImplementedError: attn_mask given.
        ValueError: tensors that are not 4-D, heads_kv != heads without enable_gqa, or any
            argument the library refuses.
        TypeError, MemoryError: as flashattn.torch.attention_with_lse.
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: flashattn has no arbitrary attention masks; use is_causal "
                                  "(or flashattn.torch.attention's window_size / alibi_slopes)")
    check_bhsd(query, key, value, enable_gqa)
    seq_q, seq_k = query.shape[2], key.shape[2]
    if is_causal and seq_q < seq_k:
        # Top-left alignment hides keys seq_q.. from every query: drop them, then the library's
        # (bottom-right) causal mask is SDPA's.
        key, value = key[:, :, :seq_q], value[:, :, :seq_q]
    window = (-1, max(seq_q - seq_k, 0)) if is_causal else (-1, -1)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scale,
                    window_size=window, dropout_p=dropout_p)
    return out.transpose(1, 2)


__all__ = ["attention", "attention_with_lse", "scaled_dot_product_attention"]

"""flashattn.flex_attention: torch.nn.attention.flex_attention.flex_attention's signature and
[batch, heads, seqlen, head_dim] layout, run by flashattn's kernels, differentiable.

A PyTorch BlockMask (create_block_mask) becomes a flashattn.BlockMask once and is cached on it:
its lists as they are (int32), and for its partially visible blocks the element bits of its
mask_mod, evaluated with torch on the mask's device (vmapped over the elements of those blocks
only) and packed 32 keys a word, all moved to the query's device. Blocks listed full are not
evaluated; blocks listed in neither list are hidden.

The CUDA kernels read the lists in place, so their blocks must hold whole kernel tiles. A mask
of smaller blocks that divide 128 (FlexAttention's 16 / 32 / 64) is regrouped for CUDA tensors
into 128 x 128 blocks: hidden where every small block is, full where every one is full, else
partial, its element bits those of the small blocks (a full one's all set, a partial one's
mask_mod's). This is what create_block_mask at 128 x 128 would give, without the user building
a second mask.

A mask that is exactly the library's causal / sliding-window mask, packed
documents or a prefix-LM, whatever its mask_mod's code, runs as that: the dense kernels' window,
varlen calls over the documents, or two dense calls (_mask_forms.py proves the form on every
block and element bit first). A flashattn.BlockMask always runs as its lists.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops, score_mods
from ._mask_forms import CHUNK, DenseForm, cells_of, dense_form, packed_bits
from .block_mask import BlockMask
from .torch import check_bhsd
# The blocks CUDA tensors' masks are regrouped into (see the module's documentation).
_CUDA_BLOCK = 128


def _regrouped(cells: Tensor, group_m: int, group_n: int):
    """Lists of the blocks of group_m x group_n small blocks of `cells` (cells_of's form): (kv_num_blocks,
    kv_indices, full_kv_num_blocks, full_kv_indices), int32, each row's blocks ascending."""
    *lead, qb, kb = cells.shape
    big_q, big_k = -(-qb // group_m), -(-kb // group_n)
    padded = torch.zeros((*lead, big_q * group_m, big_k * group_n), dtype=torch.int8, device=cells.device)
    padded[..., :qb, :kb] = cells
    inside = torch.zeros_like(padded, dtype=torch.bool)
    inside[..., :qb, :kb] = True
    grid = padded.view(*lead, big_q, group_m, big_k, group_n)
    listed = (grid > 0).any(dim=-1).any(dim=-2)
    # (Small blocks past the mask's own grid lie past the sequences: they do not stop a block from
    # being full.)
    full = ((grid == 2) | ~inside.view(grid.shape)).all(dim=-1).all(dim=-2) & listed

    def lists(selected: Tensor):
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)  # the selected first, ascending
        return selected.sum(-1).to(torch.int32), order.to(torch.int32).contiguous()

    return (*lists(listed & ~full), *lists(full))


def _partial_bits(mask_mod, block_size, kv_num_blocks: Tensor, kv_indices: Tensor, q_len: int, kv_len: int,
                  small=None):
    """The element bits of the partial blocks, in (batch, head, query block, slot) order, and
    bits_block (each list's first block in them). `small`: (cells, small block size) where the
    blocks are regrouped small ones: an element of a full small block is visible, one of a
    partial small block where mask_mod says, any other not."""
    block_m, block_n = block_size
    device = kv_indices.device
    counts = kv_num_blocks.to(torch.int64)
    flat_counts = counts.flatten()
    bits_block = (torch.cumsum(flat_counts, 0) - flat_counts).view(counts.shape)
    total = int(flat_counts.sum())
    if total == 0:
        return (torch.zeros((1, block_m, (block_n + 31) // 32), dtype=torch.int32, device=device),
                bits_block.to(torch.int32))
    slots = torch.arange(kv_indices.shape[-1], device=device)
    listed = slots.view(1, 1, 1, -1) < counts.unsqueeze(-1)  # [B, H, QB, KB]: the slots in use
    b, h, qb, slot = listed.nonzero(as_tuple=True)  # row-major: (b, h, qb, slot) order
    kb = kv_indices.to(torch.int64)[b, h, qb, slot]
    rows = torch.arange(block_m, device=device)
    cols = torch.arange(block_n, device=device)
    visible = torch.empty((total, block_m, block_n), dtype=torch.bool, device=device)
    per_chunk = max(1, CHUNK // (block_m * block_n))
    for start in range(0, total, per_chunk):
        end = min(total, start + per_chunk)
        q_idx = (qb[start:end, None, None] * block_m + rows[None, :, None]).expand(-1, block_m, block_n)
        kv_idx = (kb[start:end, None, None] * block_n + cols[None, None, :]).expand(-1, block_m, block_n)
        shape = q_idx.shape
        bb = b[start:end, None, None].expand(shape)
        hh = h[start:end, None, None].expand(shape)
        inside = (q_idx < q_len) & (kv_idx < kv_len)
        # mask_mod sees indices within the sequences (FlexAttention's padding is never visible).
        q_in = q_idx.clamp(max=q_len - 1).flatten()
        kv_in = kv_idx.clamp(max=kv_len - 1).flatten()
        flat = torch.vmap(mask_mod)(bb.flatten(), hh.flatten(), q_in, kv_in).to(torch.bool)
        if small is not None:
            cells, (small_m, small_n) = small
            cell = cells[bb.flatten(), hh.flatten(), q_in // small_m, kv_in // small_n]
            flat = (cell == 2) | ((cell == 1) & flat)
        visible[start:end] = flat.view(shape) & inside
    return packed_bits(visible, block_n), bits_block.to(torch.int32)


def cuda_block_size(block_size) -> Optional[Tuple[int, int]]:
    """The blocks a CUDA call regroups a mask of `block_size` into: 128 x 128 where a side is
    smaller and divides 128; None where the mask's own blocks serve."""
    block_m, block_n = (int(x) for x in block_size)
    small = block_m < _CUDA_BLOCK or block_n < _CUDA_BLOCK
    divides = _CUDA_BLOCK % block_m == 0 and _CUDA_BLOCK % block_n == 0
    return (_CUDA_BLOCK, _CUDA_BLOCK) if small and divides else None


def block_mask_from_torch(torch_mask, q_len: int, kv_len: int, device=None, block_size=None) -> BlockMask:
    """A flashattn.BlockMask of PyTorch's BlockMask for sequences of (q_len, kv_len), its arrays
    on `device` (None: the mask's own), cached on it (the conversion evaluates mask_mod on every
    partial block). block_size: None (the mask's own), or blocks of whole numbers of the mask's
    to regroup it into (see the module's documentation)."""
    return _converted(torch_mask, q_len, kv_len, device, block_size)[0]


def _converted(torch_mask, q_len: int, kv_len: int, device=None, block_size=None):
    """block_mask_from_torch's mask, and the DenseForm it runs as, or None (see the module's
    documentation)."""
    device = torch_mask.kv_indices.device if device is None else torch.device(device)
    own = tuple(int(x) for x in torch_mask.BLOCK_SIZE)
    block_size = own if block_size is None else (int(block_size[0]), int(block_size[1]))
    if block_size[0] % own[0] or block_size[1] % own[1]:
        raise ValueError(f"block_mask: block size {block_size} is not a whole number of the mask's {own}")
    key = (q_len, kv_len, device, block_size)
    cache = getattr(torch_mask, "_flashattn_block_mask", None)
    if cache is not None and cache[0] == key:
        return cache[1:]
    if tuple(torch_mask.seq_lengths) != key[:2]:
        raise ValueError(f"block_mask: built for sequences {tuple(torch_mask.seq_lengths)}, the call has "
                         f"(seqlen_q, seqlen_kv) = {key[:2]}")

    def int32(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else t.to(torch.int32).contiguous()

    def moved(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else t.to(device).contiguous()

    kv_num_blocks, kv_indices = int32(torch_mask.kv_num_blocks), int32(torch_mask.kv_indices)
    full_num, full_indices = int32(torch_mask.full_kv_num_blocks), int32(torch_mask.full_kv_indices)
    small = None
    if block_size != own:
        cells = cells_of(kv_num_blocks, kv_indices, full_num, full_indices)
        kv_num_blocks, kv_indices, full_num, full_indices = _regrouped(cells, block_size[0] // own[0],
                                                                       block_size[1] // own[1])
        small = (cells, own)
    bits, bits_block = _partial_bits(torch_mask.mask_mod, block_size, kv_num_blocks, kv_indices, q_len, kv_len,
                                     small)
    ours = BlockMask(moved(kv_num_blocks), moved(kv_indices), moved(full_num), moved(full_indices), moved(bits),
                     moved(bits_block), block_size)
    form = dense_form(torch_mask.mask_mod, (kv_num_blocks, kv_indices, full_num, full_indices), bits, block_size,
                      q_len, kv_len)
    if form is not None and form.documents is not None:
        cu_seqlens, longest, causal = form.documents
        form = DenseForm(documents=(cu_seqlens.to(device), longest, causal))
    try:
        torch_mask._flashattn_block_mask = (key, ours, form)
    except AttributeError:  # a BlockMask type with slots: no cache, the conversion runs each call
        pass
    return ours, form


class _FlexAttention(torch.autograd.Function):
    """Attention on [b, s, h, d] views of the [b, h, s, d] tensors (the library takes any strides
    but the last's), under the block mask's lists, or its DenseForm: one call with the form's
    window, per batch entry one varlen call over the documents, or a prefix-LM's two calls,
    writing into slices of whole outputs."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale, form, softcap, alibi_slopes):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        options = dict(softmax_scale=scale, block_mask=block_mask, softcap=softcap, alibi_slopes=alibi_slopes)
        if form is not None and form.window is not None:
            options.update(window_size=form.window)
        ctx.options, ctx.form = options, form
        if form is not None and form.documents is not None:
            batch, seqlen, heads = qt.shape[:3]
            out = qt.new_empty((batch, seqlen, heads, vt.shape[-1]))
            lse = qt.new_empty((batch, heads, seqlen), dtype=torch.float32)
            for b in range(batch):
                ops.forward(qt[b], kt[b], vt[b], out=out[b], lse=lse[b], **_document_options(ctx, b))
        elif form is not None and form.prefix is not None:
            out, lse = _prefix_forward(qt, kt, vt, form.prefix, options)
        else:
            out, lse = ops.forward(qt, kt, vt, **options)
        ctx.save_for_backward(qt, kt, vt, out, lse)
        ctx.mark_non_differentiable(lse)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qt, kt, vt, out, lse = ctx.saved_tensors
        dout = dout.transpose(1, 2)
        form = ctx.form
        if form is not None and form.documents is not None:
            dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
            for b in range(qt.shape[0]):
                ops.backward(dout[b], qt[b], kt[b], vt[b], out[b], lse[b], dq=dq[b], dk=dk[b], dv=dv[b],
                             **_document_options(ctx, b))
        elif form is not None and form.prefix is not None:
            dq, dk, dv = _prefix_backward(dout, qt, kt, vt, out, lse, form.prefix, ctx.options)
        else:
            dq, dk, dv = ops.backward(dout, qt, kt, vt, out, lse, **ctx.options)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None


def _prefix_forward(qt, kt, vt, prefix: int, options: dict):
    """A prefix-LM's forward as two dense calls on row slices: rows [0, prefix) over the prefix's
    keys without a mask, the rest causally (bottom-right aligned: row i sees keys up to i) over
    every key. The outputs go into slices of one out; the LSE through contiguous temporaries."""
    batch, seqlen, heads = qt.shape[:3]
    out = qt.new_empty((batch, seqlen, heads, vt.shape[-1]))
    lse = qt.new_empty((batch, heads, seqlen), dtype=torch.float32)
    lse[:, :, :prefix] = ops.forward(qt[:, :prefix], kt[:, :prefix], vt[:, :prefix], out=out[:, :prefix],
                                     **options)[1]
    lse[:, :, prefix:] = ops.forward(qt[:, prefix:], kt, vt, out=out[:, prefix:], causal=True, **options)[1]
    return out, lse


def _prefix_backward(dout, qt, kt, vt, out, lse, prefix: int, options: dict):
    """_prefix_forward's backward: the causal rows' call writes dQ's slice and dK / dV whole, the
    prefix rows' call dQ's slice, its dK / dV of the prefix's keys then added."""
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
    ops.backward(dout[:, prefix:], qt[:, prefix:], kt, vt, out[:, prefix:], lse[:, :, prefix:].contiguous(),
                 dq=dq[:, prefix:], dk=dk, dv=dv, causal=True, **options)
    _, dk_prefix, dv_prefix = ops.backward(dout[:, :prefix], qt[:, :prefix], kt[:, :prefix], vt[:, :prefix],
                                           out[:, :prefix], lse[:, :, :prefix].contiguous(), dq=dq[:, :prefix],
                                           **options)
    dk[:, :prefix] += dk_prefix
    dv[:, :prefix] += dv_prefix
    return dq, dk, dv


def _document_options(ctx, b: int) -> dict:
    """The varlen call's options for batch entry b of a documents form: its documents are the
    sequences (ALiBi slopes given per batch entry are that entry's for every document)."""
    cu_seqlens, longest, causal = ctx.form.documents
    options = dict(ctx.options, block_mask=None, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                   max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)
    slopes = options["alibi_slopes"]
    if slopes is not None and slopes.dim() == 2:
        options["alibi_slopes"] = slopes[b]
    return options


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
                   scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """torch.nn.attention.flex_attention.flex_attention on flashattn's kernels.

    Args:
        query: [batch, heads, seqlen_q, head_dim].
        key: [batch, heads_kv, seqlen_kv, head_dim]; heads_kv divides heads (with enable_gqa).
        value: like key, or with a head_dim of its own (as FlexAttention allows; CPU tensors).
        score_mod: None, or one of flashattn.score_mods' modifiers (softcap, ALiBi, or both
            chained), run inside the kernels; other callables raise NotImplementedError.
        block_mask: a torch.nn.attention.flex_attention.BlockMask (create_block_mask) for these
            sequence lengths, a flashattn.BlockMask, or None (every key visible). A PyTorch
            mask that equals a causal or sliding-window mask, packed documents or a prefix-LM
            runs as that (see the module's documentation). Other masks run as
            lists; on CUDA
            tensors, forward and backward, at blocks that are multiples of the kernels' tiles
            (PyTorch's default 128 x 128 is; a PyTorch mask of smaller blocks that divide 128 is
            regrouped into 128 x 128 ones), the lists checked by the forward kernel
            (flashattn.forward's index_check="device") and by the host before the backward.
        scale: the scores' scale, or None for 1 / sqrt(head_dim).
        enable_gqa: allow heads_kv < heads (grouped-query attention).
        return_lse: also return the log-sum-exp of each row's scores (natural log, float32
            [batch, heads, seqlen_q]; -inf for a row that sees no key).

    Returns:
        out [batch, heads, seqlen_q, head_dim_v] (value's head_dim, query's dtype), or (out, lse)
        with return_lse; differentiable in query, key and value.
    """
    check_bhsd(query, key, value, enable_gqa)
    softcap, alibi_slopes = 0.0, None
    if score_mod is not None:
        softcap, alibi_slopes = score_mods.native(score_mod, query.shape[2], key.shape[2], query.device)
    form = None
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        regroup = cuda_block_size(block_mask.BLOCK_SIZE) if query.device.type == "cuda" else None
        block_mask, form = _converted(block_mask, query.shape[2], key.shape[2], query.device, regroup)
        if form is not None:  # the library's own mask or packed documents: not the lists
            block_mask = None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, lse = _FlexAttention.apply(query, key, value, block_mask, scale, form, softcap, alibi_slopes)
    return (out, lse) if return_lse else out

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
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from .block_mask import BlockMask
from .torch import check_bhsd

# Elements of partial blocks evaluated per vmapped call of mask_mod (bounds the index tensors).
_CHUNK = 1 << 22
# The blocks CUDA tensors' masks are regrouped into (see the module's documentation).
_CUDA_BLOCK = 128


def _packed_bits(visible: Tensor, block_n: int) -> Tensor:
    """bool [n, block_m, block_n] -> int32 [n, block_m, ceil(block_n / 32)] (key j: bit j % 32
    of word j // 32; the words' bit patterns as int32)."""
    n, block_m, _ = visible.shape
    words = (block_n + 31) // 32
    padded = torch.zeros((n, block_m, words * 32), dtype=torch.int64, device=visible.device)
    padded[:, :, :block_n] = visible.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=visible.device),
                                       torch.arange(32, device=visible.device))
    packed = (padded.view(n, block_m, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _cells(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor],
           full_kv_indices: Optional[Tensor]) -> Tensor:
    """int8 [b, h, query blocks, key blocks]: each block hidden (0), partial (1) or full (2), from
    the lists (a row of kv_indices has a slot per key block)."""
    *lead, key_blocks = kv_indices.shape
    cells = torch.zeros((*lead, key_blocks + 1), dtype=torch.int8, device=kv_indices.device)
    slots = torch.arange(key_blocks, device=kv_indices.device)
    for counts, indices, kind in ((kv_num_blocks, kv_indices, 1), (full_kv_num_blocks, full_kv_indices, 2)):
        if counts is None:
            continue
        used = slots < counts.to(torch.int64).unsqueeze(-1)
        target = torch.where(used, indices.to(torch.int64), key_blocks)  # unused slots: the spare column
        cells.scatter_(-1, target, torch.full_like(target, kind, dtype=torch.int8))
    return cells[..., :key_blocks]


def _regrouped(cells: Tensor, group_m: int, group_n: int):
    """Lists of the blocks of group_m x group_n small blocks of `cells` (_cells' form): (kv_num_blocks,
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
    per_chunk = max(1, _CHUNK // (block_m * block_n))
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
    return _packed_bits(visible, block_n), bits_block.to(torch.int32)


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
    device = torch_mask.kv_indices.device if device is None else torch.device(device)
    own = tuple(int(x) for x in torch_mask.BLOCK_SIZE)
    block_size = own if block_size is None else (int(block_size[0]), int(block_size[1]))
    if block_size[0] % own[0] or block_size[1] % own[1]:
        raise ValueError(f"block_mask: block size {block_size} is not a whole number of the mask's {own}")
    key = (q_len, kv_len, device, block_size)
    cache = getattr(torch_mask, "_flashattn_block_mask", None)
    if cache is not None and cache[0] == key:
        return cache[1]
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
        cells = _cells(kv_num_blocks, kv_indices, full_num, full_indices)
        kv_num_blocks, kv_indices, full_num, full_indices = _regrouped(cells, block_size[0] // own[0],
                                                                       block_size[1] // own[1])
        small = (cells, own)
    bits, bits_block = _partial_bits(torch_mask.mask_mod, block_size, kv_num_blocks, kv_indices, q_len, kv_len,
                                     small)
    ours = BlockMask(moved(kv_num_blocks), moved(kv_indices), moved(full_num), moved(full_indices), moved(bits),
                     moved(bits_block), block_size)
    try:
        torch_mask._flashattn_block_mask = (key, ours)
    except AttributeError:  # a BlockMask type with slots: no cache, the conversion runs each call
        pass
    return ours


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale):
        # [b, h, s, d] -> [b, s, h, d] views (the library takes any strides but the last).
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        out, lse = ops.forward(qt, kt, vt, softmax_scale=scale, block_mask=block_mask)
        ctx.save_for_backward(qt, kt, vt, out, lse)
        ctx.block_mask, ctx.scale = block_mask, scale
        ctx.mark_non_differentiable(lse)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qt, kt, vt, out, lse = ctx.saved_tensors
        dq, dk, dv = ops.backward(dout.transpose(1, 2), qt, kt, vt, out, lse, softmax_scale=ctx.scale,
                                  block_mask=ctx.block_mask)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
                   scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """torch.nn.attention.flex_attention.flex_attention on flashattn's kernels.

    Args:
        query: [batch, heads, seqlen_q, head_dim].
        key: [batch, heads_kv, seqlen_kv, head_dim]; heads_kv divides heads (with enable_gqa).
        value: like key, or with a head_dim of its own (as FlexAttention allows; CPU tensors).
        score_mod: must be None in this version (a NotImplementedError otherwise).
        block_mask: a torch.nn.attention.flex_attention.BlockMask (create_block_mask) for these
            sequence lengths, a flashattn.BlockMask, or None (every key visible). On CUDA
            tensors: forward and backward, at blocks that are multiples of the kernels' tiles
            (PyTorch's default 128 x 128 is; a PyTorch mask of smaller blocks that divide 128 is
            regrouped into 128 x 128 ones), its lists checked by the forward kernel
            (flashattn.forward's index_check="device") and by the host before the backward.
        scale: the scores' scale, or None for 1 / sqrt(head_dim).
        enable_gqa: allow heads_kv < heads (grouped-query attention).
        return_lse: also return the log-sum-exp of each row's scores (natural log, float32
            [batch, heads, seqlen_q]; -inf for a row that sees no key).

    Returns:
        out [batch, heads, seqlen_q, head_dim_v] (value's head_dim, query's dtype), or (out, lse)
        with return_lse; differentiable in query, key and value.
    """
    if score_mod is not None:
        raise NotImplementedError("score_mod: not supported by flashattn.flex_attention yet (block_mask and "
                                  "mask_mod are)")
    check_bhsd(query, key, value, enable_gqa)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        regroup = cuda_block_size(block_mask.BLOCK_SIZE) if query.device.type == "cuda" else None
        block_mask = block_mask_from_torch(block_mask, query.shape[2], key.shape[2], query.device, regroup)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, lse = _FlexAttention.apply(query, key, value, block_mask, scale)
    return (out, lse) if return_lse else out

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

A mask that is the library's own causal / sliding-window mask (bottom-right aligned, optionally
with sink tokens: the first keys kept in view of a causal window), whatever its mask_mod's code,
runs as that mask: the conversion guesses the window from two rows of mask_mod, then checks every
block of the lists and every element bit against it, and only where all agree does the call take
the dense kernels' window (flashattn.forward's window_size / sink_tokens) instead of the lists,
which skip no more and cost more per tile. A flashattn.BlockMask is always run as its lists.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops, score_mods
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


def _row_runs(mask_mod, row: int, kv_len: int, device) -> list:
    """The runs of keys row `row` sees by mask_mod (batch entry and head 0), as [begin, end) pairs."""
    kv = torch.arange(kv_len, device=device)
    zero = torch.zeros_like(kv)
    seen = torch.vmap(mask_mod)(zero, zero, torch.full_like(kv, row), kv).to(torch.bool).to(torch.int8)
    steps = torch.diff(torch.nn.functional.pad(seen, (1, 1)))
    return list(zip((steps == 1).nonzero().flatten().tolist(), (steps == -1).nonzero().flatten().tolist()))


def _guessed_window(mask_mod, q_len: int, kv_len: int, device) -> Optional[Tuple[int, int, int]]:
    """(window_left, window_right, sink_tokens) of the library's mask that mask_mod would be, from
    the last row (the widest reach to the left, and the sink tokens in full) and the first row whose
    diagonal is a key (the right side); None where those rows fit no such mask. A guess only:
    _is_window checks it everywhere."""
    last = _row_runs(mask_mod, q_len - 1, kv_len, device)  # its diagonal is the last key
    if not last or len(last) > 2 or (len(last) == 2 and last[0][0] != 0):
        return None
    window_left = -1 if last[-1][0] == 0 else kv_len - 1 - last[-1][0]
    sink_tokens = last[0][1] if len(last) == 2 else 0
    row = max(0, q_len - kv_len)
    first = _row_runs(mask_mod, row, kv_len, device)
    if not first:
        return None
    end = first[-1][1]
    window_right = -1 if end == kv_len else end - 1 - (row + kv_len - q_len)
    return (window_left, window_right, sink_tokens) if end == kv_len or window_right >= 0 else None


def _window_keys(rows: Tensor, window, q_len: int, kv_len: int):
    """Per row, the keys the window mask shows as two ranges, [window_begin, end) and [0,
    sink_end), int64 tensors like `rows` (core::SinkTokenMask's rule)."""
    window_left, window_right, sink_tokens = window
    diag = rows + (kv_len - q_len)
    begin = (diag - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(rows)
    end = (diag + window_right + 1).clamp(min=0, max=kv_len) if window_right >= 0 else torch.full_like(rows, kv_len)
    sink_end = end.clamp(max=sink_tokens) if window_left >= 0 else torch.zeros_like(rows)
    return begin, end, sink_end


def _is_window(window, kv_num_blocks, kv_indices, full_num, full_indices, bits, block_size, q_len, kv_len):
    """Whether the lists (one for every batch entry and head) and the partial blocks' element bits
    show exactly the elements the window mask does."""
    if kv_num_blocks.shape[:2] != (1, 1) or (full_num is not None and full_num.shape[:2] != (1, 1)):
        return False
    block_m, block_n = block_size
    cells = _cells(kv_num_blocks, kv_indices, full_num, full_indices)[0, 0]  # [query blocks, key blocks]
    device = cells.device
    key_blocks = cells.shape[-1]
    col_begin = torch.arange(key_blocks, device=device) * block_n
    col_end = (col_begin + block_n).clamp(max=kv_len)

    def overlap(begin, end):  # [rows, 1] ranges against [key blocks] columns: keys in common
        return (torch.minimum(end, col_end) - torch.maximum(begin, col_begin)).clamp(min=0)

    # Visible keys of each (query block, key block), rows a slab at a time.
    counts = torch.zeros(cells.shape, dtype=torch.int64, device=device)
    slab = max(1, _CHUNK // max(1, key_blocks))
    for start in range(0, q_len, slab):
        rows = torch.arange(start, min(q_len, start + slab), device=device)
        begin, end, sink_end = (x[:, None] for x in _window_keys(rows, window, q_len, kv_len))
        zero = torch.zeros_like(begin)
        both_end = torch.minimum(end, sink_end)
        seen = overlap(begin, end) + overlap(zero, sink_end) - overlap(begin, both_end)
        counts.index_add_(0, rows // block_m, seen)
    rows_in = (torch.arange(cells.shape[0], device=device) * block_m).clamp(max=q_len)
    area = ((rows_in + block_m).clamp(max=q_len) - rows_in)[:, None] * (col_end - col_begin)[None, :]
    if ((cells == 0) & (counts != 0)).any() or ((cells == 2) & (counts != area)).any():
        return False
    if bits is None:
        return bool(((cells != 1) | (counts == area)).all())
    # The partial blocks' elements, in the order of the bits (_partial_bits').
    slots = torch.arange(kv_indices.shape[-1], device=device)
    listed = slots[None, :] < kv_num_blocks[0, 0].to(torch.int64)[:, None]
    qb, slot = listed.nonzero(as_tuple=True)
    if qb.numel() == 0:
        return True
    kb = kv_indices[0, 0].to(torch.int64)[qb, slot]
    per_chunk = max(1, _CHUNK // (block_m * block_n))
    for start in range(0, qb.numel(), per_chunk):
        stop = min(qb.numel(), start + per_chunk)
        rows = qb[start:stop, None] * block_m + torch.arange(block_m, device=device)[None, :]
        cols = kb[start:stop, None, None] * block_n + torch.arange(block_n, device=device)[None, None, :]
        begin, end, sink_end = (x[:, :, None] for x in _window_keys(rows, window, q_len, kv_len))
        visible = ((cols >= begin) & (cols < end)) | (cols < sink_end)
        visible &= (rows[:, :, None] < q_len) & (cols < kv_len)
        if not torch.equal(_packed_bits(visible, block_n), bits[start:stop]):
            return False
    return True


def block_mask_from_torch(torch_mask, q_len: int, kv_len: int, device=None, block_size=None) -> BlockMask:
    """A flashattn.BlockMask of PyTorch's BlockMask for sequences of (q_len, kv_len), its arrays
    on `device` (None: the mask's own), cached on it (the conversion evaluates mask_mod on every
    partial block). block_size: None (the mask's own), or blocks of whole numbers of the mask's
    to regroup it into (see the module's documentation)."""
    return _converted(torch_mask, q_len, kv_len, device, block_size)[0]


def _converted(torch_mask, q_len: int, kv_len: int, device=None, block_size=None):
    """block_mask_from_torch's mask, and the window (window_left, window_right, sink_tokens) of the
    library's mask that shows the same elements, or None (see the module's documentation)."""
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
        cells = _cells(kv_num_blocks, kv_indices, full_num, full_indices)
        kv_num_blocks, kv_indices, full_num, full_indices = _regrouped(cells, block_size[0] // own[0],
                                                                       block_size[1] // own[1])
        small = (cells, own)
    bits, bits_block = _partial_bits(torch_mask.mask_mod, block_size, kv_num_blocks, kv_indices, q_len, kv_len,
                                     small)
    ours = BlockMask(moved(kv_num_blocks), moved(kv_indices), moved(full_num), moved(full_indices), moved(bits),
                     moved(bits_block), block_size)
    window = _guessed_window(torch_mask.mask_mod, q_len, kv_len, kv_indices.device) if q_len and kv_len else None
    if window is not None and not _is_window(window, kv_num_blocks, kv_indices, full_num, full_indices, bits,
                                             block_size, q_len, kv_len):
        window = None
    try:
        torch_mask._flashattn_block_mask = (key, ours, window)
    except AttributeError:  # a BlockMask type with slots: no cache, the conversion runs each call
        pass
    return ours, window


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale, window, softcap, alibi_slopes):
        # [b, h, s, d] -> [b, s, h, d] views (the library takes any strides but the last).
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ctx.options = dict(softmax_scale=scale, block_mask=block_mask, window_size=window[:2], sink_tokens=window[2],
                           softcap=softcap, alibi_slopes=alibi_slopes)
        out, lse = ops.forward(qt, kt, vt, **ctx.options)
        ctx.save_for_backward(qt, kt, vt, out, lse)
        ctx.mark_non_differentiable(lse)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qt, kt, vt, out, lse = ctx.saved_tensors
        dq, dk, dv = ops.backward(dout.transpose(1, 2), qt, kt, vt, out, lse, **ctx.options)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None


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
            mask that equals a causal or sliding-window mask (with or without sink tokens) runs
            as that mask (see the module's documentation). Other masks run as lists; on CUDA
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
    window = (-1, -1, 0)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        regroup = cuda_block_size(block_mask.BLOCK_SIZE) if query.device.type == "cuda" else None
        block_mask, as_window = _converted(block_mask, query.shape[2], key.shape[2], query.device, regroup)
        if as_window is not None:  # the library's own mask: the dense kernels' window, not the lists
            block_mask, window = None, as_window
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, lse = _FlexAttention.apply(query, key, value, block_mask, scale, window, softcap, alibi_slopes)
    return (out, lse) if return_lse else out

"""Block masks that are the library's own masks: flex_attention runs a PyTorch BlockMask whose
elements are exactly a causal / sliding-window mask (bottom-right aligned) as the dense kernels'
window, one whose elements are exactly packed documents (each
token sees the tokens of its own document, causally or not) as varlen calls over the documents,
and a prefix-LM (the first P keys visible to every row, causal after them) as two dense calls,
whatever the mask_mod's code. They run faster than the block lists: the lists' kernels use
128-row tiles and read the element bits of every block a mask's edge crosses.

A form is guessed from a few rows of mask_mod, then proved on the whole mask: each block's count
of visible elements under the form (interval arithmetic per row) must be zero where the lists
hide the block and the block's size where they list it full, and the element bits of every
partial block must equal the form's. Only a mask that passes runs as the form.

Also here, the list and bit helpers the conversion shares: the lists as one cell per block, and
the bit packing.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

# Elements evaluated (or compared) per vectorised step (bounds the index tensors).
CHUNK = 1 << 22


def packed_bits(visible: Tensor, block_n: int) -> Tensor:
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


def cells_of(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor],
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


class DenseForm(NamedTuple):
    """What a mask runs as instead of its lists: a window (window_left, window_right);
    documents (cu_seqlens int32 on the mask's device, the longest document, causal); or a
    prefix-LM's prefix length P (row i sees keys [0, max(P, i + 1)): the first P rows attend to
    the prefix without a mask, the others causally to every key, two dense calls)."""
    window: Optional[Tuple[int, int]] = None
    documents: Optional[Tuple[Tensor, int, bool]] = None
    prefix: Optional[int] = None


def _seen(mask_mod, rows: Tensor, cols: Tensor) -> Tensor:
    """mask_mod at (batch entry 0, head 0, rows, cols), 1-D index tensors, as bool."""
    zero = torch.zeros_like(rows)
    return torch.vmap(mask_mod)(zero, zero, rows, cols).to(torch.bool)


def _row_runs(mask_mod, row: int, kv_len: int, device) -> list:
    """The runs of keys row `row` sees, as [begin, end) pairs."""
    kv = torch.arange(kv_len, device=device)
    seen = _seen(mask_mod, torch.full_like(kv, row), kv).to(torch.int8)
    steps = torch.diff(torch.nn.functional.pad(seen, (1, 1)))
    return list(zip((steps == 1).nonzero().flatten().tolist(), (steps == -1).nonzero().flatten().tolist()))


def _guessed_window(mask_mod, q_len: int, kv_len: int, device) -> Optional[Tuple[int, int]]:
    """(window_left, window_right) from the last row (the widest reach to the left) and the
    first row whose diagonal is a key (the right side); None where those rows fit no window."""
    last = _row_runs(mask_mod, q_len - 1, kv_len, device)  # its diagonal is the last key
    if len(last) != 1:  # (a window with sink tokens runs faster as lists, see dense_form)
        return None
    window_left = -1 if last[0][0] == 0 else kv_len - 1 - last[0][0]
    row = max(0, q_len - kv_len)
    first = _row_runs(mask_mod, row, kv_len, device)
    if not first:
        return None
    end = first[-1][1]
    window_right = -1 if end == kv_len else end - 1 - (row + kv_len - q_len)
    return (window_left, window_right) if end == kv_len or window_right >= 0 else None


def _window_keys(window, q_len: int, kv_len: int):
    """rows -> the keys [begin, end) each row sees (core::Mask's rule)."""
    window_left, window_right = window

    def keys(rows: Tensor):
        diag = rows + (kv_len - q_len)
        begin = (diag - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(rows)
        end = (diag + window_right + 1).clamp(0, kv_len) if window_right >= 0 else torch.full_like(rows, kv_len)
        return begin, end

    return keys


def _guessed_documents(mask_mod, n: int, device) -> Optional[Tuple[Tensor, bool]]:
    """(cu_seqlens, causal) of packed documents, from whether each token sees the one before it
    (the same document) and the one after it (not causal); None where that fits no documents or
    one document only (a window, if anything)."""
    if n < 2:
        return None
    i = torch.arange(1, n, device=device)
    back, ahead = _seen(mask_mod, i, i - 1), _seen(mask_mod, i - 1, i)
    causal = not bool(ahead.any())
    if not causal and not torch.equal(ahead, back):
        return None
    starts = i[~back]
    if starts.numel() == 0:
        return None
    zero, end = torch.zeros(1, dtype=i.dtype, device=device), torch.full((1,), n, dtype=i.dtype, device=device)
    return torch.cat([zero, starts, end]).to(torch.int32), causal


def _document_keys(cu_seqlens: Tensor, causal: bool, n: int):
    """rows -> each row's keys [begin, end): its document's, ended at the row itself when causal."""
    bounds = cu_seqlens.to(torch.int64)
    doc = torch.repeat_interleave(torch.arange(bounds.numel() - 1, device=bounds.device), torch.diff(bounds))
    start, stop = bounds[doc], bounds[doc + 1]

    def keys(rows: Tensor):
        inside = rows.clamp(max=n - 1)  # (rows past the sequence: their bits are masked anyway)
        begin = start[inside]
        end = torch.minimum(stop[inside], rows + 1) if causal else stop[inside]
        return begin, end

    return keys


def _prefix_keys(prefix: int):
    """rows -> each row's keys [0, max(prefix, row + 1))."""

    def keys(rows: Tensor):
        return torch.zeros_like(rows), (rows + 1).clamp(min=prefix)

    return keys


def _shows_exactly(row_keys, kv_num_blocks, kv_indices, full_num, full_indices, bits, block_size, q_len, kv_len):
    """Whether the lists (one for every batch entry and head) and the partial blocks' element bits
    show exactly the elements that row_keys (rows -> each row's keys as a range [begin, end))
    gives."""
    if kv_num_blocks.shape[:2] != (1, 1) or (full_num is not None and full_num.shape[:2] != (1, 1)):
        return False
    block_m, block_n = block_size
    cells = cells_of(kv_num_blocks, kv_indices, full_num, full_indices)[0, 0]  # [query blocks, key blocks]
    device = cells.device
    key_blocks = cells.shape[-1]
    col_begin = torch.arange(key_blocks, device=device) * block_n
    col_end = (col_begin + block_n).clamp(max=kv_len)

    def overlap(begin, end):  # [rows, 1] ranges against [key blocks] columns: keys in common
        return (torch.minimum(end, col_end) - torch.maximum(begin, col_begin)).clamp(min=0)

    # Visible keys of each (query block, key block), rows a slab at a time.
    counts = torch.zeros(cells.shape, dtype=torch.int64, device=device)
    slab = max(1, CHUNK // max(1, key_blocks))
    for start in range(0, q_len, slab):
        rows = torch.arange(start, min(q_len, start + slab), device=device)
        begin, end = (x[:, None] for x in row_keys(rows))
        counts.index_add_(0, rows // block_m, overlap(begin, end))
    rows_in = (torch.arange(cells.shape[0], device=device) * block_m).clamp(max=q_len)
    area = ((rows_in + block_m).clamp(max=q_len) - rows_in)[:, None] * (col_end - col_begin)[None, :]
    if ((cells == 0) & (counts != 0)).any() or ((cells == 2) & (counts != area)).any():
        return False
    if bits is None:
        return bool(((cells != 1) | (counts == area)).all())
    # The partial blocks' elements, in the order of the bits (the conversion's).
    slots = torch.arange(kv_indices.shape[-1], device=device)
    listed = slots[None, :] < kv_num_blocks[0, 0].to(torch.int64)[:, None]
    qb, slot = listed.nonzero(as_tuple=True)
    kb = kv_indices[0, 0].to(torch.int64)[qb, slot]
    per_chunk = max(1, CHUNK // (block_m * block_n))
    for start in range(0, qb.numel(), per_chunk):
        stop = min(qb.numel(), start + per_chunk)
        rows = qb[start:stop, None] * block_m + torch.arange(block_m, device=device)[None, :]
        cols = kb[start:stop, None, None] * block_n + torch.arange(block_n, device=device)[None, None, :]
        begin, end = (x[:, :, None] for x in row_keys(rows))
        visible = (cols >= begin) & (cols < end) & (rows[:, :, None] < q_len) & (cols < kv_len)
        if not torch.equal(packed_bits(visible, block_n), bits[start:stop]):
            return False
    return True


def dense_form(mask_mod, lists, bits, block_size, q_len: int, kv_len: int) -> Optional[DenseForm]:
    """The form the mask of these lists (kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices) and partial blocks' bits runs as, or None (it runs as its lists).

    A window with sink tokens stays lists: the kernels join sink tokens in a pass after the
    window's, which ran at 0.56x the lists' speed (H100, bf16 d128 8k, a 1024-key window and 4
    sink tokens, bench/gpu_flex.py)."""
    if not q_len or not kv_len or lists[0].shape[:2] != (1, 1):
        return None
    device = lists[1].device
    window = _guessed_window(mask_mod, q_len, kv_len, device)
    if window is not None and _shows_exactly(_window_keys(window, q_len, kv_len), *lists, bits, block_size, q_len,
                                             kv_len):
        return DenseForm(window=window)
    documents = _guessed_documents(mask_mod, q_len, device) if q_len == kv_len else None
    if documents is not None and _shows_exactly(_document_keys(*documents, q_len), *lists, bits, block_size, q_len,
                                                kv_len):
        cu_seqlens, causal = documents
        return DenseForm(documents=(cu_seqlens, int(torch.diff(cu_seqlens).max()), causal))
    # A prefix-LM: the first row sees the prefix (and the lists prove the rest).
    first = _row_runs(mask_mod, 0, kv_len, device) if q_len == kv_len else []
    if len(first) == 1 and first[0][0] == 0 and 1 < first[0][1] < q_len and _shows_exactly(
            _prefix_keys(first[0][1]), *lists, bits, block_size, q_len, kv_len):
        return DenseForm(prefix=first[0][1])
    return None

"""flashattn.BlockMask: a block-sparse mask in FlexAttention's form, for flashattn.forward /
flashattn.backward (block_mask=) and flashattn.flex_attention, which builds one from PyTorch's
BlockMask.

The layout (the C++ library's BlockMaskOptions): at block size (block_m, block_n), per (batch
entry, query head, query block) the partly visible key blocks (the first kv_num_blocks entries of
the kv_indices row) and the wholly visible ones (full_kv_num_blocks / full_kv_indices, optional);
every other key block is hidden. A partial block's elements are visible where its bits say
(bits absent: all of them): bits holds one [block_m, ceil(block_n / 32)] array of 32-bit words per
partial block (bit j % 32 of word j // 32 of row i is key j of row i, in the block's
coordinates), and the partial blocks of (b, h, qb) are blocks bits_block[b, h, qb] on, in
kv_indices' order. All arrays int32 (bits: the words' bit patterns) on q's device; a leading dim
of 1 broadcasts over the batch or the heads. Dense (not varlen) calls. GPU lists are checked as
the call's index_check says: by the kernel ("device", the default: no wait for the GPU; a bad
entry gives its query tile NaN and is raised later, see flashattn.check_device_errors) or on the
host ("host": one copy and wait per call); a backward's lists are checked on the host always.
CPU: forward and backward; CUDA: forward and backward at blocks that are multiples of the
kernels' tiles (128 x 128 always are), without dropout or sink tokens.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ._docs import Array


class BlockMask:
    """A block-sparse mask (see the module's documentation for the layout).

    Args:
        kv_num_blocks: int32 [b|1, h|1, query_blocks]: partly visible key blocks per query block.
        kv_indices: int32 [b|1, h|1, query_blocks, key_blocks]: their indices, first.
        full_kv_num_blocks: None, or int32 like kv_num_blocks: wholly visible key blocks.
        full_kv_indices: None, or int32 like kv_indices.
        bits: None (partial blocks wholly visible), or int32 [partial blocks, block_m,
            ceil(block_n / 32)]: their element bits.
        bits_block: with bits, int32 like kv_num_blocks: each list's first block in bits.
        block_size: (block_m, block_n), FlexAttention's BLOCK_SIZE (default 128 x 128).
    """

    __slots__ = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "bits", "bits_block",
                 "block_size")

    def __init__(self, kv_num_blocks: Array, kv_indices: Array, full_kv_num_blocks: Optional[Array] = None,
                 full_kv_indices: Optional[Array] = None, bits: Optional[Array] = None,
                 bits_block: Optional[Array] = None, block_size: Tuple[int, int] = (128, 128)):
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.bits = bits
        self.bits_block = bits_block
        self.block_size = (int(block_size[0]), int(block_size[1]))

    def _ext(self, fw, index):
        """The extension's form: (block_m, block_n, then the arrays as `index` converts them)."""
        return (*self.block_size, index(fw, self.kv_num_blocks, "block_mask.kv_num_blocks"),
                index(fw, self.kv_indices, "block_mask.kv_indices"),
                index(fw, self.full_kv_num_blocks, "block_mask.full_kv_num_blocks"),
                index(fw, self.full_kv_indices, "block_mask.full_kv_indices"), index(fw, self.bits, "block_mask.bits"),
                index(fw, self.bits_block, "block_mask.bits_block"))

    def __repr__(self):
        return f"flashattn.BlockMask(block_size={self.block_size}, kv_num_blocks shape " \
               f"{tuple(self.kv_num_blocks.shape)}, bits {'absent' if self.bits is None else 'given'})"

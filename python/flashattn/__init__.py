"""flashattn: exact attention (the FlashAttention algorithm) in C++/CUDA, with a CPU backend.

- flashattn.forward / flashattn.backward / flashattn.forward_kvcache: any array library (numpy incl. ml_dtypes bfloat16,
  PyTorch, CuPy, JAX) through DLPack, results in the caller's framework, device and stream;
- flash_attn_func & co.: drop-in replacements for the flash_attn package's functions (PyTorch
  tensors with autograd, or numpy arrays for the forward);
- flashattn.torch: the PyTorch custom ops (torch.compile-able) and scaled_dot_product_attention;
- flashattn.flex_attention: PyTorch's flex_attention signature with its BlockMask (block-sparse
  masks) and flashattn.score_mods' modifiers, and flashattn.BlockMask, the library's own form
  of a block mask;
- flashattn.distributed: context parallelism (ring and Ulysses attention) on torch.distributed.
"""
from typing import List

from . import _ext
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        flash_attn_with_kvcache)
from .block_mask import BlockMask
from .ops import backward, forward, forward_kvcache

__version__ = _ext.version()


def cuda_compiled() -> bool:
    """Whether this build holds the CUDA backend (built when nvcc and CUTLASS were found, unless
    FLASHATTN_CUDA=OFF). Without it, CUDA arrays raise NotImplementedError.

    Returns:
        True when the CUDA backend is compiled in.
    """
    return _ext.cuda_compiled()


def cuda_kernels() -> List[str]:
    """The names of the CUDA kernels compiled into this build, for diagnostics.

    Returns:
        Their names; empty without the CUDA backend.
    """
    return _ext.cuda_kernels()


def check_device_errors(device=None) -> None:
    """Waits for the GPU, then raises the bad index value that a kernel of an earlier
    forward_kvcache / flash_attn_with_kvcache, varlen or block-sparse call with
    index_check="device" (the default) found.

    Such calls return before their kernels run, so a bad cache_seqlens, cache_leftpad,
    cache_batch_idx or block_table entry (or cu_seqlens, or block-mask list entry) cannot be
    raised by the call itself: the kernels write NaN to the rows it reaches (a sequence's, a
    query tile's; a varlen call's every output) and record the first bad entry, which the next
    index_check="device" call on that device raises before it writes anything, or this function.

    Args:
        device: a CUDA device index, a torch.device / "cuda:N", or None for every device.

    Raises:
        ValueError: naming the entry, its value and its valid range, e.g.
            "block_table: entry [3, 7] is 9000, outside [0, 512) (k blocks) (found on cuda:0 ...)".
            The record is cleared once raised.
    """
    index = -1
    if device is not None:
        index = getattr(device, "index", device)
        if isinstance(index, str):
            index = int(index.rsplit(":", 1)[1]) if ":" in index else 0
        index = 0 if index is None else int(index)
    _ext.check_device_errors(index)


def __getattr__(name):
    # flex_attention and score_mods need PyTorch: imported on first use, so `import flashattn`
    # never imports it.
    if name == "flex_attention":
        from .flex import flex_attention

        return flex_attention
    if name == "score_mods":
        import importlib

        return importlib.import_module(".score_mods", __name__)  # (a from-import would call this again)
    raise AttributeError(f"module 'flashattn' has no attribute {name!r}")


__all__ = ["forward", "backward", "forward_kvcache", "flash_attn_func", "flash_attn_with_kvcache",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "cuda_compiled", "cuda_kernels",
           "check_device_errors", "BlockMask", "flex_attention", "score_mods", "__version__"]

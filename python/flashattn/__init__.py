"""flashattn: exact attention (the FlashAttention algorithm) in C++/CUDA, with a CPU backend.

- flashattn.forward / flashattn.backward / flashattn.forward_kvcache: any array library (numpy incl. ml_dtypes bfloat16,
  PyTorch, CuPy, JAX) through DLPack, results in the caller's framework, device and stream;
- flash_attn_func & co.: drop-in replacements for the flash_attn package's functions (PyTorch
  tensors with autograd, or numpy arrays for the forward);
- flashattn.torch: the PyTorch custom ops (torch.compile-able) and scaled_dot_product_attention.
"""
from typing import List

from . import _ext
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        flash_attn_with_kvcache)
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


__all__ = ["forward", "backward", "forward_kvcache", "flash_attn_func", "flash_attn_with_kvcache",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "cuda_compiled", "cuda_kernels",
           "__version__"]
